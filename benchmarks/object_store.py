"""Benchmark: checkpoints in an object store (``--run-dir s3://``) and the agents' memory
tier, against a local run directory, interleaved in one run.

    python benchmarks/object_store.py                 # the four tables: medium preset, 3
                                                      # repetitions (about 12 minutes on 2 cores)
    python benchmarks/object_store.py --reps 1 --preset small    # a quick look
    python benchmarks/object_store.py --every 8 --steps 40       # checkpoints further apart
    python benchmarks/object_store.py --nproc 1 --skip-restore   # a core left to the writer
                                                      # and the object store (tables 1, 2, 4)
    python benchmarks/object_store.py --skip-restore  # tables 1, 2 and 4 only
    python benchmarks/object_store.py --store-priority idle      # the store takes only the
                                                      # CPU training leaves, as a remote one
    python benchmarks/object_store.py --skip-steady   # table 3 only
    python benchmarks/object_store.py --recovery restart         # table 3 without live

The object store is moto's S3 server (tests/s3_server.py; ``make setup`` installs it) as a
process on loopback, a fresh empty one for every run, on the same cores as the job: what
it spends receiving a checkpoint is taken from training, as a real endpoint's would not
be (moto runs at normal priority; the checkpoint writer thread in SCHED_IDLE,
checkpoint/persister.py, so where training fills every core a persist moves only in the
gaps and the time until durable measures that slack as much as the store: ``--nproc 1``
leaves a core). Every job is ``elastic-train run`` with one node of 2 workers
(``--nproc``); the runs of each table are interleaved and their order rotated every
repetition, each started with the previous one's writes flushed (``os.sync()``). Every
figure has its median and spread (min-max) over the repetitions (over every checkpoint of
them where the figure is per checkpoint), and a ratio against a baseline of the same
invocation:

1. stall per checkpoint (the step that contains a save, minus the median step; bench.py's
   ``_stalls``) and mean step time, checkpoints every N steps: local run directory
   (baseline) vs ``s3://`` run directory, both with the memory tier (the default), and
   ``s3://`` with ``--memory-tier off`` (what the tier costs the stall);
2. time until a checkpoint is durable (``checkpoint_saved.time - snapshot_at``), and the
   offer to the memory tier (``memory_seconds``: the agent's copy, and its copy to another
   node's agent when there is one; the serialization before it is not counted) with the
   copies held (``memory_copies``: 1 on a single node, there is no other agent);
3. restore after every worker died (SIGKILL of both workers right after a
   ``checkpoint_saved`` event; the agent lives on and restarts them): kill -> the next
   completed step and ``checkpoint_loaded.seconds``, restoring from the memory tier
   (``s3://``, tier on), from the object store (``s3://``, tier off) and from local disk
   (local run directory, tier off: the file is in the page cache, as on a restart on the
   same node), each checked against ``checkpoint_loaded.source``; once with
   ``--recovery restart`` (the group restart alone: the restore's cost) and once with the
   default ``--recovery live`` (what a job gets by default; the agent's log says whether it
   saw both deaths as one failure, and which stopped worker ran out its SIGTERM budget);
4. host memory of the tier: a checkpoint's payload bytes x copies, and the agent process's
   RSS (VmRSS of the ``elastic-train run`` process) before the first checkpoint, after the
   last periodic one and at its peak, with the tier on and off (the runs of table 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import (
    PRESETS,
    Preset,
    _cpu_ticks,
    _finish,
    _ratio,
    _stalls,
    _steal_since,
    _step_times,
    _summary,
)

from elastic_train.config import StorageConfig
from elastic_train.rundir import RunDir
from tests.integration import harness
from tests.s3_server import S3Server

BUCKET = "bench"
MIB = 1024 ** 2


@dataclass(frozen=True)
class Config:
    """Where a run keeps its checkpoints and whether its agent holds them in memory."""

    label: str
    s3: bool
    tier: bool


STEADY = (Config("local", s3=False, tier=True), Config("s3", s3=True, tier=True),
          Config("s3, tier off", s3=True, tier=False))
RESTORE = (Config("memory", s3=True, tier=True), Config("object store", s3=True, tier=False),
           Config("local disk", s3=False, tier=False))
EXPECTED_SOURCE = {"memory": "memory", "object store": "storage", "local disk": "storage"}


def _vs(num: list[float], den: list[float]) -> str:
    """bench.py's ratio of medians, unless the baseline's median is not above zero (a stall
    lost in the noise): then the difference of the medians."""
    if num and den and statistics.median(den) <= 0:
        difference = statistics.median(num) - statistics.median(den)
        return f"n/a (baseline <= 0; difference {difference:+.3f} s)"
    return _ratio(num, den)


def _job_args(p: Preset, every: int, tier: bool, recovery: str = "live") -> list[str]:
    return ["--preset", p.name, "--steps", str(p.steps), "--batch-size", str(p.batch),
            "--checkpoint-every", str(every), "--log-every", "1000", "--max-restarts", "3",
            "--warmup-steps", "0", "--nproc-per-node", str(p.nproc),
            "--memory-tier", "on" if tier else "off", "--recovery", recovery]


STORE_PRIORITY: dict[str, bool] = {}
"""How the object store's process is scheduled (``--store-priority``): ``normal`` (it takes
CPU from training as the job's own threads do) or ``idle`` (Linux's SCHED_IDLE: it runs
only where training leaves a core, as a remote endpoint's CPU is not the job's at all)."""


def _idle(pid: int) -> None:
    """Every thread of ``pid`` (and those it starts later: they inherit it) in SCHED_IDLE."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setscheduler(int(task), os.SCHED_IDLE, os.sched_param(0))


@contextlib.contextmanager
def _launched(tmp: Path, name: str, cfg: Config, args: list[str]) -> Iterator[harness.Job]:
    """``elastic-train run`` of ``args`` on a local run directory, or on ``s3://`` against
    a fresh moto server; ``job.run_dir`` is where rank 0's node writes its event log. The
    job and the server are stopped when the block ends."""
    run = tmp / name / "run"
    server = S3Server.start() if cfg.s3 else None
    try:
        if server is not None and STORE_PRIORITY.get("idle"):
            _idle(server.proc.pid)
        if server is not None:
            server.make_bucket(BUCKET)
            url, local = f"s3://{BUCKET}/{name}", tmp / name / "local"
            location = [url, "--storage-opt", f"endpoint_url={server.endpoint}",
                        "--storage-opt", f"local_dir={local}"]
            env = harness.job_env(server.env())
            events_root = RunDir(url, StorageConfig(endpoint_url=server.endpoint,
                                                    local_dir=str(local))).root
        else:
            location, env, events_root = [str(run)], harness.job_env(), run
        argv = [sys.executable, "-m", "elastic_train", "run", "--run-dir", *location,
                *harness.with_metrics_ports(args)]
        job = harness.start(argv, run, env)
        job.run_dir = events_root
        try:
            yield job
        finally:
            job.stop()
    finally:
        if server is not None:
            server.stop()


class _Rss(threading.Thread):
    """VmRSS of one process, sampled every ``interval`` seconds until ``stop``."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []  # (time.time(), bytes)
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            self.samples.append((time.time(), int(line.split()[1]) * 1024))
                            break
            except (OSError, ValueError):
                return  # gone
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self.join()

    def last_before(self, at: float) -> int | None:
        found = [rss for t, rss in self.samples if t < at]
        return found[-1] if found else None

    def first_after(self, at: float) -> int | None:
        return next((rss for t, rss in self.samples if t > at), None)


def _steady_once(tmp: Path, name: str, cfg: Config, p: Preset, every: int
                 ) -> dict[str, list[float]]:
    """One run to its end: its step times, stalls, saves and the agent's RSS."""
    os.sync()
    ticks = _cpu_ticks()
    with _launched(tmp, name, cfg, _job_args(p, every, cfg.tier)) as job:
        rss = _Rss(job.proc.pid)
        rss.start()
        try:
            _finish(job, 1800)
        finally:
            rss.stop()
        events = job.events()
    saved = sorted((e for e in events if e["event"] == "checkpoint_saved"),
                   key=lambda e: e["step"])
    periodic = [e for e in saved if e["reason"] == "periodic"]
    if not periodic:
        raise SystemExit(f"{name}: no periodic checkpoint (every {every} of {p.steps} steps)")
    out: dict[str, list[float]] = {
        "step": [statistics.mean(_step_times(events))],
        "stall": _stalls(events, every),
        "durable": [e["time"] - e["snapshot_at"] for e in periodic],
        "persist": [e["persist_seconds"] for e in periodic],
        "waited": [e.get("waited_seconds", 0.0) for e in periodic],
        "memory": [e["memory_seconds"] for e in periodic if e.get("memory_seconds") is not None],
        "copies": [float(e.get("memory_copies") or 0) for e in periodic],
        "bytes": [float(e["bytes"]) for e in periodic],
        "held": [float(e["bytes"] * (e.get("memory_copies") or 0)) for e in periodic],
        "saves waited": [float(sum(e.get("waited_seconds", 0.0) > 0.001 for e in periodic))],
        "steal": [_steal_since(ticks)],
    }
    before = rss.last_before(saved[0]["snapshot_at"])
    after = rss.first_after(periodic[-1]["time"])
    for key, value in (("rss before", before), ("rss after", after),
                       ("rss peak", max((r for _, r in rss.samples), default=None))):
        out[key] = [value / MIB] if value is not None else []
    if before is not None and after is not None:
        out["rss growth"] = [(after - before) / MIB]
    return out


def steady(tmp: Path, p: Preset, every: int, reps: int) -> None:
    results: dict[str, dict[str, list[float]]] = {c.label: {} for c in STEADY}
    for r in range(reps):
        order = STEADY[r % len(STEADY):] + STEADY[:r % len(STEADY)]
        for cfg in order:
            name = f"steady-{cfg.label.replace(', ', '-').replace(' ', '-')}-{r}"
            began = time.monotonic()
            found = _steady_once(tmp, name, cfg, p, every)
            print(f"  ({name}: {time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
            for key, values in found.items():
                results[cfg.label].setdefault(key, []).extend(values)

    def of(label: str, key: str) -> list[float]:
        return results[label].get(key, [])

    local, s3, off = (c.label for c in STEADY)
    print(f"\n## 1. Stall per checkpoint (preset {p.name}: {p.nproc} workers on "
          f"{os.cpu_count()} cores, {p.steps} steps, global batch {p.batch}, checkpoint every "
          f"{every} steps; {reps} repetition(s); stalls over every periodic checkpoint)")
    print(f"| figure | {local} s | {s3} s | {off} s | {s3} / {local} | {off} / {local} |")
    print("|---|---|---|---|---|---|")
    for key, what in (("stall", "stall per checkpoint (step-interval excess)"),
                      ("step", "mean step time"),
                      ("persist", "persist, wall (background)"),
                      ("waited", "a save's wait for the previous persist (in the stall)")):
        print(f"| {what} | {_summary(of(local, key))} | {_summary(of(s3, key))} | "
              f"{_summary(of(off, key))} | {_vs(of(s3, key), of(local, key))}"
              + (" (goal <= 1.05)" if key == "stall" else "")
              + f" | {_vs(of(off, key), of(local, key))} |")
        if key in ("stall", "waited"):  # a median hides the saves that waited
            means = [[statistics.mean(of(c.label, key))] if of(c.label, key) else []
                     for c in STEADY]
            print(f"| {what}, mean | {_summary(means[0])} | {_summary(means[1])} | "
                  f"{_summary(means[2])} | {_vs(means[1], means[0])} | "
                  f"{_vs(means[2], means[0])} |")
    print(f"| periodic saves that waited for the previous persist, per run | "
          f"{_summary(of(local, 'saves waited'))} | {_summary(of(s3, 'saves waited'))} | "
          f"{_summary(of(off, 'saves waited'))} | | |")
    print(f"| the memory tier's cost on s3: stall, tier on / off | | | | "
          f"{_vs(of(s3, 'stall'), of(off, 'stall'))} | |")
    print(f"| the memory tier's cost on s3: step, tier on / off | | | | "
          f"{_ratio(of(s3, 'step'), of(off, 'step'))} | |")
    print("| CPU time stolen by the hypervisor during the runs | "
          + " | ".join(f"{100 * statistics.median(of(c.label, 'steal')):.0f} %"
                       for c in STEADY) + " | | |")

    print(f"\n## 2. Time until a checkpoint is durable, and held in memory ({reps} "
          "repetition(s), every periodic checkpoint)")
    print(f"| figure | {local} s | {s3} s | {off} s | {s3} / {local} | {off} / {local} |")
    print("|---|---|---|---|---|---|")
    print(f"| durable: checkpoint_saved.time - snapshot_at | {_summary(of(local, 'durable'))} |"
          f" {_summary(of(s3, 'durable'))} | {_summary(of(off, 'durable'))} | "
          f"{_ratio(of(s3, 'durable'), of(local, 'durable'))} | "
          f"{_ratio(of(off, 'durable'), of(local, 'durable'))} |")
    print("| held in memory: memory_seconds (the offer, after the serialization) | "
          f"{_summary(of(local, 'memory'))} | {_summary(of(s3, 'memory'))} | (tier off) | "
          f"{_ratio(of(s3, 'memory'), of(local, 'memory'))} | |")
    print(f"| memory_copies | {_summary(of(local, 'copies'))} | {_summary(of(s3, 'copies'))}"
          f" | {_summary(of(off, 'copies'))} | | |")
    print(f"| memory_seconds / durable (s3) | | {_ratio(of(s3, 'memory'), of(s3, 'durable'))}"
          " | | | |")

    print("\n## 4. Host memory of the memory tier (the runs of table 1; agent RSS sampled "
          "every 0.05 s)")
    print(f"| figure | {local} MiB | {s3} MiB | {off} MiB | {s3} / {off} | {s3} - {off} MiB |")
    print("|---|---|---|---|---|---|")
    payload = [b / MIB for b in of(s3, "bytes")]
    held = [b / MIB for b in of(s3, "held")]
    print(f"| payload of a checkpoint (bytes) | {_summary([b / MIB for b in of(local, 'bytes')])}"
          f" | {_summary(payload)} | {_summary([b / MIB for b in of(off, 'bytes')])} | | |")
    print(f"| held by the tier: bytes x memory_copies | "
          f"{_summary([b / MIB for b in of(local, 'held')])} | {_summary(held)} | 0 | | |")
    for key, what in (("rss before", "agent RSS before the first checkpoint"),
                      ("rss after", "agent RSS after the last periodic checkpoint"),
                      ("rss peak", "agent RSS, peak"),
                      ("rss growth", "agent RSS growth: after - before")):
        on, off_ = of(s3, key), of(off, key)
        difference = f"{statistics.median(on) - statistics.median(off_):+.1f}" \
            if on and off_ else "n/a"
        print(f"| {what} | {_summary(of(local, key))} | {_summary(on)} | {_summary(off_)} | "
              f"{_ratio(on, off_) if key != 'rss growth' else ''} | {difference} |")
    if held and of(s3, "rss growth"):
        print(f"| RSS growth / held bytes (s3, tier on) | | "
              f"{statistics.median(of(s3, 'rss growth')) / statistics.median(held):.2f} | | | |")


def _restore_once(tmp: Path, name: str, cfg: Config, p: Preset, recovery: str,
                  timeout: float = 300) -> dict[str, Any]:
    """SIGKILL every worker right after the first ``checkpoint_saved``; the restore and the
    next completed step."""
    endless = dataclasses.replace(p, steps=100000)
    os.sync()
    with _launched(tmp, name, cfg, _job_args(endless, p.every, cfg.tier, recovery)) as job:
        saved = job.wait_for_event(lambda e: e["event"] == "checkpoint_saved", timeout)
        workers = harness.workers_of(job.proc.pid)
        killed_at = time.time()
        for pid in workers.values():
            os.kill(pid, signal.SIGKILL)
        if len(workers) != p.nproc:
            raise SystemExit(f"{name}: found workers {workers}, not {p.nproc}")
        deadline = time.monotonic() + timeout
        while True:
            events = job.events()
            loaded = [e for e in events if e["event"] == "checkpoint_loaded"
                      and e["time"] > killed_at]
            stepped = [e for e in events if e["event"] == "step" and loaded
                       and e["time"] > loaded[0]["time"]]
            if stepped:
                break
            if time.monotonic() > deadline or job.proc.poll() is not None:
                raise SystemExit(f"{name}: no step after the kill:\n{job.report()}")
            time.sleep(0.01)
        output = job.output()
    startup = [e for e in events if e["event"] == "startup" and e["time"] > killed_at]
    found: dict[str, Any] = {
        "total": stepped[0]["time"] - killed_at,
        "loaded": loaded[0]["seconds"],
        "kill -> loaded": loaded[0]["time"] - killed_at,
        "loaded -> step": stepped[0]["time"] - loaded[0]["time"],
        "source": loaded[0].get("source"),
        "saved step": saved["step"],
        "loaded step": loaded[0]["step"],
        # The agent's log (live recovery): whether it saw both deaths as one failure, the
        # workers it started again into the running world, and the workers it stopped with
        # SIGTERM that ran out their preemption budget instead of exiting.
        "seen at once": bool(re.search(r"worker rank\(s\) \[\d+(, \d+)+\] failed", output)),
        "live restarts": output.count("started again into the running world"),
        "budget overruns": output.count("preemption budget"),
        "bytes": saved["bytes"],
    }
    if startup:
        marks = startup[0]
        start = marks.get("process_start") or marks.get("imported")
        if start:
            found["kill -> worker started"] = start - killed_at
    return found


def restore(tmp: Path, p: Preset, reps: int, modes: list[str]) -> None:
    runs = [(cfg, mode) for mode in modes for cfg in RESTORE]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {(c.label, m): [] for c, m in runs}
    for r in range(reps):
        order = runs[r % len(runs):] + runs[:r % len(runs)]
        for cfg, mode in order:
            name = f"restore-{mode}-{cfg.label.replace(' ', '-')}-{r}"
            began = time.monotonic()
            results[cfg.label, mode].append(_restore_once(tmp, name, cfg, p, mode))
            print(f"  ({name}: {time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
    memory, store, disk = (c.label for c in RESTORE)
    for mode in modes:
        print(f"\n## 3{'ab'[modes.index(mode)] if len(modes) > 1 else ''}. Restore after every "
              f"worker died, --recovery {mode}{' (the default)' if mode == 'live' else ''} "
              f"(preset {p.name}, 1 node x {p.nproc} workers, checkpoint every {p.every} "
              f"steps, SIGKILL of every worker right after the first checkpoint_saved; {reps} "
              "repetition(s))")
        print(f"| figure | from {memory} s | from the {store} s | from {disk} s | "
              f"{memory} / {disk} | {store} / {disk} |")
        print("|---|---|---|---|---|---|")
        for key, what in (("total", "kill -> next completed step"),
                          ("loaded", "checkpoint_loaded.seconds (the restore)"),
                          ("kill -> worker started", "kill -> the restarted worker's start"),
                          ("kill -> loaded", "kill -> checkpoint loaded"),
                          ("loaded -> step", "checkpoint loaded -> next step")):
            values = {label: [x[key] for x in results[label, mode] if key in x]
                      for label in (memory, store, disk)}
            print(f"| {what} | {_summary(values[memory])} | {_summary(values[store])} | "
                  f"{_summary(values[disk])} | {_ratio(values[memory], values[disk])} | "
                  f"{_ratio(values[store], values[disk])} |")
        for label in (memory, store, disk):
            done = results[label, mode]
            sources = [x["source"] for x in done]
            wrong = sum(s != EXPECTED_SOURCE[label] for s in sources)
            print(f"- {label}: checkpoint_loaded.source {sources} (expected "
                  f"{EXPECTED_SOURCE[label]!r}"
                  f"{', ' + str(wrong) + ' NOT AS CLAIMED' if wrong else ', as claimed'}); "
                  f"saved step -> loaded step {[(x['saved step'], x['loaded step']) for x in done]}"
                  + (f"; both deaths seen as one failure {[x['seen at once'] for x in done]}"
                     f"; workers started again into the running world (live restarts spent) "
                     f"{[x['live restarts'] for x in done]}" if mode == "live" else "")
                  + f"; workers that ran out the 25 s SIGTERM budget "
                  f"{[x['budget overruns'] for x in done]}; payload "
                  f"{statistics.median(x['bytes'] for x in done) / MIB:.1f} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--every", type=int, help="checkpoint every N steps (default: the "
                        "preset's)")
    parser.add_argument("--steps", type=int, help="steps of the runs of tables 1, 2 and 4 "
                        "(default: the preset's)")
    parser.add_argument("--nproc", type=int, default=2, help="workers of the runs of tables "
                        "1, 2 and 4 (1 leaves a core to the writer and the object store, as "
                        "the host CPUs of a GPU node do; table 3 always runs 2)")
    parser.add_argument("--skip-steady", action="store_true", help="no tables 1, 2 and 4")
    parser.add_argument("--skip-restore", action="store_true", help="no table 3")
    parser.add_argument("--recovery", default="restart,live", help="the --recovery of the "
                        "runs of table 3, one table each (comma-separated)")
    parser.add_argument("--store-priority", choices=("normal", "idle"), default="normal",
                        help="the object store's CPU priority: normal (default: it competes "
                        "with training for the job's cores) or idle (SCHED_IDLE: it runs only "
                        "where training leaves a core, as a remote endpoint takes none)")
    ns = parser.parse_args()
    STORE_PRIORITY["idle"] = ns.store_priority == "idle"
    p = PRESETS[ns.preset]
    p = dataclasses.replace(p, steps=ns.steps or p.steps, every=ns.every or p.every)
    tmp = Path(tempfile.mkdtemp(prefix="et-object-store-"))
    began = time.monotonic()
    print(f"# elastic_train object store benchmark ({time.strftime('%Y-%m-%d %H:%M')}, "
          f"runs in {tmp})")
    print(f"\n`{' '.join(['python', 'benchmarks/object_store.py', *sys.argv[1:]])}`; the object "
          "store: moto_server on loopback, a fresh one per run, sharing the job's cores"
          + (" at idle priority (SCHED_IDLE)" if ns.store_priority == "idle" else ""))
    if not ns.skip_steady:
        steady(tmp, dataclasses.replace(p, nproc=ns.nproc), p.every, ns.reps)
    if not ns.skip_restore:
        restore(tmp, p, ns.reps, ns.recovery.split(","))
    print(f"\n(the whole invocation took {time.monotonic() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
