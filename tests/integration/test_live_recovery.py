"""Live recovery (``elastic-train run``, one node and two): a SIGKILLed worker is started again
alone, takes the state from a survivor over the new process group, and the run ends with
the weights of a run never killed, bit for bit. (Whole nodes lost and added:
test_multinode.py.)

Real workers forked from the forkserver, real SIGKILLs at the moments that matter (mid-step,
right after a checkpoint step while rank 0 persists it, a second kill while the world is
re-forming), the PIDs of the survivors (they must not restart), the event log (one recovery
per failure, at most one step redone, no checkpoint loaded), the samples each step used
(each sample once per epoch), and the fallback to the restart path when no worker survives.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import defaultdict
from pathlib import Path

import pytest

from elastic_train.live.spare import DELAY as SPARE_DELAY
from elastic_train.observe.report import write_report
from tests import procfs
from tests.integration import harness
from tests.integration.harness import TINY_DROPOUT, TINY_DROPOUT_STEPS

pytestmark = pytest.mark.slow

JOB = [*TINY_DROPOUT, "--checkpoint-every", "5", "--keep-checkpoints", str(TINY_DROPOUT_STEPS),
       "--log-every", "20", "--record-samples", "true"]
TIMEOUT = 180


def _step(n: int):
    return lambda e: e["event"] == "step" and e["step"] == n


def _wait_until_blocked(pid: int, timeout: float = 30) -> None:
    """Until the main thread of ``pid`` sleeps in a wait (its peer stopped, it sits in the
    collective) on five polls in a row."""
    deadline = time.monotonic() + timeout
    asleep = 0
    while asleep < 5:
        state = procfs.state(pid)
        asleep = asleep + 1 if state == "S" else 0
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} never blocked (state {state})")
        time.sleep(0.01)


def _samples_per_epoch(run_dir: Path) -> dict[int, list[int]]:
    """{epoch: indices} of the steps that made the final weights: the last record of each
    (step, rank) counts (a step redone is recorded again)."""
    latest: dict[tuple[int, int], dict] = {}
    for path in (run_dir / "samples").glob("rank-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            latest[(record["step"], record["rank"])] = record
    steps = {step for step, _ in latest}
    assert steps == set(range(1, TINY_DROPOUT_STEPS + 1)), sorted(steps)
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for record in latest.values():
        by_epoch[record["epoch"]].extend(record["indices"])
    return by_epoch


def test_sigkilled_workers_are_replaced_in_place_and_the_run_ends_bitwise_exact(
        tiny_dropout_reference: dict[int, str], tmp_path: Path) -> None:
    """Four failures in one run: rank 1 mid-interval; rank 0 right after a checkpoint
    step (its persist in flight); rank 1 and then its replacement while it joins; rank 1
    while rank 0 waits for it inside a collective (stopped first, killed once rank 0
    blocks). The survivor of each keeps its pid, the run loads no checkpoint, every
    failure redoes at most one step, and the final weights (and every checkpoint) equal the
    reference's."""
    run_dir = tmp_path / "run"
    job = harness.elastic_run(run_dir, [*JOB, "--max-restarts", "5"],  # 5 live restarts
                              harness.job_env({SPARE_DELAY: "0"}))
    survivors_kept: list[bool] = []
    try:
        job.wait_for_event(_step(7), TIMEOUT)
        spare = harness.wait_for_spare(job)
        pids = job.worker_pids()
        job.kill_worker(1)                                   # mid-interval
        assert harness.new_pid(job, 1, pids[1]) == spare     # the hot spare took its place
        job.wait_for_event(lambda e: e["event"] == "recovery", TIMEOUT)
        survivors_kept.append(job.worker_pids()[0] == pids[0])

        job.wait_for_event(_step(20), TIMEOUT)                # a checkpoint is due at 20
        pids = job.worker_pids()
        job.kill_worker(0)                                   # the writer, mid-persist
        harness.new_pid(job, 0, pids[0])
        job.wait_for_event(lambda e: e["event"] == "recovery" and e["step"] >= 20, TIMEOUT)
        survivors_kept.append(job.worker_pids()[1] == pids[1])

        job.wait_for_event(_step(30), TIMEOUT)
        pids = job.worker_pids()
        job.kill_worker(1)
        replacement = harness.new_pid(job, 1, pids[1])
        os.kill(replacement, signal.SIGKILL)                          # while it joins
        harness.new_pid(job, 1, replacement)
        job.wait_for_event(lambda e: e["event"] == "recovery" and e["step"] >= 30, TIMEOUT)
        survivors_kept.append(job.worker_pids()[0] == pids[0])

        job.wait_for_event(_step(38), TIMEOUT)
        pids = job.worker_pids()
        os.kill(pids[1], signal.SIGSTOP)
        _wait_until_blocked(pids[0])                               # inside a collective
        os.kill(pids[1], signal.SIGKILL)
        harness.new_pid(job, 1, pids[1])
        assert job.wait(TIMEOUT) == 0, job.report()
        survivors_kept.append(harness.workers_of(job.proc.pid).get(0, pids[0]) == pids[0])
    finally:
        job.stop()
    assert survivors_kept == [True] * 4, job.report()
    assert harness.spare_of(job.proc.pid) is None  # dismissed at the end
    assert "Closing process" not in job.output()   # ... not killed
    events = job.events()
    names = [e["event"] for e in events]
    assert names.count("start") == 1, job.report()           # no worker group restarted
    assert "checkpoint_loaded" not in names
    recoveries = [e for e in events if e["event"] == "recovery"]
    assert [e["kind"] for e in recoveries] == ["live"] * len(recoveries)
    assert len(recoveries) in (4, 5), recoveries  # the replacement's kill may come before
    # its join (one recovery) or after it (two)
    assert [e["failed_ranks"] for e in recoveries[:2]] == [[1], [0]]
    assert recoveries[-1]["failed_ranks"] == [1] and recoveries[-1]["step"] >= 38
    assert all(e["steps_redone"] <= 1 and e["bytes"] > 0 for e in recoveries), recoveries
    assert all(e["seconds"] is not None and e["seconds"] < 30 for e in recoveries)
    # The final weights and every checkpoint written are the reference's, bit for bit.
    assert harness.final_digest(run_dir) == tiny_dropout_reference[TINY_DROPOUT_STEPS]
    for row in harness.checkpoint_listing(run_dir):
        assert row["model_digest"] == tiny_dropout_reference[row["step"]], row
    for epoch, seen in _samples_per_epoch(run_dir).items():
        assert len(seen) == len(set(seen)), f"epoch {epoch} repeats samples"
    out = job.output()
    assert "live recovery: rank 1 started again, the world of 2 re-formed in place" in out
    report = write_report(run_dir, plot=False).text   # elastic-train report's summary
    assert report.count("  live recovery ") == len(recoveries), report
    assert "  live recovery 2   rank 0 replaced at step " in report
    assert "restarts survived 0 (" in out and "  live recoveries   " in out


def test_when_no_worker_survives_the_job_restarts_from_its_checkpoint(
        tiny_dropout_reference: dict[int, str], tmp_path: Path) -> None:
    """Both workers SIGKILLed at once: no one holds the state, so the agent takes torch's
    restart path and the newest checkpoint; the result is still exact."""
    run_dir = tmp_path / "run"
    job = harness.elastic_run(run_dir, [*JOB, "--max-restarts", "3"])
    try:
        job.wait_for_event(_step(12), TIMEOUT)
        for pid in job.worker_pids().values():
            os.kill(pid, signal.SIGKILL)
        reached = max(e["step"] for e in job.events() if e["event"] == "step")
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    events = job.events()
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    # The newest complete checkpoint (every 5 steps) before the kill: the one before it when
    # the kill struck rank 0 while it persisted one.
    assert loaded and loaded[0]["step"] % 5 == 0, job.report()
    assert reached - 10 < loaded[0]["step"] <= reached, (reached, job.report())
    assert [e["kind"] for e in events if e["event"] == "recovery"][-1] == "restart"
    assert harness.final_digest(run_dir) == tiny_dropout_reference[TINY_DROPOUT_STEPS]


def test_a_stopped_worker_is_named_killed_and_replaced_in_place(
        tiny_dropout_reference: dict[int, str], tmp_path: Path) -> None:
    """SIGSTOP of rank 1: within --step-timeout rank 0's watchdog names it and kills it, the
    agent starts it again, and the world re-forms in place (rank 0 keeps its pid). Before
    that the hot spare is SIGKILLed: no recovery, the agent starts another."""
    run_dir = tmp_path / "run"
    job = harness.elastic_run(run_dir, [*JOB, "--max-restarts", "2", "--step-timeout", "3"],
                              harness.job_env({SPARE_DELAY: "0"}))
    try:
        job.wait_for_event(_step(12), TIMEOUT)
        spare = harness.wait_for_spare(job)
        os.kill(spare, signal.SIGKILL)
        harness.wait_for_spare(job, other_than=spare)
        seen = harness.stop_until_replaced(job, 1, TIMEOUT)
        assert seen.exit_code == 0, job.report()
    finally:
        job.stop()
    hang, recovery = seen.hang, seen.recovery
    assert hang["stuck_rank"] == 1 and hang["killed_pid"] == seen.pids[1], hang
    assert recovery["kind"] == "live" and recovery["failed_ranks"] == [1], recovery
    assert seen.seconds < 3 + 10, seen.seconds
    assert harness.workers_of(job.proc.pid).get(0, seen.pids[0]) == seen.pids[0]
    names = [e["event"] for e in job.events()]
    assert names.count("start") == 1 and "checkpoint_loaded" not in names
    assert names.count("recovery") == 1  # the spare's death was none
    assert "the agent starts it again and the world re-forms in place" in job.output()
    assert "the hot spare ended before it was needed (1 of 2): another is started " \
        "later" in job.output()
    assert harness.final_digest(run_dir) == tiny_dropout_reference[TINY_DROPOUT_STEPS]


def _two_nodes(run_dir: Path, job_id: str) -> list[harness.Job]:
    """Two agents of ``elastic-train run`` (c10d, node-a holding the store), a worker each."""
    port = harness.free_ports()
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job_id}"]
    return [harness.node(run_dir, name, [*rdzv, f"--rdzv-conf=is_host={host}"],
                         [*JOB, "--max-restarts", "3"], launcher="elastic-train", nnodes="2")
            for name, host in (("node-a", "true"), ("node-b", "false"))]


@pytest.mark.extended  # across real hosts, bitwise: test_across_hosts.py (a worker killed there)
def test_workers_lost_on_either_of_two_nodes_are_replaced_in_place_bitwise_exact(
        tiny_dropout_reference: dict[int, str], tmp_path: Path) -> None:
    """Two agents (c10d, one worker each), two kills in a row: rank 1 mid-interval, then
    rank 0 (on the other node, the checkpoint writer) right after a checkpoint step. Each
    time the dead worker's agent starts it again and calls the other agent; the other
    node's worker keeps its process; no checkpoint is loaded, at most one step is redone,
    and the final weights equal the one-node reference's, bit for bit."""
    run_dir = tmp_path / "run"
    nodes = _two_nodes(run_dir, tmp_path.name)
    kept: list[bool] = []
    try:
        nodes[0].wait_for_event(_step(7), TIMEOUT)
        for rank, after in ((1, 7), (0, 20)):
            nodes[0].wait_for_event(_step(after), TIMEOUT)
            (victim,) = [n for n in nodes if rank in harness.workers_of(n.proc.pid)]
            (other,) = [n for n in nodes if n is not victim]
            others = set(harness.workers_of(other.proc.pid).values())
            old = victim.kill_worker(rank)
            harness.new_pid(victim, rank, old)
            nodes[0].wait_for_event(lambda e, s=after: e["event"] == "recovery"
                                    and e["step"] >= s, TIMEOUT)
            kept.append(set(harness.workers_of(other.proc.pid).values()) == others)
        for node in nodes:
            assert node.wait(TIMEOUT) == 0, node.report()
    finally:
        for node in nodes:
            node.stop()
    assert kept == [True, True], [n.report() for n in nodes]
    events = nodes[0].events()
    names = [e["event"] for e in events]
    assert names.count("start") == 1 and "checkpoint_loaded" not in names
    recoveries = [e for e in events if e["event"] == "recovery"]
    assert [(e["kind"], e["cause"], e["failed_ranks"]) for e in recoveries] == [
        ("live", "worker lost", [1]), ("live", "worker lost", [0])], recoveries
    assert all(e["steps_redone"] <= 1 and e["bytes"] > 0 for e in recoveries), recoveries
    assert harness.final_digest(run_dir) == tiny_dropout_reference[TINY_DROPOUT_STEPS]
    for epoch, seen in _samples_per_epoch(run_dir).items():
        assert len(seen) == len(set(seen)), f"epoch {epoch} repeats samples"


# Extended (make test-extended); the default suite proves it with
# test_when_no_worker_survives_the_job_restarts_from_its_checkpoint.
@pytest.mark.extended
def test_when_both_nodes_lose_their_workers_the_job_restarts_from_its_checkpoint(
        tiny_dropout_reference: dict[int, str], tmp_path: Path) -> None:
    """Two agents (c10d, one worker each), both workers SIGKILLed at once: each agent starts
    its worker again and calls the other, one coordinates, finds no member holding the
    state and tells the other so; both take torch's restart path from the newest
    checkpoint, and the result is still exact."""
    run_dir = tmp_path / "run"
    nodes = _two_nodes(run_dir, tmp_path.name)
    try:
        nodes[0].wait_for_event(_step(12), TIMEOUT)
        for node in nodes:
            for pid in harness.workers_of(node.proc.pid).values():
                os.kill(pid, signal.SIGKILL)
        for node in nodes:
            assert node.wait(TIMEOUT) == 0, node.report()
    finally:
        for node in nodes:
            node.stop()
    events = nodes[0].events()
    assert [e["kind"] for e in events if e["event"] == "recovery"] == ["restart"], events
    assert [e["event"] for e in events].count("checkpoint_loaded") == 1
    assert harness.final_digest(run_dir) == tiny_dropout_reference[TINY_DROPOUT_STEPS]
