"""Live recovery of a hand-written loop (``ElasticSession`` under ``elastic-train run
SCRIPT``): the same guarantees as the built-in trainer's (test_live_recovery.py,
test_multinode.py), with real workers, real SIGKILLs, a real SIGSTOP, and a real c10d
or etcd-v3 rendezvous of two agents on this machine.

The loop is session_live_loop.py: a step loop over the session's DataLoader with an LR
scheduler, recording the samples each rank starts each step with, and the generation of
the world it trains in.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elastic_train.live.spare import DELAY as SPARE_DELAY
from elastic_train.worker.sampler import epoch_order
from elastic_train.worker.session import LIVE_NEEDS_WRAP
from tests.etcd_server import free_port
from tests.integration import harness

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("session_live_loop.py")
SAMPLES, GLOBAL_BATCH, SEED = 256, 16, 0
TIMEOUT = 120
FAST = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=60"
FAST_V3 = "last_call_timeout=1,lease_ttl=3,join_timeout=60"


def script_run(run_dir: Path, steps: int, pace: float, launcher: list[str] | None = None,
               name: str | None = None, extra: tuple[str, ...] = ()) -> harness.Job:
    """``elastic-train run [launcher] session_live_loop.py RUN_DIR STEPS PACE [extra]``
    (a hot spare, were one made for a script, would come at once: none must)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "elastic_train", "run",
            *(launcher or ["--nproc-per-node", "2"]), str(SCRIPT), str(run_dir), str(steps),
            str(pace), *extra]
    return harness.start(argv, run_dir, harness.job_env({SPARE_DELAY: "0"}), log_name=name)


def effective_steps(run_dir: Path) -> dict[int, list[int]]:
    """{step: the global batch's indices} from the records of the newest generation that
    started the step (a step redone in a newer world counts there)."""
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for path in run_dir.glob("samples-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_step[record["step"]][record["generation"]].append(record)
    steps = {}
    for step, generations in by_step.items():
        records = sorted(generations[max(generations)], key=lambda r: r["rank"])
        world = records[0]["world_size"]
        assert [r["rank"] for r in records] == list(range(world)), (step, records)
        steps[step] = [i for r in records for i in r["indices"]]
    return steps


def assert_each_sample_once_in_order(run_dir: Path, total: int) -> None:
    steps = effective_steps(run_dir)
    assert sorted(steps) == list(range(1, total + 1))
    per_epoch = SAMPLES // GLOBAL_BATCH
    for epoch in range((total + per_epoch - 1) // per_epoch):
        used = [i for s in range(epoch * per_epoch + 1, min(total, (epoch + 1) * per_epoch) + 1)
                for i in steps[s]]
        assert used == epoch_order(SAMPLES, SEED, epoch).tolist()[:len(used)], epoch


def _step(n: int):
    return lambda e: e["event"] == "step" and e["step"] == n


STEPS = 60


def ema_digest(run_dir: Path) -> str:
    """The digest of the loop's final EMA of the weights (rank 0 writes it)."""
    return (run_dir / "ema.sha256").read_text()


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("session-reference") / "run"
    job = script_run(run_dir, STEPS, 0.0)
    assert job.wait(TIMEOUT) == 0, job.report()
    return run_dir


@pytest.fixture(scope="module")
def reference(reference_run: Path) -> str:
    return harness.digest_at(reference_run, STEPS)


@pytest.fixture(scope="module")
def reference_ema(reference_run: Path) -> str:
    return ema_digest(reference_run)


def test_a_hand_written_loop_recovers_in_place_and_ends_bitwise_exact(
        reference: str, reference_ema: str, tmp_path: Path) -> None:
    """Rank 1 killed mid-run, then rank 0 (the checkpoint writer) right after a checkpoint
    step, then rank 1 crashing after its forward (rank 0 fails inside the gradient
    all-reduce: the step is not applied, not even to the loop's EMA, and redone): each
    time only the dead worker starts again, the survivor keeps its process and sends the
    state, at most the step in flight is redone, no checkpoint is loaded, each sample is
    used once per epoch, and the weights and the EMA are those of a run never killed."""
    run_dir = tmp_path / "run"
    job = script_run(run_dir, STEPS, 0.03, extra=("crash-at=45:1",))
    kept = []
    try:
        job.wait_for_event(_step(12), TIMEOUT)
        # a job of one node: both of the agent's stores (the c10d rendezvous' and its own)
        # and its memory tier's holder listen on loopback only
        agent_listens = harness.listening(job.proc.pid)
        pids = job.worker_pids()
        job.kill_worker(1)
        harness.new_pid(job, 1, pids[1])
        job.wait_for_event(lambda e: e["event"] == "recovery", TIMEOUT)
        kept.append(job.worker_pids()[0] == pids[0])
        job.wait_for_event(_step(30), TIMEOUT)               # a checkpoint is due at 30
        pids = job.worker_pids()
        job.kill_worker(0)
        harness.new_pid(job, 0, pids[0])
        job.wait_for_event(lambda e: e["event"] == "recovery" and e["step"] >= 30, TIMEOUT)
        kept.append(job.worker_pids()[1] == pids[1])
        # a script's workers run the user's code from the start: no hot spare for them
        assert harness.spare_of(job.proc.pid) is None
        pids = job.worker_pids()
        job.wait_for_event(lambda e: e["event"] == "recovery" and e["step"] >= 44, TIMEOUT)
        kept.append(job.worker_pids()[0] == pids[0])
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    assert kept == [True, True, True], job.report()
    assert len(agent_listens) == 3 and {a for a, _ in agent_listens} == {"127.0.0.1"}, \
        agent_listens
    events = job.events()
    names = [e["event"] for e in events]
    assert names.count("start") == 1 and "checkpoint_loaded" not in names, job.report()
    recoveries = [e for e in events if e["event"] == "recovery"]
    assert [(e["kind"], e["failed_ranks"]) for e in recoveries] == \
        [("live", [1]), ("live", [0]), ("live", [1])], recoveries
    # the crash inside step 45: step 44 is what everyone holds, step 45 is redone
    assert (recoveries[2]["step"], recoveries[2]["steps_redone"]) == (44, 1), recoveries
    assert all(e["steps_redone"] <= 1 and e["bytes"] > 0 for e in recoveries), recoveries
    assert_each_sample_once_in_order(run_dir, STEPS)
    assert harness.digest_at(run_dir, STEPS) == reference
    assert ema_digest(run_dir) == reference_ema  # updated once per step that counted
    assert "live recovery: rank 1 started again" in job.output()


def test_a_stopped_worker_of_a_hand_written_loop_is_named_killed_and_replaced_in_place(
        reference: str, reference_ema: str, tmp_path: Path) -> None:
    """SIGSTOP of rank 1 with ``ElasticSession(step_timeout=3)``: within the step timeout
    rank 0's watchdog names rank 1 and kills it, the agent starts it again, the world
    re-forms in place (rank 0 keeps its process), and the run still ends bitwise exact."""
    run_dir = tmp_path / "run"
    job = script_run(run_dir, STEPS, 0.03, extra=("step-timeout=3",))
    try:
        job.wait_for_event(_step(12), TIMEOUT)
        seen = harness.stop_until_replaced(job, 1, TIMEOUT)
        assert seen.exit_code == 0, job.report()
    finally:
        job.stop()
    hang, recovery = seen.hang, seen.recovery
    assert hang["stuck_rank"] == 1 and hang["killed_pid"] == seen.pids[1], hang
    assert hang["detected_by"] == 0 and hang["stalled_seconds"] >= 3, hang
    assert recovery["kind"] == "live" and recovery["failed_ranks"] == [1], recovery
    assert recovery["steps_redone"] <= 1, recovery
    assert 3 <= seen.seconds < 3 + 10, seen.seconds
    assert harness.workers_of(job.proc.pid).get(0, seen.pids[0]) == seen.pids[0]  # kept
    names = [e["event"] for e in job.events()]
    assert names.count("start") == 1 and "checkpoint_loaded" not in names, job.report()
    assert_each_sample_once_in_order(run_dir, STEPS)
    assert harness.digest_at(run_dir, STEPS) == reference
    assert ema_digest(run_dir) == reference_ema
    out = job.output()
    assert "rank 0: no step completed for" in out and "step-timeout 3" in out, out
    assert "the agent starts it again and the world re-forms in place" in out, out


def test_a_loop_on_plain_ddp_says_why_and_takes_the_restart_path(
        reference: str, reference_ema: str, tmp_path: Path) -> None:
    """``DDP(model)`` instead of ``session.wrap(model)``: the session cannot recover in
    place; rank 0 says so once, and a killed worker restarts every worker from the newest
    checkpoint, still exact."""
    run_dir = tmp_path / "run"
    job = script_run(run_dir, STEPS, 0.03, extra=("plain-ddp",))
    try:
        job.wait_for_event(_step(15), TIMEOUT)
        job.kill_worker(1)
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    events = job.events()
    assert [e["kind"] for e in events if e["event"] == "recovery"] == ["restart"]
    assert [e["step"] for e in events if e["event"] == "checkpoint_loaded"] == [10]
    assert job.output().count(f"elastic_train: {LIVE_NEEDS_WRAP}") == 1, job.report()
    assert harness.digest_at(run_dir, STEPS) == reference
    assert ema_digest(run_dir) == reference_ema  # from the checkpoint


def _agent_node(run_dir: Path, steps: int, backend: str, endpoint: str, rdzv_id: str,
                name: str, extra: tuple[str, ...] = ()) -> harness.Job:
    """One agent of a job of up to two nodes, one worker each (node-a hosts c10d's store)."""
    conf = FAST_V3 if backend == "etcd-v3" else \
        f"{FAST},is_host={'true' if name == 'node-a' else 'false'}"
    return script_run(run_dir, steps, 0.03, [
        "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3",
        f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}", f"--rdzv-conf={conf}"], name, extra=extra)


def _grow_then_lose_node_b(start: Callable[[str], harness.Job],
                           settled: Callable[[harness.Job, dict[str, Any]], object]
                           ) -> tuple[harness.Job, list[int], list[tuple[str, int]]]:
    """node-a trains alone, node-b joins, and once ``settled(a, first step of 2)`` returns,
    node-b is killed; node-a trains on alone to the end (exit 0). Node-a, its worker's PID
    at each of the three sizes, and what node-a listened on (alone)."""
    a = start("node-a")
    nodes = [a]
    try:
        a.wait_for_event(_step(5), TIMEOUT)
        listens = harness.listening(a.proc.pid)
        pids = [a.worker_pids()[0]]
        nodes.append(b := start("node-b"))
        grown = a.wait_for_event(lambda e: e["event"] == "step" and e["world_size"] == 2,
                                 TIMEOUT)
        settled(a, grown)
        pids.append(harness.workers_of(a.proc.pid)[0])
        b.kill_node()
        a.wait_for_event(lambda e: e["event"] == "step" and e["world_size"] == 1
                         and e["step"] > grown["step"], TIMEOUT)
        pids.append(harness.workers_of(a.proc.pid)[0])
        assert a.wait(TIMEOUT) == 0, a.report()
    finally:
        for n in nodes:
            n.stop()
    return a, pids, listens


# Across real hosts, with a pulled cable: test_across_hosts.py (so extended here, on one host)
@pytest.mark.extended
@pytest.mark.parametrize("backend", ["c10d", "etcd-v3"])
def test_a_hand_written_loop_grows_and_shrinks_in_place_across_nodes(
        backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Two agents on c10d (node-a hosts the store) or on etcd-v3 (a real etcd, v3 API
    only): node-a trains alone, node-b joins (the survivor pauses at a step boundary,
    nothing redone, node-b's worker receives the state), then node-b is killed (node-a
    re-forms alone, at most the step in flight redone). Node-a's worker keeps its process
    throughout, no checkpoint is loaded, and each sample is used once per epoch across
    both resizes."""
    run_dir, steps = tmp_path / "run", 400
    if backend == "etcd-v3":
        endpoint = request.getfixturevalue("etcd_v3").endpoint
    else:
        endpoint = f"127.0.0.1:{free_port()}"
    a, pids, listens = _grow_then_lose_node_b(
        lambda name: _agent_node(run_dir, steps, backend, endpoint, tmp_path.name, name),
        lambda a, grown: a.wait_for_event(_step(grown["step"] + 10), TIMEOUT))
    rendezvous_listens = [addr for addr, port in listens if f"127.0.0.1:{port}" == endpoint]
    assert pids[0] == pids[1] == pids[2], a.report()
    if backend == "c10d":  # node-a hosts the store of an endpoint on loopback: loopback only
        assert rendezvous_listens == ["127.0.0.1"], rendezvous_listens
    events = a.events()
    names = [e["event"] for e in events]
    assert names.count("start") == 1 and "checkpoint_loaded" not in names, a.report()
    recoveries = {e["cause"]: e for e in events if e["event"] == "recovery"}
    joined, lost = recoveries["node joined"], recoveries["node lost"]
    assert (joined["kind"], joined["steps_redone"], joined["world_size"]) == ("live", 0, 2)
    assert (lost["kind"], lost["steps_redone"] <= 1, lost["world_size"]) == ("live", True, 1)
    assert joined["bytes"] > 0
    resizes = [(e["old_world_size"], e["new_world_size"]) for e in events
               if e["event"] == "resize"]
    assert resizes == [(1, 2), (2, 1)], resizes
    assert_each_sample_once_in_order(run_dir, steps)


# Extended (make test-extended); the default suite proves it with
# test_a_hand_written_fsdp_loop_recovers_in_place_with_the_weights_of_one_never_killed in
# test_sharded_jobs.py.
@pytest.mark.extended
def test_a_hand_written_fsdp_loop_grows_from_the_peers_and_shrinks_through_the_checkpoint(
        tmp_path: Path) -> None:
    """The loop with ``session.wrap(model, parallelism="fsdp")`` on two c10d agents: node-a
    trains alone, node-b joins at a step boundary (node-a's model is sharded again on the
    mesh of 2 in the loop's own object and sends node-b its half: nothing redone, no
    checkpoint read), then node-b is killed (node-b's shards are gone: node-a loads the
    newest checkpoint onto a mesh of 1, node-b's part from the copy node-a's agent holds).
    Node-a's worker keeps its process throughout and each sample is used once per epoch."""
    run_dir, steps = tmp_path / "run", 300
    endpoint = f"127.0.0.1:{free_port()}"
    a, pids, _ = _grow_then_lose_node_b(
        lambda name: _agent_node(run_dir, steps, "c10d", endpoint, tmp_path.name, name,
                                 extra=("fsdp",)),
        lambda a, grown: a.wait_for_event(lambda e: e["event"] == "checkpoint_saved"
                                          and e["step"] > grown["step"], TIMEOUT))
    assert pids[0] == pids[1] == pids[2], a.report()
    events = a.events()
    assert [e["event"] for e in events].count("start") == 1, a.report()
    recoveries = {e["cause"]: e for e in events if e["event"] == "recovery"}
    joined, lost = recoveries["node joined"], recoveries["node lost"]
    assert (joined["kind"], joined["state_from"], joined["steps_redone"],
            joined["world_size"]) == ("live", "peers", 0, 2), joined
    assert joined["bytes"] > 0
    assert (lost["kind"], lost["state_from"], lost["world_size"]) == \
        ("live", "checkpoint", 1), lost
    loads = [(e["step"], e["saved_world_size"], e["world_size"], e["source"])
             for e in events if e["event"] == "checkpoint_loaded"]
    assert loads == [(lost["step"], 2, 1, "memory")], loads
    resizes = [(e["old_world_size"], e["new_world_size"]) for e in events
               if e["event"] == "resize"]
    assert resizes == [(1, 2), (2, 1)], resizes
    assert "not recovered in place" not in a.output()
    assert_each_sample_once_in_order(run_dir, steps)
