"""ElasticSession's stop on SIGTERM, in a world of one in this process (a real signal)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

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
