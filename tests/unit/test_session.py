"""ElasticSession in a world of one in this process: its stop on SIGTERM (a real signal),
a resume at the end of an epoch, step loops, batch sizes and the export of the weights."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_train.checkpoint.storage import CheckpointStore, model_digest
from elastic_train.errors import ConfigError
from elastic_train.events.log import read_events
from elastic_train.rundir import EVENTS_FILE
from elastic_train.worker.batching import global_batch
from elastic_train.worker.env import WorkerEnv
from elastic_train.worker.session import ElasticSession
from elastic_train.worker.step_gates import skip_failed_steps


def test_sigterm_stops_at_the_next_step_with_a_checkpoint(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = ElasticSession(tmp_path / "run", checkpoint_every=100, env=WorkerEnv())
    try:
        session.restore(model=model, optimizer=optimizer)
        assert session.step(0.5) is False
        os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets the flag
        assert session.step(0.4) is True
        assert session.stopped_at == 2
        assert list(session.epochs(3)) == []
        with pytest.raises(ConfigError, match=r"step\(\) after the stop at step 2: leave the "
                                              r"training loop when step\(\) returns True"):
            session.step(0.3)
    finally:
        session.close()  # also cancels the budget's watchdog, which would end this process
    assert signal.getsignal(signal.SIGTERM) is before
    events = list(read_events(tmp_path / "run" / EVENTS_FILE))
    saved = [(e["step"], e["reason"]) for e in events if e["event"] == "checkpoint_saved"]
    assert saved == [(2, "preemption")]  # and no final checkpoint after it
    (preempted,) = [e for e in events if e["event"] == "preempted"]
    assert (preempted["signal"], preempted["rank_signalled"]) == ("SIGTERM", True)
    assert "end" not in [e["event"] for e in events]


def test_without_a_budget_sigterm_is_left_to_python(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    session = ElasticSession(tmp_path / "run", preemption_budget=None, env=WorkerEnv())
    try:
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        session.close()


def test_a_bad_budget_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="preemption_budget 0 is invalid: it must be a "
                                          "positive number of seconds, or None"):
        ElasticSession(tmp_path / "run", preemption_budget=0, env=WorkerEnv())


def test_a_resume_at_the_end_of_an_epoch_starts_the_next_one(tmp_path: Path) -> None:
    """8 samples, 4 per step: a checkpoint at step 2 ends epoch 0 exactly."""
    dataset = TensorDataset(torch.arange(8.0).unsqueeze(1))

    entered: list[int] = []  # the epochs whose body ran (per-epoch code: eval, logging)

    def session_over(steps: int) -> list[tuple[int, list[float]]]:
        model = nn.Linear(1, 1)
        session = ElasticSession(tmp_path / "run", checkpoint_every=2, env=WorkerEnv())
        seen = []
        try:
            loader = session.dataloader(dataset, batch_size=4)
            session.restore(model=model)
            for epoch in session.epochs(3):
                entered.append(epoch)
                for (x,) in loader:
                    seen.append((epoch, sorted(x.flatten().tolist())))
                    session.step()
                    if session.step_count == steps:
                        return seen
        finally:
            session.close()
        return seen

    first = session_over(steps=2)
    assert [epoch for epoch, _ in first] == [0, 0]
    entered.clear()
    resumed = session_over(steps=6)
    assert entered == [1, 2]  # not an empty epoch 0 first
    assert [epoch for epoch, _ in resumed] == [1, 1, 2, 2]
    for epoch in (1, 2):  # each epoch whole: every sample once
        assert sorted(i for e, batch in resumed if e == epoch for i in batch) == \
            [float(i) for i in range(8)]


def run_steps(run_dir: Path, total: int, stop_after: int | None = None,
              checkpoint_every: int = 3) -> list[int]:
    """A step loop over ``session.steps(total)``; returns the steps it ran. With
    ``stop_after`` the process "dies" (no close: the newest checkpoint is what stays)."""
    model = nn.Linear(2, 1)
    session = ElasticSession(run_dir, checkpoint_every=checkpoint_every, env=WorkerEnv())
    ran = []
    try:
        session.restore(model=model)
        for step in session.steps(total):
            ran.append(step)
            session.step()
            if stop_after is not None and session.step_count == stop_after:
                session.checkpoints.finish()
                return ran
        session.close()
    finally:
        session._leave()
    return ran


def test_a_step_loop_resumes_where_the_checkpoint_left_off(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    assert run_steps(tmp_path / "run", 10, stop_after=7) == list(range(7))
    # The newest checkpoint is step 6: step 6 is redone, and the loop ends at 10, not 16.
    assert run_steps(tmp_path / "run", 10) == [6, 7, 8, 9]
    capsys.readouterr()
    assert run_steps(tmp_path / "run", 10) == []
    err = capsys.readouterr().err
    assert err == (f"elastic_train: {tmp_path / 'run'} is finished: its newest checkpoint is "
                   "at step 10 of 10; nothing to train (raise the total steps to train on, or "
                   "use a new run directory to start afresh)\n")
    assert run_steps(tmp_path / "run", 12) == [10, 11]   # more steps asked: trains on


def test_a_step_without_session_step_is_refused(tmp_path: Path) -> None:
    session = ElasticSession(tmp_path / "run", env=WorkerEnv())
    try:
        session.restore(model=nn.Linear(2, 1))
        with pytest.raises(ConfigError, match=r"^step 0 ended without session.step\(\): call "
                                              r"it once per step of a steps\(\) loop, after "
                                              r"optimizer.step\(\)$"):
            for _ in session.steps(5):
                pass
    finally:
        session._leave()


def test_a_step_loop_over_a_dataloader_crosses_epochs_and_resumes_mid_epoch(
        tmp_path: Path) -> None:
    """10 samples, 4 per step: two steps an epoch (2 left over); a checkpoint every 3 steps
    falls mid-epoch (epoch 1, step 3)."""
    dataset = TensorDataset(torch.arange(10.0).unsqueeze(1))

    def loop(total: int, die_after: int | None = None) -> list[tuple[int, int, list[float]]]:
        session = ElasticSession(tmp_path / "run", checkpoint_every=3, env=WorkerEnv())
        seen = []
        try:
            loader = session.dataloader(dataset, global_batch_size=4)
            session.restore(model=nn.Linear(1, 1))
            for step, (x,) in session.steps(total, loader):
                seen.append((step, session._sampler.epoch, sorted(x.flatten().tolist())))
                session.step()
                if session.step_count == die_after:
                    session.checkpoints.finish()
                    return seen
            session.close()
        finally:
            session._leave()
        return seen

    first = loop(total=6, die_after=5)
    assert [(s, e) for s, e, _ in first] == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2)]
    resumed = loop(total=6)
    assert [(s, e) for s, e, _ in resumed] == [(3, 1), (4, 2), (5, 2)]
    assert resumed[0][2] == first[3][2]                 # the same batch: step 3 is redone
    for epoch in (0, 1):                                # 8 distinct samples of each epoch
        used = [i for _, e, b in first[:3] + resumed if e == epoch for i in b]
        assert len(used) == len(set(used)) == 8


@pytest.mark.parametrize("loop_kind", ["steps", "epochs"])
def test_a_recovery_that_takes_the_sampler_back_an_epoch_trains_that_epoch_again(
        tmp_path: Path, loop_kind: str) -> None:
    """A live recovery through a checkpoint (a sharded loop that lost a rank's shards)
    loads the sampler's state of that checkpoint, which may be in the epoch before the one
    in flight: the loop goes on from there, the next epoch whole, none skipped. Here 8
    samples, 4 a step: the state at the end of epoch 0 is loaded in epoch 1's first step."""
    dataset = TensorDataset(torch.arange(8.0).unsqueeze(1))
    session = ElasticSession(tmp_path / "run", checkpoint_every=None, env=WorkerEnv())
    seen: list[tuple[int, list[float]]] = []
    try:
        loader = session.dataloader(dataset, global_batch_size=4)
        session.restore(model=nn.Linear(1, 1))
        sampler = session._sampler
        assert sampler is not None
        saved: dict | None = None

        def body(epoch: int, x: torch.Tensor) -> None:
            nonlocal saved
            seen.append((epoch, sorted(x.flatten().tolist())))
            session.step()
            if session.step_count == 2:                    # the end of epoch 0
                saved = sampler.state_dict()
            elif session.step_count == 3 and len(seen) == 3:   # in epoch 1, once
                assert saved is not None
                sampler.load_state_dict(saved)             # what the restore does
                session._counter.step = 2
                sampler.reshard(0, 1, 4)

        if loop_kind == "steps":
            for _, (x,) in session.steps(6, loader):
                body(sampler.epoch, x)
        else:
            for epoch in session.epochs(3):
                for (x,) in loader:
                    body(epoch, x)
    finally:
        session._leave()
    epochs = [e for e, _ in seen]
    assert epochs == [0, 0, 1, 1, 1, 2, 2], epochs        # epoch 1 began again, whole
    assert seen[3][1] == seen[2][1]                         # its first batch, redone
    assert sorted(i for _, b in seen[3:5] for i in b) == [float(i) for i in range(8)]


def test_steps_refuses_a_loader_of_its_own(tmp_path: Path) -> None:
    session = ElasticSession(tmp_path / "run", env=WorkerEnv())
    try:
        session.restore(model=nn.Linear(1, 1))
        loader = torch.utils.data.DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2)
        with pytest.raises(ConfigError, match=r"^steps\(total, loader\): the loader must be "
                                              r"this session's dataloader\(...\), whose "
                                              "position the checkpoints keep$"):
            next(session.steps(3, loader))
    finally:
        session._leave()


@pytest.mark.parametrize(("per_rank", "global_", "message"), [
    (None, None, "give batch_size (per rank) or global_batch_size (over all ranks), one of them"),
    (8, 16, "give batch_size (per rank) or global_batch_size (over all ranks), one of them"),
    (0, None, "batch_size 0 is invalid: it must be a positive number of samples"),
    (None, 3, "global_batch_size 3 is smaller than the world size 4: every rank needs at "
              "least one sample"),
])
def test_batch_size_is_per_rank_or_global_and_one_of_them(per_rank: int | None,
                                                          global_: int | None,
                                                          message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        global_batch(per_rank, global_, world_size=4)
    assert str(caught.value) == message


def test_batch_size_meanings() -> None:
    assert global_batch(8, None, world_size=4) == 32     # per rank: PyTorch's convention
    assert global_batch(None, 32, world_size=4) == 32    # global: the built-in job's meaning
    assert global_batch(None, 30, world_size=4) == 30    # shares of 8, 8, 7, 7


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_close_exports_the_final_weights(tmp_path: Path, suffix: str) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = ElasticSession(tmp_path / "run", checkpoint_every=100, env=WorkerEnv())
    session.restore(model=model, optimizer=optimizer)
    for _ in session.steps(3):
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
        session.step()
    out = tmp_path / "out" / f"model{suffix}"
    session.close(export=out)
    fresh = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    if suffix == ".safetensors":
        fresh.load_state_dict(safetensors.torch.load_file(out), strict=True)
    else:
        fresh.load_state_dict(torch.load(out, weights_only=True), strict=True)
    assert model_digest(fresh.state_dict()) == model_digest(model.state_dict())
    (final,) = CheckpointStore(tmp_path / "run" / "checkpoints").list()
    assert (final.step, final.model_digest) == (3, model_digest(model.state_dict()))


def test_close_refuses_an_unknown_export_suffix_before_anything(tmp_path: Path) -> None:
    session = ElasticSession(tmp_path / "run", env=WorkerEnv())
    session.restore(model=nn.Linear(1, 1))
    try:
        with pytest.raises(ConfigError) as caught:
            session.close(export=tmp_path / "model.h5")
        assert str(caught.value) == (f"cannot write model weights to {tmp_path / 'model.h5'}: "
                                     "it has suffix '.h5'; use one of .safetensors, .pt, "
                                     ".pth, .bin")
        assert CheckpointStore(tmp_path / "run" / "checkpoints").list() == []
    finally:
        session._leave()


def test_a_step_loop_over_a_dataset_smaller_than_the_batch_is_refused(tmp_path: Path) -> None:
    session = ElasticSession(tmp_path / "run", env=WorkerEnv())
    try:
        loader = session.dataloader(TensorDataset(torch.zeros(3, 1)), global_batch_size=4)
        session.restore(model=nn.Linear(1, 1))
        with pytest.raises(ConfigError) as caught:
            next(session.steps(5, loader))
        assert str(caught.value) == ("the step's batch of 4 samples exceeds the 3 samples of "
                                     "the dataset: use a smaller batch size or more data")
    finally:
        session._leave()


def test_the_package_exports_what_a_user_of_a_session_meets() -> None:
    import elastic_train

    met = {"ElasticSession", "NodeStoppedError", "CheckpointStopError", "ConfigError", "Task",
           "TaskContext"}
    assert met <= set(elastic_train.__all__)
    for name in elastic_train.__all__:
        assert getattr(elastic_train, name) is not None
    assert elastic_train.ElasticSession is ElasticSession


def test_a_bad_recovery_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^recovery 'inplace' is invalid: use one of live, "
                                          r"restart$"):
        ElasticSession(tmp_path / "run", recovery="inplace", env=WorkerEnv())


def test_wrap_gives_ddp_on_the_sessions_world_and_training_runs(tmp_path: Path) -> None:
    """Outside ``elastic-train run`` (no live recovery) ``wrap`` is plain DDP."""
    session = ElasticSession(tmp_path / "run", env=WorkerEnv())
    try:
        model = nn.Linear(2, 1)
        ddp = session.wrap(model)
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and ddp.module is model
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        session.restore(model=model, optimizer=optimizer)
        for _ in session.steps(2):
            loss = ddp(torch.ones(4, 2)).sum()
            loss.backward()
            optimizer.step()
            session.step(loss)
        assert session.step_count == 2
    finally:
        session._leave()


class _Layered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_sharded_wrap_is_the_model_sharded_in_place_once_per_session(
        tmp_path: Path) -> None:
    """``wrap(model, parallelism="fsdp")`` shards the loop's own object; a second sharded
    model is refused; a loop whose restore() names another model is told, in one line,
    why it cannot be recovered in place (under ``elastic-train run`` it then restarts)."""
    from torch.distributed.fsdp import FSDPModule

    session = ElasticSession(tmp_path / "run", env=WorkerEnv())
    try:
        model = _Layered()
        assert session.wrap(model, parallelism="fsdp") is model
        assert isinstance(model, FSDPModule)
        with pytest.raises(ConfigError, match=r"^wrap\(parallelism=\.\.\.\) was called twice: "
                                              r"a session shards one model"):
            session.wrap(_Layered(), parallelism="fsdp")
        assert session._not_live({"model": model}) is None
        assert session._not_live({"model": _Layered()}) == (
            "a hand-written loop's sharded model (wrap(parallelism=\"fsdp\" or \"hsdp\")) is "
            "not recovered in place here: restore(model=...) must be the model "
            "session.wrap(...) returned: this job restarts from its newest sharded "
            "checkpoint on a failure instead (ElasticSession(..., recovery=\"restart\") "
            "silences this line)")
    finally:
        session._leave()


def test_the_sampler_hands_out_the_step_to_redo_after_a_reshard() -> None:
    """A DataLoader without worker processes reads one batch at a time: after the world
    re-formed, the next batch is the step in flight again, cut for the new world."""
    from elastic_train.worker.sampler import ElasticBatchSampler, epoch_order

    sampler = ElasticBatchSampler(64, 8, rank=1, world_size=2, seed=3)
    it = iter(sampler)
    order = epoch_order(64, 3, 0).tolist()
    assert next(it) == order[4:8]
    sampler.advance()                       # step 1 done
    assert next(it) == order[12:16]         # step 2 in flight ...
    assert sampler.read_ahead == 1
    sampler.reshard(rank=0, world_size=1, batch_size=8)   # ... fails; world of 1
    assert next(it) == order[8:16]          # step 2 again, all of it
    assert sampler.read_ahead == 1 and sampler.reshards == 1


@pytest.mark.filterwarnings("error::UserWarning")  # no "optimizer.step() overridden" either
def test_a_failed_step_changes_no_optimizer_scheduler_or_scaler(tmp_path: Path) -> None:
    """The gates live recovery puts on what restore() registers (a failure is recorded
    here by hand; the real one, a lost peer, is tests/integration/test_session_live.py)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    session = ElasticSession(tmp_path / "run", env=WorkerEnv())
    try:
        for obj in (optimizer, scheduler, scaler):
            skip_failed_steps(obj, session._failures)

        def one_step() -> None:
            optimizer.zero_grad()
            scaler.scale(model(torch.ones(3, 4)).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

        one_step()  # applied: the scale grows (growth_interval 1), the LR decays
        assert scaler.get_scale() == 16.0 and scheduler.last_epoch == 1
        weights, lr = [p.clone() for p in model.parameters()], scheduler.get_last_lr()
        optimizer_state = optimizer.state_dict()["state"][0]["step"].item()

        session._failures.error = RuntimeError("the gradient all-reduce failed")
        assert session.step_failed
        one_step()  # not applied: nothing changes, and the scaler's records are cleared
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(),
                                                     strict=True))
        assert scaler.get_scale() == 16.0 and scaler.state_dict()["_growth_tracker"] == 0
        assert scheduler.last_epoch == 1 and scheduler.get_last_lr() == lr
        assert optimizer.state_dict()["state"][0]["step"].item() == optimizer_state
        # the gates stay out of what is checkpointed
        assert "step" not in scheduler.state_dict() and "update" not in scaler.state_dict()

        session._failures.take()
        assert not session.step_failed
        one_step()  # the redone step applies again
        assert scaler.get_scale() == 32.0 and scheduler.last_epoch == 2
        assert not torch.equal(weights[0], model.weight)
    finally:
        session.close()
