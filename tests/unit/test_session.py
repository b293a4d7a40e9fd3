"""ElasticSession in a world of one in this process: its stop on SIGTERM (a real signal),
and a resume at the end of an epoch."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_train.env import WorkerEnv
from elastic_train.errors import ConfigError
from elastic_train.events import EVENTS_FILE, read_events
from elastic_train.session import ElasticSession


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
