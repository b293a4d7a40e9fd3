"""Asynchronous persist: training waits only for the snapshot; failures are reported."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.checkpoint.manager import CheckpointManager
from elastic_train.checkpoint.snapshot import (
    PendingCopies,
    SnapshotBuffers,
    changed_only_by_step,
    split_deferred,
)
from elastic_train.checkpoint.storage import CheckpointStore, model_digest
from elastic_train.config import CheckpointConfig
from elastic_train.errors import CheckpointError
from elastic_train.events.log import EventLog, read_events
from elastic_train.worker.distributed import Group

GROUP = Group(0, 1, "gloo", torch.device("cpu"))


class GatedStore(CheckpointStore):
    """A real store whose writes wait for a gate, or fail like a full disk."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_with: OSError | None = None

    def write(self, step: int, payload: Any, meta: Any, **kw: Any):  # type: ignore[override]
        self.entered.set()
        assert self.gate.wait(timeout=30), "test gate never opened"
        if self.fail_with is not None:
            raise self.fail_with
        return super().write(step, payload, meta, **kw)


def make(tmp_path: Path) -> tuple[CheckpointManager, GatedStore, Path]:
    store = GatedStore(tmp_path / "checkpoints")
    events_path = tmp_path / "events.jsonl"
    manager = CheckpointManager(store, GROUP, CheckpointConfig(every_steps=1, keep=5),
                                EventLog(events_path))
    return manager, store, events_path


def events(path: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(path) if e["event"] == kind]


def test_save_returns_before_the_persist_and_the_snapshot_is_isolated(tmp_path: Path) -> None:
    manager, store, events_path = make(tmp_path)
    model = torch.nn.Linear(4, 4)
    before = model_digest(model.state_dict())
    store.gate.clear()
    manager.save(1, {"model": model})
    assert store.entered.wait(10)
    assert manager._persister.busy                      # persisting in the background
    with torch.no_grad():
        model.weight.add_(1.0)                          # training goes on meanwhile
    store.gate.set()
    manager.finish()
    (info,) = store.list()
    assert info.model_digest == before                  # what was saved is the snapshot
    assert store.verify(info).valid
    (saved,) = events(events_path, "checkpoint_saved")
    assert saved["step"] == 1 and saved["snapshot_seconds"] >= 0


def test_a_snapshot_waits_only_while_the_previous_persist_runs(tmp_path: Path) -> None:
    manager, store, events_path = make(tmp_path)
    model = torch.nn.Linear(4, 4)
    store.gate.clear()
    manager.save(1, {"model": model})
    assert store.entered.wait(10)
    threading.Timer(0.2, store.gate.set).start()
    manager.save(2, {"model": model})                   # must wait for step 1's persist
    manager.finish()
    (waited,) = events(events_path, "checkpoint_waited")
    assert waited["step"] == 1 and waited["seconds"] >= 0.1
    assert [i.step for i in store.list()] == [2, 1]
    manager.save(3, {"model": model})                   # nothing in flight: no wait
    manager.finish()
    assert len(events(events_path, "checkpoint_waited")) == 1


def test_waits_are_said_once_and_counted_at_the_end(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    class StepGatedStore(CheckpointStore):
        """Each step's write waits for its own gate."""

        gates = {step: threading.Event() for step in (1, 2, 3, 4)}

        def write(self, step: int, payload: Any, meta: Any, **kw: Any):  # type: ignore[override]
            assert self.gates[step].wait(timeout=30), "test gate never opened"
            return super().write(step, payload, meta, **kw)

    store = StepGatedStore(tmp_path / "checkpoints")
    events_path = tmp_path / "events.jsonl"
    manager = CheckpointManager(store, GROUP, CheckpointConfig(every_steps=1, keep=5),
                                EventLog(events_path))
    model = torch.nn.Linear(4, 4)
    caplog.set_level("WARNING", logger="elastic_train.checkpoint.manager")
    manager.save(1, {"model": model})
    for step in (2, 3, 4):
        threading.Timer(0.05, store.gates[step - 1].set).start()
        manager.save(step, {"model": model})           # waits for the previous persist
    store.gates[4].set()
    manager.finish()
    manager.finish()                                    # shutdown paths may call it twice
    assert len(events(events_path, "checkpoint_waited")) == 3   # the metrics see each one
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("checkpoint save waited ")
    assert lines[0].endswith("s for the previous persist (step 1) to finish: checkpoints are "
                             "due faster than the disk writes them (said once; the run's "
                             "count comes at its end)")
    assert re.fullmatch(r"3 checkpoint saves waited for the previous persist \(\d+\.\d{3}s in "
                        r"all\): checkpoint less often \(checkpoint_every, --checkpoint-every\) "
                        r"or to a faster disk", lines[1]), lines[1]


def test_a_failed_background_write_is_reported_and_keeps_the_last_good(tmp_path: Path) -> None:
    manager, store, events_path = make(tmp_path)
    model = torch.nn.Linear(4, 4)
    manager.save(1, {"model": model}, wait=True)
    good = store.list()[0]
    store.fail_with = OSError(28, "No space left on device")
    manager.save(2, {"model": model})                   # returns: training is not stopped
    manager.finish()
    assert manager.failures == 1
    assert manager.last_saved_step == 1
    (failed,) = events(events_path, "checkpoint_failed")
    assert failed["step"] == 2 and "No space left" in failed["error"]
    assert [i.step for i in store.list()] == [1]
    assert store.verify(good).valid
    assert not store.leftovers()
    # The final checkpoint is persisted in the foreground: its failure stops the run.
    with pytest.raises(CheckpointError, match=r"could not write checkpoint 3 .*No space left "
                       r"on device.*the previous checkpoints are intact"):
        manager.save(3, {"model": model}, wait=True)
    store.fail_with = None
    manager.save(3, {"model": model}, wait=True)        # and a retry succeeds
    assert [i.step for i in store.list()] == [3, 1]


def test_snapshot_buffers_are_reused() -> None:
    buffers = SnapshotBuffers()
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    first = buffers.copy({"model": model, "optimizer": optimizer})
    allocated = buffers.bytes_allocated
    second = buffers.copy({"model": model, "optimizer": optimizer})
    assert buffers.bytes_allocated == allocated > 0
    assert second["model"]["weight"].data_ptr() == first["model"]["weight"].data_ptr()
    assert second["model"]["weight"].data_ptr() != model.weight.data_ptr()
    assert torch.equal(second["optimizer"]["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_failed_periodic_write_is_reported_at_once_under_either_mode(
        tmp_path: Path, asynchronous: bool, caplog: pytest.LogCaptureFixture) -> None:
    store = GatedStore(tmp_path / "checkpoints")
    policy = CheckpointConfig(every_steps=1, keep=5, asynchronous=asynchronous,
                              on_save_failure="stop")
    manager = CheckpointManager(store, GROUP, policy, EventLog(tmp_path / "events.jsonl"))
    model = torch.nn.Linear(4, 4)
    manager.save(1, {"model": model})
    manager.finish()
    store.fail_with = OSError(13, "Permission denied")
    manager.save(2, {"model": model})        # a periodic write never raises: the policy acts
    manager.finish()
    failed = manager.failed
    assert failed is not None and (failed.step, failed.reason) == (2, "Permission denied")
    assert manager.last_saved_step == 1 and manager.failures == 1
    (event,) = events(tmp_path / "events.jsonl", "checkpoint_failed")
    assert (event["step"], event["policy"]) == (2, "stop")
    assert (f"checkpoint 2 was not written: could not write checkpoint 2 under {store.root} "
            "(Permission denied): free space or fix permissions; the previous checkpoints are "
            "intact; every rank stops at the next step (--on-save-failure stop)") in caplog.text
    assert [i.step for i in store.list()] == [1]


# --- snapshots that overlap the next step ---------------------------------------------------


def _trained(width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    model(torch.randn(4, width)).sum().backward()  # gradients ready for the next step
    return model, optimizer


def test_changed_only_by_step_names_parameters_and_optimizer_state() -> None:
    model, optimizer = _trained()
    pointers = changed_only_by_step(optimizer)
    expected = {p.data_ptr() for p in model.parameters()}
    for state in optimizer.state.values():
        expected |= {state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
                     state["step"].data_ptr()}
    assert pointers == expected and len(pointers) == 4 * 4


def test_host_step_counts_do_not_stop_accelerator_state_from_overlapping() -> None:
    """AdamW keeps ``step`` on the CPU while its moments live on the GPU: the counts are
    copied at once and the device tensors still overlap (on the H100 they had made every
    save copy synchronously). ``meta`` tensors stand in for an accelerator."""
    def pair(device: str) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(3, device=device), torch.empty(3)

    moment, weight, step = pair("meta"), pair("meta"), pair("cpu")
    assert split_deferred([moment, step, weight]) == ([step], [moment, weight])
    assert split_deferred([step, step]) == ([], [step, step])  # CPU training: a thread
    assert split_deferred([]) == ([], [])


@pytest.fixture
def copy_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Overlapped copies start only once the returned event is set (opened at teardown)."""
    gate = threading.Event()
    copy = PendingCopies._copy_on_host

    def gated_copy(self: PendingCopies, pairs: Any) -> None:
        assert gate.wait(timeout=30), "test gate never opened"
        copy(self, pairs)

    monkeypatch.setattr(PendingCopies, "_copy_on_host", gated_copy)
    yield gate
    gate.set()


def test_the_next_optimizer_step_waits_for_an_overlapped_copy(
        tmp_path: Path, copy_gate: threading.Event) -> None:
    manager, store, events_path = make(tmp_path)
    model, optimizer = _trained()
    before = model_digest(model.state_dict())
    moment = optimizer.state_dict()["state"][0]["exp_avg"].clone()

    manager.save(1, {"model": model, "optimizer": optimizer}, overlap_with=optimizer)
    stepper = threading.Thread(target=optimizer.step)
    stepper.start()                                  # the next step: it must wait
    stepper.join(timeout=0.5)
    assert stepper.is_alive(), "optimizer.step() ran while the snapshot was being copied"
    assert model_digest(model.state_dict()) == before
    copy_gate.set()
    stepper.join(timeout=30)
    assert not stepper.is_alive()
    assert model_digest(model.state_dict()) != before    # the step did run, afterwards
    manager.finish()

    (info,) = store.list()
    assert info.model_digest == before                   # the state of step 1, not 2
    saved = store.load(info, map_location="cpu")
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], moment)
    (event,) = events(events_path, "checkpoint_saved")
    assert event["copy_wait_seconds"] >= 0.4 and event["copy_seconds"] > 0
    assert event["persist_cpu_seconds"] >= 0
    optimizer.step()                                     # nothing in flight: no wait


def test_an_overlapped_snapshot_copies_forward_changed_tensors_at_once(
        tmp_path: Path, copy_gate: threading.Event) -> None:
    manager, store, _ = make(tmp_path)
    model = torch.nn.BatchNorm1d(8)                      # running stats change in forward
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(16, 8))
    stats = model.running_mean.clone()
    manager.save(1, {"model": model}, overlap_with=optimizer)
    assert manager._copies_in_flight is not None         # weight and bias wait at the gate
    model(torch.randn(16, 8) + 5.0)                      # the next forward, meanwhile
    copy_gate.set()
    manager.finish()
    (info,) = store.list()
    saved = store.load(info, map_location="cpu")
    assert torch.equal(saved["model"]["running_mean"], stats)


def test_without_background_writes_a_save_does_not_overlap(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    manager = CheckpointManager(store, GROUP, CheckpointConfig(every_steps=1, keep=5,
                                                               asynchronous=False),
                                EventLog(tmp_path / "events.jsonl"))
    model, optimizer = _trained()
    manager.save(1, {"model": model, "optimizer": optimizer}, overlap_with=optimizer)
    assert manager._copies_in_flight is None
    (event,) = [e for e in read_events(tmp_path / "events.jsonl")
                if e["event"] == "checkpoint_saved"]
    assert "copy_wait_seconds" not in event
