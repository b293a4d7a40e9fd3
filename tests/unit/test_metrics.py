"""Unit tests of the worker metrics: values from event records, the HTTP endpoint (real
sockets on loopback), the final-scrape wait, the guards, and the event-log tail."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from elastic_train.config import JobConfig, MetricsConfig
from elastic_train.errors import MetricsError
from elastic_train.events.log import EventLog, previous_incarnation, read_events
from elastic_train.observe.metrics import WorkerMetrics, check_single_process_mode
from elastic_train.observe.metrics_server import (
    MetricsServer,
    check_ports_free,
    serve_worker_metrics,
)
from elastic_train.worker.env import WorkerEnv, read_worker_env


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"run_id": "r", "node": "n", **labels})


def feed(metrics: WorkerMetrics, *records: dict[str, Any]) -> None:
    for record in records:
        metrics.observe(record)


def step(n: int, time: float, **extra: Any) -> dict[str, Any]:
    return {"event": "step", "time": time, "step": n, "loss": 3.0 - n / 100, "lr": 0.001 * n,
            "epoch": 0, "world_size": 2, "samples": 15 * n, "seconds": 0.1, **extra}


def test_values_follow_the_records_of_a_restarted_rank0() -> None:
    registry = CollectorRegistry()
    env = WorkerEnv(rank=0, world_size=2, restart_count=1, max_restarts=3, run_id="r",
                    rendezvous_seconds=2.5)
    metrics = WorkerMetrics(registry, env, batch_size=15, node="n", min_world_size=2)
    rank0 = {"rank": "0"}
    assert value(registry, "elastic_train_step", **rank0) is None   # not known yet
    assert value(registry, "elastic_train_steps_total", **rank0) == 0
    feed(metrics,
         {"event": "start", "time": 96.0, "world_size": 2, "total_steps": 40, "restart": 1},
         {"event": "rendezvous", "time": 96.1, "previous_last_step": 27,
          "previous_last_seen": 100.0},
         {"event": "checkpoint_skipped", "time": 96.5, "step": 25},
         {"event": "checkpoint_loaded", "time": 97.0, "step": 20, "seconds": 0.25,
          "saved_time": 80.0},
         {"event": "startup", "time": 100.5, "process_start": 90.0, "group_began": 93.5,
          "group_ready": 95.0, "first_step_done": 100.5},
         *[step(n, 100.0 + (n - 20) * 0.5) for n in range(21, 31)],
         {"event": "checkpoint_saved", "time": 106.0, "step": 30, "bytes": 1234,
          "snapshot_seconds": 0.01, "persist_seconds": 0.2, "waited_seconds": 0.03,
          "copy_wait_seconds": 0.005})
    expected = {
        "elastic_train_steps_total": 10, "elastic_train_samples_total": 80,  # 8 of every 15
        "elastic_train_step": 30, "elastic_train_target_step": 40,
        "elastic_train_last_step_timestamp_seconds": 105.0,
        "elastic_train_loss": 2.7, "elastic_train_learning_rate": 0.03,
        "elastic_train_world_size": 2, "elastic_train_min_world_size": 2,
        "elastic_train_restarts_total": 1, "elastic_train_max_restarts": 3,
        "elastic_train_step_duration_seconds_count": 10,
        "elastic_train_samples_per_second": 72 / 4.5,   # 9 intervals of 8 samples in 4.5 s
        "elastic_train_checkpoints_skipped_total": 1,
        "elastic_train_checkpoint_load_duration_seconds_count": 1,
        "elastic_train_checkpoint_load_duration_seconds_sum": 0.25,
        "elastic_train_checkpoint_size_bytes": 1234,
        "elastic_train_last_checkpoint_step": 30,
        "elastic_train_last_checkpoint_timestamp_seconds": 106.0,
        "elastic_train_rendezvous_duration_seconds": 2.5,   # the agent's, from the env
        "elastic_train_process_group_init_seconds": 1.5,
        "elastic_train_time_to_process_group_seconds": 5.0,
        "elastic_train_time_to_first_step_seconds": 10.5,
        "elastic_train_recovery_seconds": 0.5,     # first step at 100.5, last sign at 100
        "elastic_train_lost_steps": 7,             # 27 logged, resumed from 20
    }
    for name, want in expected.items():
        assert value(registry, name, **rank0) == pytest.approx(want), name
    assert value(registry, "elastic_train_step_duration_seconds_bucket", le="0.1",
                 **rank0) == 10
    for stage, seconds in (("wait", 0.03), ("snapshot", 0.01), ("copy_wait", 0.005),
                           ("persist", 0.2)):
        assert value(registry, "elastic_train_checkpoint_save_duration_seconds_count",
                     stage=stage, **rank0) == 1
        assert value(registry, "elastic_train_checkpoint_save_duration_seconds_sum",
                     stage=stage, **rank0) == seconds
    assert registry.get_sample_value("elastic_train_build_info", {
        "run_id": "r", "rank": "0", "node": "n", "version": "0.1.0",
        "torch_version": __import__("torch").__version__,
        "python_version": __import__("platform").python_version()}) == 1


def test_rank1_counts_its_share_and_exposes_no_rank0_series() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, WorkerEnv(rank=1, world_size=2, run_id="r"),
                            batch_size=15, node="n")
    feed(metrics, {"event": "start", "time": 1.0, "world_size": 2, "total_steps": 5},
         {"event": "checkpoint_loaded", "time": 2.0, "step": 2, "seconds": 0.1,
          "saved_time": 0.5},
         step(3, 3.0), step(4, 3.5))
    one = {"rank": "1"}
    assert value(registry, "elastic_train_samples_total", **one) == 14   # 7 of every 15
    assert value(registry, "elastic_train_steps_total", **one) == 2
    assert value(registry, "elastic_train_checkpoint_load_duration_seconds_count", **one) == 1
    for absent in ("elastic_train_last_checkpoint_step", "elastic_train_recovery_seconds",
                   "elastic_train_lost_steps", "elastic_train_min_world_size",
                   "elastic_train_rendezvous_duration_seconds"):
        assert value(registry, absent, **one) is None, absent


def test_a_worker_moved_to_another_rank_serves_its_series_under_that_rank() -> None:
    """A node before it was lost: rank 2 of 3 becomes rank 1 of 2 in place; its series move
    to rank="1" with their values, and its share of each batch is rank 1's."""
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, WorkerEnv(rank=2, world_size=3, run_id="r"),
                            batch_size=15, node="n")
    feed(metrics, step(1, 1.0, world_size=3))
    assert value(registry, "elastic_train_samples_total", rank="2") == 5   # 10..15 of 15
    metrics.moved(WorkerEnv(rank=1, world_size=2, run_id="r"))
    feed(metrics, step(2, 2.0))
    for gone in ("elastic_train_samples_total", "elastic_train_steps_total",
                 "elastic_train_step"):
        assert value(registry, gone, rank="2") is None, gone
    assert value(registry, "elastic_train_samples_total", rank="1") == 5 + 7  # 8..15 of 15
    assert value(registry, "elastic_train_steps_total", rank="1") == 2
    assert value(registry, "elastic_train_step_duration_seconds_count", rank="1") == 2
    assert value(registry, "elastic_train_step", rank="1") == 2
    assert value(registry, "elastic_train_world_size", rank="1") == 2
    assert registry.get_sample_value("process_open_fds") is not None  # unlabelled: as it was
    # /metrics?name[]=... (a registry restricted to some names) still finds the series
    only = generate_latest(registry.restricted_registry(["elastic_train_steps_total"])).decode()
    assert 'elastic_train_steps_total{node="n",rank="1",run_id="r"} 2.0' in only


def test_records_without_optional_fields_are_fine() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, WorkerEnv(run_id="r"), batch_size=4, node="n")
    feed(metrics, {"event": "start", "time": 1.0, "world_size": 1, "total_steps": None},
         {"event": "step", "time": 2.0, "step": 1, "loss": None},
         {"event": "something_new", "time": 3.0})
    assert value(registry, "elastic_train_steps_total", rank="0") == 1
    assert value(registry, "elastic_train_loss", rank="0") is None


def test_nothing_touches_the_global_registry() -> None:
    before = set(REGISTRY._names_to_collectors)
    WorkerMetrics(CollectorRegistry(), WorkerEnv(), batch_size=2)
    assert set(REGISTRY._names_to_collectors) == before


# --- guards ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variable", ["PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"])
@pytest.mark.parametrize("setting", ["", "/tmp/prom"])
def test_multiprocess_mode_is_refused_even_when_empty(variable: str, setting: str) -> None:
    env = read_worker_env({variable: setting})
    assert env.prometheus_multiproc_dir == setting
    with pytest.raises(MetricsError) as caught:
        check_single_process_mode(env)
    assert str(caught.value) == (
        f"PROMETHEUS_MULTIPROC_DIR is set (to {setting!r}), which puts prometheus-client in "
        "multiprocess mode; every worker serves its own endpoint instead: unset it for the "
        "job, or pass --metrics-port 0 to run without metrics")
    check_single_process_mode(read_worker_env({}))
    config = JobConfig(metrics=MetricsConfig(port=0))
    assert serve_worker_metrics(config, env) is None   # metrics off: no objection


WORKER = """
import sys, threading
from prometheus_client import REGISTRY
before = set(REGISTRY._names_to_collectors)
import elastic_train.observe.metrics, elastic_train.observe.metrics_server
import elastic_train.observe.progress
import elastic_train.observe.report, elastic_train.worker.train
assert set(REGISTRY._names_to_collectors) == before, "an import registered metrics"
assert threading.active_count() == 1, threading.enumerate()
assert "matplotlib" not in sys.modules
sys.exit(elastic_train.worker.train.main(sys.argv[1:]))
"""


def test_imports_start_nothing_and_the_worker_refuses_multiprocess_mode(tmp_path: Path
                                                                         ) -> None:
    env = {"PATH": "/usr/bin:/bin", "PROMETHEUS_MULTIPROC_DIR": "",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", WORKER, "--run-dir", str(tmp_path / "run"),
                           "--metrics-port", "1"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    assert "elastic_train: error: PROMETHEUS_MULTIPROC_DIR is set (to '')" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]   # no .db files left behind


def taken_after_a_free_port() -> socket.socket:
    """A listening socket on a port whose predecessor is free (the check of PORT - 1 and PORT
    must name PORT: in a CI run, PORT - 1 was once another process's)."""
    for _ in range(100):
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", taken.getsockname()[1] - 1))
            except OSError:
                taken.close()
                continue
        taken.listen()
        return taken
    raise AssertionError("no port with a free predecessor in 100 tries")


def test_a_port_in_use_names_the_address_and_the_option() -> None:
    with taken_after_a_free_port() as taken:
        port = taken.getsockname()[1]
        expected = (f"metrics port 127.0.0.1:{port} is in use (Address already in use): pass "
                    "--metrics-port with a free base port (each worker serves PORT + its local "
                    "rank), or --metrics-port 0 to run without metrics")
        with pytest.raises(MetricsError) as caught:
            MetricsServer(CollectorRegistry(), "127.0.0.1", port)
        assert str(caught.value) == expected
        with pytest.raises(MetricsError) as caught:
            check_ports_free("127.0.0.1", port - 1, 2)
        assert str(caught.value) == expected
    with pytest.raises(MetricsError, match=r"^--metrics-port 65535 \+ local ranks up to 1 go"):
        check_ports_free("127.0.0.1", 65535, 2)


def test_an_address_not_of_this_machine_names_the_address_option() -> None:
    with pytest.raises(MetricsError) as caught:
        MetricsServer(CollectorRegistry(), "192.0.2.1", 0)    # TEST-NET-1: never local
    assert str(caught.value).startswith("cannot serve metrics on 192.0.2.1:0 (")
    assert str(caught.value).endswith("): pass --metrics-address with an address of this "
                                      "machine (0.0.0.0: every interface)")


# --- the endpoint ----------------------------------------------------------------------------


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_endpoint_serves_metrics_and_its_port_is_free_again_after_close() -> None:
    registry = CollectorRegistry()
    WorkerMetrics(registry, WorkerEnv(run_id="r"), batch_size=2, node="n")
    server = MetricsServer(registry, "127.0.0.1", 0)
    port = server.port
    try:
        status, text = get(server.url)
        assert status == 200
        assert 'elastic_train_steps_total{node="n",rank="0",run_id="r"} 0.0' in text
        assert get(f"http://127.0.0.1:{port}/")[0] == 404
        assert server.scrapes == 1
    finally:
        server.close()
    again = MetricsServer(registry, "127.0.0.1", port)   # what a restarted worker does
    again.close()


def test_wait_for_scrape_wants_a_scrape_that_began_after_the_call() -> None:
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
    try:
        get(server.url)
        assert not server.wait_for_scrape(0.05)      # the earlier scrape does not count
        waited: list[bool] = []
        waiter = threading.Thread(target=lambda: waited.append(server.wait_for_scrape(30)))
        waiter.start()
        deadline = time.monotonic() + 30
        while waiter.is_alive() and time.monotonic() < deadline:
            get(server.url)                          # one of these begins after the call
            waiter.join(timeout=0.02)
        assert waited == [True]
    finally:
        server.close()


def test_promtool_finds_nothing_to_lint(tmp_path: Path) -> None:
    from tests.integration.prom import tool

    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, WorkerEnv(restart_count=1, run_id="r",
                                                rendezvous_seconds=0.3), batch_size=2)
    feed(metrics, {"event": "start", "time": 1.0, "world_size": 1, "total_steps": 9},
         {"event": "rendezvous", "time": 1.0, "previous_last_step": 3,
          "previous_last_seen": 0.9},
         {"event": "startup", "time": 2.0, "process_start": 0.5, "group_began": 0.8,
          "group_ready": 0.9, "first_step_done": 2.0},
         {"event": "checkpoint_loaded", "time": 1.5, "step": 2, "seconds": 0.1,
          "saved_time": 0.2}, step(3, 2.0),
         {"event": "checkpoint_saved", "time": 2.5, "step": 3, "bytes": 10,
          "snapshot_seconds": 0.01, "persist_seconds": 0.02})
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        text = get(server.url)[1]
    finally:
        server.close()
    lint = subprocess.run([tool("promtool"), "check", "metrics"], input=text,
                          capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), \
        lint.stdout + lint.stderr


# --- the event log's side --------------------------------------------------------------------


def test_observers_see_every_record_also_where_the_log_is_off(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    log = EventLog(tmp_path / "on.jsonl", observers=[seen.append])
    log.emit_raw("step", step=1, loss=2.0)
    log.close()
    assert [dict(r) for r in read_events(tmp_path / "on.jsonl")] == seen
    off = EventLog(tmp_path / "off.jsonl", enabled=False, observers=[seen.append])
    off.emit_raw("step", step=2)
    assert seen[-1]["step"] == 2 and not (tmp_path / "off.jsonl").exists()


def test_an_observer_that_raises_is_logged_once_and_stops_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A bug in the metrics must not end training (it once did: a rank moved by a live
    re-formation raised in every step's observer)."""
    def broken(record: Any) -> None:
        raise ValueError("rank 1 outside world of 1")

    seen: list[dict[str, Any]] = []
    log = EventLog(tmp_path / "events.jsonl", observers=[broken, seen.append])
    with caplog.at_level("WARNING", logger="elastic_train.events.log"):
        log.emit_raw("step", step=1, loss=2.0)
        log.emit_raw("step", step=2, loss=1.0)
    log.close()
    assert [r["step"] for r in seen] == [1, 2]
    assert [r["step"] for r in read_events(tmp_path / "events.jsonl")] == [1, 2]
    errors = [r for r in caplog.records if r.name == "elastic_train.events.log"]
    assert len(errors) == 1 and "broken" in errors[0].getMessage()
    assert errors[0].exc_info is not None and "outside world" in str(errors[0].exc_info[1])


def test_previous_incarnation_knows_its_last_step_and_last_sign_of_life(tmp_path: Path
                                                                        ) -> None:
    path = tmp_path / "events.jsonl"
    records = [{"event": "start", "time": 10.0, "run_id": "r", "restart": 0, "world_size": 2},
               *[{"event": "step", "time": 10.0 + n, "step": n} for n in range(1, 31)],
               {"event": "checkpoint_saved", "time": 41.0, "step": 30}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"event": "st')
    previous = previous_incarnation(path, "r")
    assert previous is not None
    assert (previous.last_step, previous.last_step_time, previous.last_seen) == (30, 40.0, 41.0)
    # One that died before its first step: no step of its own.
    with open(path, "a") as f:
        f.write("\n" + json.dumps({"event": "start", "time": 50.0, "run_id": "r",
                                   "restart": 1, "world_size": 2}) + "\n")
    previous = previous_incarnation(path, "r")
    assert previous is not None
    assert (previous.restart, previous.last_step, previous.last_seen) == (1, None, 50.0)


def test_the_share_follows_the_global_batch_of_each_step() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, WorkerEnv(rank=1, world_size=2, run_id="r"),
                            batch_size=16, node="n")
    feed(metrics, {"event": "start", "time": 1.0, "world_size": 2, "total_steps": 9},
         step(1, 2.0), step(2, 3.0, global_batch=30))   # a batch policy doubled it
    assert value(registry, "elastic_train_samples_total", rank="1") == 8 + 15


def test_a_divergence_of_the_replicas_counts_each_suspect_by_rank_and_node() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, WorkerEnv(run_id="r", world_size=3), batch_size=6,
                            node="n")
    feed(metrics, {"event": "replicas_diverged", "time": 1.0, "step": 15, "named": [1],
                   "suspects": [1], "nodes": ["host-b"], "replicas": 3},
         {"event": "replicas_diverged", "time": 2.0, "step": 40, "named": [],
          "suspects": [0, 1], "nodes": ["host-a", "host-b"], "replicas": 2})
    name = "elastic_train_replica_divergences_total"
    assert value(registry, name, rank="0", suspect_rank="1", suspect_node="host-b") == 2
    assert value(registry, name, rank="0", suspect_rank="0", suspect_node="host-a") == 1


def test_a_straggler_is_counted_once_by_rank_and_node_and_each_rank_shows_its_score() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, WorkerEnv(run_id="r", world_size=3), batch_size=6,
                            node="n")
    feed(metrics, {"event": "step", "time": 1.0, "step": 1, "loss": 2.0, "world_size": 3,
                   "restart": 0, "compute_seconds": 0.031, "straggler_score": 2.4},
         {"event": "straggler", "time": 2.0, "step": 12, "rank": 1, "node": "host-b",
          "score": 2.4, "compute_seconds": 0.031, "others_seconds": 0.013, "factor": 1.5,
          "window": 10, "policy": "warn"})
    assert value(registry, "elastic_train_stragglers_total", rank="0", suspect_rank="1",
                 suspect_node="host-b") == 1
    assert value(registry, "elastic_train_straggler_score", rank="0") == 2.4
    assert value(registry, "elastic_train_step_compute_seconds", rank="0") == 0.031
    other = CollectorRegistry()  # rank 1 sees the same event: not counted twice in a sum
    feed(WorkerMetrics(other, WorkerEnv(run_id="r", rank=1, world_size=3), batch_size=6,
                       node="n"),
         {"event": "straggler", "time": 2.0, "step": 12, "rank": 1, "node": "host-b",
          "score": 2.4, "compute_seconds": 0.031, "others_seconds": 0.013, "factor": 1.5,
          "window": 10, "policy": "warn"})
    assert value(other, "elastic_train_stragglers_total", rank="1", suspect_rank="1",
                 suspect_node="host-b") is None
    assert value(other, "elastic_train_steps_total", rank="1") == 0  # (the labels match)
