"""A hand-written loop (``ElasticSession``) losing a worker: live recovery vs the restart
paths, interleaved in one invocation.

Each repetition runs benchmarks/session_loop.py (an MLP of 4.2 M parameters, 2 workers,
c10d on one node) three ways, in an order that rotates: under plain ``torchrun`` (what a
session got before: torch's agent restarts every worker, which reload the newest
checkpoint), under ``elastic-train run`` with ``recovery="restart"`` (the same path under
our agent and its forkserver), and under ``elastic-train run`` with live recovery (the
default). Rank 1 is SIGKILLed once step ``--kill-at`` is logged; measured from rank 0's
event log: the kill -> the next completed step, and the completed steps done again.

    python benchmarks/session_recovery.py --reps 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench import _events, _ratio, _summary  # noqa: E402

from elastic_train.rundir import RunDir  # noqa: E402
from tests.integration import harness  # noqa: E402

LOOP = str(REPO / "benchmarks" / "session_loop.py")
MODES = ("torchrun", "restart", "live")
STEPS = 400


def _start(run_dir: Path, mode: str) -> harness.Job:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", "127.0.0.1:0", "--monitor-interval", "0.1"]
                if mode == "torchrun" else [sys.executable, "-m", "elastic_train", "run"])
    recovery = "live" if mode == "live" else "restart"
    argv = [*launcher, "--nproc-per-node", "2", "--max-restarts", "3", LOOP, str(run_dir),
            str(STEPS), recovery]
    run_dir.mkdir(parents=True, exist_ok=True)
    return harness.start(argv, run_dir)


def one_kill(run_dir: Path, mode: str, kill_at: int) -> dict[str, float]:
    """Kill rank 1 at ``kill_at``; {"total": kill -> next completed step, "redone": ...}."""
    job = _start(run_dir, mode)
    log = RunDir(run_dir).events

    def steps(after: float = 0.0) -> list[dict[str, Any]]:
        return [e for e in _events(log) if e["event"] == "step" and e["time"] > after]

    try:
        deadline = time.monotonic() + 300
        while not any(e["step"] >= kill_at for e in steps()):
            if time.monotonic() > deadline or job.proc.poll() is not None:
                raise SystemExit(f"{mode}: never reached step {kill_at}:\n{job.report()}")
            time.sleep(0.005)
        killed_at = time.time()
        job.kill_worker(1)
        done = max(e["step"] for e in steps())
        marker = "recovery" if mode == "live" else "start"
        deadline = time.monotonic() + 300
        while True:
            events = _events(log)
            marks = [e["time"] for e in events if e["event"] == marker and e["time"] > killed_at]
            after = steps(marks[0]) if marks else []
            if after:
                return {"total": after[0]["time"] - killed_at,
                        "redone": float(done - (after[0]["step"] - 1)), "failed": 0.0}
            if time.monotonic() > deadline or job.proc.poll() is not None:
                return {"failed": 1.0}
            time.sleep(0.005)
    finally:
        job.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=50,
                        help="the step after which rank 1 is killed (checkpoints every 20)")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="session-recovery-") as tmp:
        for r in range(args.reps):
            order = MODES[r % 3:] + MODES[:r % 3]
            for mode in order:
                run_dir = Path(tmp) / f"{mode}-{r}" / "run"
                results[mode].append(one_kill(run_dir, mode, args.kill_at + r))
    print(f"\n## SIGKILL of rank 1 of a hand-written loop (ElasticSession, 2 workers, "
          f"4.2 M parameters, {args.reps} repetition(s))")
    print("| | torchrun | elastic-train run, restart | elastic-train run, live | "
          "live / restart | live / torchrun |")
    print("|---|---|---|---|---|---|")
    for key, name in (("total", "kill -> next completed step, s"),
                      ("redone", "completed steps done again")):
        torchrun, restart, live = ([x[key] for x in results[m] if not x["failed"]]
                                   for m in MODES)
        print(f"| {name} | {_summary(torchrun)} | {_summary(restart)} | {_summary(live)} | "
              f"{_ratio(live, restart)} | {_ratio(live, torchrun)} |")
    for mode, runs in results.items():
        failed = sum(int(x["failed"]) for x in runs)
        if failed:
            print(f"{mode}: {failed} of {len(runs)} kills never recovered")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
