"""Benchmark: sharded models (``--parallelism fsdp``) against DDP, and our sharded checkpoints
against ``dcp.async_save``, interleaved in one run.

    python benchmarks/sharded.py                  # medium preset, 2 repetitions (~15 min)
    python benchmarks/sharded.py --preset large --reps 1
    python benchmarks/sharded.py --skip-loop --skip-restore    # table 1 only

1. The built-in job under ``elastic-train run`` (2 workers, a checkpoint every N steps,
   ``--memory-tier off`` and ``--recovery restart`` for both, so the persist is the same
   kind of work): DDP vs FSDP2 step time, stall per checkpoint (the step that holds a
   save, less the median step: bench.py's ``_stalls``), time until durable, and the bytes
   each rank writes per checkpoint (DDP: rank 0 the whole state; FSDP: each rank its
   shard, rank 0 also ``common.pt``).
2. One hand-written FSDP2 loop (benchmarks/sharded_loop.py, the same model, data and
   steps) checkpointed by ElasticSession vs by ``dcp.async_save`` of ``get_state_dict``
   (the previous save waited for before the next, on a gloo group of its own, as
   torchtitan does): the stall per checkpoint as the loop's own step times show it.
3. Restore: SIGKILL of worker 1 right after a ``checkpoint_saved`` (every worker restarts
   from the checkpoint, ``--recovery restart``): kill -> next completed step and
   ``checkpoint_loaded.seconds``, DDP and FSDP at the same world size; and FSDP
   stopped at world 2 (SIGTERM) and relaunched at world 3: the resharding restore's
   ``checkpoint_loaded.seconds`` and launch -> first step.
4. Live recovery (``--recovery live``, the default) against the restart path, interleaved:
   SIGKILL of worker 1 right after a ``checkpoint_saved``: fsdp restarting every worker
   (the baseline), fsdp live (the survivor keeps its process; every rank loads the
   checkpoint in place: no replica holds the lost shards), its parts from the agents'
   memory tier (the default) or, ``--memory-tier off``, from the run directory, and hsdp
   live with 2 replica groups of 1 (the new worker receives its shards from the other
   group; nothing is loaded): kill -> next completed step, the ``recovery`` event's
   seconds, ``checkpoint_loaded.seconds``, steps redone.

    python benchmarks/sharded.py --skip-steady --skip-loop --skip-restore --reps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import PRESETS, Preset, _finish, _ratio, _stalls, _step_times, _summary

from tests.integration import harness

MIB = 1024 ** 2
LOOP = Path(__file__).resolve().parent / "sharded_loop.py"


def _job(p: Preset, every: int, parallelism: str, nproc: int = 2) -> list[str]:
    return ["--preset", p.name, "--steps", str(p.steps), "--batch-size", str(p.batch),
            "--checkpoint-every", str(every), "--log-every", "1000", "--warmup-steps", "0",
            "--nproc-per-node", str(nproc), "--memory-tier", "off", "--recovery", "restart",
            "--parallelism", parallelism, "--keep-checkpoints", "2"]


def _bytes_per_rank(run_dir: Path) -> dict[str, float]:
    """Of the newest checkpoint: the most any rank wrote, and all ranks together."""
    final = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    manifest = json.loads((final / "manifest.json").read_text())
    files = {n: int(f["bytes"]) for n, f in manifest["files"].items()}
    shards = [b for n, b in files.items() if n.startswith("shard-")]
    most = (max(shards) + files.get("common.pt", 0)) if shards else sum(files.values())
    return {"rank bytes": most / MIB, "total bytes": sum(files.values()) / MIB}


def steady(tmp: Path, p: Preset, every: int, reps: int) -> None:
    kinds = ("ddp", "fsdp")
    results: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}
    for r in range(reps):
        for kind in kinds[r % 2:] + kinds[:r % 2]:
            run_dir = tmp / f"steady-{kind}-{r}" / "run"
            job = harness.elastic_run(run_dir, _job(p, every, kind))
            _finish(job, 1800)
            events = job.events()
            saved = [e for e in events if e["event"] == "checkpoint_saved"
                     and e["reason"] == "periodic"]
            found = {"step": _step_times(events), "stall": _stalls(events, every),
                     "durable": [e["time"] - e["snapshot_at"] for e in saved],
                     "snapshot": [e["snapshot_seconds"] for e in saved],
                     **{k: [v] for k, v in _bytes_per_rank(run_dir).items()}}
            for key, values in found.items():
                results[kind].setdefault(key, []).extend(values)
            print(f"  ({run_dir.parent.name} done)", file=sys.stderr, flush=True)
    print(f"\n## 1. DDP vs FSDP2, the built-in job (preset {p.name}, 2 workers on "
          f"{os.cpu_count()} cores, {p.steps} steps, global batch {p.batch}, a checkpoint "
          f"every {every} steps; {reps} repetition(s))")
    print("| figure | ddp | fsdp | fsdp / ddp |\n|---|---|---|---|")
    for key, what in (("step", "step time, s"), ("stall", "stall per checkpoint, s"),
                      ("snapshot", "snapshot (training waits), s"),
                      ("durable", "durable after the snapshot, s"),
                      ("rank bytes", "bytes one rank writes per checkpoint (the most), MiB"),
                      ("total bytes", "bytes of a checkpoint, all ranks, MiB")):
        ddp, fsdp = results["ddp"].get(key, []), results["fsdp"].get(key, [])
        print(f"| {what} | {_summary(ddp)} | {_summary(fsdp)} | {_ratio(fsdp, ddp)} |")
        if key == "stall":
            means = [[statistics.mean(v)] if v else [] for v in (ddp, fsdp)]
            print(f"| stall per checkpoint, mean, s | {_summary(means[0])} | "
                  f"{_summary(means[1])} | {_ratio(means[1], means[0])} |")


def _loop_stalls(run_dir: Path, every: int) -> tuple[list[float], list[float]]:
    lines = [json.loads(x) for x in (run_dir / "steps-0.jsonl").read_text().splitlines()]
    events = [{"event": "step", **x} for x in lines]
    return _stalls(events, every), _step_times(events)


def loop(tmp: Path, p: Preset, every: int, reps: int) -> None:
    modes = ("dcp", "ours")
    stalls: dict[str, list[float]] = {m: [] for m in modes}
    steps: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(reps):
        for mode in modes[r % 2:] + modes[:r % 2]:
            run_dir = tmp / f"loop-{mode}-{r}"
            run_dir.mkdir(parents=True)
            argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                    "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(LOOP), mode,
                    str(run_dir), p.name, str(p.steps), str(every), str(p.batch)]
            job = harness.start(argv, run_dir / "run")
            _finish(job, 1800)
            found = _loop_stalls(run_dir, every)
            stalls[mode].extend(found[0])
            steps[mode].extend(found[1])
            print(f"  (loop-{mode}-{r} done)", file=sys.stderr, flush=True)
    print(f"\n## 2. One hand-written FSDP2 loop: ElasticSession vs dcp.async_save (preset "
          f"{p.name}, 2 workers, a checkpoint every {every} steps; {reps} repetition(s))")
    print("| figure | dcp.async_save | ours | ours / dcp |\n|---|---|---|---|")
    print(f"| stall per checkpoint, s | {_summary(stalls['dcp'])} | "
          f"{_summary(stalls['ours'])} | {_ratio(stalls['ours'], stalls['dcp'])} |")
    means = [[statistics.mean(stalls[m])] if stalls[m] else [] for m in modes]
    print(f"| stall per checkpoint, mean, s | {_summary(means[0])} | {_summary(means[1])} | "
          f"{_ratio(means[1], means[0])} |")
    print(f"| step time, s | {_summary(steps['dcp'])} | {_summary(steps['ours'])} | "
          f"{_ratio(steps['ours'], steps['dcp'])} |")


def _killed_once(run_dir: Path, p: Preset, kind: str) -> dict[str, float]:
    endless = dataclasses.replace(p, steps=100000)
    job = harness.elastic_run(run_dir, [*_job(endless, p.every, kind), "--max-restarts", "2"])
    try:
        job.wait_for_event(lambda e: e["event"] == "checkpoint_saved", 600)
        killed_at = time.time()
        job.kill_worker(1)
        loaded = job.wait_for_event(lambda e: e["event"] == "checkpoint_loaded", 600)
        step = job.wait_for_event(lambda e: e["event"] == "step" and e["time"] > loaded["time"],
                                  600)
    finally:
        job.stop()
    return {"kill to next step": step["time"] - killed_at, "loaded": loaded["seconds"]}


def _resized(run_dir: Path, p: Preset) -> dict[str, float]:
    endless = dataclasses.replace(p, steps=100000)
    job = harness.elastic_run(run_dir, _job(endless, p.every, "fsdp"))
    try:
        job.wait_for_event(lambda e: e["event"] == "checkpoint_saved", 600)
        job.proc.send_signal(signal.SIGTERM)
        job.wait(300)
    finally:
        job.stop()
    began = time.time()
    job = harness.elastic_run(run_dir, _job(endless, p.every, "fsdp", nproc=3))
    try:
        loaded = job.wait_for_event(lambda e: e["event"] == "checkpoint_loaded"
                                    and e["world_size"] == 3, 600)
        step = job.wait_for_event(lambda e: e["event"] == "step" and e["time"] > loaded["time"],
                                  600)
    finally:
        job.stop()
    assert loaded["saved_world_size"] == 2, loaded
    return {"loaded": loaded["seconds"], "launch to first step": step["time"] - began}


def _kill_after_a_checkpoint(job: harness.Job) -> tuple[float, dict, dict]:
    """SIGKILL worker 1 of ``job`` right after its first checkpoint; stop the job once a
    step follows the recovery: (the kill's time, the recovery event, that step's event)."""
    try:
        job.wait_for_event(lambda e: e["event"] == "checkpoint_saved", 600)
        killed_at = time.time()
        job.kill_worker(1)
        done = job.wait_for_event(lambda e: e["event"] == "recovery" and e["time"] > killed_at,
                                  600)
        step = job.wait_for_event(lambda e: e["event"] == "step" and e["time"] > done["time"],
                                  600)
    finally:
        job.stop()
    return killed_at, done, step


def _killed_live(run_dir: Path, p: Preset, parallelism: str, recovery: str,
                 extra: tuple[str, ...] = ()) -> dict[str, float]:
    """Worker 1 SIGKILLed right after a checkpoint; the figures of its recovery."""
    endless = dataclasses.replace(p, steps=100000)
    job = harness.elastic_run(run_dir, [*_job(endless, p.every, parallelism), *extra,
                                        "--recovery", recovery, "--max-restarts", "2"])
    killed_at, done, step = _kill_after_a_checkpoint(job)
    if recovery == "live":
        assert done["kind"] == "live", done
    loads = [e for e in job.events() if e["event"] == "checkpoint_loaded"
             and e["time"] > killed_at]
    source = "memory" if "on" in extra else "storage"
    assert all(e["source"] == source for e in loads), loads
    return {"kill to next step": step["time"] - killed_at,
            "steps redone": float(done["steps_redone"] or 0),
            **({"recovery seconds": done["seconds"]} if done["seconds"] is not None else {}),
            **({"checkpoint_loaded.seconds": max(e["seconds"] for e in loads)}
               if loads else {})}


MEMORY = ("--memory-tier", "on")
LIVE_CASES = {"fsdp, restart": ("fsdp", "restart", MEMORY),
              "fsdp, live (checkpoint in memory)": ("fsdp", "live", MEMORY),
              "fsdp, live (checkpoint on disk)": ("fsdp", "live", ()),
              "hsdp 2x1, live (peers)": ("hsdp", "live", (*MEMORY, "--replica-group-size",
                                                          "1")),
              "hsdp 2x1, live (peers), memory tier off": ("hsdp", "live",
                                                          ("--replica-group-size", "1"))}
"""The restart baseline and the live cases, with the memory tier on as a user's job has it
(the default) but for the ones marked off (``_job``'s ``--memory-tier off``): the fsdp
one that reads the run directory, and hsdp's, which reads no checkpoint, to show what the
tier's offers cost it; the restart also reads the checkpoint's parts from memory."""


def live(tmp: Path, p: Preset, reps: int) -> None:
    found: dict[str, dict[str, list[float]]] = {case: {} for case in LIVE_CASES}
    for r in range(reps):
        order = list(LIVE_CASES)[r % len(LIVE_CASES):] + list(LIVE_CASES)[:r % len(LIVE_CASES)]
        for i, case in enumerate(order):
            parallelism, recovery, extra = LIVE_CASES[case]
            figures = _killed_live(tmp / f"live-{r}-{i}" / "run", p, parallelism, recovery,
                                   extra)
            for key, value in figures.items():
                found[case].setdefault(key, []).append(value)
        print(f"  (live rep {r} done)", file=sys.stderr, flush=True)
    print(f"\n## 4. Live recovery of sharded state (preset {p.name}; {reps} repetition(s)): "
          "worker 1 SIGKILLed right after a checkpoint")
    cases = list(LIVE_CASES)
    print("| figure | " + " | ".join(cases) + " | fsdp live (memory) / restart | fsdp live "
          "(memory) / fsdp live (disk) | hsdp live / fsdp restart | hsdp live, memory tier "
          "on / off |\n|---|" + "---|" * (len(cases) + 4))
    for key in ("kill to next step", "recovery seconds", "checkpoint_loaded.seconds",
                "steps redone"):
        values = [found[c].get(key, []) for c in cases]
        print(f"| {key} | " + " | ".join(_summary(v) for v in values)
              + f" | {_ratio(values[1], values[0])} | {_ratio(values[1], values[2])} | "
              f"{_ratio(values[3], values[0])} | {_ratio(values[3], values[4])} |")


def restore(tmp: Path, p: Preset, reps: int) -> None:
    same: dict[str, dict[str, list[float]]] = {"ddp": {}, "fsdp": {}}
    resized: dict[str, list[float]] = {}
    for r in range(reps):
        for kind in ("ddp", "fsdp")[r % 2:] + ("ddp", "fsdp")[:r % 2]:
            for key, value in _killed_once(tmp / f"kill-{kind}-{r}" / "run", p, kind).items():
                same[kind].setdefault(key, []).append(value)
        for key, value in _resized(tmp / f"resize-{r}" / "run", p).items():
            resized.setdefault(key, []).append(value)
        print(f"  (restore rep {r} done)", file=sys.stderr, flush=True)
    print(f"\n## 3. Restore (preset {p.name}; {reps} repetition(s)): worker 1 SIGKILLed after "
          "a checkpoint, every worker restarted from it; and fsdp stopped at world 2, "
          "relaunched at world 3")
    print("| figure | ddp, world 2 -> 2 | fsdp, world 2 -> 2 | fsdp, world 2 -> 3 | "
          "fsdp 2->2 / ddp |\n|---|---|---|---|---|")
    print(f"| checkpoint_loaded.seconds | {_summary(same['ddp'].get('loaded', []))} | "
          f"{_summary(same['fsdp'].get('loaded', []))} | {_summary(resized.get('loaded', []))}"
          f" | {_ratio(same['fsdp'].get('loaded', []), same['ddp'].get('loaded', []))} |")
    ddp_kill, fsdp_kill = (same[k].get("kill to next step", []) for k in ("ddp", "fsdp"))
    print(f"| kill -> next step, s | {_summary(ddp_kill)} | {_summary(fsdp_kill)} | | "
          f"{_ratio(fsdp_kill, ddp_kill)} |")
    print(f"| relaunch -> first step, s | | | "
          f"{_summary(resized.get('launch to first step', []))} | |")


def _loop_killed(run_dir: Path, p: Preset, recovery: str) -> dict[str, float]:
    """sharded_loop.py under ``elastic-train run``, worker 1 SIGKILLed right after a
    checkpoint; the figures of its recovery."""
    run_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", "elastic_train", "run", "--nproc-per-node=2",
            "--max-restarts=2", str(LOOP), recovery, str(run_dir), p.name, "100000",
            str(p.every), str(p.batch)]
    job = harness.start(argv, run_dir)
    killed_at, done, step = _kill_after_a_checkpoint(job)
    assert done["kind"] == recovery, done
    loads = [e for e in job.events() if e["event"] == "checkpoint_loaded"
             and e["time"] > killed_at]
    assert loads and all(e["source"] == "memory" for e in loads), loads
    return {"kill to next step": step["time"] - killed_at,
            **({"recovery seconds": done["seconds"]} if done["seconds"] is not None else {}),
            "checkpoint_loaded.seconds": max(e["seconds"] for e in loads)}


def loop_recovery(tmp: Path, p: Preset, reps: int) -> None:
    modes = ("restart", "live")
    found: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    for r in range(reps):
        for mode in modes[r % 2:] + modes[:r % 2]:
            figures = _loop_killed(tmp / f"loop-killed-{mode}-{r}", p, mode)
            for key, value in figures.items():
                found[mode].setdefault(key, []).append(value)
        print(f"  (loop recovery rep {r} done)", file=sys.stderr, flush=True)
    print(f"\n## 5. A hand-written FSDP2 loop killed (ElasticSession, preset {p.name}, 2 "
          f"workers; {reps} repetition(s)): worker 1 SIGKILLed right after a checkpoint")
    print("| figure | recovery=\"restart\" | recovery=\"live\" | live / restart |\n"
          "|---|---|---|---|")
    for key in ("kill to next step", "recovery seconds", "checkpoint_loaded.seconds"):
        values = [found[m].get(key, []) for m in modes]
        print(f"| {key} | {_summary(values[0])} | {_summary(values[1])} | "
              f"{_ratio(values[1], values[0])} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--skip-steady", action="store_true")
    parser.add_argument("--skip-loop", action="store_true")
    parser.add_argument("--skip-restore", action="store_true")
    parser.add_argument("--skip-live", action="store_true")
    parser.add_argument("--skip-loop-recovery", action="store_true")
    ns = parser.parse_args()
    p = dataclasses.replace(PRESETS[ns.preset], steps=ns.steps, every=ns.every)
    tmp = Path(tempfile.mkdtemp(prefix="et-sharded-"))
    began = time.monotonic()
    print(f"# elastic_train sharded benchmark ({time.strftime('%Y-%m-%d %H:%M')}, runs in "
          f"{tmp})\n\n`{' '.join(['python', 'benchmarks/sharded.py', *sys.argv[1:]])}`")
    if not ns.skip_steady:
        steady(tmp, p, ns.every, ns.reps)
    if not ns.skip_loop:
        loop(tmp, p, ns.every, ns.reps)
    if not ns.skip_restore:
        restore(tmp, p, ns.reps)
    if not ns.skip_live:
        live(tmp, p, ns.reps)
    if not ns.skip_loop_recovery:
        loop_recovery(tmp, p, ns.reps)
    print(f"\n(the whole invocation took {time.monotonic() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

