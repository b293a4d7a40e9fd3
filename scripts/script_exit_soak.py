"""Does an unmodified user's script always end under ``elastic-train run``? (issue 28)

Runs the pytorch/examples-shaped tutorial script (tests/integration/user_scripts/
tutorial_trainer.py: a Trainer class, DistributedSampler, its own snapshot,
init/destroy_process_group, gloo on the CPU, 2 workers) ``--runs`` times without a fault and
``--kill-runs`` times with a SIGKILL of rank 1 mid-run, one run at a time, and counts the
runs that hung (still running at ``--timeout``, then killed), the runs in which a worker
aborted (SIGABRT, "terminate called without an active exception"), and the runs that
exited with another status than the script's (0).

    python scripts/script_exit_soak.py --runs 50 --kill-runs 20
    python scripts/script_exit_soak.py --runs 20 --kill-runs 10 --worker-start subprocess
    python scripts/script_exit_soak.py --runs 20 --launcher torchrun
    python scripts/script_exit_soak.py --runs 20 --code /tmp/old-checkout   # a baseline

Exit status 0 when no run hung, aborted or ended with another status; 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration import script_jobs  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50, help="fault-free runs (default 50)")
    p.add_argument("--kill-runs", type=int, default=20,
                   help="runs with a SIGKILL of rank 1 mid-run (default 20)")
    p.add_argument("--worker-start", choices=("forkserver", "subprocess"),
                   default="forkserver")
    p.add_argument("--launcher", choices=("elastic-train", "torchrun"), default="elastic-train")
    p.add_argument("--shape", choices=("tutorial", "module", "plain"), default="tutorial")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds after which a run counts as hung (default 60; a run takes "
                        "~5 s, ~9 s with a kill)")
    p.add_argument("--code", type=Path, default=None,
                   help="run elastic_train from this checkout instead (first on PYTHONPATH)")
    p.add_argument("--keep", action="store_true", help="keep the runs' directories and logs")
    args = p.parse_args()
    env = None
    if args.code is not None:  # before this checkout, which the scripts' imports need
        env = {"PYTHONPATH": os.pathsep.join([str(args.code.resolve()), str(ROOT)])}
    root = Path(tempfile.mkdtemp(prefix="script-exit-soak-"))
    counts = {"hung": 0, "aborted": 0, "other status": 0}
    seconds: dict[str, list[float]] = {"no fault": [], "sigkill": []}
    plan = [None] * args.runs + [1] * args.kill_runs
    for i, kill in enumerate(plan):
        outcome = script_jobs.run(args.shape, root / f"run-{i}", worker_start=args.worker_start,
                                  kill_rank=kill, launcher=args.launcher, timeout=args.timeout,
                                  env=env)
        kind = "no fault" if kill is None else "sigkill"
        verdict = ("HUNG" if outcome.hung else "ABORTED" if outcome.aborted
                   else "ok" if outcome.code == 0 else f"STATUS {outcome.code}")
        if outcome.hung:
            counts["hung"] += 1
        elif outcome.aborted:
            counts["aborted"] += 1
        elif outcome.code != 0:
            counts["other status"] += 1
        else:
            seconds[kind].append(outcome.seconds)
        if kill is not None and outcome.killed_pid is None and not outcome.hung:
            verdict += " (the run ended before the kill)"
        print(f"run {i + 1:3d}/{len(plan)} {kind:8s} {outcome.seconds:6.1f} s  {verdict}"
              + (f"  log: {root / f'run-{i}' / 'job.log'}" if verdict != "ok" else ""),
              flush=True)
    how = ("torchrun --standalone (subprocess workers)" if args.launcher == "torchrun"
           else f"elastic-train run --worker-start {args.worker_start}")
    print(f"\n{how}, {args.shape} script, "
          f"{args.runs} fault-free + {args.kill_runs} SIGKILL runs, bound {args.timeout:g} s")
    for kind, values in seconds.items():
        if values:
            print(f"  {kind}: {len(values)} ok, median {statistics.median(values):.1f} s, "
                  f"max {max(values):.1f} s")
    print("  " + ", ".join(f"{k}: {v}" for k, v in counts.items()))
    if not args.keep and not any(counts.values()):
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"  runs kept in {root}")
    return 1 if any(counts.values()) else 0


if __name__ == "__main__":
    start = time.monotonic()
    code = main()
    print(f"  ({time.monotonic() - start:.0f} s in all)")
    sys.exit(code)
