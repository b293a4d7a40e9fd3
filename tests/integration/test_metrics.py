"""Every worker of a real 2-worker torchrun job serves /metrics with exactly the counts the
job produced: its steps, its share of the samples, rank 0's checkpoints, and the values of
the event log's last records."""

from __future__ import annotations

import functools
import time
import urllib.error
from pathlib import Path

import pytest

from elastic_train import __version__
from elastic_train.sampler import shard_bounds
from tests.integration import harness

pytestmark = pytest.mark.slow

STEPS, EVERY, BATCH = 30, 10, 15   # 15 = 8 + 7: the ranks' shares differ
TIMEOUT = 180


def final_scrapes(job: harness.Job, urls: dict[int, str],
                  timeout: float) -> dict[int, harness.Samples]:
    """After the run's ``end``, scrape every worker until it exits (it lingers for a scrape
    of its final values); return each one's first scrape after the end."""
    job.wait_for_event(lambda e: e["event"] == "end", timeout=TIMEOUT)
    first: dict[int, harness.Samples] = {}
    gone: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(gone) < len(urls) and time.monotonic() < deadline:
        for rank, url in urls.items():
            if rank in gone:
                continue
            try:
                first.setdefault(rank, harness.scrape(url, timeout=2))
            except (urllib.error.URLError, ConnectionError):
                if rank in first:
                    gone.add(rank)     # it was scraped after the end, and has exited
        time.sleep(0.05)
    assert set(first) == set(urls), f"workers never scraped after the end: {job.report()}"
    return first


def test_each_worker_serves_the_exact_counts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    base = harness.free_ports(2)
    job = harness.torchrun(run_dir, [
        "--preset", "tiny", "--steps", str(STEPS), "--batch-size", str(BATCH),
        "--checkpoint-every", str(EVERY), "--metrics-port", str(base),
        "--metrics-address", "127.0.0.1", "--metrics-linger", "60", "--min-world-size", "2"],
        max_restarts=0)
    try:
        urls = {rank: f"http://127.0.0.1:{base + rank}/metrics" for rank in (0, 1)}
        scrapes = final_scrapes(job, urls, timeout=60)
        assert job.wait(60) == 0, job.report()
    finally:
        job.stop()
    events = job.events()
    run_id = next(e["run_id"] for e in events if e["event"] == "start")
    last_step = [e for e in events if e["event"] == "step"][-1]
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    assert [e["step"] for e in saved] == [10, 20, 30]

    for rank, samples in scrapes.items():
        value = functools.partial(harness.sample, samples, run_id=run_id, rank=str(rank))
        start, stop = shard_bounds(BATCH, rank, 2)
        assert value("elastic_train_steps_total") == STEPS
        assert value("elastic_train_samples_total") == STEPS * (stop - start)
        assert value("elastic_train_step") == STEPS
        assert value("elastic_train_target_step") == STEPS
        # Each rank stamps its own records; rank 0's are the log's.
        assert value("elastic_train_last_step_timestamp_seconds") == (
            last_step["time"] if rank == 0 else pytest.approx(last_step["time"], abs=5))
        assert value("elastic_train_loss") == last_step["loss"]
        assert value("elastic_train_learning_rate") == last_step["lr"]
        assert value("elastic_train_world_size") == 2
        assert value("elastic_train_min_world_size") == 2
        assert value("elastic_train_restarts_total") == 0
        assert value("elastic_train_max_restarts") == 0
        assert value("elastic_train_step_duration_seconds_count") == STEPS
        assert value("elastic_train_step_duration_seconds_sum") > 0
        assert value("elastic_train_checkpoint_load_duration_seconds_count") == 0
        assert value("elastic_train_checkpoints_skipped_total") == 0
        assert value("elastic_train_build_info", version=__version__) == 1
        assert value("elastic_train_samples_per_second") > 0
        assert 0 < value("elastic_train_process_group_init_seconds") \
            < value("elastic_train_time_to_process_group_seconds") \
            < value("elastic_train_time_to_first_step_seconds")
        assert value("elastic_train_rendezvous_duration_seconds") is None  # plain torchrun
        assert value("elastic_train_recovery_seconds") is None   # no restart happened
        saves = value("elastic_train_checkpoint_save_duration_seconds_count", stage="snapshot")
        if rank == 0:   # rank 0's step records are the log's
            assert value("elastic_train_step_duration_seconds_sum") == pytest.approx(
                sum(e["seconds"] for e in events if e["event"] == "step"))
            assert saves == len(saved)
            assert value("elastic_train_checkpoint_save_duration_seconds_count",
                         stage="persist") == len(saved)
            assert value("elastic_train_checkpoint_save_duration_seconds_sum",
                         stage="persist") == pytest.approx(
                sum(e["persist_seconds"] for e in saved))
            assert value("elastic_train_last_checkpoint_step") == STEPS
            assert value("elastic_train_last_checkpoint_timestamp_seconds") == saved[-1]["time"]
            assert value("elastic_train_checkpoint_size_bytes") == saved[-1]["bytes"]
        else:
            assert saves == 0
            assert value("elastic_train_last_checkpoint_step") is None
