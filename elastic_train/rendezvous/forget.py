"""Tell the rendezvous that nodes are gone, once live recovery knows it.

torch's dynamic rendezvous (c10d, and etcd-v3's ``design=state-key``) keeps a node as a
participant of its round until its heartbeats are judged stale (``keep_alive_interval`` x
``keep_alive_max_attempt``: 15 s by default). Live recovery re-forms the world without a
lost node at once, but a node that joins soon after waits out that expiry: the next round
begins only when every participant of the current one left it, the dead one included.

The agent that coordinated a re-formation therefore removes the lost nodes from the
rendezvous' state itself, the way torch's expiry does (their heartbeats marked stale, then
torch's own sanitizer), written back by compare-and-swap like every change of that state.
A node removed while it still runs (cut off, not dead) is what torch's expiry would make
of it too: it stops sending heartbeats, finds itself outside the newer plan, and joins
again as a new node.

The lease design of etcd-v3 (etcd_v3/leases.py) needs none of this to form its next round
(a round there never waits for a member of the one before), but its members watch each
other's leases: every agent tells its own handler which members live recovery left out,
so that their leases expiring later does not re-form a world they are no longer in.

An agent that ends with an error leaves the rendezvous open for the others
(``leave_open``). Handlers offer the rest through two calls, ``rendezvous_node_id`` and
``forget_nodes``; a
handler of our own may define methods of those names, torch's dynamic handler is served
here, and any other handler forgets nothing (its nodes expire as they always did). A
handler with a ``lost_grace`` attribute (the lease design) also lets live recovery's
failure detector act first on a member whose lease just expired (``defer_lease_losses``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousHandler

from elastic_train.rendezvous.torch_seams import (
    heartbeat_lock,
    private_state_holder,
    remove_expired_nodes,
    rendezvous_state,
    state_holder,
    stop_heartbeats,
    this_node,
)

log = logging.getLogger(__name__)

FORGET_ATTEMPTS = 5
"""Compare-and-swap attempts (each one lost to a concurrent heartbeat or join re-reads)."""
_STALE = datetime.min.replace(tzinfo=UTC)


def rendezvous_node_id(handler: RendezvousHandler) -> str:
    """This agent's node in ``handler``'s rendezvous, as ``forget_nodes`` takes it ("" when
    the handler has no such notion)."""
    try:
        own = getattr(handler, "rendezvous_node_id", None)
        if callable(own):
            return str(own())
        node = this_node(handler)  # torch's DynamicRendezvousHandler
        return repr(node) if node is not None else ""
    except Exception as exc:  # only a shortcut depends on it: never worth failing over
        log.warning("no rendezvous node id from %s (%s: %s): lost nodes will leave the "
                    "rendezvous when their heartbeats expire", type(handler).__name__,
                    type(exc).__name__, exc)
        return ""


def round_node_ids(handler: RendezvousHandler, group_ranks: Collection[int]) -> list[str]:
    """The nodes (as ``forget_nodes`` takes them) holding ``group_ranks`` in the round
    ``handler`` last closed: torch's dynamic rendezvous (its next round waits for every
    member of this one), or a handler of our own that says (etcd-v3's leases: its next
    round waits for this one's live members); [] for any other handler."""
    own = getattr(handler, "round_node_ids", None)
    if callable(own):
        return list(own(group_ranks))
    if state_holder(handler) is None:
        return []
    try:
        participants = rendezvous_state(handler).participants
        wanted = set(group_ranks)
        return sorted(repr(node) for node, rank in participants.items() if rank in wanted)
    except Exception as exc:  # only a shortcut depends on it
        log.warning("could not tell the rendezvous nodes of ranks %s (%s: %s): they leave "
                    "it when their heartbeats expire", sorted(group_ranks),
                    type(exc).__name__, exc)
        return []


def forget_nodes(handler: RendezvousHandler, node_ids: Collection[str],
                 coordinator: bool = True, stalled: bool = False,
                 in_round: bool = False, staying: Collection[str] = ()) -> list[str]:
    """Remove the nodes ``node_ids`` (``rendezvous_node_id`` of their agents) from the
    current round of ``handler``'s rendezvous now, as their heartbeats' expiry would later;
    the ids removed. Every member of the re-formed world calls it: a handler of our own
    forgets locally (etcd-v3's leases: the lost node's lease expiring later is then no
    news); torch's dynamic rendezvous keeps one shared state, which only the
    ``coordinator`` of the re-formation writes. ``stalled``: the world's workers wait for
    these nodes, so the next round must not wait its last call (a handler of our own only).
    ``in_round``: the caller's agent waits in a round of ``handler`` meanwhile (a node
    joins), whose next round begins only when every member of the last one left it: any
    member writes torch's state then, through a holder of its own (the fault campaign,
    c10d seeds 862 and 863: a member frozen or cut off as a node joined held the round,
    and every step, 7.7-15.7 s, until it was back). ``staying``: with ``in_round``, the
    nodes of the caller's world that stay; once the next round holds them and the nodes
    that waited for it, it closes without its last call (``close_without_last_call``).
    Never raises for the rendezvous' sake: on any error the nodes simply expire as before
    (logged)."""
    wanted = {n for n in node_ids if n}
    if not wanted:
        return []
    try:
        own = getattr(handler, "forget_nodes", None)
        if callable(own):
            return list(own(wanted, stalled=True) if stalled else own(wanted))
        if in_round:
            holder = private_state_holder(handler)
            if holder is None:
                return []
            removed = _forget(holder, wanted)
            if removed and staying:
                state = holder.state
                expected = set(staying) | {repr(n) for n in state.wait_list}
                forming = state.round + 1 if state.complete else state.round
                threading.Thread(target=close_without_last_call, name="rdzv-no-last-call",
                                 args=(holder, expected - wanted, forming),
                                 daemon=True).start()
            return removed
        if not coordinator:
            return []
        holder = state_holder(handler)
        if holder is None:
            return []
        lock = heartbeat_lock(handler)  # the heartbeat thread shares it
        with lock if lock is not None else contextlib.nullcontext():
            removed = _forget(holder, wanted)
        if removed and stalled:
            _close_next_round_early(handler, wanted)
        return removed
    except Exception as exc:  # a shortcut of torch's own expiry: never worth failing over
        log.warning("could not remove the lost node(s) %s from the rendezvous (%s: %s): they "
                    "leave it when their heartbeats expire", sorted(wanted),
                    type(exc).__name__, exc)
        return []


def _close_next_round_early(handler: RendezvousHandler, lost: set[str]) -> None:
    """After ``lost`` left the round just closed (``stalled``: every member waits for them),
    the next round closes as soon as it holds the round's other members and the nodes that
    waited for it, without its last call (the soak of 6e1ef70, c10d seed 1100: a member cut
    off right after its round closed, given up 0.5 s in, and the next round of the two
    others waited its 5 s of last call: 8.1 s to the next step)."""
    holder = private_state_holder(handler)  # torch's is the agent's, in use meanwhile
    if holder is None:
        return
    holder.sync()
    state = holder.state
    expected = {repr(n) for n in state.participants} | {repr(n) for n in state.wait_list}
    forming = state.round + 1 if state.complete else state.round
    threading.Thread(target=close_without_last_call, name="rdzv-no-last-call",
                     args=(holder, expected - lost, forming), daemon=True).start()


def _forget(holder: Any, wanted: set[str]) -> list[str]:
    holder.sync()
    for _ in range(FORGET_ATTEMPTS):
        state = holder.state
        # Participants only: a node on the wait list is alive (its join op beats for it),
        # e.g. a member that took torch's restart path instead of answering the call.
        found = [node for node in state.participants if repr(node) in wanted]
        if not found:
            return []
        for node in found:
            state.last_heartbeats[node] = _STALE
        remove_expired_nodes(holder)  # torch's, this round's epilogue included
        holder.mark_dirty()
        if holder.sync():  # written: the state as the others read it now
            removed = sorted(repr(n) for n in found if n not in holder.state.last_heartbeats)
            if removed:
                log.info("removed the lost node(s) %s from the rendezvous", removed)
            else:  # e.g. right after an etcd outage, when no heartbeat is judged
                log.info("the lost node(s) %s leave the rendezvous when their heartbeats "
                         "are judged again", sorted(repr(n) for n in found))
            return removed
        # another node changed the state first: sync() read its version; try on that
    log.warning("could not remove the lost node(s) %s from the rendezvous in %d attempts: "
                "they leave it when their heartbeats expire", sorted(wanted), FORGET_ATTEMPTS)
    return []


NEXT_ROUND_SECONDS = 15.0
"""How long ``close_without_last_call`` watches for the next round to hold every node it
expects (the survivors leave the last round within about a second of each other; a node
that waited for it comes when it opens) before leaving that round to its last call."""
NEXT_ROUND_POLL_SECONDS = 0.1


def close_without_last_call(holder: Any, expected: set[str], forming: int,
                            seconds: float = NEXT_ROUND_SECONDS) -> bool:
    """Once round ``forming`` holds every node of ``expected`` (and is still open), bring
    its last call forward to now: the round a lost member held waited for it,
    and the nodes the world wants are all there (torch's round would otherwise wait its
    last call, 5 s, for nodes nobody expects: the fault campaign's c10d replay of seed 863,
    5.5 s to the next step after the member was left out). ``holder``: one of this
    caller's own (torch_seams.private_state_holder). Whether it did; never raises."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            holder.sync()
            state = holder.state
            if state.closed or state.round > forming or \
                    (state.round == forming and state.complete):
                return False  # formed (or ended) meanwhile
            present = {repr(n) for n in state.participants}
            if state.round == forming and expected <= present \
                    and state.deadline is not None:
                now = datetime.now(UTC)
                if state.deadline <= now:
                    return False  # its last call is over: it closes as it is
                state.deadline = now
                holder.mark_dirty()
                if holder.sync():
                    log.info("the next rendezvous round holds every node expected (%s): it "
                             "closes without its last call", ", ".join(sorted(expected)))
                    return True
                continue  # another node wrote first: look again
            time.sleep(NEXT_ROUND_POLL_SECONDS)
    except Exception as exc:  # a shortcut only: the round's last call still ends it
        log.warning("could not close the next rendezvous round early (%s: %s): it waits its "
                    "last call", type(exc).__name__, exc)
    return False


def leave_open(handler: RendezvousHandler) -> None:
    """Make ``handler.shutdown()`` leave the rendezvous open for the other nodes: torch's
    launcher calls it whenever its agent ends with an error, and closing the rendezvous
    there ends every node of the job ("a job with this --rdzv-id already finished"), one
    node's error made the job's (the fault campaign, etcd-v3 seed 512: two agents ended
    with a store timeout, and every agent started again after them was refused). A handler
    with ``leave`` (etcd-v3's lease design) leaves at once; torch's dynamic handler stops
    this node's heartbeats, which then expire (live recovery's ``forget_nodes`` removes it
    sooner). Its heartbeat thread left running would log its failures to a store that is
    gone after this node's last line."""
    leave = getattr(handler, "leave", None)

    def shutdown() -> bool:
        try:
            if callable(leave):
                leave()
            else:
                stop_heartbeats(handler)
        except Exception as exc:  # its lease or heartbeats expire instead
            log.warning("could not leave rendezvous %s at once (%s: %s): this node's "
                        "lease or heartbeats expire instead", handler.get_run_id(),
                        type(exc).__name__, exc)
        return True

    handler.shutdown = shutdown  # type: ignore[method-assign]


def defer_lease_losses(handler: RendezvousHandler, seconds: float) -> bool:
    """Let a member's expired lease wait ``seconds`` before it re-forms the world by a new
    rendezvous round, where the handler offers it (``lost_grace``): live recovery leaves a
    silent member out in place first. Whether the handler took it."""
    if not hasattr(handler, "lost_grace"):
        return False
    handler.lost_grace = float(seconds)  # type: ignore[attr-defined]
    return True
