"""What the Prometheus metrics cost: steps/s with metrics on and off, interleaved in one run.

    python benchmarks/metrics_overhead.py [--steps 1000] [--block 10] [--scrape-interval 1]
                                    [job options, e.g. --preset small --batch-size 32]

One real training run (the built-in trainer; a world of one, or every rank under torchrun)
alternates blocks of ``--block`` steps with the metrics on (every event record updates the
worker's metrics, and a scraper GETs /metrics every ``--scrape-interval`` seconds, 15 times
as often as Prometheus' default) and off (the records go nowhere, nothing is scraped).
Interleaving makes slow drifts of a shared machine hit both sides alike. It prints the
median steps/s of each side, the median on/off ratio of neighbouring blocks with its 95%
interval, and the cost measured directly: time spent in the metrics per step, against the
step time. Checkpoints are off unless asked for (they would land in one side's blocks).
"""

from __future__ import annotations

import argparse
import io
import math
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from elastic_train.config_options import parse_job_args
from elastic_train.observe.metrics import WorkerMetrics
from elastic_train.observe.metrics_server import MetricsServer
from elastic_train.rundir import prepare_run_dir
from elastic_train.tasks.base import TaskContext
from elastic_train.tasks.loader import load_task
from elastic_train.worker.distributed import destroy_group, init_group
from elastic_train.worker.env import read_worker_env
from elastic_train.worker.trainer import Trainer

DEFAULT_JOB = ["--preset", "tiny", "--batch-size", "16", "--checkpoint-every", "off"]


class Interleaver:
    """An event observer that feeds the metrics in every other block of steps and times
    each block from the end of its first step's handling to the end of its last's."""

    def __init__(self, metrics: WorkerMetrics, block: int) -> None:
        self.metrics = metrics
        self.block = block
        self.on = False                     # the first block is off, then they alternate
        self.blocks: list[tuple[bool, int, float]] = []   # (on, steps, seconds)
        self.observe_seconds = 0.0          # time spent in metrics.observe during on blocks
        self.observed_steps = 0
        self._mark: float | None = None
        self._steps = 0

    def observe(self, record: Mapping[str, Any]) -> None:
        if self.on:
            began = time.perf_counter()
            self.metrics.observe(record)
            self.observe_seconds += time.perf_counter() - began
            self.observed_steps += record["event"] == "step"
        if record["event"] != "step":
            return
        now = time.perf_counter()
        if self._mark is None:               # the first step's compile/warm-up is not timed
            self._mark = now
            return
        self._steps += 1
        if self._steps == self.block:
            self.blocks.append((self.on, self._steps, now - self._mark))
            self._mark, self._steps = now, 0
            self.on = not self.on


class Scraper(threading.Thread):
    """GETs the endpoint every ``interval`` seconds while ``active()``; records each GET."""

    def __init__(self, url: str, interval: float, active: Any) -> None:
        super().__init__(daemon=True)
        self.url, self.interval, self.active = url, interval, active
        self.seconds: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            if self.active():
                began = time.perf_counter()
                with urllib.request.urlopen(self.url, timeout=10) as response:
                    response.read()
                self.seconds.append(time.perf_counter() - began)


def ratio_interval(blocks: Sequence[tuple[bool, int, float]]) -> tuple[float, float, float]:
    """The on/off steps/s ratio of neighbouring (off, on) blocks: the median over the pairs
    and its 95% interval (sign-test order statistics: robust to a shared machine's spikes)."""
    ratios = sorted((n_b / s_b) / (n_a / s_a) for (on_a, n_a, s_a), (on_b, n_b, s_b)
                    in zip(blocks[::2], blocks[1::2], strict=True) if not on_a and on_b)
    n = len(ratios)
    k = max(0, math.floor(n / 2 - 0.98 * math.sqrt(n)))
    return statistics.median(ratios), ratios[k], ratios[n - 1 - k]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--block", type=int, default=10, help="steps per on/off block")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    ns, job_args = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if ns.steps < 4 * ns.block:
        parser.error("--steps must be at least 4 blocks")
    env = read_worker_env()
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as scratch:
        config = parse_job_args([
            "--run-dir", str(Path(scratch) / "run"), *DEFAULT_JOB, *job_args,
            "--steps", str(ns.steps + 1), "--log-every", str(ns.steps + 1)])
        if env.rank == 0:
            prepare_run_dir(config.run_dir)
        registry = CollectorRegistry()
        metrics = WorkerMetrics(registry, env, config.train.batch_size)
        server = MetricsServer(registry, "127.0.0.1", 0)
        task = load_task(config.train.task, TaskContext(config.train.task_options,
                                                        config.train.seed, config.run_dir))
        group = init_group(env, config.distributed.backend, config.distributed.timeout_seconds)
        interleaver = Interleaver(metrics, ns.block)
        scraper = Scraper(server.url, ns.scrape_interval, lambda: interleaver.on)
        scraper.start()
        try:
            Trainer(config, env, task, group, out=io.StringIO(),
                    observers=[interleaver.observe]).run()
        finally:
            scraper.stop.set()
            destroy_group()
            server.close()
    if env.rank != 0:
        return 0
    blocks = interleaver.blocks[: len(interleaver.blocks) // 2 * 2]
    rate = {side: statistics.median(n / s for on, n, s in blocks if on == side)
            for side in (True, False)}
    ratio, low, high = ratio_interval(blocks)
    step_seconds = sum(s for _, _, s in blocks) / sum(n for _, n, _ in blocks)
    per_step = interleaver.observe_seconds / max(1, interleaver.observed_steps)
    scrape = statistics.median(scraper.seconds) if scraper.seconds else float("nan")
    print(f"{len(blocks)} blocks of {ns.block} steps, metrics off and on in turn "
          f"(world size {group.world_size}, {config.train.task_options.get('preset', '')} "
          f"preset, batch {config.train.batch_size})")
    print(f"  metrics off       {rate[False]:.2f} steps/s (median of blocks)")
    print(f"  metrics on        {rate[True]:.2f} steps/s (median of blocks; /metrics scraped "
          f"every {ns.scrape_interval:g} s, {len(scraper.seconds)} times, median "
          f"{scrape * 1000:.1f} ms each)")
    print(f"  on / off          {ratio:.4f} (median of {len(blocks) // 2} neighbouring pairs; "
          f"95% interval {low:.4f} .. {high:.4f})")
    print(f"  measured cost     {per_step * 1e6:.1f} us of metrics per step = "
          f"{100 * per_step / step_seconds:.3f}% of a {step_seconds * 1000:.1f} ms step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
