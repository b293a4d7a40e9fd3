"""Live recovery across nodes, the pure and store-level parts: who is in a generation
(live/plan.py), and how agents call each other and commit plans (live/peers.py), against
real TCPStores. The agents themselves, with real kills, are in
tests/integration/test_multinode.py and test_live_recovery.py."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_train.live.coordination import commit_plan, local_value, take_over
from elastic_train.live.messages import Announcement
from elastic_train.live.peers import PROBE_SECONDS, PeerStores, reachable
from elastic_train.live.plan import FRESH, LIVE, Arrival, Member, Plan, plan_reformation, plan_round

A, B, C = "host-a:1", "host-b:2", "host-c:3"


def world_of(*members: tuple[str, int], generation: int = 4) -> Plan:
    return Plan(generation, LIVE, tuple(Member(a, n) for a, n in members), A, "start",
                kept={a: tuple(range(n)) for a, n in members})


def holder(agent: str, workers: int, plan: Plan, alive: tuple[int, ...] | None = None
           ) -> Arrival:
    first = plan.first_rank(agent)
    alive = tuple(range(workers)) if alive is None else alive
    return Arrival(agent, workers, alive, first, plan.generation, plan.world_size,
                   writer=first == 0 and 0 in alive)


def test_a_round_without_anyone_holding_the_state_starts_fresh_in_the_rounds_order() -> None:
    plan = plan_round([Arrival(B, 2), Arrival(A, 1)], group_store=B)
    assert (plan.kind, plan.generation, plan.agents, plan.world_size) == (FRESH, 0, (B, A), 3)
    assert plan.ranks(B) == {0: 0, 1: 1} and plan.ranks(A) == {0: 2}
    assert plan.started == 3 and plan.keeps(B) == ()


def test_a_joining_node_follows_the_members_who_keep_their_ranks_and_their_state() -> None:
    before = world_of((A, 2), (B, 2))
    # C joined the rendezvous before them (its group rank is lower): ranks stay put anyway.
    plan = plan_round([Arrival(C, 2), holder(B, 2, before), holder(A, 2, before)], A)
    assert plan.kind == LIVE and plan.cause == "node joined"
    assert plan.agents == (A, B, C) and plan.ranks(C) == {0: 4, 1: 5}
    assert plan.generation == before.generation + 1 and plan.started == 2
    assert plan.keeps(A) == (0, 1) and plan.keeps(C) == ()
    assert not plan.claim_epoch  # the writer (rank 0 on A) is still there
    assert plan.previous_world_size == 4


def test_a_round_of_the_same_members_changes_nothing() -> None:
    before = world_of((A, 1), (B, 1))
    plan = plan_round([holder(A, 1, before), holder(B, 1, before)], B)
    assert plan.same_world(before) and plan.cause == "new round"
    assert not plan.same_world(world_of((A, 1)))


def test_a_lost_node_leaves_the_world_and_takes_the_writer_with_it() -> None:
    before = world_of((A, 2), (B, 1), (C, 1))
    plan = plan_reformation(before, {B: holder(B, 1, before), C: holder(C, 1, before)}, B,
                            detected_at=12.5)
    assert plan is not None
    assert (plan.cause, plan.lost, plan.failed_ranks) == ("node lost", (A,), (0, 1))
    assert plan.agents == (B, C) and plan.world_size == 2 and plan.ranks(B) == {0: 0}
    assert plan.claim_epoch and plan.started == 0 and plan.previous_world_size == 4
    assert plan.detected_at == 12.5 and plan.group_store == B


def test_a_lost_worker_is_started_again_at_its_rank() -> None:
    before = world_of((A, 2), (B, 2))
    plan = plan_reformation(before, {A: holder(A, 2, before),
                                     B: holder(B, 2, before, alive=(0,))}, A, generation=9)
    assert plan is not None and plan.generation == 9
    assert (plan.cause, plan.failed_ranks, plan.started) == ("worker lost", (3,), 1)
    assert plan.ranks(B) == {0: 2, 1: 3} and plan.keeps(B) == (0,)
    assert not plan.claim_epoch


def test_a_members_rendezvous_node_goes_with_it_into_plans_and_out_when_it_is_lost() -> None:
    first = plan_round([Arrival(A, 1, rdzv_node="a_10_0"), Arrival(B, 1, rdzv_node="b_20_0")],
                       A)
    assert [m.rdzv_node for m in first.members] == ["a_10_0", "b_20_0"]
    started = Plan(1, LIVE, first.members, A, "start", kept={A: (0,), B: (0,)})
    arrival = Arrival(A, 1, (0,), 0, 1, 2, writer=True, rdzv_node="a_10_0")
    plan = plan_reformation(started, {A: arrival}, A)
    assert plan is not None and plan.members == (Member(A, 1, "a_10_0"),)
    assert plan.lost_from(started) == (Member(B, 1, "b_20_0"),)
    assert Plan.decode(plan.encode()) == plan and Arrival.decode(arrival.encode()) == arrival
    # a plan written before members carried their node still reads
    older = world_of((A, 1)).encode().replace(b', "rdzv_node": ""', b"")
    assert b"rdzv_node" not in older and Plan.decode(older).members == (Member(A, 1),)


def test_no_holder_left_means_the_checkpoint() -> None:
    before = world_of((A, 1), (B, 1))
    assert plan_reformation(before, {B: holder(B, 1, before, alive=())}, B) is None


def test_a_node_back_from_a_partition_holds_a_stale_state_and_starts_again() -> None:
    # B was cut off (or frozen) while A re-formed the world without it as generation 5; B
    # still holds generation 4's state, and its workers may wait in one of its collectives.
    before = world_of((A, 1), (B, 1))
    alone = plan_reformation(before, {A: holder(A, 1, before)}, A)
    assert alone is not None and alone.generation == 5
    plan = plan_round([holder(B, 1, before), holder(A, 1, alone)], B)
    assert plan.kind == LIVE and plan.generation == 6 and plan.cause == "node joined"
    assert plan.keeps(A) == (0,) and plan.keeps(B) == ()
    assert plan.agents == (A, B) and plan.started == 1
    assert not plan.claim_epoch  # A's worker is the writer of the newest world
    assert not plan.same_world(alone)


def test_members_carry_where_their_agent_answers_the_failure_detector() -> None:
    plan = plan_round([Arrival(A, 1, beat="host-a:7"), Arrival(B, 1, beat="host-b:8")], A)
    assert [m.beat for m in plan.members] == ["host-a:7", "host-b:8"]
    after = plan_reformation(plan, {A: Arrival(A, 1, (0,), 0, 0, 2, beat="host-a:7")}, A)
    assert after is not None and after.members == (Member(A, 1, "", "host-a:7"),)
    assert Plan.decode(after.encode()) == after


def test_plans_and_arrivals_survive_their_encoding() -> None:
    before = world_of((A, 2), (B, 1))
    plan = plan_reformation(before, {A: holder(A, 2, before)}, A, detected_at=1.5)
    assert plan is not None
    assert Plan.decode(plan.encode()) == plan and plan.encode() == Plan.decode(
        plan.encode()).encode()
    arrival = holder(B, 1, before)
    assert Arrival.decode(arrival.encode()) == arrival
    told = Announcement("abort", A, plan)
    assert Announcement.decode(told.encode()) == told


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=5))


def test_of_two_coordinators_from_one_base_only_the_first_commits_and_a_stale_one_none() -> None:
    store = _server()
    base, first, second, newer = (world_of((A, 1), (B, 1), generation=g).encode()
                                  for g in (1, 2, 3, 4))
    assert commit_plan(store, "plan", b"", base) == base
    assert commit_plan(store, "plan", base, first) == first
    assert commit_plan(store, "plan", base, second) == first  # learns the winner
    assert commit_plan(store, "plan", first, newer) == newer
    assert commit_plan(store, "plan", base, second) == newer  # a partitioned minority


def test_a_new_rounds_plan_supersedes_every_plan_and_fences_the_old_worlds_coordinator(
        ) -> None:
    """A node cut off while the others formed a new rendezvous round without it: its
    coordinator swaps from the plan of its old round, which the new round replaced (the
    job's plan key spans rounds), so it commits nothing and learns the newer plan."""
    store = _server()
    old_round, cut_off, new_round = (world_of((A, 1), (B, 1), generation=g)
                                     for g in (1, 2, 3))
    assert take_over(store, "plan", old_round) == old_round.encode()  # nothing before it
    assert take_over(store, "plan", new_round) == new_round.encode()  # whatever was there
    assert commit_plan(store, "plan", old_round.encode(), cut_off.encode()) \
        == new_round.encode()


def test_a_new_rounds_plan_is_numbered_above_a_world_a_cut_off_node_committed_meanwhile(
        ) -> None:
    """Found by the fault campaign (seed 300): node C cut off re-formed alone in place as
    generation 8 from generation 7, its commit reaching etcd as its cable came back, while
    A and B formed a new round, also numbered 8 (one past what they held). Two worlds of
    generation 8 trained at once, and the next round could not tell C's stale state from
    theirs. The round's plan now takes the generation after whatever it replaces."""
    store = _server()
    base = world_of((A, 1), (B, 1), (C, 1), generation=7)
    alone = world_of((C, 1), generation=8)
    round_of_two = world_of((A, 1), (B, 1), generation=8)
    assert take_over(store, "plan", base) == base.encode()
    assert commit_plan(store, "plan", base.encode(), alone.encode()) == alone.encode()
    committed = Plan.decode(take_over(store, "plan", round_of_two))
    assert committed.generation == 9
    assert committed.members == round_of_two.members
    # above an older plan, the round keeps its own number
    assert Plan.decode(take_over(store, "plan", world_of((A, 1), generation=12))).generation \
        == 12


def test_a_dead_agent_refuses_at_once_and_a_live_one_takes_the_call() -> None:
    server = _server()
    address = f"127.0.0.1:{server.port}"
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"  # bound, not listening: refused
    peers = PeerStores(timeout=2.0)
    assert reachable(address) and not reachable(dead)
    assert peers.tell_all([address, dead], "notice", "hello") == {address}
    assert local_value(server, "notice") == b"hello"
    assert local_value(server, "absent") is None
    threading.Timer(0.2, lambda: server.set("plan", b"p")).start()
    assert peers.read(address, "plan", timeout=5) == b"p"
    assert peers.read(address, "never", timeout=0.2) is None
    with pytest.raises(ConnectionError, match="no agent answers"):
        peers.client(dead)


SILENT_AGENT_CALL = """
import socket, sys, time
from elastic_train.live.peers import PeerStores
from elastic_train.process_exit import exit_process
silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel), never answers
start = time.monotonic()
told = PeerStores(timeout=15).tell(f"127.0.0.1:{silent.getsockname()[1]}", "k", "v")
print(told, round(time.monotonic() - start, 1), flush=True)
exit_process(3)
"""


def test_a_silent_agent_costs_a_bounded_call_and_the_caller_still_exits_cleanly() -> None:
    """A frozen agent's host accepts the connection but its store never answers: torch's
    client would wait without bound. The call gives up within 2 x PROBE_SECONDS, and the
    process, with a thread left inside torch's client, still exits with its own code
    instead of aborting at shutdown."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SILENT_AGENT_CALL], capture_output=True,
                          text=True, timeout=60)
    told, seconds = done.stdout.split()
    assert told == "False" and float(seconds) <= 2 * PROBE_SECONDS + 1.0
    assert done.returncode == 3, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


SUSPECTED_AGENT_CALL = """
import socket, sys, time
from elastic_train.live.peers import PeerStores
from elastic_train.process_exit import exit_process
dying = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel), never answers
import torch.distributed as dist
from datetime import timedelta
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=5))
answering = f"127.0.0.1:{store.port}"
suspected = f"127.0.0.1:{dying.getsockname()[1]}"
start = time.monotonic()
told = PeerStores(timeout=15).tell_all([answering, suspected], "k", "v",
                                       abandon=lambda: {suspected})
print(sorted(told) == [answering], round(time.monotonic() - start, 2), flush=True)
exit_process(3)
"""


def test_a_call_to_a_member_the_failure_detector_suspects_is_not_waited_for() -> None:
    """A process dying with its host up takes connections and answers none while its
    memory is freed: the call to it would wait out 2 x PROBE_SECONDS (4 s per killed node
    in the fault campaign). Once the failure detector suspects it, ``tell_all`` goes on
    with the members that answered."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SUSPECTED_AGENT_CALL], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3, done.stderr[-2000:]
    answered, seconds = done.stdout.split()
    assert answered == "True" and float(seconds) < 1.0, done.stdout


DYING_AGENT_CALL = """
import socket, sys, threading, time
from elastic_train.live.peers import PeerStores
from elastic_train.process_exit import exit_process
dying = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel), never answers
address = f"127.0.0.1:{dying.getsockname()[1]}"
def die():  # the agent's process ends: its kernel refuses every connection from now on
    time.sleep(0.5)
    dying.close()
    print("died", time.monotonic(), flush=True)
threading.Thread(target=die).start()
told = PeerStores(timeout=15).tell(address, "k", "v")
print("told", told, time.monotonic(), flush=True)
exit_process(3)
"""


def test_a_call_to_an_agent_that_dies_meanwhile_ends_at_its_first_refusal() -> None:
    """The fault campaign's host kills: a member called just as its host was killed took
    the connection, then died; torch's client connected again and again, each refused,
    until its timeout, and the caller waited for the failure detector (up to 1.6 s to the
    next step where the others took 0.2 s). The call now ends at the first refusal."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", DYING_AGENT_CALL], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    told, at = lines["told"].split()
    assert told == "False"
    assert float(at) - float(lines["died"]) < 0.5, done.stdout


AGENT_STORE = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
print(store.port, flush=True)
time.sleep(120)
"""


def test_a_call_to_an_agent_that_died_since_the_last_call_fails_at_once() -> None:
    """The coordinator keeps a client of each member's store. A store's ``set`` is never
    answered, so on the kept connection of an agent killed since, it "succeeded" and the
    coordinator waited its whole arrival timeout for the dead agent (the fault campaign's
    10 s for a killed node). ``tell`` now reads its key back: the dead one is refused."""
    import subprocess
    import sys
    import time

    agent = subprocess.Popen([sys.executable, "-c", AGENT_STORE], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert agent.stdout is not None
        address = f"127.0.0.1:{int(agent.stdout.readline())}"
        peers = PeerStores(timeout=15.0)
        assert peers.tell(address, "notice", "first call") is True
        agent.kill()
        agent.wait(timeout=10)
        started = time.monotonic()
        assert peers.tell(address, "notice", "second call") is False
        assert time.monotonic() - started < 1.0
    finally:
        agent.kill()
        agent.wait(timeout=10)
