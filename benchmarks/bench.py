"""Benchmark: elastic_train against the hand-written baseline, interleaved in one run.

    python benchmarks/bench.py                 # all figures (10-20 minutes on 2 cores)
    python benchmarks/bench.py --quick         # one repetition, small model only
    python benchmarks/bench.py --nproc 2,1     # steady state also with one worker, so that
                                               # a core is left to the writer (a GPU node)
    python benchmarks/bench.py --quick --compare-with ../before
                                               # before vs after a change: the job of
                                               # another checkout (git worktree add
                                               # ../before HEAD~1) in the same rotation,
                                               # steady state and recovery

Every figure is a ratio against a baseline measured in the same invocation (the machines
are shared and noisy), with the median and the spread (min-max) over the repetitions:

1. steady-state step time with checkpoints every N steps: ours / baseline without
   checkpoints (and the baseline with its synchronous torch.save, for reference);
2. training stall per checkpoint: ours (snapshot + any wait) vs the baseline's torch.save,
   and vs the physical floor (copying the same bytes in memory);
3. recovery after SIGKILL of one worker (single node, c10d): kill -> next completed step,
   for the baseline, our restart path (--recovery restart) and our live recovery (the
   default: only the dead worker starts again, the state comes from the survivor), with
   the restart paths broken into agent (detection + re-rendezvous + spawn), imports,
   process group, build + restore, DDP, first step, and the live path into re-formed
   (detection, the new worker's start, the new group, the state sent) and first step;
4. lost work per failure: steps redone; and the job's start (launch -> first completed
   step) of the same runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic_train.rundir import RunDir  # noqa: E402
from tests.integration import harness  # noqa: E402

BASELINE = str(REPO / "benchmarks" / "baseline_ddp.py")


@dataclass(frozen=True)
class Preset:
    name: str
    steps: int
    batch: int
    every: int
    nproc: int = 2


PRESETS = {
    "small": Preset("small", 60, 16, 10),
    "medium": Preset("medium", 16, 8, 4),
    "large": Preset("large", 8, 2, 4),
}


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _run_baseline(run_dir: Path, p: Preset, every: int) -> harness.Job:
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={p.nproc}",
            "--max-restarts=3", "--monitor-interval=0.1", "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0", BASELINE, str(run_dir), "--preset", p.name,
            "--steps", str(p.steps), "--batch-size", str(p.batch),
            "--checkpoint-every", str(every)]
    return harness.start(argv, run_dir, cwd=run_dir.parent)


def _run_ours(run_dir: Path, p: Preset, every: int, tree: Path | None = None,
              recovery: str = "live", spare: bool = True) -> harness.Job:
    """Our job; ``tree``: another checkout of elastic_train runs it (--compare-with)."""
    args = ["--preset", p.name, "--steps", str(p.steps), "--batch-size", str(p.batch),
            "--checkpoint-every", str(every) if every else "off", "--log-every", "1000",
            "--max-restarts", "3", "--warmup-steps", "0", "--nproc-per-node", str(p.nproc)]
    if tree is None or recovery != "live" or not spare:  # the other tree: any since the
        args += ["--recovery", recovery, "--hot-spare", "on" if spare else "off"]  # spare
    env = None if tree is None else harness.job_env({"PYTHONPATH": str(tree)})
    return harness.elastic_run(run_dir, args, env)


def _package_of(tree: Path, cwd: Path) -> str:
    """Where the job's ``elastic_train`` comes from when ``tree`` runs it in ``cwd``, as
    the jobs run (a check)."""
    out = subprocess.run([sys.executable, "-c", "import elastic_train; "
                          "print(elastic_train.__file__)"], capture_output=True, text=True,
                         env=harness.job_env({"PYTHONPATH": str(tree)}), cwd=cwd, check=True)
    return out.stdout.strip()


def _baseline_log(run_dir: Path) -> list[dict[str, Any]]:
    return _events(run_dir / "baseline.jsonl")


def _our_log(run_dir: Path) -> list[dict[str, Any]]:
    return _events(RunDir(run_dir).events)


def _step_times(events: list[dict[str, Any]], skip: int = 3) -> list[float]:
    """Intervals between consecutive step events (after ``skip`` warm-up steps)."""
    steps = [e for e in events if e["event"] == "step"]
    return [b["time"] - a["time"] for a, b in itertools.pairwise(steps)][skip:]


def _stalls(events: list[dict[str, Any]], every: int, skip: int = 3) -> list[float]:
    """Excess of the interval that contains a save over the median of the others."""
    steps = [e for e in events if e["event"] == "step"]
    intervals = {b["step"]: b["time"] - a["time"] for a, b in itertools.pairwise(steps)}
    plain = [t for s, t in intervals.items() if s > skip and (s - 1) % every]
    typical = statistics.median(plain)
    return [intervals[s] - typical for s in intervals if s > skip and (s - 1) % every == 0
            and s - 1 > 0]


def _floor_seconds(preset: str, threads: int) -> float:
    """Copying the same state (model + AdamW) in memory with ``threads`` threads: the
    physical floor of a snapshot (a worker of a 2-process node copies with 1, as torchrun
    sets OMP_NUM_THREADS=1)."""
    import torch

    from elastic_train.checkpoint.snapshot import SnapshotBuffers
    from elastic_train.tasks.base import TaskContext
    from elastic_train.tasks.gpt import make_task

    task = make_task(TaskContext({"preset": preset}))
    model = task.build_model()
    optimizer = task.build_optimizer(model, 1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    buffers = SnapshotBuffers()
    buffers.copy({"model": model, "optimizer": optimizer})  # allocate once, as ours does
    times = []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(5):
            began = time.perf_counter()
            buffers.copy({"model": model, "optimizer": optimizer})
            times.append(time.perf_counter() - began)
    finally:
        torch.set_num_threads(previous)
    return statistics.median(times)


def _cpu_ticks() -> tuple[int, int]:
    """(steal, all) clock ticks of the machine so far (Linux; (0, 0) elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def _steal_since(before: tuple[int, int]) -> float:
    """Share of the machine's CPU time the hypervisor gave to others since ``before``."""
    steal, total = _cpu_ticks()
    return (steal - before[0]) / max(1, total - before[1])


def _summary(values: list[float]) -> str:
    if not values:
        return "n/a"
    return (f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"
            if len(values) > 1 else f"{values[0]:.3f}")


def _ratio(num: list[float], den: list[float]) -> str:
    if not num or not den or statistics.median(den) == 0:
        return "n/a"
    return f"{statistics.median(num) / statistics.median(den):.3f}"


def _finish(job: harness.Job, timeout: float) -> None:
    code = job.wait(timeout)
    if code != 0:
        raise SystemExit(f"benchmark run failed ({code}):\n{job.report()}")


def steady_state(tmp: Path, presets: list[Preset], reps: int,
                 other: Path | None = None) -> None:
    print("\n## 1-2. Steady state and checkpoint stall")
    if other is not None:
        print(f"(also the job of {other}, whose package is {_package_of(other, tmp)}, in "
              "the same rotation)")
    for p in presets:
        per_step: dict[str, list[float]] = {"base": [], "base+ckpt": [], "ours": [],
                                            "ours-nockpt": []}
        if other is not None:
            per_step.update({"other": [], "other-nockpt": []})
        stalls: dict[str, list[float]] = {"base": [], "ours": [], "ours-stall": []}
        saves: dict[str, list[float]] = {"snapshot": [], "copy": [], "copy_wait": [],
                                         "persist": [], "persist_cpu": []}
        steal: dict[str, list[float]] = {label: [] for label in per_step}
        for r in range(reps):
            runs: list[tuple[str, Callable[[Path, Preset, int], harness.Job], int]] = [
                ("base", _run_baseline, 0), ("base+ckpt", _run_baseline, p.every),
                ("ours", _run_ours, p.every), ("ours-nockpt", _run_ours, 0)]
            if other is not None:
                def of_other(run_dir: Path, p: Preset, every: int) -> harness.Job:
                    return _run_ours(run_dir, p, every, other)
                runs += [("other", of_other, p.every), ("other-nockpt", of_other, 0)]
            # Rotate the order each repetition, and start every run with the previous one's
            # writes flushed: a run right after a checkpointing one would otherwise pay for
            # the kernel's write-back of its files.
            runs = runs[r % len(runs):] + runs[:r % len(runs)]
            for label, launch, every in runs:
                os.sync()
                run_dir = tmp / f"{p.name}-{p.nproc}-{label}-{r}" / "run"
                ticks = _cpu_ticks()
                job = launch(run_dir, p, every)
                _finish(job, 1800)
                steal[label].append(_steal_since(ticks))
                events = _baseline_log(run_dir) if label.startswith("base") else \
                    _our_log(run_dir)
                times = _step_times(events)
                per_step[label].append(statistics.mean(times))
                if label == "base+ckpt":
                    stalls["base"].extend(e["stall_seconds"] for e in events
                                          if e["event"] == "checkpoint_saved")
                if label == "ours":
                    stalls["ours"].extend(_stalls(events, p.every))
                    periodic = [e for e in events if e["event"] == "checkpoint_saved"
                                and e["reason"] == "periodic"]
                    # What training waited for: the previous persist, the copy made at
                    # once, and the next optimizer step's wait for the overlapped copy.
                    stalls["ours-stall"].extend(
                        e["snapshot_seconds"] + e.get("waited_seconds", 0.0)
                        + e.get("copy_wait_seconds", 0.0) for e in periodic)
                    for key in saves:
                        saves[key].extend(e.get(f"{key}_seconds", 0.0) for e in periodic)
        floor_1 = _floor_seconds(p.name, threads=1)
        floor_all = _floor_seconds(p.name, threads=os.cpu_count() or 1)
        base_step = statistics.median(per_step["base"])
        print(f"\n### preset {p.name}: {p.nproc} worker(s) on {os.cpu_count()} cores (gloo), "
              f"{p.steps} steps, global batch {p.batch}, checkpoint every {p.every} steps, "
              f"{reps} repetition(s)")
        print("| figure | seconds: median (min-max) | ratio |")
        print("|---|---|---|")
        print(f"| step, baseline without checkpoints | {_summary(per_step['base'])} | 1 |")
        print(f"| step, baseline with torch.save | {_summary(per_step['base+ckpt'])} | "
              f"{_ratio(per_step['base+ckpt'], per_step['base'])} |")
        print(f"| step, ours without checkpoints (the loop alone) | "
              f"{_summary(per_step['ours-nockpt'])} | "
              f"{_ratio(per_step['ours-nockpt'], per_step['base'])} |")
        print(f"| step, ours with checkpoints | {_summary(per_step['ours'])} | "
              f"{_ratio(per_step['ours'], per_step['base'])} (target <= 1.02) |")
        if other is not None:
            print(f"| step, {other} without checkpoints | {_summary(per_step['other-nockpt'])}"
                  f" | {_ratio(per_step['other-nockpt'], per_step['base'])} |")
            print(f"| step, {other} with checkpoints | {_summary(per_step['other'])} | "
                  f"{_ratio(per_step['other'], per_step['base'])} |")
            print(f"| ours / {other}, without checkpoints | | "
                  f"{_ratio(per_step['ours-nockpt'], per_step['other-nockpt'])} |")
            print(f"| ours / {other}, with checkpoints | | "
                  f"{_ratio(per_step['ours'], per_step['other'])} |")
        print("| CPU time stolen by the hypervisor during the runs (" + ", ".join(steal) +
              "): " + ", ".join(
                  f"{100 * statistics.median(v):.0f} %" for v in steal.values()) + " | | |")
        print(f"| stall per save, baseline torch.save | {_summary(stalls['base'])} | 1 |")
        print(f"| stall per save, ours (training waits: previous persist + copy at once + "
              f"next step's wait for the overlapped copy) | {_summary(stalls['ours-stall'])}"
              f" | {_ratio(stalls['ours-stall'], stalls['base'])} (target <= 0.1 at medium) |")
        print(f"| stall per save, ours (step-interval excess: also the CPU the copy and "
              f"the write take from training) | {_summary(stalls['ours'])} | "
              f"{_ratio(stalls['ours'], stalls['base'])} |")
        print(f"| ours: the copy made at once | {_summary(saves['snapshot'])} | |")
        print(f"| ours: the overlapped copy (background) | {_summary(saves['copy'])} | |")
        print(f"| ours: the next step's wait for it | {_summary(saves['copy_wait'])} | |")
        print(f"| ours: persist, wall (background) | {_summary(saves['persist'])} | |")
        cpu = statistics.median(saves["persist_cpu"]) if saves["persist_cpu"] else 0.0
        print(f"| ours: persist, CPU of the writer thread | {_summary(saves['persist_cpu'])} "
              f"| {cpu / (p.every * base_step):.3f} of one core between saves |")
        stall = statistics.median(stalls["ours-stall"]) if stalls["ours-stall"] else 0.0
        print(f"| floor: in-memory copy of the same state, 1 thread (as a worker) | "
              f"{floor_1:.3f} | ours / floor = {stall / floor_1:.2f} (target <= 1.5) |")
        print(f"| floor: the same with {os.cpu_count()} threads | {floor_all:.3f} | "
              f"ours / floor = {stall / floor_all:.2f} |")


@dataclasses.dataclass
class _Killed:
    """One run struck at ``kill_at``: when it started, stepped, was struck, and what followed."""

    launched: float
    first_step: float
    killed_at: float
    steps_done: int
    recovered: list[dict[str, Any]] | None  # None: the run never recovered


def _kill_and_wait(job: harness.Job, read: Callable[[], list[dict[str, Any]]], kill_at: int,
                   launched: float,
                   recovered: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
                   took_place: list[bool] | None = None) -> _Killed:
    """SIGKILL rank 1 once step ``kill_at`` is logged; wait until ``recovered(events)`` finds
    the records that mark the recovery (bounded; the job is stopped either way)."""
    try:
        deadline = time.monotonic() + 600
        while not any(e["event"] == "step" and e["step"] >= kill_at for e in read()):
            if time.monotonic() > deadline or job.proc.poll() is not None:
                raise SystemExit(f"run never reached step {kill_at}:\n{job.report()}")
            time.sleep(0.01)
        first_step = min(e["time"] for e in read() if e["event"] == "step")
        spare = harness.spare_of(job.proc.pid)
        killed_at = time.time()
        job.kill_worker(1)
        steps_done = max(e["step"] for e in read() if e["event"] == "step")
        deadline = time.monotonic() + 300
        while True:
            found = recovered(read())
            if found:
                if took_place is not None:  # did the hot spare take rank 1's place?
                    took_place.append(spare is not None
                                      and harness.workers_of(job.proc.pid).get(1) == spare)
                return _Killed(launched, first_step, killed_at, steps_done, found)
            if time.monotonic() > deadline or job.proc.poll() is not None:
                # Stock torchrun can spend all its restarts (docs/stock-torch.md): a failed
                # recovery.
                return _Killed(launched, first_step, killed_at, steps_done, None)
            time.sleep(0.01)
    finally:
        job.stop()


def _live_recovery_once(run_dir: Path, p: Preset, kill_at: int, spare: bool,
                        tree: Path | None = None) -> dict[str, float]:
    """Our live recovery: kill -> the next completed step, with no worker group restart
    (``spare``: with the hot spare, the default)."""
    def recovered(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        live = [e for e in events if e["event"] == "recovery" and e["kind"] == "live"]
        after = [e for e in events if e["event"] == "step" and live
                 and e["time"] > live[0]["time"]]
        return [live[0], after[0]] if after else []

    launched = time.time()
    job = _run_ours(run_dir, p, p.every, tree, recovery="live", spare=spare)
    took_place: list[bool] = []
    k = _kill_and_wait(job, lambda: _our_log(run_dir), kill_at, launched, recovered,
                       took_place)
    if k.recovered is None:
        return {"failed": 1.0}
    recovery, step = k.recovered
    detected = recovery.get("detected_at", k.killed_at)
    return {
        "job start": k.first_step - k.launched,
        "total": step["time"] - k.killed_at,
        "detected": detected - k.killed_at,
        "new worker + group": recovery.get("joined_at", detected) - detected,
        "state sent": recovery.get("state_at", recovery["time"]) - recovery.get(
            "joined_at", detected),
        "first step": step["time"] - recovery["time"],
        "lost steps": float(k.steps_done - (step["step"] - 1)),
        "bytes sent": float(recovery["bytes"]),
        "restarts used": 0.0,
        "spare took the place": float(took_place == [True]),
        "failed": 0.0,
    }


def _recovery_once(run_dir: Path, ours: bool, p: Preset, kill_at: int,
                   tree: Path | None = None) -> dict[str, float]:
    """The restart path (ours with --recovery restart, or the baseline): kill -> the first
    step of the restarted workers, by start-up stage."""
    launched = time.time()
    job = _run_ours(run_dir, p, p.every, tree, recovery="restart") if ours \
        else _run_baseline(run_dir, p, p.every)
    read = (lambda: _our_log(run_dir)) if ours else (lambda: _baseline_log(run_dir))
    k = _kill_and_wait(job, read, kill_at, launched, lambda events: [
        e for e in events if e["event"] == "startup" and e.get("restart", 0) >= 1])
    if k.recovered is None:
        return {"failed": 1.0}
    m = k.recovered[0]
    start = m["process_start"] or m["imported"]
    return {
        "job start": k.first_step - k.launched,
        "total": m["first_step_done"] - k.killed_at,
        "agent": start - k.killed_at,
        "imports": m["imported"] - start,
        "group": m["group_ready"] - m["imported"],
        "build+restore": m["restored"] - m["group_ready"],
        "ddp": m["ddp_ready"] - m["restored"],
        "first step": m["first_step_done"] - m["ddp_ready"],
        "lost steps": float(k.steps_done - m["resumed_step"]),
        "restarts used": float(m["restart"]),
        "failed": 0.0,
    }


def recovery(tmp: Path, reps: int, other: Path | None = None) -> None:
    """``other``: another checkout whose restart and live recovery run in the same rotation
    (--compare-with), printed as a before/after table."""
    p = Preset("small", 100000, 16, 10)
    labels = ("baseline", "restart", "live, no spare", "live")
    compared = ("restart, other tree", "live, other tree") if other is not None else ()
    results: dict[str, list[dict[str, float]]] = {label: [] for label in labels + compared}
    for r in range(reps):
        for label in labels + compared:
            kill_at = 25 + 3 * r
            run_dir = tmp / f"recovery-{label.replace(', ', '-').replace(' ', '-')}-{r}" / "run"
            tree = other if label in compared else None
            results[label].append(
                _live_recovery_once(run_dir, p, kill_at, spare="no spare" not in label,
                                    tree=tree)
                if label.startswith("live")
                else _recovery_once(run_dir, label.startswith("restart"), p, kill_at, tree))
    print(f"\n## 3-4. Recovery after SIGKILL of one worker (small preset, c10d, checkpoint "
          f"every {p.every}, {reps} repetition(s); live: with the hot spare, the default)")
    print("| part | baseline s | ours, restart s | ours, live, no spare s | ours, live s | "
          "restart / baseline | live, no spare / restart | live / restart |")
    print("|---|---|---|---|---|---|---|---|")
    for key in ("total", "agent", "imports", "group", "build+restore", "ddp", "detected",
                "new worker + group", "state sent", "first step", "lost steps", "bytes sent",
                "restarts used", "spare took the place", "job start"):
        base, restart, unspared, live = (
            [x[key] for x in results[label] if not x["failed"] and key in x]
            for label in labels)
        print(f"| {key} | {_summary(base)} | {_summary(restart)} | {_summary(unspared)} | "
              f"{_summary(live)} | {_ratio(restart, base)} | {_ratio(unspared, restart)} | "
              f"{_ratio(live, restart)} |")
    if other is not None:
        print(f"\n### The same kills, this tree against {other} (same rotation)")
        print("| part | restart, other s | restart, this s | this / other | live, other s | "
              "live, this s | this / other |")
        print("|---|---|---|---|---|---|---|")
        for key in ("total", "detected", "first step", "lost steps", "job start"):
            r_other, r_this, l_other, l_this = (
                [x[key] for x in results[label] if not x["failed"] and key in x]
                for label in ("restart, other tree", "restart", "live, other tree", "live"))
            print(f"| {key} | {_summary(r_other)} | {_summary(r_this)} | "
                  f"{_ratio(r_this, r_other)} | {_summary(l_other)} | {_summary(l_this)} | "
                  f"{_ratio(l_this, l_other)} |")
    for label, runs in results.items():
        failed = sum(int(x["failed"]) for x in runs)
        print(f"{label}: {len(runs) - failed} of {len(runs)} kills recovered"
              + (f", {failed} jobs died with every restart spent or hung" if failed else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--presets", default="small,medium")
    parser.add_argument("--quick", action="store_true", help="1 repetition, small only")
    parser.add_argument("--nproc", default="2", help="workers of the steady-state runs, "
                        "comma-separated for several (1 leaves a core to the checkpoint "
                        "writer, as the host CPUs of a GPU node do)")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--skip-steady", action="store_true")
    parser.add_argument("--compare-with", type=Path, metavar="TREE",
                        help="another checkout (e.g. a git worktree of the previous commit) "
                        "whose job runs in the same rotation, steady state and recovery: "
                        "before vs after")
    ns = parser.parse_args()
    reps = 1 if ns.quick else ns.reps
    names = ["small"] if ns.quick else ns.presets.split(",")
    presets = [dataclasses.replace(PRESETS[n], nproc=int(k))
               for k in ns.nproc.split(",") for n in names]
    tmp = Path(tempfile.mkdtemp(prefix="et-bench-"))
    print(f"# elastic_train benchmark ({time.strftime('%Y-%m-%d %H:%M')}, runs in {tmp})")
    if not ns.skip_steady:
        steady_state(tmp, presets, reps, ns.compare_with)
    if not ns.skip_recovery:
        recovery(tmp, reps, ns.compare_with)
    return 0


if __name__ == "__main__":
    sys.exit(main())
