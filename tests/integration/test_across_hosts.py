"""Multi-node jobs across separate hosts (tests/netbed.py): each node in a network namespace
of its own, with its own host name and address, etcd on a host of its own. A node there
dies, freezes or loses its cable the way a machine does: a killed host's kernel still
refuses and resets connections, but a frozen one or one whose cable is pulled says
nothing at all, which agents on one host (tests/integration/test_multinode.py, now
extended) never see.

- Hosts whose own name resolves to loopback (Debian's ``127.0.1.1 HOSTNAME``), nothing set
  by the user: the job trains at world 2 (the launcher names the interface that reaches the
  other nodes for gloo).
- etcd-v3, the host holding rank 0 killed, a new host joining: the survivor re-forms in
  place at once (the lost node's lease is 30 s here and is not what tells), takes over the
  event log and the writer's epoch; the new host grows the world back in place.
- etcd-v3, the writer's cable pulled, put back after the survivor committed a checkpoint:
  the failure detector cuts it off in seconds (its lease is 30 s); the cut-off side
  commits no plan and no checkpoint and trains no step of its old world once it is back;
  it rejoins in place.
- c10d (``--batch-policy scale-lr``), a node frozen (every process SIGSTOPped) and thawed,
  or its cable pulled and put back: the same, with the LR and global batch following the
  world; the store's host cut off: the other node ends with one line.
- A worker SIGKILLed on another host: the world re-forms at the same size, and every
  checkpoint and the final weights equal, bit for bit, a run never killed.

Every scenario checks, from the recorded sample ids, that each epoch used each sample
exactly once in the sampler's order despite the resizes (a step redone counts once), and
that the survivor's worker kept its process throughout.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elastic_train.checkpoint.storage import MANIFEST
from tests import netbed as nb
from tests.integration import harness, hosts
from tests.integration.hosts import EventLog
from tests.integration.test_multinode import (
    BATCH,
    JOB,
    TIMEOUT,
    assert_each_sample_once_in_order,
    assert_scaled_lr,
    check_the_log,
    first_recovery,
)

pytestmark = pytest.mark.slow

Factory = Callable[..., nb.Netbed]
# The lease (etcd-v3) and the heartbeats (c10d) would tell only after 30 s: anything
# sooner is the failure detector's or the failed collective's doing.
SLOW_LEASE = "last_call_timeout=1,lease_ttl=30,join_timeout=60"
SLOW_HEARTBEATS = "last_call_timeout=1,keep_alive_interval=2,keep_alive_max_attempt=15," \
    "join_timeout=60"
SHORT_LEASE = "last_call_timeout=1,lease_ttl=6,join_timeout=60"
NOT_BY_THE_LEASE = 15.0
"""A loss seen sooner than this after the fault was not seen by a 30 s lease."""


def job_node(bed: nb.Netbed, run_dir: Path, name: str, rdzv_id: str, nnodes: str = "1:2",
             conf: str = SLOW_LEASE) -> hosts.Node:
    """A node of the built-in job (test_multinode's JOB) on host ``name``, etcd-v3 with a
    30 s lease (SLOW_LEASE: what the world does must not wait for a lease)."""
    host = bed.host(name)
    return hosts.start_node(host, run_dir, [
        *hosts.etcd_v3(bed, host, rdzv_id, nnodes=nnodes, conf=conf), *JOB,
        "--metrics-port", "0"])


def survivor_pids(node: hosts.Node) -> set[int]:
    return set(harness.workers_of(node.proc.pid).values())


def writer_of(nodes: list[hosts.Node]) -> hosts.Node:
    """The node whose worker is rank 0 (the checkpoint writer)."""
    for node in nodes:
        if 0 in harness.workers_of(node.proc.pid):
            return node
    raise AssertionError("no node hosts rank 0:\n" + hosts.report(nodes))


def claims(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "writers").iterdir())]


def test_loopback_host_names_train_without_any_setting(netbed: Factory, tmp_path: Path
                                                       ) -> None:
    bed = netbed(["node-a", "node-b"], etcd=True, loopback_name=True)
    run_dir = tmp_path / "run"
    job = ["--preset", "tiny", "--steps", "10", "--batch-size", "16", "--log-every", "1",
           "--metrics-port", "0"]
    nodes = [hosts.start_node(h, run_dir, [*hosts.etcd_v3(bed, h, "loopback"), *job])
             for h in (bed.host("node-a"), bed.host("node-b"))]
    assert hosts.wait_all(nodes, TIMEOUT) == [0, 0], hosts.report(nodes)
    steps = EventLog(run_dir).steps()
    assert [e["step"] for e in steps] == list(range(1, 11)), hosts.report(nodes)
    assert {e["world_size"] for e in steps} == {2}


def test_etcd_v3_a_killed_host_is_reformed_at_once_and_a_new_host_grows_it_back(
        netbed: Factory, tmp_path: Path) -> None:
    bed = netbed(["node-a", "node-b", "node-c"], etcd=True)
    run_dir = tmp_path / "run"

    def start(name: str) -> hosts.Node:
        return job_node(bed, run_dir, name, "killed")

    nodes = [start("node-a"), start("node-b")]
    log = EventLog(run_dir)
    try:
        hosts.wait_for_step(log, world=2, min_step=12, timeout=TIMEOUT, nodes=nodes)
        victim = writer_of(nodes)
        survivor = nodes[1] if victim is nodes[0] else nodes[0]
        before = survivor_pids(survivor)
        assert victim.host is not None
        killed_at = victim.host.kill()
        shrunk = hosts.wait_for_world(log, 1, after=killed_at, timeout=TIMEOUT, nodes=nodes)
        assert survivor_pids(survivor) == before
        joined_at = time.time()
        nodes.append(start("node-c"))
        hosts.wait_for_world(log, 2, after=joined_at, timeout=TIMEOUT, nodes=nodes)
        assert survivor_pids(survivor) == before
        assert hosts.wait_all([survivor, nodes[2]], TIMEOUT) == [0, 0], hosts.report(nodes)
    finally:
        for node in nodes:
            node.stop()
    assert shrunk["time"] - killed_at < NOT_BY_THE_LEASE, shrunk
    events = check_the_log(run_dir)
    assert {e["global_batch"] for e in events if e["event"] == "step"} == {BATCH}
    names = [e["event"] for e in events]
    assert names.count("start") == 1 and "checkpoint_loaded" not in names, names
    shrink, grow = first_recovery(events, "node lost"), first_recovery(events, "node joined")
    assert (shrink["kind"], shrink["lost_nodes"], shrink["world_size"]) == ("live", 1, 1)
    assert shrink["steps_redone"] <= 1, shrink
    assert (grow["kind"], grow["steps_redone"], grow["world_size"]) == ("live", 0, 2), grow
    assert [c["resumed_from"] for c in claims(run_dir)] == [None, shrink["step"]]


def cut_off_and_back(host: nb.Host, fault: str, log: EventLog, nodes: list[hosts.Node],
                     steps_alone: int) -> tuple[dict[str, Any], float, float]:
    """``fault`` (``cable`` or ``freeze``) on ``host``; once the survivors re-formed and
    trained ``steps_alone`` steps alone, the fault undone; then the first step at world 2.
    (the survivors' recovery event, fault time, undo time). The recovery must be a node lost
    seen live, sooner than a 30 s lease or heartbeat expiry could tell."""
    fault_at = host.freeze() if fault == "freeze" else host.cable_down()
    cut_off = log.wait(lambda e: e["event"] == "recovery" and e["time"] > fault_at,
                       "the survivors' recovery", TIMEOUT, nodes)
    hosts.wait_for_step(log, world=1, min_step=cut_off["step"] + steps_alone,
                        timeout=TIMEOUT, nodes=nodes)
    back_at = host.thaw() if fault == "freeze" else host.cable_up()
    hosts.wait_for_world(log, 2, after=back_at, timeout=TIMEOUT, nodes=nodes)
    assert (cut_off["kind"], cut_off["cause"], cut_off["world_size"]) == \
        ("live", "node lost", 1), cut_off
    assert cut_off["time"] - fault_at < NOT_BY_THE_LEASE, cut_off
    return cut_off, fault_at, back_at


def assert_cut_off_side_committed_nothing(run_dir: Path, events: list[dict[str, Any]],
                                          cut_off: dict[str, Any], back_at: float,
                                          writer_cut_off: bool) -> None:
    """The side that was cut off (and came back at ``back_at``) trained no step of its old
    world once back; if it held the writer, every checkpoint past the cut was written by
    the new writer (a new epoch).

    A worker frozen mid-step writes, once thawed, the sample record of the step it was in
    (``cut_off["step"] + 1``): a record precedes the step's vote, so that a step that
    commits was recorded by every rank. That vote never passes (its world is gone) and the
    audits take the newest generation's records of a step; at most one such record per
    rank is allowed, nothing after it."""
    reached = max(e["step"] for e in events if e["event"] == "step" and e["time"] < back_at)
    stale, in_flight = [], []
    for path in (run_dir / "samples").glob("rank-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["time"] > back_at and record["step"] <= reached \
                    and record["restart"] == 0 and record.get("generation", 0) <= \
                    cut_off["generation"] - 1:
                if record["step"] == cut_off["step"] + 1 and not [
                        r for r in in_flight if r["rank"] == record["rank"]]:
                    in_flight.append(record)
                else:
                    stale.append(record)
    assert not stale, (stale, in_flight)
    for manifest in (run_dir / "checkpoints").glob(f"step-*/{MANIFEST}"):
        record = json.loads(manifest.read_text())
        if record["step"] > cut_off["step"]:
            assert record["writer_epoch"] >= (2 if writer_cut_off else 1), record


def test_etcd_v3_the_writers_cable_pulled_and_put_back(netbed: Factory, tmp_path: Path
                                                       ) -> None:
    bed = netbed(["node-a", "node-b"], etcd=True)
    run_dir = tmp_path / "run"
    nodes = [job_node(bed, run_dir, name, "cable") for name in ("node-a", "node-b")]
    log = EventLog(run_dir)
    try:
        hosts.wait_for_step(log, world=2, min_step=15, timeout=TIMEOUT, nodes=nodes)
        writer = writer_of(nodes)
        other = nodes[1] if writer is nodes[0] else nodes[0]
        before = survivor_pids(other)
        assert writer.host is not None
        pulled_at = writer.host.cable_down()
        cut_off = log.wait(lambda e: e["event"] == "recovery" and e["time"] > pulled_at,
                           "the survivor's recovery", TIMEOUT, nodes)
        log.wait(lambda e: e["event"] == "checkpoint_saved" and e["step"] > cut_off["step"],
                 "a checkpoint of the new world", TIMEOUT, nodes)
        back_at = writer.host.cable_up()
        hosts.wait_for_world(log, 2, after=back_at, timeout=TIMEOUT, nodes=nodes)
        assert survivor_pids(other) == before
        assert hosts.wait_all(nodes, TIMEOUT) == [0, 0], hosts.report(nodes)
    finally:
        for node in nodes:
            node.stop()
    assert (cut_off["kind"], cut_off["cause"], cut_off["world_size"]) == \
        ("live", "node lost", 1), cut_off
    assert cut_off["time"] - pulled_at < NOT_BY_THE_LEASE, cut_off
    assert [c["resumed_from"] for c in claims(run_dir)][:2] == [None, cut_off["step"]]
    events = check_the_log(run_dir)
    assert [e["event"] for e in events].count("start") == 1  # no worker group restarted
    back = [e for e in events if e["event"] == "recovery" and e["time"] > back_at]
    assert back and all((e["kind"], e["world_size"]) == ("live", 2) for e in back), back
    assert_cut_off_side_committed_nothing(run_dir, events, cut_off, back_at, True)


# A freeze and a pulled cable cut node-b off alike (the fault campaign has both): the default
# suite pulls the cable, make test-extended freezes it as well.
@pytest.mark.parametrize("fault", [pytest.param("freeze", marks=pytest.mark.extended), "cable"])
def test_c10d_a_node_cut_off_rejoins_when_back_scaling_the_lr(
        netbed: Factory, tmp_path: Path, fault: str) -> None:
    """node-b (not the store's node) frozen and thawed, or its cable pulled and put back:
    cut off by the failure detector, it rejoins in place once back. Cut off, node-b
    cannot reach the store either (it cannot tell that from the store's node being lost):
    it ends its workers and waits for the store (--rdzv-conf join_timeout)."""
    bed = netbed(["node-a", "node-b"])
    store = bed.host("node-a")
    run_dir = tmp_path / "run"
    job = [*JOB, "--batch-policy", "scale-lr", "--metrics-port", "0"]
    nodes = [hosts.start_node(h, run_dir, [*hosts.c10d(store, h, "frozen",
                                                       conf=SLOW_HEARTBEATS), *job])
             for h in (store, bed.host("node-b"))]
    log = EventLog(run_dir)
    try:
        hosts.wait_for_step(log, world=2, min_step=15, timeout=TIMEOUT, nodes=nodes)
        before = survivor_pids(nodes[0])
        writer_frozen = writer_of(nodes) is nodes[1]
        cut_off, _, thawed_at = cut_off_and_back(bed.host("node-b"), fault, log, nodes, 3)
        assert survivor_pids(nodes[0]) == before
        assert hosts.wait_all(nodes, TIMEOUT) == [0, 0], hosts.report(nodes)
    finally:
        for node in nodes:
            node.stop()
    events = check_the_log(run_dir)
    assert_scaled_lr(events)
    assert [e["event"] for e in events].count("start") == 1
    assert_cut_off_side_committed_nothing(run_dir, events, cut_off, thawed_at,
                                          writer_cut_off=writer_frozen)


# Extended (make test-extended); the default suite proves it with
# test_etcd_v3_the_writers_cable_pulled_and_put_back, and
# test_a_hand_written_loop_recovers_in_place_and_ends_bitwise_exact in test_session_live.py.
@pytest.mark.extended
def test_a_hand_written_loop_on_two_hosts_survives_a_pulled_cable_in_place(
        netbed: Factory, tmp_path: Path) -> None:
    """``ElasticSession`` (tests/integration/session_live_loop.py) on two hosts, etcd-v3:
    node-b's cable is pulled, node-a re-forms alone in place, node-b comes back and joins
    in place when the cable is back. node-a's worker keeps its process throughout, no
    checkpoint is loaded, each sample is used once per epoch."""
    from tests.integration.test_session_live import SCRIPT, assert_each_sample_once_in_order

    bed = netbed(["node-a", "node-b"], etcd=True)
    run_dir, steps = tmp_path / "run", 300
    run_dir.mkdir(parents=True)

    def node(name: str) -> hosts.Node:
        host = bed.host(name)
        return hosts.start_node(host, run_dir, [
            *hosts.etcd_v3(bed, host, "session", conf=SLOW_LEASE), str(SCRIPT), str(run_dir),
            str(steps), "0.03"], script=True)

    nodes = [node("node-a"), node("node-b")]
    log = EventLog(run_dir)
    try:
        hosts.wait_for_step(log, world=2, min_step=20, timeout=TIMEOUT, nodes=nodes)
        before = survivor_pids(nodes[0])
        cut_off_and_back(bed.host("node-b"), "cable", log, nodes, 5)
        assert survivor_pids(nodes[0]) == before
        assert hosts.wait_all(nodes, TIMEOUT) == [0, 0], hosts.report(nodes)
    finally:
        for node_ in nodes:
            node_.stop()
    names = [e["event"] for e in log.read()]
    assert names.count("start") == 1 and "checkpoint_loaded" not in names, names
    assert_each_sample_once_in_order(run_dir, steps)


# Extended (make test-extended); the default suite proves it with
# test_c10d_the_stores_host_killed_ends_the_other_node_with_one_line (the same line).
@pytest.mark.extended
def test_c10d_the_stores_host_cut_off_ends_the_other_node_with_one_line(
        netbed: Factory, tmp_path: Path) -> None:
    """c10d keeps its store in one node's agent: a job cannot outlive that node. When its
    cable is pulled, the other node, whose agent would wait on the store forever inside
    torch's rendezvous, ends within seconds with one line that says what to do (its
    workers too: nothing is left on the host) once the store did not answer for the
    rendezvous' join_timeout (a cut-off node cannot tell that from its own cable: it waits
    that long for the store); the store's node trains on alone."""
    bed = netbed(["node-a", "node-b"])
    store = bed.host("node-a")
    run_dir = tmp_path / "run"
    job = [*JOB, "--batch-policy", "scale-lr", "--metrics-port", "0"]
    conf = SLOW_HEARTBEATS.replace("join_timeout=60", "join_timeout=10")
    nodes = [hosts.start_node(h, run_dir, [*hosts.c10d(store, h, "store-lost", conf=conf),
                                           *job])
             for h in (store, bed.host("node-b"))]
    log = EventLog(run_dir)
    try:
        hosts.wait_for_step(log, world=2, min_step=5, timeout=TIMEOUT, nodes=nodes)
        pulled_at = store.cable_down()
        assert hosts.wait_all(nodes[1:], 30) == [1], hosts.report(nodes)
        ended = time.time() - pulled_at
        left = bed.host("node-b").leftovers(within=5.0)
        assert left == [], left  # workers, spare, forkserver, resource tracker: all gone
        last = nodes[1].lines()[-1][1].decode()
        assert last.startswith("elastic-train: error: the c10d rendezvous store of job "
                               "store-lost did not answer for 10 s (--rdzv-conf join_timeout): "
                               "its node is lost or this node is cut off"), nodes[1].report()
        assert "--rdzv-backend etcd-v3" in last
        hosts.wait_for_world(log, 1, after=pulled_at, timeout=TIMEOUT, nodes=nodes[:1])
        store.cable_up()
        assert hosts.wait_all(nodes[:1], TIMEOUT) == [0], hosts.report(nodes)
    finally:
        for node in nodes:
            node.stop()
    assert ended < 20, ended


def test_c10d_the_stores_host_killed_ends_the_other_node_with_one_line(
        netbed: Factory, tmp_path: Path) -> None:
    """The store's host killed (every process) and its agent started again: the store the
    job met in is gone, and the new one knows nothing of it. The other node ends within
    seconds, exit 1, its last line saying what happened and what to use instead, and no
    Python traceback (before: a RendezvousConnectionError's page)."""
    bed = netbed(["node-a", "node-b"])
    store = bed.host("node-a")
    run_dir = tmp_path / "run"
    job = [*JOB, "--batch-policy", "scale-lr", "--metrics-port", "0"]
    nodes = [hosts.start_node(h, run_dir, [*hosts.c10d(store, h, "store-killed",
                                                       conf=SLOW_HEARTBEATS), *job])
             for h in (store, bed.host("node-b"))]
    log = EventLog(run_dir)
    try:
        hosts.wait_for_step(log, world=2, min_step=5, timeout=TIMEOUT, nodes=nodes)
        killed_at = store.kill()
        assert hosts.wait_all(nodes[1:], 60) == [1], hosts.report(nodes)
        ended = time.time() - killed_at
        left = bed.host("node-b").leftovers(within=5.0)
        assert left == [], left
        out = nodes[1].output()
        last = nodes[1].lines()[-1][1].decode()
        assert last.startswith("elastic-train: error: rendezvous 'store-killed' (c10d at "
                               f"{store.ip}:29400): the store refused this node"), out[-3000:]
        assert "--rdzv-backend etcd-v3" in last
        assert "Traceback (most recent call last)" not in out
    finally:
        for node in nodes:
            node.stop()
    assert ended < 45, ended


# Extended (make test-extended); the default suite proves it with
# test_sigkilled_workers_are_replaced_in_place_and_the_run_ends_bitwise_exact in
# test_live_recovery.py.
@pytest.mark.extended
def test_a_worker_killed_on_another_host_ends_bitwise_equal_to_a_run_never_killed(
        netbed: Factory, tiny_dropout_reference: dict[int, str], tmp_path: Path) -> None:
    """The world size returns at once: node-b's worker (rank 1) is SIGKILLed on its host, its
    agent starts it again and the world re-forms in place across the hosts, at 2. Every
    checkpoint and the final weights equal, bit for bit, those of the same job trained
    without interruption on one host (harness.TINY_DROPOUT, 2 workers: the data order, the
    dropout and gloo's sum for 2 ranks do not depend on where the ranks run)."""
    bed = netbed(["node-a", "node-b"], etcd=True)
    run_dir = tmp_path / "run"
    job = [*harness.TINY_DROPOUT, "--checkpoint-every", "5", "--keep-checkpoints",
           str(harness.TINY_DROPOUT_STEPS), "--log-every", "20", "--metrics-port", "0"]
    nodes = [hosts.start_node(h, run_dir, [*hosts.etcd_v3(bed, h, "exact", nnodes="2"),
                                           *job])
             for h in (bed.host("node-a"), bed.host("node-b"))]
    log = EventLog(run_dir)
    try:
        hosts.wait_for_step(log, world=2, min_step=12, timeout=TIMEOUT, nodes=nodes)
        rank1 = next(node for node in nodes if 1 in harness.workers_of(node.proc.pid))
        killed = harness.workers_of(rank1.proc.pid)[1]
        os.kill(killed, signal.SIGKILL)
        recovery = log.wait(lambda e: e["event"] == "recovery", "the recovery", TIMEOUT,
                            nodes)
        assert hosts.wait_all(nodes, TIMEOUT) == [0, 0], hosts.report(nodes)
    finally:
        for node in nodes:
            node.stop()
    assert (recovery["kind"], recovery["failed_ranks"], recovery["world_size"]) == \
        ("live", [1], 2), recovery
    assert harness.final_digest(run_dir) == \
        tiny_dropout_reference[harness.TINY_DROPOUT_STEPS]
    for row in harness.checkpoint_listing(run_dir):
        assert row["model_digest"] == tiny_dropout_reference[row["step"]], row


def test_a_world_is_never_re_formed_below_the_jobs_minimum_of_nodes(
        netbed: Factory, tmp_path: Path) -> None:
    """``--nnodes 2:3``: a host killed leaves one node, fewer than the minimum. The survivor
    does not train on alone (the job said it needs two nodes: a model may not fit one); it
    takes the restart path, which waits for a second node, and once a new host joins the
    world trains again at 2 from the newest checkpoint, each sample once per epoch. (The
    restart's round waits for the dead node's lease, as a world that runs must never be
    doubled: a 6 s lease here, not SLOW_LEASE's 30 s, which cost the suite 25 s.)"""
    bed = netbed(["node-a", "node-b", "node-c"], etcd=True)
    run_dir = tmp_path / "run"

    def start(name: str) -> hosts.Node:
        return job_node(bed, run_dir, name, "minimum", nnodes="2:3", conf=SHORT_LEASE)

    nodes = [start("node-a"), start("node-b")]
    log = EventLog(run_dir)
    try:
        hosts.wait_for_step(log, world=2, min_step=12, timeout=TIMEOUT, nodes=nodes)
        killed_at = bed.host("node-b").kill()
        nodes[0].wait_for_line("fewer than the job's minimum", after=killed_at,
                               timeout=TIMEOUT)
        nodes.append(start("node-c"))
        hosts.wait_for_world(log, 2, after=killed_at, timeout=TIMEOUT, nodes=nodes)
        assert hosts.wait_all([nodes[0], nodes[2]], TIMEOUT) == [0, 0], hosts.report(nodes)
    finally:
        for node in nodes:
            node.stop()
    events = log.read()
    assert not [e for e in events if e["event"] == "step" and e["world_size"] == 1]
    assert [e for e in events if e["event"] == "checkpoint_loaded" and e["time"] > killed_at]
    assert_each_sample_once_in_order(run_dir)


def test_a_false_suspicion_costs_a_re_formation_never_a_wrong_result(
        netbed: Factory, tmp_path: Path) -> None:
    """node-b's agent alone stops for 4 s (a long pause of the agent process; its worker
    runs on), longer than --peer-timeout: node-a takes node-b for lost and re-forms alone.
    When node-b's agent goes on, its plan is stale: it commits nothing, its worker (which
    held the old world's state) is ended, and node-b rejoins in place. The job ends with
    each sample once per epoch and nothing of the stale side committed."""
    bed = netbed(["node-a", "node-b"], etcd=True)
    run_dir = tmp_path / "run"
    nodes = [job_node(bed, run_dir, name, "pause") for name in ("node-a", "node-b")]
    log = EventLog(run_dir)
    agent_b = nodes[1].proc.pid
    try:
        hosts.wait_for_step(log, world=2, min_step=15, timeout=TIMEOUT, nodes=nodes)
        before = survivor_pids(nodes[0])
        writer_paused = writer_of(nodes) is nodes[1]
        paused_at = time.time()
        os.kill(agent_b, signal.SIGSTOP)
        cut_off = log.wait(lambda e: e["event"] == "recovery" and e["time"] > paused_at,
                           "node-a's recovery", TIMEOUT, nodes)
        hosts.wait_for_step(log, world=1, min_step=cut_off["step"] + 2, timeout=TIMEOUT,
                            nodes=nodes)
        resumed_at = time.time()
        os.kill(agent_b, signal.SIGCONT)
        hosts.wait_for_world(log, 2, after=resumed_at, timeout=TIMEOUT, nodes=nodes)
        assert survivor_pids(nodes[0]) == before
        assert hosts.wait_all(nodes, TIMEOUT) == [0, 0], hosts.report(nodes)
    finally:
        if nodes[1].proc.poll() is None:
            os.kill(agent_b, signal.SIGCONT)
        for node in nodes:
            node.stop()
    assert (cut_off["kind"], cut_off["world_size"]) == ("live", 1), cut_off
    events = check_the_log(run_dir)
    assert [e["event"] for e in events].count("start") == 1
    assert_cut_off_side_committed_nothing(run_dir, events, cut_off, resumed_at,
                                          writer_cut_off=writer_paused)
