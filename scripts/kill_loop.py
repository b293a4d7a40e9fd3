"""Measure restart reliability: SIGKILL a random worker of one long job, again and again.

    python scripts/kill_loop.py --kills 20 [--launcher torchrun|elastic-train]

After each kill it waits (bounded) for the job to train a few steps past the restart, then
kills again. A recovery is *clean* when one kill costs exactly one restart. Prints one line
per kill and a table at the end: kills, clean recoveries, extra restarts burnt, hangs, and
the seconds from the kill to the first step after it (median, min, max).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration import harness


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--launcher", choices=("torchrun", "elastic-train"), default="torchrun")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recovery-timeout", type=float, default=90.0)
    ns = parser.parse_args()
    rng = random.Random(ns.seed)
    run_dir = Path(tempfile.mkdtemp(prefix="kill-loop-")) / "run"
    job_args = ["--preset", "tiny", "--batch-size", "32", "--steps", "100000",
                "--checkpoint-every", "20", "--log-every", "1000"]
    max_restarts = ns.kills * 3
    if ns.launcher == "torchrun":
        job = harness.torchrun(run_dir, job_args, max_restarts=max_restarts)
    else:
        job = harness.elastic_run(run_dir, [*job_args, "--max-restarts", str(max_restarts)])
    recoveries: list[float] = []
    clean = hangs = extra = 0
    try:
        job.wait_for_event(lambda e: e["event"] == "step" and e["step"] >= 5, timeout=120)
        restart = 0
        for kill in range(ns.kills):
            rank = rng.randrange(2)
            time.sleep(rng.uniform(0.0, 0.5))
            killed_at = time.time()
            job.kill_worker(rank)
            try:
                first = job.wait_for_event(
                    lambda e, r=restart: e["event"] == "step" and e.get("restart", 0) > r,
                    timeout=ns.recovery_timeout)
            except AssertionError:
                hangs += 1
                print(f"kill {kill + 1}: rank {rank}: NO RECOVERY within "
                      f"{ns.recovery_timeout:.0f}s")
                break
            burnt = first["restart"] - restart
            restart = first["restart"]
            seconds = first["time"] - killed_at
            recoveries.append(seconds)
            clean += burnt == 1
            extra += burnt - 1
            print(f"kill {kill + 1}: rank {rank}: recovered in {seconds:.2f}s, "
                  f"restarts used {burnt}", flush=True)
            job.wait_for_event(lambda e, r=restart: e["event"] == "step"
                               and e.get("restart") == r and e["step"] % 5 == 0, timeout=60)
    finally:
        job.stop()
    print(f"\nlauncher {ns.launcher}: kills {len(recoveries) + hangs}, clean {clean}, extra "
          f"restarts {extra}, hangs {hangs}")
    if recoveries:
        print(f"kill -> first step: median {statistics.median(recoveries):.2f}s, "
              f"min {min(recoveries):.2f}s, max {max(recoveries):.2f}s")
    return 0 if hangs == 0 and extra == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
