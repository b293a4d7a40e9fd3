"""What the hot spare costs when nothing fails: the same job with ``--hot-spare on`` and
``off``, interleaved, mean step time (medium preset, checkpoints every 4 steps).

    python benchmarks/spare_steady.py --reps 6 --steps 64

Prints the ratio on / off over the steps after the first 3 (what bench.py's steady state
counts) and after the first 12 (the spare is built by then: its idle cost alone).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--steps", type=int, default=64)
    ns = parser.parse_args()
    preset = bench.Preset("medium", ns.steps, 8, 4)
    tmp = Path(tempfile.mkdtemp(prefix="et-spare-"))
    skips = (3, 12)
    means: dict[tuple[str, int], list[float]] = {(m, k): [] for m in ("on", "off") for k in skips}
    for r in range(ns.reps):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            run_dir = tmp / f"{mode}-{r}" / "run"
            job = bench._run_ours(run_dir, preset, preset.every, spare=mode == "on")
            if job.wait(600) != 0:
                raise SystemExit(job.report())
            for k in skips:
                times = bench._step_times(bench._our_log(run_dir), skip=k)
                means[(mode, k)].append(statistics.mean(times))
    for k in skips:
        on, off = statistics.median(means[("on", k)]), statistics.median(means[("off", k)])
        print(f"medium, {ns.steps} steps, checkpoint every {preset.every}, steps after {k}: "
              f"spare on {on:.4f} s, off {off:.4f} s: on / off {on / off:.3f} ({ns.reps} runs "
              f"each, interleaved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
