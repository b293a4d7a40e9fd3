"""Every worker of a real 2-worker torchrun job serves /metrics with exactly the counts the
job produced: its steps, its share of the samples, rank 0's checkpoints, and the values of
the event log's last records. A worker binds only the --metrics-address it is given, and
exposes only the documented metrics and labels."""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from elastic_train import __version__
from elastic_train.batch_shares import shard_bounds
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


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN that process ``pid`` holds, from
    /proc (the kernel's own table: what is bound, not what the program meant to bind)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # The kernel prints each 32-bit word of the address in host (little-endian) order.
            words = struct.unpack(f"<{len(raw) // 4}I", raw)
            packed = struct.pack(f">{len(words)}I", *words)
            found.add((str(ipaddress.ip_address(packed)), int(port, 16)))
    return found


def this_machines_other_address() -> str | None:
    """An address of this machine that is not loopback (None if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: picks the route's source
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def documented_metrics() -> set[str]:
    """Every metric name in the documented table of a worker's series (docs/metrics.md;
    the README and every other page are read too, wherever the table is)."""
    rows = [line for page in harness.documentation() for line in page.read_text().splitlines()
            if line.startswith("| `elastic_train_")]
    return {name for row in rows for name in re.findall(r"`(elastic_train_[a-z_]+)", row)}


def test_metrics_bind_only_the_given_address_and_expose_only_the_documented(
        tmp_path: Path) -> None:
    """A worker started with --metrics-address 127.0.0.1 listens on loopback alone; its
    endpoint serves the documented metrics and labels, and none of the job's paths or the
    environment's secrets."""
    run_dir = tmp_path / "run-dir-not-exposed"
    port = harness.free_ports(1)
    secret = "s3cret-not-exposed"
    worker = subprocess.Popen(
        [sys.executable, "-m", "elastic_train.train", "--run-dir", str(run_dir),
         "--task", "tests.integration.paced_task:make_task", "--preset", "tiny",
         "--task-opt", "pace=0.05", "--steps", "2000", "--batch-size", "8",
         "--metrics-port", str(port), "--metrics-address", "127.0.0.1"],
        env=harness.job_env({"ETCD_PASSWORD": secret}), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        samples: harness.Samples = {}
        while time.monotonic() < deadline and not any(
                name == "elastic_train_steps_total" and value > 0
                for (name, _), value in samples.items()):
            assert worker.poll() is None, worker.stderr.read().decode()[-3000:]
            try:
                samples = harness.scrape(f"http://127.0.0.1:{port}/metrics", timeout=2)
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
        assert samples, "the worker never served /metrics"
        listening = listening_sockets(worker.pid)
        other = this_machines_other_address()
        if other is not None:
            with socket.socket() as probe:
                probe.settimeout(5)
                assert probe.connect_ex((other, port)) != 0, f"metrics reachable on {other}"
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
        worker.stderr.close()
    assert [a for a in listening if a[1] == port] == [("127.0.0.1", port)]
    assert not [a for a in listening if a[0] in ("0.0.0.0", "::")], listening
    documented = documented_metrics()
    for name, labels in samples:
        stems = {name, *(name.removesuffix(s) for s in ("_bucket", "_sum", "_count",
                                                         "_created", "_total"))}
        assert name.startswith("process_") or stems & documented or \
            {f"{stem}_total" for stem in stems} & documented, name
        assert {key for key, _ in labels} <= {"run_id", "rank", "node", "stage", "kind", "le",
                                              "version", "torch_version", "python_version",
                                              "suspect_rank", "suspect_node"}
    for private in (str(tmp_path), secret, "pace"):
        assert private.encode() not in text
