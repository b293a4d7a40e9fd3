"""The live agent's options reach each agent through the factory torch's launcher calls
(agent/live_agent.py: ``live_agent_installed``), never as settings on the class."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.launcher import api

from elastic_train.agent.live_agent import LiveOptions, LiveRecoveryAgent, live_agent_installed


def test_the_launcher_builds_the_live_agent_with_the_job_s_options_then_torch_s_again() -> None:
    original = api.LocalElasticAgent
    with live_agent_installed("restart", listen_host="127.0.0.1", hot_spare=True,
                              peer_timeout=0, store_lost_seconds=9, min_nodes=3):
        factory = api.LocalElasticAgent
        assert factory.func is LiveRecoveryAgent  # type: ignore[attr-defined]
        assert factory.keywords == {"options": LiveOptions(  # type: ignore[attr-defined]
            "restart", "127.0.0.1", True, 0, 9, 3)}
    assert api.LocalElasticAgent is original


def test_no_option_lives_on_the_agent_class_and_options_are_frozen() -> None:
    for field in dataclasses.fields(LiveOptions):
        assert not hasattr(LiveRecoveryAgent, field.name), field.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        LiveOptions().min_nodes = 2  # type: ignore[misc]
