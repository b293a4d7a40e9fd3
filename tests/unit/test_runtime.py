"""The worker runtime driven directly, in a world of one in this process: the protocol's own
tests (start, restore, the vote, both stops, the end), apart from its two adapters.

A world of one needs no process group: the runtime's collectives reduce to this rank's
values. The save failure here is an injected OSError from the store (the real OS failure,
through torchrun and both adapters, is in tests/integration/test_save_failure.py).
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elastic_train.checkpoint.storage import CheckpointStore
from elastic_train.config import CheckpointConfig
from elastic_train.errors import CheckpointFencedError, CheckpointStopError, NodeStoppedError
from elastic_train.events.log import EventLog, read_events
from elastic_train.rundir import RunDir
from elastic_train.worker.distributed import Group
from elastic_train.worker.env import WorkerEnv
from elastic_train.worker.runtime import GO_ON, Vote, WorkerRuntime

GROUP = Group(rank=0, world_size=1, backend="gloo", device=torch.device("cpu"))


def make_runtime(run_dir: RunDir, *, restart: int = 0, policy: CheckpointConfig | None = None,
                 budget: float | None = 25.0, said: list[str] | None = None,
                 **env: Any) -> WorkerRuntime:
    return WorkerRuntime(run_dir, WorkerEnv(run_id="r1", restart_count=restart, **env), GROUP,
                         policy or CheckpointConfig(every_steps=2, asynchronous=False),
                         preemption_budget=budget,
                         say=(said.append if said is not None else lambda text: None))


def kinds(run_dir: RunDir) -> list[str]:
    return [e["event"] for e in read_events(run_dir.events)]


def of(run_dir: RunDir, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir.events) if e["event"] == kind]


def train(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    loss = model(torch.ones(1, 4)).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach().double()


def test_a_run_starts_saves_when_due_ends_and_a_restart_resumes(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").prepare()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    objects = {"model": model, "optimizer": optimizer}
    runtime = make_runtime(run_dir).install()
    try:
        assert runtime.start(total_steps=5) is None          # a first start: no previous
        assert runtime.restore(objects) is None              # nothing to resume
        for step in range(1, 6):
            loss = train(model, optimizer)
            vote = runtime.vote(loss)
            assert vote == Vote(float(loss), False, False)
            runtime.save_if_due(step, objects)
        runtime.end(5, objects, vote)
    finally:
        runtime.close()
    assert kinds(run_dir)[:2] == ["start", "rendezvous"]
    assert [(e["step"], e["reason"]) for e in of(run_dir, "checkpoint_saved")] == \
        [(2, "periodic"), (4, "periodic"), (5, "final")]
    assert kinds(run_dir)[-1] == "end" and of(run_dir, "end")[0]["step"] == 5
    assert runtime.stopped_at is None
    runtime.raise_if_node_stopped()                          # no stop: nothing to raise

    # The agent restarts the worker (restart 1): it resumes from step 5 and says so.
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = nn.Linear(4, 2)
    again = make_runtime(run_dir, restart=1)
    try:
        again.start(total_steps=5)
        restored = again.restore({"model": fresh,
                                  "optimizer": torch.optim.SGD(fresh.parameters(), lr=0.1)})
    finally:
        again.close()
    assert restored is not None and restored.step == 5
    assert all(torch.equal(fresh.state_dict()[k], weights[k]) for k in weights)
    assert of(run_dir, "restart") == [{**of(run_dir, "restart")[0], "restart": 1, "step": 5}]


def test_start_records_the_resize_from_the_previous_incarnation(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").prepare()
    log = EventLog(run_dir.events)  # the previous incarnation of this launch: world size 2
    log.emit_raw("start", run_id="r1", restart=0, world_size=2)
    log.emit_raw("step", step=7, loss=1.0, world_size=2, restart=0)
    log.close()
    runtime = make_runtime(run_dir, restart=1, rendezvous_seconds=0.25)
    try:
        previous = runtime.start(total_steps=None)
    finally:
        runtime.close()
    assert previous is not None and (previous.world_size, previous.last_step) == (2, 7)
    (rendezvous,) = of(run_dir, "rendezvous")
    assert (rendezvous["previous_world_size"], rendezvous["previous_last_step"],
            rendezvous["seconds"]) == (2, 7, 0.25)
    assert rendezvous["since_last_step_seconds"] >= 0
    (resize,) = of(run_dir, "resize")
    assert (resize["old_world_size"], resize["new_world_size"], resize["restart"]) == (2, 1, 1)


def test_sigterm_is_a_vote_and_the_end_checkpoints_that_step_without_an_end(
        tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").prepare()
    before = signal.getsignal(signal.SIGTERM)
    model = nn.Linear(4, 2)
    objects = {"model": model}
    said: list[str] = []
    runtime = make_runtime(run_dir, said=said, group_rank=1, group_world_size=3).install()
    try:
        runtime.start(total_steps=10)
        runtime.restore(objects)
        assert runtime.vote() == Vote(0.0, False, False)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets the flag
        vote = runtime.vote()
        assert (vote.stop, vote.save_failed, vote.stopped_nodes, vote.ends_loop) == \
            (True, False, (1,), True)
        runtime.end(3, objects, vote)
    finally:
        runtime.close()  # also cancels the budget's watchdog, which would end this process
    assert signal.getsignal(signal.SIGTERM) is before
    assert [(e["step"], e["reason"]) for e in of(run_dir, "checkpoint_saved")] == \
        [(3, "preemption")]
    (preempted,) = of(run_dir, "preempted")
    assert (preempted["step"], preempted["signal"], preempted["rank_signalled"]) == \
        (3, "SIGTERM", True)
    assert "end" not in kinds(run_dir)
    assert said == ["stop requested (preemption): stopped at step 3 with a checkpoint; rerun "
                    "the same command to resume"]
    assert runtime.stopped_at == 3
    runtime.raise_if_node_stopped()  # this node (1) got the signal: it exits 0


def test_a_node_that_was_not_signalled_fails_after_the_stop(tmp_path: Path) -> None:
    runtime = make_runtime(RunDir(tmp_path / "run"), group_rank=0, group_world_size=2)
    runtime.stopped_at, runtime.stopped_nodes = 8, (1,)  # node 1's workers got the SIGTERM
    with pytest.raises(NodeStoppedError, match=r"node\(s\) \[1\] stopped at step 8 "
                                               r"\(preempted\); this node checkpointed"):
        runtime.raise_if_node_stopped()


def test_without_a_stop_policy_a_loop_without_a_loss_makes_no_collective(
        tmp_path: Path) -> None:
    runtime = make_runtime(RunDir(tmp_path / "run"), budget=None)
    assert not runtime.votes_needed and runtime.preemption is None
    assert runtime.vote() == GO_ON
    stopping = make_runtime(RunDir(tmp_path / "run"),
                            policy=CheckpointConfig(on_save_failure="stop"), budget=None)
    assert stopping.votes_needed


def test_a_fenced_write_without_a_collective_does_not_end_rank_0s_loop_alone(
        tmp_path: Path) -> None:
    """With no vote collective (no loss, no stop policy), only a world of one may stop on
    rank 0's fenced write: in a larger world rank 0 leaving alone would hang the others."""
    fenced = CheckpointFencedError(4, 1, 2, "writer epoch 2")
    alone = make_runtime(RunDir(tmp_path / "one"), budget=None)
    alone.checkpoints.fenced = fenced
    assert alone.vote().ends_loop
    pair = WorkerRuntime(RunDir(tmp_path / "two"), WorkerEnv(run_id="r1"),
                         Group(rank=0, world_size=2, backend="gloo", device=torch.device("cpu")),
                         CheckpointConfig(every_steps=2, asynchronous=False),
                         preemption_budget=None)
    pair.checkpoints.fenced = fenced
    assert not pair.votes_needed and pair.vote() == GO_ON


def test_a_failed_save_under_stop_ends_every_rank_with_one_line_and_refuses_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = RunDir(tmp_path / "run").prepare()
    model = nn.Linear(4, 2)
    objects = {"model": model}
    policy = CheckpointConfig(every_steps=2, asynchronous=False, on_save_failure="stop")
    runtime = make_runtime(run_dir, policy=policy)
    real_write = CheckpointStore.write
    try:
        runtime.start(total_steps=10)
        runtime.restore(objects)
        runtime.save_if_due(2, objects)                   # written
        assert runtime.vote() == Vote(0.0, False, False)

        def full(*args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(CheckpointStore, "write", full)
        runtime.save_if_due(4, objects)                   # fails: reported, training goes on
        vote = runtime.vote()
        assert (vote.stop, vote.save_failed, vote.ends_loop) == (False, True, True)
        with pytest.raises(CheckpointStopError) as stopped:
            runtime.end(5, objects, vote)
    finally:
        runtime.close()
    monkeypatch.setattr(CheckpointStore, "write", real_write)
    line = (f"stopped at step 5: checkpoint 4 could not be written under {run_dir.checkpoints} "
            "(No space left on device) and --on-save-failure is stop: free space or fix "
            "permissions, then rerun the same command (it resumes from checkpoint 2, which is "
            "intact)")
    assert str(stopped.value) == line
    assert [e["step"] for e in of(run_dir, "checkpoint_saved")] == [2]  # no final one tried
    assert [p.name for p in run_dir.checkpoints.glob("step-*")] == ["step-00000002"]
    (record,) = of(run_dir, "stopped")
    assert (record["step"], record["failed_step"], record["last_good_step"]) == (5, 4, 2)
    assert "end" not in kinds(run_dir)

    restarted = make_runtime(run_dir, restart=1, policy=policy)
    try:
        with pytest.raises(CheckpointStopError, match="^not restarting: " + line.replace(
                "(", r"\(").replace(")", r"\)")):
            restarted.start(total_steps=10)
    finally:
        restarted.close()


def test_an_end_without_registered_objects_writes_no_checkpoint(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").prepare()
    exported: list[bool] = []
    runtime = make_runtime(run_dir)
    try:
        runtime.start(total_steps=None)
        runtime.end(0, {}, then=lambda: exported.append(True))
    finally:
        runtime.close()
    assert of(run_dir, "checkpoint_saved") == [] and exported == [True]
    assert kinds(run_dir)[-1] == "end"


def test_a_node_ready_to_join_takes_the_loop_out_at_the_vote(tmp_path: Path) -> None:
    """Live recovery's boundary re-formation: the vote carries it (with the loss, and in a
    loop that votes nothing else), and it ends nothing by itself."""
    from types import SimpleNamespace

    runtime = make_runtime(RunDir(tmp_path / "run").prepare())
    try:
        live = SimpleNamespace(reform_due=False, close=lambda: None)
        runtime.live = live  # type: ignore[assignment]
        assert not runtime.vote(torch.tensor(1.0, dtype=torch.float64)).reform
        live.reform_due = True
        vote = runtime.vote(torch.tensor(2.0, dtype=torch.float64))
        assert vote.reform and vote.loss_sum == 2.0 and not vote.ends_loop
        runtime.preemption = None
        assert runtime.vote().reform
    finally:
        runtime.close()


def test_a_new_rank_after_a_reformation_is_passed_on_and_the_same_rank_is_not(
        tmp_path: Path) -> None:
    runtime = make_runtime(RunDir(tmp_path / "run"), rank=1, world_size=2)
    moves: list[WorkerEnv] = []
    runtime.on_moved.append(moves.append)
    runtime.set_group(GROUP, WorkerEnv(run_id="r1", rank=1, world_size=3))
    assert moves == [] and runtime.env.world_size == 3
    runtime.set_group(GROUP, WorkerEnv(run_id="r1", rank=0, world_size=1))
    assert [(m.rank, m.world_size) for m in moves] == [(0, 1)]
    assert runtime.events.enabled  # rank 0 keeps the event log now


def test_a_world_re_formed_in_a_new_round_is_said_without_an_unknown_rank():
    from elastic_train.worker.distributed import Group
    from elastic_train.worker.live_world import LostMembers
    from elastic_train.worker.runtime import Rejoined, _recovery_line

    rejoined = Rejoined(Group(0, 1, "gloo", torch.device("cpu")), 104, 1, 0, 0)
    line = _recovery_line(LostMembers([], None, "new round"), 2, 1, 1, rejoined)
    assert line == ("live recovery: the world from 2 to 1 workers re-formed in place (new "
                    "round, generation 1) at step 104: 0 bytes of state sent, 1 step redone")
    assert "rank ?" not in _recovery_line(LostMembers([], None, "collective failed"), 2, 2, 3,
                                          rejoined)
    assert _recovery_line(LostMembers([1], None, "worker lost"), 2, 2, 3, rejoined).startswith(
        "live recovery: rank 1 started again, the world of 2 re-formed in place")


def tally(nodes: int, *, preempted: tuple[int, ...] = (), ripe: int = 0, agent_stops: int = 0,
          reform: bool = False) -> torch.Tensor:
    """The vote's summed tally (worker/vote.py's slots) of a world of ``nodes`` nodes."""
    from elastic_train.worker import vote as rt

    summed = torch.zeros(rt.TALLY_NODES + nodes, dtype=torch.float64)
    summed[rt.TALLY_LOSS] = 4.0
    summed[rt.TALLY_STOPS] = len(preempted)
    summed[rt.TALLY_RIPE] = ripe
    summed[rt.TALLY_AGENT_STOPS] = agent_stops
    summed[rt.TALLY_REFORMS] = float(reform)
    for node in preempted:
        summed[rt.TALLY_NODES + node] = 1.0
    return summed


def test_a_sigterm_on_every_node_stops_the_job_and_on_some_nodes_they_leave_alone() -> None:
    """The decision every rank takes from the same tally (worker/runtime.decide)."""
    from elastic_train.worker.vote import decide

    # every node signalled: the job stops with a checkpoint, at once
    whole = decide(tally(3, preempted=(0, 1, 2)), 1, 3, live=True)
    assert (whole.stop, whole.leave, whole.stopped_nodes, whole.restart) == \
        (True, False, (0, 1, 2), False)
    # some nodes signalled within LEAVE_GRACE: nothing yet (the others may be signalled next)
    assert not decide(tally(3, preempted=(2,)), 0, 3, live=True).ends_loop
    # LEAVE_GRACE later: node 2 leaves alone, the others re-form without it and go on
    stays = decide(tally(3, preempted=(2,), ripe=1), 0, 3, live=True)
    assert (stays.stop, stays.leave, stays.reform, stays.leaving, stays.ends_loop) == \
        (False, False, True, (2,), False)
    goes = decide(tally(3, preempted=(2,), ripe=1), 2, 3, live=True)
    assert (goes.stop, goes.leave, goes.reform, goes.ends_loop) == (False, True, False, True)
    # without live recovery every rank stops with the signalled ones (torch's restart path)
    old = decide(tally(3, preempted=(2,), ripe=1), 0, 3, live=False)
    assert (old.stop, old.stopped_nodes, old.leave) == (True, (2,), False)
    # an agent's own stop of its workers: every rank stops with a checkpoint, a restart
    restart = decide(tally(3, agent_stops=1), 0, 3, live=True)
    assert (restart.stop, restart.restart, restart.stopped_nodes) == (True, True, ())


def test_the_agents_own_sigterm_is_a_restart_not_a_preemption(tmp_path: Path) -> None:
    """A SIGTERM that finds the agent's stop note (torch's restart path) stops at a step
    boundary with a checkpoint, says so, writes no ``preempted`` event, and ends the worker
    with NodeStoppedError (never an exit that reads as the job's end: in the fault campaign
    the workers took such a stop for a preemption and the whole job ended)."""
    run_dir = RunDir(tmp_path / "run").prepare()
    note = tmp_path / "note"
    note.write_text("restart")
    objects = {"model": nn.Linear(4, 2)}
    said: list[str] = []
    runtime = make_runtime(run_dir, said=said, stop_note=str(note)).install()
    try:
        runtime.start(total_steps=10)
        runtime.restore(objects)
        assert not runtime.vote().ends_loop  # a step: the worker holds the state
        os.kill(os.getpid(), signal.SIGTERM)
        vote = runtime.vote()
        assert (vote.stop, vote.restart, vote.ends_loop) == (True, True, True)
        runtime.end(3, objects, vote)
    finally:
        runtime.close()
    assert [(e["step"], e["reason"]) for e in of(run_dir, "checkpoint_saved")] == \
        [(3, "restart")]
    assert "preempted" not in kinds(run_dir) and "end" not in kinds(run_dir)
    assert said == ["an agent restarts its workers: every rank stopped at step 3 with a "
                    "checkpoint, and starts again from it (not a preemption)"]
    with pytest.raises(NodeStoppedError, match="an agent restarts its workers from it"):
        runtime.raise_if_node_stopped()


def test_a_node_that_leaves_alone_writes_nothing_and_exits_143(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").prepare()
    objects = {"model": nn.Linear(4, 2)}
    runtime = make_runtime(run_dir, group_rank=2, group_world_size=3).install()
    try:
        runtime.start(total_steps=10)
        runtime.restore(objects)
        leave = Vote(0.0, False, False, leave=True, leaving=(2,))
        runtime.end(4, objects, leave)  # no barrier: the others are not there
    finally:
        runtime.close()
    assert runtime.left and runtime.stopped_at == 4
    assert not of(run_dir, "checkpoint_saved") and "preempted" not in kinds(run_dir)
    with pytest.raises(NodeStoppedError, match=r"^this node was stopped alone \(a signal\): "
                       r"it left the job at step 4, and the other nodes go on") as left:
        runtime.raise_if_node_stopped()  # never 0: an unsignalled agent reads 0 as done
    assert left.value.exit_code == 143


def test_a_failed_step_that_is_no_collective_says_so_and_one_that_is_tells_the_agent(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A peer's loss read as the loop's own error waits the grace for a re-formation (the
    soak of 4eb25d8: a host kill that cost the failure detector's 1.5 s, where its workers'
    step had failed 54 ms after the kill): said in one line, so that the next soak shows
    which error it was."""
    from types import SimpleNamespace

    from elastic_train.worker import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "OWN_FAILURE_GRACE", 0.01)
    runtime = make_runtime(RunDir(tmp_path / "run").prepare())
    told: list[bool] = []
    try:
        runtime.live = SimpleNamespace(  # type: ignore[assignment]
            report_failed_collective=lambda: told.append(True),
            announced=lambda timeout=None: None, close=lambda: None)
        assert not runtime.failed_step(BrokenPipeError(32, "Broken pipe"))
        assert told == []
        assert ("rank 0: the step failed (BrokenPipeError: [Errno 32] Broken pipe), not a "
                "collective: waits 0.01 s for a re-formation") in capsys.readouterr().err
        assert not runtime.failed_step(RuntimeError("Connection closed by peer [127.0.0.1]"))
        assert told == [True] and capsys.readouterr().err == ""
    finally:
        runtime.close()
