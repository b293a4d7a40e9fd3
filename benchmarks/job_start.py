"""How long ``elastic-train run`` takes to start and to end, against another git revision.

    python benchmarks/job_start.py --against REV [--reps 5] [job options]

Checks REV out into a temporary worktree and runs the same short job (default: the small
preset, 3 steps, 2 workers) with this checkout's ``elastic-train run`` and REV's, in
turns, so that a shared machine's drifts hit both alike. OMP_NUM_THREADS is unset, as in a
user's shell. Prints the medians and ranges of: launch -> first completed step, the `end`
event -> process exit, and the whole command, with this checkout / REV.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("first step", "end -> exit", "whole command")


def run_once(checkout: Path, run_dir: Path, job: list[str]) -> tuple[float, float, float]:
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = str(checkout)
    launched = time.time()
    done = subprocess.run([sys.executable, "-m", "elastic_train", "run", "--run-dir",
                           str(run_dir), *job], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=600)
    exited = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: exit {done.returncode}\n{done.stderr[-3000:]}")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    first = min(e["time"] for e in events if e["event"] == "step")
    end = max(e["time"] for e in events if e["event"] == "end")
    return first - launched, exited - end, exited - launched


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="git revision to compare with")
    parser.add_argument("--reps", type=int, default=5)
    ns, job = parser.parse_known_args()
    job = job or ["--preset", "small", "--steps", "3", "--metrics-port", "0"]
    tmp = Path(tempfile.mkdtemp(prefix="et-job-start-"))
    other = tmp / "other"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(other),
                    ns.against], check=True)
    results: dict[str, list[tuple[float, float, float]]] = {"this": [], "other": []}
    try:
        for _ in range(ns.reps):
            for label, checkout in (("other", other), ("this", REPO)):
                results[label].append(run_once(checkout, tmp / f"run-{label}", job))
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)],
                       check=False)
    print(f"# job start and end: this checkout vs {ns.against} ({ns.reps} runs each, "
          f"{' '.join(job)})")
    print(f"| part | {ns.against} s | this s | this / {ns.against} |")
    print("|---|---|---|---|")
    for i, part in enumerate(PARTS):
        theirs = [r[i] for r in results["other"]]
        ours = [r[i] for r in results["this"]]
        print(f"| {part} | {statistics.median(theirs):.2f} ({min(theirs):.2f}-{max(theirs):.2f})"
              f" | {statistics.median(ours):.2f} ({min(ours):.2f}-{max(ours):.2f}) | "
              f"{statistics.median(ours) / statistics.median(theirs):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
