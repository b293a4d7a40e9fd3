"""The waits of a rendezvous round's agreement (live/coordination.agree_on_round), bounded and
ended early by the failure detector.

Rank 0 waits for every agent of the round to say what it brings; the others wait for the
plan rank 0 commits. An agent lost right after the round closed (frozen, cut off) says
nothing: rank 0 used to wait its whole bound (5 s), and the others then went into the next
round without knowing whom rank 0 missed, so that the next round waited for the lost
agent's lease and its last call too (the fault campaign, etcd-v3 seed 905 of 9c51e2c's
soak: a one-way loss as a node rejoined, 10.8 s to the next step). Now a wait ends as soon
as the agents missing are ones the failure detector suspects (``suspect``), on rank 0 or
on any other agent: the first to give up writes whom it missed (``LOST_KEY`` of the round),
every agent's wait ends on that word, and each names the lost agents, so that every one of
them leaves them out of the next round.

Torch-free, as the rest of live/.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["mark_lost", "marked_lost", "poll_for", "wait_for_arrivals", "wait_for_keys",
           "wait_for_plan", "waited"]

SILENT_CHECK_SECONDS = 0.25
"""How often a wait asks which agents are missing and whether the detector suspects them."""
_POLL_FIRST, _POLL_MAX = 0.02, 0.25

Suspect = Callable[[list[int]], bool]


def poll_for(store: Any, keys: list[str], seconds: float) -> bool:
    """Whether every key of ``keys`` is set in ``store`` within ``seconds``, polled: a
    blocking wait on c10d's ``TCPStore`` holds its client (and the rendezvous' heartbeats)
    for its length (agent/round_ranks.py polls the same way)."""
    deadline = time.monotonic() + seconds
    pause = _POLL_FIRST
    while not store.check(keys):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, _POLL_MAX)
    return True


def wait_for_keys(store: Any, keys: list[str], deadline: float,
                  give_up: Callable[[list[str]], bool]) -> list[str]:
    """Poll until every key of ``keys`` exists, ``deadline``, or ``give_up(missing keys)``
    (asked every ``SILENT_CHECK_SECONDS``); the keys still missing (a key, once set, stays:
    only those missing are asked again)."""
    missing = keys
    while True:
        left = deadline - time.monotonic()
        if poll_for(store, missing, min(SILENT_CHECK_SECONDS, max(0.0, left))):
            return []
        missing = [k for k in missing if not store.check([k])]
        if missing and (time.monotonic() >= deadline or give_up(missing)):
            return missing


def waited(began: float, bound: float) -> float:
    """The seconds a wait took, as its error says them: the bound once it passed."""
    took = time.monotonic() - began
    return bound if took >= bound else round(took, 1)


def mark_lost(store: Any, lost_key: str, ranks: Sequence[int]) -> None:
    """Say in the round's store that this agent gave up on ``ranks`` (the first word
    stays). Best effort: the others' bounds still hold."""
    try:
        store.compare_set(lost_key, "", json.dumps(sorted(ranks)))
    except Exception:
        pass


def marked_lost(store: Any, lost_key: str) -> list[int] | None:
    """The ranks an agent of the round gave up on (None: nobody gave up)."""
    try:
        if not store.check([lost_key]):
            return None
        return [int(r) for r in json.loads(store.get(lost_key))]
    except Exception:  # read as nobody: the bounds hold
        return None


def _missing(store: Any, keys: Sequence[str], among: list[int]) -> list[int]:
    """The ranks of ``among`` whose key is not set (a key, once set, stays)."""
    return [r for r in among if not store.check([keys[r]])]


def wait_for_arrivals(store: Any, keys: Sequence[str], seconds: float, lost_key: str,
                      lost_if: Callable[[list[int]], bool]) -> list[int]:
    """Rank 0: poll until every key of ``keys`` (one per rank) is set, ``seconds`` pass, or
    every agent still missing is lost: ``lost_if([rank])`` (ours, and the detector suspects
    it) or another agent gave up on it; the ranks still missing ([]: every agent said it).
    A missing agent that nobody suspects is waited for (it may only be slow)."""
    deadline = time.monotonic() + seconds
    missing = list(range(len(keys)))
    pause, next_look = _POLL_FIRST, 0.0
    while True:
        if store.check([keys[r] for r in missing]):
            return []
        now = time.monotonic()
        if now >= next_look or now >= deadline:
            missing = _missing(store, keys, missing)
            if not missing:
                return []
            lost = set(marked_lost(store, lost_key) or ())
            if now >= deadline or all(r in lost or lost_if([r]) for r in missing):
                return missing
            next_look = now + SILENT_CHECK_SECONDS
        time.sleep(min(pause, max(0.0, deadline - now)))
        pause = min(pause * 2, _POLL_MAX)


def wait_for_plan(store: Any, plan_key: str, seconds: float, keys: Sequence[str],
                  lost_key: str, suspect: Suspect | None) -> bool:
    """An agent but rank 0: poll until ``plan_key`` is set (True) or ``seconds`` pass
    (False). Meanwhile, when agents of the round have not said what they bring and the
    detector (``suspect``) suspects them, say so (``mark_lost``): rank 0 then gives up on
    them at once instead of at its bound (its word, a plan or the next round, is what
    every member follows)."""
    deadline = time.monotonic() + seconds
    pause, next_look, told = _POLL_FIRST, 0.0, False
    missing = list(range(len(keys)))
    while not store.check([plan_key]):
        now = time.monotonic()
        if now >= deadline:
            return False
        if now >= next_look:
            next_look = now + SILENT_CHECK_SECONDS
            # Never given up on rank 0 early: a suspicion outlives the silence (the detector
            # keeps it until the next plan), and a member that left while rank 0 committed
            # a plan with it split the round (the two worlds' writers fenced each other:
            # test_c10d_a_node_cut_off_rejoins_when_back_scaling_the_lr). Rank 0 decides.
            if suspect is not None and not told and suspect(missing):
                missing = _missing(store, keys, missing)  # who of the round has not said?
                suspected = [r for r in missing if suspect([r])]
                if suspected:
                    mark_lost(store, lost_key, suspected)
                    told = True
        time.sleep(min(pause, max(0.0, deadline - now)))
        pause = min(pause * 2, _POLL_MAX)
    return True
