"""The fault campaign's schedule (tests/chaos/schedule.py): seeded, replayable, and never
taking a protected host's node."""

from __future__ import annotations

import pytest

from tests.chaos.schedule import KINDS, Schedule, make_schedule

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
