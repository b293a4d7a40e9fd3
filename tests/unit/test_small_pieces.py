"""Unit tests of the small pure pieces: LR schedule, micro-batches, seeds, the worker
environment, the event log and its summary, state snapshots, the checkpoint policy, task
loading and the run directory. Single process, CPU, about a second.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_train.checkpoint import manager as manager_module
from elastic_train.checkpoint.manager import CheckpointManager, snapshot_state
from elastic_train.checkpoint.storage import CheckpointStore
from elastic_train.config import CheckpointConfig
from elastic_train.errors import ConfigError, TaskError
from elastic_train.events.log import EventLog, read_events
from elastic_train.observe.summary import summarize
from elastic_train.rundir import prepare_run_dir
from elastic_train.tasks.base import TaskContext
from elastic_train.tasks.loader import load_task, resolve_factory
from elastic_train.worker.distributed import Group
from elastic_train.worker.env import WorkerEnv, read_worker_env
from elastic_train.worker.seeding import derive_seed
from elastic_train.worker.step_parts import lr_factor, micro_batches
from elastic_train.worker.trainer import TrainerState

# --- lr_factor ----------------------------------------------------------------------------


def test_warmup_is_linear_up_to_one() -> None:
    factors = [lr_factor(s, 10, 100, "cosine") for s in range(10)]
    assert factors == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[-1] == 1.0
    assert lr_factor(10, 10, 100, "cosine") == pytest.approx(1.0)   # decay starts at 1.0
    assert [lr_factor(s, 4, 100, "constant") for s in range(4)] == \
        pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_cosine_decays_to_a_tenth_at_the_end() -> None:
    warmup, total = 10, 100
    decay = [lr_factor(s, warmup, total, "cosine") for s in range(warmup, total + 1)]
    assert all(a > b for a, b in itertools.pairwise(decay))             # strictly decreasing
    assert decay[-1] == pytest.approx(0.1)                          # after the last step
    assert 0.1 < lr_factor(total - 1, warmup, total, "cosine") < 0.101
    assert lr_factor(55, warmup, total, "cosine") == pytest.approx(0.55)  # half-way
    assert lr_factor(500, warmup, total, "cosine") == pytest.approx(0.1)  # clamped after
    assert lr_factor(0, 0, 50, "cosine") == pytest.approx(1.0)      # no warm-up


def test_constant_stays_at_one_after_warmup() -> None:
    assert all(lr_factor(s, 5, 50, "constant") == 1.0 for s in range(5, 80))
    assert all(lr_factor(s, 0, 50, "constant") == 1.0 for s in range(50))
    # A run no longer than its warm-up stays at the peak once warm.
    assert lr_factor(20, 20, 20, "cosine") == 1.0


def test_the_lr_of_optimizer_step_s_is_peak_times_lr_factor_s() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, 3, 12, "cosine"))
    for step in range(12):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0 * lr_factor(step, 3, 12,
                                                                                "cosine"))
        optimizer.step()
        scheduler.step()


# --- micro_batches ------------------------------------------------------------------------


def test_micro_batches_examples() -> None:
    indices = torch.arange(10)
    (whole,) = micro_batches(indices, 0)
    assert torch.equal(whole, indices)
    assert len(micro_batches(indices, 10)) == 1
    assert len(micro_batches(indices, 64)) == 1
    chunks = micro_batches(indices, 3)
    assert [c.tolist() for c in chunks] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [c.tolist() for c in micro_batches(indices, -1)] == [list(range(10))]


@settings(max_examples=100, deadline=None, database=None)
@given(st.integers(0, 100), st.integers(0, 40))
def test_micro_batches_split_in_order_within_the_limit(size: int, limit: int) -> None:
    indices = torch.randperm(size)
    chunks = micro_batches(indices, limit)
    assert torch.equal(torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.long),
                       indices)
    if limit > 0:
        assert all(len(c) <= limit for c in chunks)
        assert len(chunks) == max(1, math.ceil(size / limit))


# --- TrainerState -------------------------------------------------------------------------


def test_trainer_state_round_trips() -> None:
    state = TrainerState(step=12, samples_seen=192)
    restored = TrainerState()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert restored == state
    restored.load_state_dict({"step": torch.tensor(3), "samples_seen": 48.0})
    assert (restored.step, restored.samples_seen) == (3, 48)
    assert type(restored.step) is int and type(restored.samples_seen) is int


# --- derive_seed --------------------------------------------------------------------------


def test_derive_seed_is_stable_across_calls_and_versions() -> None:
    # Data order and dropout of a resumed run come from these: they must never change.
    assert derive_seed(0, "data-order", 0) == 4987831230155830758
    assert derive_seed(0, "init") == 7797302695267191734
    assert derive_seed(1234, "step", 7, 3) == 9039538096171470987
    assert derive_seed(1234, "step", 7, 3) == derive_seed(1234, "step", 7, 3)


def test_derive_seed_is_distinct_and_in_range() -> None:
    seeds = {derive_seed(seed, purpose, step, rank)
             for seed in range(3) for purpose in ("init", "step", "data-order")
             for step in range(20) for rank in range(4)}
    assert len(seeds) == 3 * 3 * 20 * 4
    assert all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(1, 2) != derive_seed(2, 1)
    torch.Generator().manual_seed(max(seeds))                        # usable as a seed


# --- read_worker_env ----------------------------------------------------------------------


def test_outside_torchrun_the_worker_is_a_world_of_one() -> None:
    env = read_worker_env({})
    assert env == WorkerEnv()
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (0, 0, 1, 1)
    assert (env.restart_count, env.max_restarts, env.run_id) == (0, 0, "local")
    assert (env.master_addr, env.master_port) == ("127.0.0.1", None)
    assert not env.under_torchrun and not env.use_agent_store
    assert env.is_rank0 and env.single_node
    empty = {k: "" for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    assert read_worker_env(empty) == WorkerEnv()


def test_every_torchrun_variable_is_read() -> None:
    env = read_worker_env({
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "job-7", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert env == WorkerEnv(rank=5, local_rank=1, world_size=8, local_world_size=4,
                            group_rank=1, restart_count=2, max_restarts=3, run_id="job-7",
                            master_addr="10.0.0.1", master_port=29500, use_agent_store=True,
                            under_torchrun=True)
    assert not env.is_rank0 and not env.single_node
    assert not read_worker_env({"TORCHELASTIC_USE_AGENT_STORE": "False"}).use_agent_store


def test_read_worker_env_defaults_to_the_process_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "3")
    env = read_worker_env()
    assert env.rank == 3 and env.world_size == 1 and not env.under_torchrun


@pytest.mark.parametrize("key", ["RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"])
def test_a_non_integer_variable_is_named(key: str) -> None:
    with pytest.raises(ValueError) as caught:
        read_worker_env({key: "zero"})
    assert str(caught.value) == f"environment variable {key}='zero' is not an integer"


def test_a_non_integer_master_port_is_named() -> None:
    with pytest.raises(ValueError, match="MASTER_PORT"):
        read_worker_env({"MASTER_PORT": "http"})


# --- EventLog and read_events -------------------------------------------------------------


def test_events_are_written_as_json_lines_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "events.jsonl"
    log = EventLog(path)
    log.emit_raw("start", run_id="r", world_size=2)
    log.emit_raw("step", step=1, loss=2.5)
    # Flushed as they happen: a reader sees them before close (or a crash).
    assert [e["event"] for e in read_events(path)] == ["start", "step"]
    log.close()
    events = list(read_events(path))
    assert [{k: v for k, v in e.items() if k != "time"} for e in events] == [
        {"event": "start", "run_id": "r", "world_size": 2},
        {"event": "step", "step": 1, "loss": 2.5}]
    assert all(isinstance(e["time"], float) for e in events)
    # A new log on the same file appends.
    again = EventLog(path)
    again.emit_raw("end", step=1)
    again.close()
    assert [e["event"] for e in read_events(path)] == ["start", "step", "end"]


def test_a_disabled_log_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "events.jsonl"
    log = EventLog(path, enabled=False)
    log.emit_raw("start", run_id="r")
    log.close()
    assert not path.exists() and not path.parent.exists()
    assert list(read_events(path)) == []


def test_a_torn_last_line_and_foreign_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    log.emit_raw("start", run_id="r")
    log.emit_raw("step", step=1, loss=1.0)
    log.close()
    with open(path, "a") as f:
        f.write('[1, 2]\n{"no_event": 1}\n{"time": 1.0, "event": "st')
    assert [e["event"] for e in read_events(path)] == ["start", "step"]


def test_the_event_after_a_torn_line_survives(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    log.emit_raw("step", step=1, loss=1.0)
    log.close()
    with open(path, "a") as f:
        f.write('{"time": 2.0, "event": "step", "st')     # a crash mid-line
    restarted = EventLog(path)
    restarted.emit_raw("start", run_id="r", restart=1)
    restarted.close()
    assert [e["event"] for e in read_events(path)] == ["step", "start"]


# --- summarize ----------------------------------------------------------------------------


def _step(step: int, loss: float) -> dict[str, Any]:
    return {"event": "step", "step": step, "loss": loss}


def _restart_run(run_id: str = "run-1") -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"event": "start", "run_id": run_id, "restart": 0, "world_size": 4,
         "total_steps": 40}]
    for step in range(1, 31):
        events.append(_step(step, 10.0 - step * 0.1))
        if step % 10 == 0:
            events.append({"event": "checkpoint_saved", "step": step})
    # Crash after step 30; checkpoint 30 turned out corrupt, so the restart resumes at 20.
    events += [{"event": "start", "run_id": run_id, "restart": 1, "world_size": 2,
                "total_steps": 40},
               {"event": "checkpoint_skipped", "step": 30},
               {"event": "checkpoint_loaded", "step": 20}]
    for step in range(21, 41):
        events.append(_step(step, 5.0 - step * 0.01))
        if step % 10 == 0:
            events.append({"event": "checkpoint_saved", "step": step})
    events.append({"event": "end", "step": 40, "run_id": run_id})
    return events


def test_summary_of_a_run_with_a_restart() -> None:
    summary = summarize(_restart_run())
    assert summary.run_id == "run-1"
    assert summary.steps_done == 40
    assert summary.total_steps == 40
    assert summary.restarts == 1
    assert summary.steps_redone == 10
    assert summary.checkpoints_written == 5
    assert summary.checkpoints_skipped == 1
    # The final loss is the mean over the last LOSS_WINDOW (10) steps: 31..40 here.
    assert summary.final_loss == pytest.approx(sum(5.0 - s * 0.01 for s in range(31, 41)) / 10)
    assert summary.loss_window == 10
    assert summary.first_loss == pytest.approx(9.9)
    assert summary.world_sizes == (4, 2)
    lines = summary.lines()
    assert lines[0] == "run run-1: 40/40 steps"
    assert "4.6450 (mean of the last 10 steps; first step 9.9000)" in lines[1]
    assert "5 written, 1 skipped as corrupt" in lines[2]
    assert "1 (10 steps redone)" in lines[3]
    assert lines[4].endswith("4 -> 2")


def test_the_final_loss_counts_each_step_once_with_its_newest_loss() -> None:
    events = ([{"event": "start", "run_id": "r", "restart": 0, "world_size": 2,
                "total_steps": 6}]
              + [_step(s, 100.0) for s in range(1, 6)]
              + [{"event": "start", "run_id": "r", "restart": 1, "world_size": 2,
                  "total_steps": 6}]
              + [_step(s, float(s)) for s in range(3, 7)])
    summary = summarize(events)
    # Steps 1-2 from the first incarnation, 3-6 as redone after the restart.
    assert summary.final_loss == pytest.approx((100.0 + 100.0 + 3 + 4 + 5 + 6) / 6)
    assert summary.loss_window == 6
    assert (summary.steps_done, summary.steps_redone, summary.restarts) == (6, 3, 1)
    assert summary.first_loss == 100.0


def _older_run() -> list[dict[str, Any]]:
    return [{"event": "start", "run_id": "old", "restart": 0, "world_size": 1,
             "total_steps": 5}] + [_step(s, 1.0) for s in range(1, 6)] + [
            {"event": "checkpoint_saved", "step": 5}, {"event": "end", "step": 5}]


def _relaunch() -> list[dict[str, Any]]:
    """A second launch of run-1 after the first finished (restart count back at 0)."""
    return [{"event": "start", "run_id": "run-1", "restart": 0, "world_size": 3,
             "total_steps": 50}] + [_step(s, 0.5) for s in range(41, 51)]


def test_summary_takes_the_newest_launch() -> None:
    events = _older_run() + _restart_run() + _relaunch()
    for run_id in (None, "run-1"):
        newest = summarize(events, run_id=run_id)
        assert (newest.run_id, newest.steps_done, newest.total_steps) == ("run-1", 50, 50)
        assert (newest.restarts, newest.steps_redone, newest.world_sizes) == (0, 0, (3,))
        assert newest.checkpoints_written == 0
        assert newest.final_loss == pytest.approx(0.5)
        assert newest.first_loss is None                  # it did not start at step 1
    nothing = summarize(_older_run(), run_id="x")
    assert (nothing.run_id, nothing.steps_done, nothing.final_loss) == ("x", 0, None)
    assert (nothing.restarts, nothing.world_sizes) == (0, ())


def test_summary_of_a_named_run_that_is_not_the_newest() -> None:
    named = summarize(_older_run() + _restart_run(), run_id="old")
    assert (named.run_id, named.steps_done, named.total_steps) == ("old", 5, 5)
    assert (named.final_loss, named.checkpoints_written) == (pytest.approx(1.0), 1)
    assert (named.restarts, named.steps_redone, named.world_sizes) == (0, 0, (1,))


# --- snapshot_state -----------------------------------------------------------------------


def _storages(value: Any) -> list[int]:
    if isinstance(value, torch.Tensor):
        return [value.untyped_storage().data_ptr()]
    if isinstance(value, dict):
        return [p for v in value.values() for p in _storages(v)]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _storages(v)]
    return []


def test_snapshot_state_copies_everything() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    trainer = TrainerState(step=5, samples_seen=80)
    objects = {"model": model, "optimizer": optimizer, "trainer": trainer}

    snapshot = snapshot_state(objects)
    expected = {name: json.loads(json.dumps(_plain(obj.state_dict())))
                for name, obj in objects.items()}
    assert {name: json.loads(json.dumps(_plain(v))) for name, v in snapshot.items()} == expected

    live = set(_storages([model.state_dict(), optimizer.state_dict()]))
    copied = _storages(snapshot)
    # weight, bias, and Adam's exp_avg, exp_avg_sq and step of each
    assert len(copied) == len(set(copied)) == len(live) == 8
    assert not live & set(copied)                 # no storage shared with training
    assert all(not t.requires_grad and t.device.type == "cpu"
               for t in _tensors(snapshot))

    with torch.no_grad():
        model.weight.add_(1.0)
    optimizer.state[model.weight]["exp_avg"].add_(1.0)
    optimizer.param_groups[0]["lr"] = 9.0
    trainer.step = 99
    assert {name: json.loads(json.dumps(_plain(v))) for name, v in snapshot.items()} == expected


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _plain(value: Any) -> Any:
    """A JSON-comparable rendering of a state dict (tensors as exact value lists)."""
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype), "values": value.double().reshape(-1).tolist()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# --- CheckpointManager.due ----------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(manager_module, "time", types.SimpleNamespace(
        monotonic=fake.monotonic, time=time.time, thread_time=time.thread_time))
    return fake


def _manager(tmp_path: Path, every_steps: int | None, every_seconds: float | None
             ) -> CheckpointManager:
    group = Group(0, 1, "gloo", torch.device("cpu"))
    policy = CheckpointConfig(every_steps=every_steps, every_seconds=every_seconds, keep=2)
    return CheckpointManager(CheckpointStore(tmp_path / "checkpoints"), group, policy,
                             EventLog(tmp_path / "e", enabled=False))


def _save(manager: CheckpointManager, step: int) -> None:
    manager.save(step, {"model": torch.nn.Linear(2, 2)}, wait=True)
    assert manager.last_saved_step == step


def test_due_every_n_steps(tmp_path: Path, clock: FakeClock) -> None:
    manager = _manager(tmp_path, every_steps=5, every_seconds=None)
    assert [s for s in range(1, 21) if manager.due(s)] == [5, 10, 15, 20]
    clock.now += 1e6                                   # time alone never triggers it
    assert not manager.due(7)
    _save(manager, 10)
    assert not manager.due(10)                         # never twice for one step
    assert manager.due(15)


def test_due_every_n_seconds(tmp_path: Path, clock: FakeClock) -> None:
    manager = _manager(tmp_path, every_steps=None, every_seconds=30.0)
    assert not manager.due(1)
    clock.now += 29.5
    assert not manager.due(2)
    clock.now += 0.5
    assert manager.due(3)
    _save(manager, 3)
    assert not manager.due(3)                          # not again for the same step
    assert not manager.due(4)                          # the timer restarted at the save
    clock.now += 30.0
    assert manager.due(9)
    assert not manager.due(3)


def test_both_policies_and_neither(tmp_path: Path, clock: FakeClock) -> None:
    both = _manager(tmp_path / "a", every_steps=10, every_seconds=60.0)
    assert both.due(10) and not both.due(11)
    clock.now += 60.0
    assert both.due(11)
    never = _manager(tmp_path / "b", every_steps=None, every_seconds=None)
    clock.now += 1e6
    assert not any(never.due(s) for s in range(1, 50))


def test_a_second_save_of_the_same_step_does_nothing(tmp_path: Path, clock: FakeClock) -> None:
    manager = _manager(tmp_path, every_steps=5, every_seconds=None)
    _save(manager, 5)
    manager.save(5, {"model": torch.nn.Linear(2, 2)})
    manager.finish()
    assert manager.saved == 1
    assert [i.step for i in manager.store.list()] == [5]


# --- load_task ----------------------------------------------------------------------------


TASK_MODULE = '''
from elastic_train.errors import ConfigError


class Good:
    def __init__(self, ctx):
        self.ctx = ctx

    def build_model(self): ...
    def build_dataset(self): ...
    def build_optimizer(self, model, lr): ...
    def loss(self, model, batch): ...


class Half:
    def build_model(self): ...
    loss = 3


def good(ctx):
    return Good(ctx)


def half(ctx):
    return Half()


def boom(ctx):
    raise RuntimeError("boom")


def picky(ctx):
    raise ConfigError("unknown task option 'x'")


NOT_CALLABLE = 3
'''


@pytest.fixture
def task_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"et_unit_task_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _task_error(spec: str) -> TaskError:
    with pytest.raises(TaskError) as caught:
        load_task(spec, TaskContext())
    assert "\n" not in str(caught.value)
    return caught.value


def test_load_task_builds_a_task_with_its_context(task_module: str) -> None:
    ctx = TaskContext(options={"a": "1"}, seed=4)
    task = load_task(f"{task_module}:good", ctx)
    assert type(task).__name__ == "Good" and task.ctx is ctx


def test_built_in_task_names_resolve() -> None:
    from elastic_train.tasks import gpt

    assert resolve_factory("gpt") is gpt.make_task


def test_an_unknown_module(task_module: str) -> None:
    assert str(_task_error("no_such_module_zz:make")) == (
        "--task 'no_such_module_zz:make' cannot be imported (No module named "
        "'no_such_module_zz'): check that 'no_such_module_zz' is installed or on PYTHONPATH")


@pytest.mark.parametrize("spec", ["gtp", "module_only", "mod:", ":factory"])
def test_a_spec_that_is_neither_built_in_nor_module_factory(spec: str) -> None:
    assert str(_task_error(spec)) == (f"--task {spec!r} is neither a built-in task (gpt) nor "
                                      "of the form package.module:factory")


@pytest.mark.parametrize("attr", ["absent", "NOT_CALLABLE"])
def test_a_missing_or_uncallable_factory(task_module: str, attr: str) -> None:
    assert str(_task_error(f"{task_module}:{attr}")) == (
        f"--task '{task_module}:{attr}': module '{task_module}' has no callable '{attr}'")


def test_a_factory_that_raises(task_module: str) -> None:
    error = _task_error(f"{task_module}:boom")
    assert str(error) == f"--task '{task_module}:boom': its factory failed (RuntimeError: boom)"
    assert isinstance(error.__cause__, RuntimeError)


def test_a_factorys_config_error_passes_through(task_module: str) -> None:
    with pytest.raises(ConfigError, match=r"^unknown task option 'x'$"):
        load_task(f"{task_module}:picky", TaskContext())


def test_an_object_lacking_the_protocol_methods(task_module: str) -> None:
    assert str(_task_error(f"{task_module}:half")) == (
        f"--task '{task_module}:half' returned Half, which lacks build_dataset, "
        "build_optimizer, loss of the Task protocol (see elastic_train.Task)")


# --- prepare_run_dir ----------------------------------------------------------------------


def test_prepare_run_dir_creates_checkpoints_and_leaves_no_probe(tmp_path: Path) -> None:
    run_dir = tmp_path / "a" / "b"
    assert prepare_run_dir(run_dir) == run_dir
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]
    assert prepare_run_dir(run_dir) == run_dir                  # idempotent


def test_prepare_run_dir_under_a_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    run_dir = blocker / "run"
    with pytest.raises(ConfigError) as caught:
        prepare_run_dir(run_dir)
    assert str(caught.value) == (
        f"run directory {run_dir} is not writable (Not a directory): choose another "
        "--run-dir or fix its permissions")
    assert blocker.read_text() == "not a directory"


def test_an_option_an_older_torchrun_lacks_is_dropped_and_said(
        capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from elastic_train.agent.launch import options_torchrun_knows

    old = argparse.ArgumentParser()  # torch 2.11's torchrun: no --shutdown-timeout
    old.add_argument("--nnodes")
    cmd = ["--nnodes=1", "--shutdown-timeout=40", "-m", "elastic_train.train", "--steps", "5"]
    assert options_torchrun_knows(cmd, old) == [
        "--nnodes=1", "-m", "elastic_train.train", "--steps", "5"]
    assert "torchrun has no --shutdown-timeout: the agent waits torch's default, 30 s" in \
        capsys.readouterr().err
    new = argparse.ArgumentParser()
    new.add_argument("--nnodes")
    new.add_argument("--shutdown-timeout")
    assert options_torchrun_knows(cmd, new) == cmd
    assert capsys.readouterr().err == ""


def test_no_backend_thread_holds_a_callback_of_ours_once_the_group_is_destroyed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exit-time abort ('terminate called without an active exception') came from a
    gloo thread releasing our done-callback while the interpreter finalized: every
    collective's callback must be released before the group goes."""
    import torch.distributed as dist

    from elastic_train.worker import aborts, distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    monkeypatch.setattr(aborts, "_abandoned", [])  # other tests of this process did
    held = []
    hold = aborts._hold_callback
    aborts._hold_callback = lambda callback: (held.append(1), hold(callback))
    try:
        for _ in range(100):  # gloo runs each one on its worker thread, as in a real world
            aborts.wait(dist.all_reduce(torch.ones(3), async_op=True))
        assert len(held) == 100  # every wait went through a callback a gloo thread ran
        assert aborts.settle_callbacks(5.0)
        assert aborts._callbacks_pending == 0
    finally:
        aborts._hold_callback = hold
        distributed.destroy_group()
    assert not dist.is_initialized()


def test_the_group_is_destroyed_only_once_no_work_holds_a_tensor_of_our_collectives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same abort at exit came from a gloo thread freeing a work that held our vote's
    tensor (a barrier kept it until the barrier's work was freed): that frees the tensor's
    Python object, under the GIL. Each tensor given to a collective is kept until no work
    holds it, then freed by this thread; ``settle_callbacks`` waits for that."""
    import torch.distributed as dist

    from elastic_train.worker import aborts, distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    monkeypatch.setattr(aborts, "_abandoned", [])  # other tests of this process did
    try:
        assert aborts.settle_callbacks(5.0)
        tensor = torch.ones(3)
        work = dist.all_reduce(tensor, async_op=True)  # held here, as gloo's thread may
        aborts.wait(work, tensor)
        del tensor
        assert not aborts.settle_callbacks(0.05)
        assert len(aborts._handed) == 1  # kept: its work still holds it
        del work
        assert aborts.settle_callbacks(5.0)
        assert not aborts._handed and aborts._callbacks_pending == 0
        for _ in range(100):  # each kept only until gloo's thread let go of it
            values = torch.ones(2)
            aborts.wait(dist.all_reduce(values, async_op=True), values)
        del values
        assert aborts.settle_callbacks(5.0)
        assert not aborts._handed
    finally:
        distributed.destroy_group()
    assert not dist.is_initialized()


@pytest.mark.parametrize(("argv", "split"), [
    (["--nproc-per-node", "2", "train.py", "runs/x", "--lr", "1"],
     (["--nproc-per-node", "2"], ["train.py", "runs/x", "--lr", "1"])),
    (["--nnodes=1:2", "--tee", "3", "--worker-start", "subprocess", "t.py"],
     (["--nnodes=1:2", "--tee", "3", "--worker-start", "subprocess"], ["t.py"])),
    (["train.py"], ([], ["train.py"])),
    (["--nproc-per-node", "2", "--task", "gpt", "--steps", "5"], None),
    (["--steps", "5", "x.py"], None),
    (["--help"], None),
])
def test_elastic_train_run_tells_a_script_from_the_built_in_jobs_options(
        argv: list[str], split: tuple[list[str], list[str]] | None) -> None:
    from elastic_train.agent.launch import launcher_parser, script_command

    assert script_command(argv, launcher_parser()) == split


def test_elastic_train_run_of_a_missing_script_says_so(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    from elastic_train.agent.launch import main

    assert main([str(tmp_path / "nope.py"), "arg"]) == 2
    assert capsys.readouterr().err == (
        f"elastic-train: error: no training script at {tmp_path / 'nope.py'}: give the path "
        "of a Python file (or job options, e.g. --task, for the built-in trainer)\n")
