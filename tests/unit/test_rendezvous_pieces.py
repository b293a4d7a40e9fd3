"""Unit tests of the pure parts of multi-node support: options, leases, batch policy, the
event log's view of the previous world, the summary across nodes, launcher defaults."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic import metrics

from elastic_train.errors import ConfigError, RendezvousConfigError
from elastic_train.events.log import EventLog, previous_incarnation, read_events_backwards
from elastic_train.live.environment import RENDEZVOUS_SECONDS
from elastic_train.observe.summary import summarize
from elastic_train.rendezvous import timing
from elastic_train.rendezvous.config import (
    LAST_CALL_TIMEOUT,
    RDZV_DEFAULTS,
    parse_rdzv_conf,
    rdzv_conf_with_defaults,
    rendezvous_endpoint,
    rendezvous_id,
)
from elastic_train.rendezvous.etcd_v3.client import Endpoint
from elastic_train.rendezvous.etcd_v3.gateway import failure_reason
from elastic_train.rendezvous.etcd_v3.options import EtcdV3Options, parse_endpoint
from elastic_train.rendezvous.etcd_v3.shared_lease import SharedLease
from elastic_train.rendezvous.failures import rendezvous_failure_line
from elastic_train.rendezvous.heartbeat import check_keep_alive, check_keep_alive_conf
from elastic_train.worker.batching import plan_batch
from elastic_train.worker.env import read_worker_env
from tests.memory_kv import MemoryKV

# --- --rdzv-endpoint and --rdzv-conf of etcd-v3 -------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("etcd.example:2380", Endpoint("etcd.example", 2380, "http")),
    ("etcd.example", Endpoint("etcd.example", 2379, "http")),
    ("https://10.0.0.5:4001/", Endpoint("10.0.0.5", 4001, "https")),
    ("[::1]:2379", Endpoint("::1", 2379, "http")),
    ("[fd00::7]", Endpoint("fd00::7", 2379, "http")),
])
def test_endpoints(text: str, expected: Endpoint) -> None:
    assert parse_endpoint(text, None) == expected


def test_endpoint_urls() -> None:
    assert Endpoint("::1", 2379).url == "http://[::1]:2379"
    assert parse_endpoint("h:1", "https").url == "https://h:1"


@pytest.mark.parametrize(("text", "message"), [
    ("", "--rdzv-backend etcd-v3 needs --rdzv-endpoint HOST:PORT of an etcd server"),
    ("h:0", "--rdzv-endpoint h:0 has an invalid port '0': write HOST:PORT"),
    ("h:port", "--rdzv-endpoint h:port has an invalid port 'port': write HOST:PORT"),
    ("a:1,b:2", "--rdzv-endpoint a:1,b:2 is invalid: give one etcd member as HOST:PORT"),
    ("ftp://h:1", "protocol 'ftp' is invalid: use http or https"),
    (":2379", "--rdzv-endpoint :2379 has no host: write HOST:PORT"),
])
def test_bad_endpoints(text: str, message: str) -> None:
    with pytest.raises(RendezvousConfigError) as info:
        parse_endpoint(text, None)
    assert str(info.value) == message


def test_defaults_and_every_option(tmp_path: Path) -> None:
    defaults = EtcdV3Options.parse("h", {"timeout": 900})  # torchrun always adds timeout
    assert (defaults.key_prefix, defaults.last_call_timeout, defaults.join_timeout) == \
        ("/elastic_train/rendezvous", 5.0, 600.0)
    assert (defaults.keep_alive_interval, defaults.keep_alive_max_attempt) == (5.0, 3)
    assert (defaults.design, defaults.lease_ttl) == ("leases", 10)
    assert (defaults.state_ttl, defaults.read_timeout, defaults.request_timeout,
            defaults.connect_timeout) == (7200, 60.0, 10.0, 30.0)
    files = {}
    for name in ("ca.pem", "cert.pem", "key.pem"):
        files[name] = tmp_path / name
        files[name].write_text("x")
    (tmp_path / "pw").write_text("hunter2\n")
    options = EtcdV3Options.parse("h:1", {
        "key_prefix": "/jobs/rdzv/", "ca_cert": str(files["ca.pem"]),
        "ssl_cert": str(files["cert.pem"]), "ssl_cert_key": str(files["key.pem"]),
        "user": "trainer", "password_file": str(tmp_path / "pw"), "join_timeout": "60",
        "design": "state-key",  # the heartbeat settings are that design's
        "last_call_timeout": "0.5", "close_timeout": "3", "heartbeat_timeout": "2",
        "keep_alive_interval": "1", "keep_alive_max_attempt": "6", "read_timeout": "9",
        "request_timeout": "4", "state_ttl": "0", "connect_timeout": "7"})
    assert options.endpoint == Endpoint("h", 1, "https")
    assert options.key_prefix == "/jobs/rdzv"
    assert options.credentials.password == "hunter2"
    assert options.credentials.user == "trainer"
    assert (options.join_timeout, options.last_call_timeout, options.close_timeout,
            options.heartbeat_timeout, options.keep_alive_interval,
            options.keep_alive_max_attempt, options.read_timeout, options.request_timeout,
            options.state_ttl, options.connect_timeout) == (60, 0.5, 3, 2, 1, 6, 9, 4, 0, 7)
    assert options.design == "state-key"
    assert EtcdV3Options.parse("h", {"lease_ttl": "30"}).lease_ttl == 30


@pytest.mark.parametrize(("conf", "message"), [
    ({"state_ttl": "1.5"}, "--rdzv-conf state_ttl=1.5 is invalid: expected a whole number"),
    ({"last_call_timeout": "0"}, "--rdzv-conf last_call_timeout=0 is invalid: it must be "
                                 "positive"),
    ({"state_ttl": "-1"}, "--rdzv-conf state_ttl=-1 is invalid: it must be >= 0"),
    ({"ssl_cert": "/c"}, "--rdzv-conf needs both ssl_cert and ssl_cert_key for a client "
                         "certificate"),
    ({"design": "ring"}, "--rdzv-conf design=ring is invalid: use leases or state-key"),
    ({"lease_ttl": "1"}, "--rdzv-conf lease_ttl=1 is invalid: use at least 2 seconds"),
    ({"keep_alive_max_attempt": "5"},
     "--rdzv-conf keep_alive_max_attempt does not apply to the etcd-v3 rendezvous, which "
     "notices a dead node when its lease expires: set lease_ttl=SECONDS (default 10) "
     "instead, or design=state-key for the previous, heartbeat-based design"),
    ({"user": "u", "password_file": "/nonexistent/pw"},
     "--rdzv-conf password_file=/nonexistent/pw cannot be read (No such file or directory): "
     "give a readable file"),
])
def test_bad_options(conf: dict[str, str], message: str) -> None:
    with pytest.raises(RendezvousConfigError) as info:
        EtcdV3Options.parse("h", conf)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)  # what torch's launcher expects


@pytest.mark.parametrize(("interval", "attempts", "ok"), [
    (1, 5, True), (1, 4, False), (2, 4, True), (2, 3, False), (5, 3, True), (0.5, 8, True)])
def test_heartbeat_margin(interval: float, attempts: int, ok: bool) -> None:
    if ok:
        check_keep_alive(interval, attempts)
    else:
        with pytest.raises(RendezvousConfigError, match="use keep_alive_max_attempt="):
            check_keep_alive(interval, attempts)


def test_short_reasons_of_client_errors() -> None:
    class Fake(Exception):
        def __init__(self, detail: str) -> None:
            super().__init__()
            self.detail_text = detail

    refused = Fake("HTTPConnectionPool(host='h', port=1): Max retries exceeded with url: /v3/x "
                   "(Caused by NewConnectionError(\"...: [Errno 111] Connection refused\"))")
    assert failure_reason(refused) == "[Errno 111] Connection refused"
    etcd = Fake('{"error":"etcdserver: user name is empty","message":"etcdserver: user name '
                'is empty","code":3}')
    assert failure_reason(etcd) == "etcdserver: user name is empty"
    assert failure_reason(Fake("404 Not Found")) == "404 Not Found"


# --- etcd outages: bounded retries, the grace after an outage ------------------------------


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_an_unreachable_etcd_is_retried_until_connect_timeout() -> None:
    from elastic_train.rendezvous.etcd_v3.kv import EtcdUnreachableError
    from elastic_train.rendezvous.etcd_v3.outage import retry_unreachable

    fake, calls = FakeTime(), []

    def down_for(attempts: int) -> Any:
        def fn() -> str:
            calls.append(fake.now)
            if len(calls) <= attempts:
                raise EtcdUnreachableError("http://h:1", "reading k: [Errno 111] Connection "
                                           "refused")
            return "answer"
        return fn

    assert retry_unreachable(down_for(4), 5, fake.sleep, fake.clock) == "answer"
    assert [round(t - 100, 3) for t in calls] == [0, 0.1, 0.3, 0.7, 1.5]  # backoff to 1 s
    calls.clear()
    with pytest.raises(EtcdUnreachableError) as info:
        retry_unreachable(down_for(1000), 5, fake.sleep, fake.clock)
    assert calls[-1] - calls[0] == pytest.approx(5)   # tried until the deadline, not past it
    assert str(info.value) == (
        "cannot reach etcd at http://h:1 for 5 s (reading k: [Errno 111] Connection refused): "
        "check that etcd runs there and --rdzv-endpoint, or wait longer with --rdzv-conf "
        "connect_timeout=SECONDS")


def test_no_node_is_judged_dead_for_one_timeout_after_an_outage() -> None:
    from elastic_train.rendezvous.etcd_v3.kv import EtcdUnreachableError
    from elastic_train.rendezvous.etcd_v3.outage import Outage

    fake = FakeTime()
    outage = Outage("http://h:1", grace_seconds=15, clock=fake.clock)
    outage.reached()
    assert not outage.ongoing and not outage.in_grace   # no outage, no grace
    outage.failed(EtcdUnreachableError("http://h:1", "x"))
    fake.sleep(40)
    assert outage.ongoing
    outage.reached()
    assert not outage.ongoing and outage.in_grace
    fake.sleep(14.9)
    assert outage.in_grace
    fake.sleep(0.2)
    assert not outage.in_grace


# --- the shared lease ---------------------------------------------------------------------


def test_the_lease_is_replaced_after_half_its_ttl() -> None:
    kv, now = MemoryKV(), [0.0]
    lease = SharedLease(kv, ttl=10, clock=lambda: now[0])
    first = lease.current()
    now[0] = 4.9
    assert lease.current() == first
    now[0] = 5.0
    second = lease.current()
    assert second != first
    assert SharedLease(kv, ttl=0).current() == 0  # no TTL: keys never expire


def test_a_lost_lease_is_granted_again() -> None:
    kv = MemoryKV()
    lease = SharedLease(kv, ttl=10, clock=lambda: 0.0)
    kv.put("/k", b"1", lease.current())
    kv.advance(11)  # etcd dropped the lease (and its key), our clock did not notice
    assert kv.get("/k") is None
    lease.write(lambda lease_id: kv.put("/k", b"2", lease_id))
    assert kv.get("/k").value == b"2"


# --- the batch policy ---------------------------------------------------------------------


def test_constant_policy_keeps_the_global_batch() -> None:
    for world in (1, 2, 3, 8):
        plan = plan_batch("constant", 64, world, reference_world_size=4)
        assert (plan.global_batch, plan.lr_scale) == (64, 1.0)


def test_scale_lr_keeps_the_per_rank_batch_and_scales_the_lr() -> None:
    assert [(p.global_batch, p.lr_scale) for p in
            (plan_batch("scale-lr", 64, w, reference_world_size=4) for w in (1, 2, 4, 8))] == \
        [(16, 0.25), (32, 0.5), (64, 1.0), (128, 2.0)]
    odd = plan_batch("scale-lr", 64, 2, reference_world_size=3)
    assert (odd.global_batch, odd.lr_scale) == (42, 42 / 64)


def test_a_batch_smaller_than_the_world_is_refused() -> None:
    with pytest.raises(ConfigError, match="global batch of 2 samples is smaller than the "
                                          "world size 3"):
        plan_batch("scale-lr", 4, 3, reference_world_size=6)


# --- the event log's view of the previous world -------------------------------------------


def _log(tmp_path: Path, records: list[dict[str, Any]]) -> Path:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    for record in records:
        log.emit_raw(record.pop("event"), **record)
    log.close()
    return path


def test_reading_backwards_across_blocks(tmp_path: Path) -> None:
    path = _log(tmp_path, [{"event": "step", "step": i, "pad": "x" * 50} for i in range(300)])
    with open(path, "a") as f:
        f.write('{"event": "step", "step": 30')  # a torn last line is skipped
    steps = [e["step"] for e in read_events_backwards(path, block=97)]
    assert steps == list(range(299, -1, -1))


def test_previous_incarnation(tmp_path: Path) -> None:
    path = _log(tmp_path, [
        {"event": "start", "run_id": "r", "world_size": 2, "restart": 0},
        {"event": "step", "step": 1}, {"event": "step", "step": 2},
        {"event": "checkpoint_saved", "step": 2}])
    previous = previous_incarnation(path, "r")
    last_step = next(e for e in read_events_backwards(path) if e["event"] == "step")
    assert previous is not None
    assert (previous.world_size, previous.restart, previous.last_step_time) == \
        (2, 0, last_step["time"])
    assert previous_incarnation(path, "other-run") is None
    _log(tmp_path, [{"event": "end", "run_id": "r", "step": 2}])
    assert previous_incarnation(path, "r") is None  # that launch finished
    assert previous_incarnation(tmp_path / "missing.jsonl", "r") is None


# --- the summary of a run whose world changed ----------------------------------------------


def test_summary_of_a_multi_node_run_with_rank0_on_a_new_node() -> None:
    """A grow puts rank 0 on the node that just joined: restart 0 there, same launch."""
    events: list[dict[str, Any]] = [
        {"event": "start", "run_id": "job", "restart": 0, "world_size": 2, "total_steps": 30}]
    events += [{"event": "step", "step": s, "loss": 1.0} for s in range(1, 13)]
    events += [{"event": "start", "run_id": "job", "restart": 1, "world_size": 1,
                "total_steps": 30}]
    events += [{"event": "step", "step": s, "loss": 1.0} for s in range(11, 21)]
    events += [{"event": "start", "run_id": "job", "restart": 0, "world_size": 2,
                "total_steps": 30}]
    events += [{"event": "step", "step": s, "loss": 1.0} for s in range(21, 31)]
    events.append({"event": "end", "run_id": "job", "step": 30})
    summary = summarize(events)
    assert summary.world_sizes == (2, 1, 2)
    assert (summary.steps_done, summary.restarts, summary.steps_redone) == (30, 1, 2)


# --- launcher defaults and the agent's rendezvous timing ----------------------------------


def test_rendezvous_conf_defaults_and_overrides() -> None:
    assert rdzv_conf_with_defaults("c10d", "") == "last_call_timeout=5"
    with pytest.raises(RendezvousConfigError, match="use keep_alive_max_attempt=5 or more"):
        rdzv_conf_with_defaults("etcd-v2", "keep_alive_interval=1")
    assert rdzv_conf_with_defaults("etcd", "last_call_timeout=1,timeout=60") == \
        "last_call_timeout=1,timeout=60"
    assert rdzv_conf_with_defaults("etcd-v3", "") == ""
    with pytest.raises(ConfigError, match="--rdzv-conf item 'oops' is invalid"):
        parse_rdzv_conf("a=1,oops")


def test_rendezvous_conf_parsing() -> None:
    assert parse_rdzv_conf("") == {}
    assert parse_rdzv_conf(" a = 1 ,, b=x=y ") == {"a": "1", "b": "x=y"}
    for bad in ("=1", "a=", "a= "):
        with pytest.raises(ConfigError, match="write KEY=VALUE"):
            parse_rdzv_conf(bad)


def test_one_last_call_default_for_every_backend() -> None:
    assert {backend: conf["last_call_timeout"] for backend, conf in RDZV_DEFAULTS.items()} \
        == {"c10d": "5", "etcd-v2": "5", "etcd": "5"}
    assert EtcdV3Options.parse("h", {}).last_call_timeout == LAST_CALL_TIMEOUT == 5.0


def test_heartbeat_conf_of_torchs_backends() -> None:
    check_keep_alive_conf("c10d", {})  # torch's 5 s x 3
    check_keep_alive_conf("c10d", {"keep_alive_interval": "1", "keep_alive_max_attempt": "5"})
    with pytest.raises(ConfigError, match="must be whole numbers for etcd-v2") as info:
        check_keep_alive_conf("etcd-v2", {"keep_alive_interval": "0.5"})
    assert not isinstance(info.value, RendezvousConfigError)
    with pytest.raises(RendezvousConfigError, match="use keep_alive_max_attempt=5 or more"):
        rdzv_conf_with_defaults("c10d", "keep_alive_interval=1,keep_alive_max_attempt=4")
    rdzv_conf_with_defaults("etcd", "keep_alive_interval=1")  # etcd (v1) has no heartbeats


def test_endpoint_and_id_defaults_for_one_node() -> None:
    assert rendezvous_endpoint("1", "") == rendezvous_endpoint("1:1", "") == "127.0.0.1:0"
    assert rendezvous_endpoint("1:2", "etcd:2379") == "etcd:2379"
    with pytest.raises(ConfigError, match="--rdzv-endpoint is required with more than one"):
        rendezvous_endpoint("2", "")
    assert len(rendezvous_id("1", "")) == 12
    assert rendezvous_id("1", "") != rendezvous_id("1", "")
    assert rendezvous_id("1:4", "job") == "job"
    with pytest.raises(ConfigError, match="--rdzv-id is required with more than one node"):
        rendezvous_id("1:4", "")


def test_failure_lines_of_rendezvous_errors() -> None:
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousTimeoutError,
    )

    where = {"backend": "etcd-v3", "endpoint": "etcd:2379", "run_id": "job", "nnodes": "2:4"}
    assert rendezvous_failure_line(RendezvousClosedError(), **where) == (
        "rendezvous 'job' (etcd-v3 at etcd:2379) is closed: a job with this --rdzv-id already "
        "finished; use a new --rdzv-id")
    assert rendezvous_failure_line(RendezvousTimeoutError(), **where) == (
        "rendezvous 'job' (etcd-v3 at etcd:2379) did not complete within its join_timeout: "
        "start the other nodes (--nnodes 2:4) or lower the minimum")
    assert rendezvous_failure_line(OSError("port in use"), **where) is None
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    refused = rendezvous_failure_line(RendezvousConnectionError("C++ text"),
                                      **{**where, "backend": "c10d"})
    assert refused is not None and refused.startswith(
        "rendezvous 'job' (c10d at etcd:2379): the store refused this node") \
        and "--rdzv-backend etcd-v3" in refused


def test_the_agents_rendezvous_time_reaches_the_next_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RENDEZVOUS_SECONDS, "stale")
    seen: list[metrics.MetricData] = []

    class Previous(metrics.MetricHandler):
        def emit(self, metric_data: metrics.MetricData) -> None:
            seen.append(metric_data)

    monkeypatch.setattr(metrics.api, "_metrics_map", {"torchelastic": Previous()})
    timer = timing.install()
    metrics.put_metric("SimpleElasticAgent._rendezvous.duration.ms", 1234, "torchelastic")
    metrics.put_metric("SimpleElasticAgent._rendezvous.success", 1, "torchelastic")
    assert timer.last_seconds == 1.234
    assert os.environ[RENDEZVOUS_SECONDS] == "1.234"
    assert read_worker_env({RENDEZVOUS_SECONDS: "1.234"}).rendezvous_seconds == 1.234
    assert read_worker_env({}).rendezvous_seconds is None
    assert [m.name for m in seen][-2:] == ["SimpleElasticAgent._rendezvous.duration.ms",
                                           "SimpleElasticAgent._rendezvous.success"]
    assert json.dumps(timer.last_seconds)


# --- the etcd-v3 handler's guard against a split-off world --------------------------------


def test_a_node_dropped_from_its_round_asks_to_rejoin(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the others took this node for dead and moved on, its agent must restart and
    rejoin (torch's handler alone would let it train on as a second world)."""
    import pickle

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    from elastic_train.rendezvous.etcd_v3.state_backend import encode_state
    from elastic_train.rendezvous.etcd_v3.state_key import build_handler

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setenv(RENDEZVOUS_SECONDS, "unset")
    kv = MemoryKV()
    options = EtcdV3Options.parse("h", {"last_call_timeout": "0.1"})
    handler = build_handler(kv, options, "job", 1, 2, local_addr="node-a")
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert float(os.environ[RENDEZVOUS_SECONDS]) > 0  # timed for the next workers
    assert handler.num_nodes_waiting() == 0
    moved_on = _RendezvousState()
    moved_on.round = 1  # the others formed round 1 without node-a
    kv.put("/elastic_train/rendezvous/job/state", encode_state(pickle.dumps(moved_on)))
    handler._state_holder._last_sync_time = -1  # no cached state
    assert handler.num_nodes_waiting() == 1
    handler._stop_heartbeats()


def test_a_missing_etcd_skips_but_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import etcd_server

    monkeypatch.setattr(etcd_server.shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="etcd is not installed"):
        etcd_server.etcd_binary()
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="etcd is not installed"):
        etcd_server.etcd_binary()
