"""The fault campaign's schedule (tests/chaos/schedule.py): seeded, replayable, and never
taking a protected host's node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.chaos.campaign import FaultRecord
from tests.chaos.schedule import KINDS, Fault, Schedule, make_schedule

HOSTS = ["node-a", "node-b", "node-c"]


def test_a_seed_gives_the_same_schedule_and_its_file_replays_it() -> None:
    first = make_schedule(7, 40, HOSTS, list(KINDS))
    assert make_schedule(7, 40, HOSTS, list(KINDS)) == first
    assert make_schedule(8, 40, HOSTS, list(KINDS)) != first
    assert Schedule.decode(first.encode()) == first
    assert {f.kind for f in first.faults} <= set(KINDS)
    assert all(3.0 <= f.hold <= 15.0 and 0.0 <= f.gap <= 6.0 for f in first.faults)
    assert all(f.host == "etcd" for f in first.faults if KINDS[f.kind].needs_etcd)


def test_a_protected_host_never_loses_its_node_or_its_agent() -> None:
    schedule = make_schedule(3, 200, HOSTS, list(KINDS), protected=["node-a"])
    on_a = {f.kind for f in schedule.faults if f.host == "node-a"}
    assert on_a and not any(KINDS[k].node_leaves or KINDS[k].silent for k in on_a), on_a


def test_an_unknown_kind_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown fault kind\(s\) \['meteor'\]: choose from"):
        make_schedule(1, 1, HOSTS, ["meteor"])


def soak_module() -> Any:
    """benchmarks/chaos.py, loaded as a module (it is a script, not a package's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "chaos_soak", Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py")
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    return soak


def test_the_soak_reads_each_agents_start_from_the_launchers_own_line(tmp_path: Path) -> None:
    from elastic_train.agent.launch import READY_LINE

    soak = soak_module()
    line = READY_LINE.format(ready=9.46, torch=6.22, check=2.98, preflight=0.26)
    (tmp_path / "node-c.1.log").write_text(f"1795873355.45 {line}\n1795873356.0 later\n")
    (tmp_path / "node-a.0.log").write_text("1795873300.0 an agent that never got ready\n")
    assert soak.agent_starts(tmp_path) == [
        {"node": "node-c", "life": 1, "ready": 9.46, "torch": 6.22, "check": 2.98,
         "preflight": 0.26}]
    assert soak.starts_line([{"agent_starts": soak.agent_starts(tmp_path)}]).startswith(
        "- agents started again after a fault: 1; from the launcher's start to ready to join "
        "p50 / max 9.46 / 9.46 s, of which torch imported by 6.22 / 6.22 s, the torch check "
        "2.98 / 2.98 s")


def test_the_soak_counts_the_recovery_paths_by_the_agents_own_lines(tmp_path: Path) -> None:
    """Each path's line is the one the agent writes (a changed message must change here)."""
    from elastic_train.errors import RoundMemberLostError

    soak = soak_module()
    package = Path(__file__).resolve().parents[2] / "elastic_train"
    sources = "".join((package / m).read_text() for m in (
        "agent/live_agent.py", "agent/store_watch.py", "live/coordination.py"))
    for line in soak.PATHS.values():
        assert line in sources, line
    lost = RoundMemberLostError([2], 3, 5.0, "say what they bring")
    (tmp_path / "node-a.0.log").write_text(
        f"1.0 {lost}: this node goes into the next rendezvous round\n"
        "2.0 the others re-formed the world without this node: it ends its workers\n")
    (tmp_path / "node-b.1.log").write_text(
        f"1.0 {lost}: this node goes into the next rendezvous round\n")
    paths = soak.recovery_paths(tmp_path)
    assert paths["next round (a member lost right after a round closed)"] == 2
    assert paths["left out, joined again"] == 1
    assert paths["stock rounds (live recovery off)"] == 0
    assert soak.paths_line([{"paths": paths}, {}]).startswith(
        "- recovery paths taken (agents' lines): next round (a member lost right after a "
        "round closed) 2; ")


def test_the_soak_names_the_faults_slower_than_their_bound_and_no_other() -> None:
    """A campaign whose kill cost more than a second to the next step, or a silent fault
    more than three, or a fault that loses no member more than one, keeps its logs (soak of
    69b6e60: two slow host kills, not understood, their logs gone)."""
    soak = soak_module()

    def record(index: int, kind: str, next_step: float | None) -> Any:
        return FaultRecord(index, Fault(kind, "node-b", 3.0, 1.0, True), 0.0,
                           next_step=next_step)

    records = [record(0, "host_kill", 0.3), record(1, "host_kill", 5.51),
               record(2, "worker_kill", 1.2), record(3, "cable", 2.9),
               record(4, "worker_kill", None), record(5, "freeze", 3.2),
               record(6, "etcd_kill", 11.21), record(7, "disk_full", 0.1)]
    assert soak.slow_faults(records) == ["fault 1 host_kill node-b 5.51 s",
                                         "fault 2 worker_kill node-b 1.20 s",
                                         "fault 5 freeze node-b 3.20 s",
                                         "fault 6 etcd_kill node-b 11.21 s"]
