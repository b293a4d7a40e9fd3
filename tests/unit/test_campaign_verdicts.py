"""tests/chaos/campaign.py's verdict on a job whose agents end one after the other: the
campaign starts each node's agent again as it ends, so a job that died (c10d seed 403:
all three agents ended with DistStoreError within 1.2 s) never shows "no agent alive"; every
node's agent ending by itself within seconds is the whole job ending."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.chaos.campaign import JOB_DEATH_WINDOW, Agent, Campaign, Setup


def process(alive: bool) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c",
                             "import time; time.sleep(60)" if alive else "raise SystemExit(1)"])
    if not alive:
        proc.wait(10)
    return proc


def agent(host: str, alive: bool, ended_ago: float | None = None,
          last: str = "error: the end") -> Agent:
    node: Any = SimpleNamespace(proc=process(alive), output=lambda: last + "\n",
                                log_path=Path(f"{host}.log"))
    a = Agent(host, node, time.time() - 100)
    if ended_ago is not None:
        a.ended_at, a.code = time.time() - ended_ago, 1
    return a


@pytest.fixture
def campaign(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Campaign:
    run = Campaign(None, Setup(), tmp_path)  # type: ignore[arg-type]
    run.started: list[str] = []  # type: ignore[attr-defined]
    monkeypatch.setattr(run, "start_agent", run.started.append)  # type: ignore[attr-defined]
    return run


def lives(run: Campaign, *agents: Agent) -> None:
    for a in agents:
        run.lives.append(a)
        run.agents[a.host] = a


def teardown(run: Campaign) -> None:
    for a in run.lives:
        if a.node.proc.poll() is None:
            a.node.proc.kill()
            a.node.proc.wait(10)


def test_every_node_s_agent_ending_within_the_window_is_the_whole_job_ending(
        campaign: Campaign) -> None:
    first = agent("node-a", False, ended_ago=2.0)  # ended, and started again since
    lives(campaign, first, agent("node-a", True), agent("node-b", False), agent("node-c", False))
    try:
        campaign._check_agents(fault=11)
    finally:
        teardown(campaign)
    assert campaign.job_died
    assert any(v.what.startswith("the whole job ended by itself (every node's agent within")
               for v in campaign.violations), campaign.violations
    assert campaign.started == []  # type: ignore[attr-defined]


def test_nodes_ending_apart_are_nodes_ending_not_the_job(campaign: Campaign) -> None:
    first = agent("node-a", False, ended_ago=JOB_DEATH_WINDOW + 5)
    lives(campaign, first, agent("node-a", True), agent("node-b", False), agent("node-c", True))
    try:
        campaign._check_agents(fault=3)
    finally:
        teardown(campaign)
    assert not campaign.job_died
    assert [v.what for v in campaign.violations] == ["an agent ended by itself with exit code 1"]
    assert campaign.started == ["node-b"]  # type: ignore[attr-defined]


def test_an_agent_refused_by_a_closed_rendezvous_is_the_whole_job_ending(
        campaign: Campaign) -> None:
    """etcd-v3 seed 512, before its fix: one node trained on alone, but the job's
    rendezvous was closed and every agent started again was refused."""
    lives(campaign, agent("node-a", True), agent("node-b", False, last=(
        "elastic-train: error: rendezvous 'chaos1' (etcd-v3 at 198.18.0.4:2379) is closed: "
        "a job with this --rdzv-id already finished; use a new --rdzv-id")),
        agent("node-c", True))
    try:
        campaign._check_agents(fault=13)
    finally:
        teardown(campaign)
    assert campaign.job_died
    assert campaign.violations[-1].what == \
        "the whole job ended by itself (its rendezvous was closed)"


def test_a_round_of_our_agents_started_the_torch_way_is_one_violation_per_fault(
        campaign: Campaign) -> None:
    """c10d seed 642's replay: a member cut off right after a round closed was taken for
    plain torchrun, and the round ran without live recovery; nothing else flagged it."""
    from tests.chaos.campaign import STOCK_ROUND, FaultRecord
    from tests.chaos.schedule import Fault

    campaign.records = [FaultRecord(0, Fault("cable", "node-c", 8.0, 3.0, True), 100.0),
                        FaultRecord(1, Fault("cable", "node-b", 8.0, 3.0, True), 200.0)]
    said = f"{STOCK_ROUND} (plain torchrun?): this round starts every worker the torch way"
    a = agent("node-a", True, last=f"150.0 {said}\n160.0 step 5")
    b = agent("node-b", True, last=f"150.2 {said}")
    lives(campaign, a, b, agent("node-c", True, last="150.0 step 4"))
    try:
        campaign._stock_rounds()
    finally:
        teardown(campaign)
    assert [(v.fault, v.detail.split(":")[0]) for v in campaign.violations] == [
        (0, "node-a.log")]
    assert campaign.violations[0].what.startswith(
        "a round of elastic-train agents only started every worker the torch way")
