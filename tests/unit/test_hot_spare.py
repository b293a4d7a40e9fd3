"""The hot spare's side of its protocol, against a real TCPStore (the agent's store)."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_train.live import spare as hot_spare
from elastic_train.live.spare import SPARE, assign, take_place, wait_for_place


@pytest.fixture
def agent_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def _address(store: dist.TCPStore) -> str:
    return f"127.0.0.1:{store.port}"


def test_a_spare_waits_for_its_place_and_takes_that_environment(
        agent_store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPARE, "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", "/spare/error.json")
    got: list[dict[str, str] | None] = []
    waiter = threading.Thread(target=lambda: got.append(wait_for_place(_address(agent_store))))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # no place yet: it waits
    assign(agent_store, os.getpid(), {"RANK": "1", "TORCHELASTIC_ERROR_FILE": "/w1/error.json"})
    waiter.join(10)
    assert got == [{"RANK": "1", "TORCHELASTIC_ERROR_FILE": "/w1/error.json"}]
    take_place(got[0] or {})
    assert os.environ["RANK"] == "1" and SPARE not in os.environ
    assert os.environ["TORCHELASTIC_ERROR_FILE"] == "/spare/error.json"  # torch reads its own


def test_a_dismissed_spare_and_one_whose_agent_is_gone_have_no_place(
        agent_store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    assign(agent_store, os.getpid(), {})
    assert wait_for_place(_address(agent_store)) is None

    monkeypatch.setattr(hot_spare, "WAIT_SECONDS", 0.2)  # a wait times out, then the check
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = _address(store)
    got: list[dict[str, str] | None] = []
    waiter = threading.Thread(target=lambda: got.append(wait_for_place(address)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # it outlives its timed-out waits while the agent is there
    del store  # the agent ends: its store closes
    waiter.join(10)
    assert not waiter.is_alive() and got == [None]


def test_the_delay_before_a_spare_comes_from_the_environment() -> None:
    assert hot_spare.spare_delay({}) == 1.0
    assert hot_spare.spare_delay({hot_spare.DELAY: "0"}) == 0.0
    assert hot_spare.spare_delay({hot_spare.DELAY: "soon"}) == 1.0
