"""Unit tests of the agent's side of the environment (agent/environment.py): torchrun's ``PET_*``
defaults, the defaults the launcher sets, and values handed to the workers it starts next."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from elastic_train.agent import environment as agent_env
from elastic_train.live.environment import (
    RENDEZVOUS_SECONDS,
    WORKER_ENV_FILE,
    set_for_workers,
    set_rendezvous_seconds,
)
from elastic_train.worker.env import read_worker_env


def test_option_defaults_come_from_pet_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NNODES", "2:4")
    monkeypatch.setenv("PET_WORKER_START", "subprocess")  # not one of torchrun's options
    monkeypatch.delenv("PET_RDZV_ID", raising=False)
    assert agent_env.option_default("nnodes", "1") == "2:4"
    assert agent_env.option_default("rdzv_id", "") == ""
    assert agent_env.option_default("worker_start", "forkserver") == "forkserver"


@pytest.mark.parametrize(("nproc", "omp"), [("1", None), ("2", "1"), ("auto", None)])
def test_launcher_environment_defaults(nproc: str, omp: str | None) -> None:
    defaults = agent_env.launcher_environment_defaults(nproc)
    assert defaults["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert defaults.get("OMP_NUM_THREADS") == omp


def test_defaults_do_not_override_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    agent_env.apply_environment_defaults(agent_env.launcher_environment_defaults("2"))
    assert os.environ["OMP_NUM_THREADS"] == "4"
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_values_reach_forked_workers_through_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_ENV_FILE, raising=False)
    monkeypatch.setenv(RENDEZVOUS_SECONDS, "stale")
    with agent_env.worker_env_file() as path:
        assert os.environ[WORKER_ENV_FILE] == path
        forked = {WORKER_ENV_FILE: path}  # a worker's environment, fixed before the value
        set_rendezvous_seconds(1.23456)
        assert os.environ[RENDEZVOUS_SECONDS] == "1.235"
        assert json.loads(Path(path).read_text()) == {RENDEZVOUS_SECONDS: "1.235"}
        assert read_worker_env(forked).rendezvous_seconds == 1.235
    assert WORKER_ENV_FILE not in os.environ
    assert not Path(path).exists()
    set_for_workers(RENDEZVOUS_SECONDS, "2.000")  # no file: the environment only
    assert os.environ[RENDEZVOUS_SECONDS] == "2.000"
