"""The rules of a rendezvous round apart from etcd (rendezvous/etcd_v3/rounds.py): when a round
closes, who is in it, in which rank order, and where its keys live."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from elastic_train.rendezvous.etcd_v3.rounds import RoundKeys, RoundTally, World, rank_order


def test_a_round_closes_at_once_when_the_maximum_joined() -> None:
    tally = RoundTally(min_nodes=1, max_nodes=2, last_call=30.0)
    tally.joined("a", 5, now=0.0)
    assert not tally.due(0.0) and tally.wake_at() == 30.0
    tally.joined("b", 7, now=1.0)
    assert tally.due(1.0)
    assert tally.close() == ("a", "b")


def test_a_round_closes_after_the_last_call_once_the_minimum_is_in() -> None:
    tally = RoundTally(min_nodes=2, max_nodes=8, last_call=5.0)
    tally.joined("a", 5, now=0.0)
    assert not tally.due(100.0) and tally.wake_at() is None    # below the minimum: never
    tally.joined("b", 6, now=10.0)
    assert tally.wake_at() == 15.0 and not tally.due(14.9) and tally.due(15.0)
    tally.joined("c", 9, now=12.0)                             # a later join does not extend
    assert tally.wake_at() == 15.0


def test_a_node_leaving_below_the_minimum_cancels_the_last_call() -> None:
    tally = RoundTally(min_nodes=2, max_nodes=8, last_call=5.0)
    tally.joined("a", 5, now=0.0)
    tally.joined("b", 6, now=1.0)
    tally.left("b", now=2.0)
    assert tally.wake_at() is None and not tally.due(10.0)
    tally.joined("b2", 8, now=20.0)                            # the last call starts again
    assert tally.wake_at() == 25.0


def test_a_round_waits_for_the_previous_worlds_members_alive_whatever_its_last_call() -> None:
    tally = RoundTally(1, 3, last_call=1.0)
    tally.expect({"a", "b"})                  # the world of the round before runs
    tally.joined("new", 10, now=0.0)
    assert not tally.due(5.0) and tally.wake_at() is None
    assert tally.due_but_for_the_previous_world(5.0)
    tally.joined("a", 11, now=6.0)
    assert tally.awaited() == {"b"} and not tally.due(7.0)
    tally.previous_gone("b")                  # its lease expired, or the world left it out
    assert tally.due(7.0)


def test_the_maximum_closes_a_round_even_while_a_previous_member_is_awaited() -> None:
    tally = RoundTally(1, 2, last_call=1.0)
    tally.expect({"a", "b"})
    tally.joined("new", 10, now=0.0)
    tally.joined("a", 11, now=0.0)
    assert tally.due(0.0)


def test_ranks_are_stable_across_rounds_and_newcomers_follow_in_join_order() -> None:
    joined = {"new-2": 40, "b": 31, "new-1": 33, "a": 30}
    assert rank_order(joined) == ("a", "b", "new-1", "new-2")
    # The previous round was (b, gone, a): b keeps rank 0, a follows; then the newcomers.
    assert rank_order(joined, previous=("b", "gone", "a")) == ("b", "a", "new-1", "new-2")
    assert rank_order({"x": 3, "y": 3}) == ("x", "y")          # ties by name: deterministic


def test_beyond_the_maximum_the_earliest_joiners_are_in() -> None:
    tally = RoundTally(min_nodes=1, max_nodes=2, last_call=1.0)
    for node, revision in (("late", 9), ("first", 2), ("second", 4)):
        tally.joined(node, revision, now=0.0)
    assert tally.close(previous=("second",)) == ("second", "first")


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="need 1 <= min <= max"):
        RoundTally(min_nodes=3, max_nodes=2, last_call=1.0)


def test_keys_of_a_job_and_of_its_rounds() -> None:
    keys = RoundKeys.of("/jobs/rdzv/", "run1")
    assert keys.latest == "/jobs/rdzv/run1/latest"
    assert keys.node(3, "host_1_ab") == "/jobs/rdzv/run1/round/00000003/node/host_1_ab"
    assert keys.world(3) == "/jobs/rdzv/run1/round/00000003/ctl/world"
    assert keys.coordinator(3).startswith(keys.ctl(3)) and keys.ctl(3).startswith(keys.round(3))
    assert keys.parse_node_key(keys.node(12, "n")) == (12, "n")
    assert keys.parse_node_key(keys.world(12)) is None
    assert keys.parse_node_key("/jobs/rdzv/run2/round/00000001/node/n") is None
    assert keys.store == "/jobs/rdzv/run1/store/"


def test_a_world_record_round_trips_and_a_foreign_one_is_named() -> None:
    world = World(4, ("b", "a"))
    assert World.decode(world.encode(), "k") == world
    with pytest.raises(RendezvousStateError, match="the rendezvous record at /x/world is "
                                                   "corrupt or was not written by the etcd-v3"):
        World.decode(b"not json", "/x/world")


def test_a_stalled_round_closes_without_its_last_call_but_still_awaits_the_previous_world(
        ) -> None:
    """A member of the world before fell silent while the round formed (its workers wait
    for it in a collective): the round closes once it has its minimum and awaits nobody,
    with no last call; a live member of the world before is still awaited."""
    tally = RoundTally(1, 3, last_call=30.0)
    tally.expect({"a", "b"})
    tally.joined("a", 1, now=0.0)
    tally.joined("c", 2, now=0.0)
    tally.stall()
    assert not tally.due(0.1) and tally.wake_at() is None      # b is alive, awaited
    tally.previous_gone("b")                                   # left out (forget_nodes)
    assert tally.due(0.1) and tally.wake_at() == 0.0
    assert tally.close(("a", "b")) == ("a", "c")
    plain = RoundTally(1, 3, last_call=30.0)
    plain.joined("a", 1, now=0.0)
    assert not plain.due(0.1) and plain.wake_at() == 30.0      # the last call, unstalled
