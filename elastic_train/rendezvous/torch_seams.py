"""Every private name of torch the rendezvous (rendezvous/) uses, in one place: torch's
dynamic rendezvous handler's internals (c10d, and etcd-v3's ``design=state-key``).
``REQUIRED`` declares them; tests/unit/test_torch_seams.py checks that the installed torch
still has each, with the signature used here; tests/unit/test_agent_seam_rule.py that no
other module of rendezvous/ touches one.

- ``JudgingStateHolder``: its state holder, with a say in judging nodes dead;
- ``rendezvous_state``, ``this_node``, ``new_node_descriptor``, ``state_holder``,
  ``private_state_holder``, ``heartbeat_lock``, ``remove_expired_nodes``,
  ``stop_heartbeats``.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    _BackendRendezvousStateHolder,
)

from elastic_train.torch_private import Private

__all__ = ["REQUIRED", "JudgingStateHolder", "heartbeat_lock", "new_node_descriptor",
           "private_state_holder", "remove_expired_nodes", "rendezvous_state",
           "state_holder", "stop_heartbeats", "this_node"]

_DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
REQUIRED: tuple[Private, ...] = (
    Private(_DYNAMIC, "_BackendRendezvousStateHolder", "subclassed (JudgingStateHolder)",
            params=("backend", "settings")),
    Private(_DYNAMIC, "_BackendRendezvousStateHolder._sanitize", "overridden by "
            "JudgingStateHolder, called by remove_expired_nodes", params=()),
    Private(_DYNAMIC, "_BackendRendezvousStateHolder._dead_nodes", "emptied when no node "
            "may be judged dead (JudgingStateHolder)"),
    Private(_DYNAMIC, "_BackendRendezvousStateHolder._dirty", "cleared in a private "
            "copy (private_state_holder)"),
    Private(_DYNAMIC, "_BackendRendezvousStateHolder._last_sync_time", "reset in a "
            "private copy, so that it reads the backend (private_state_holder)"),
    Private(_DYNAMIC, "_BackendRendezvousStateHolder._cache_duration", "zero in a private "
            "copy: each sync reads the backend (private_state_holder)"),
    Private(_DYNAMIC, "_RendezvousState.deadline", "brought forward when the next round "
            "holds every node expected (forget.close_without_last_call)"),
    Private(_DYNAMIC, "_RendezvousState.wait_list", "the nodes waiting for the next round "
            "(forget.close_without_last_call)"),
    Private(_DYNAMIC, "_RendezvousState.round", "(forget.close_without_last_call)"),
    Private(_DYNAMIC, "_RendezvousState.complete", "(forget.close_without_last_call)"),
    Private(_DYNAMIC, "DynamicRendezvousHandler._state_holder", "(rendezvous_state, "
            "state_holder)"),
    Private(_DYNAMIC, "DynamicRendezvousHandler._this_node", "(this_node)"),
    Private(_DYNAMIC, "DynamicRendezvousHandler._heartbeat_lock", "(heartbeat_lock)"),
    Private(_DYNAMIC, "DynamicRendezvousHandler._node_desc_generator",
            "(new_node_descriptor)"),
    Private(_DYNAMIC, "DynamicRendezvousHandler._stop_heartbeats", "(stop_heartbeats: a "
            "node that leaves without closing the rendezvous)", params=()),
)


class JudgingStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder of the dynamic rendezvous, asking ``may_judge()`` before it
    judges nodes dead by their heartbeats (after every read or write of the state)."""

    def may_judge(self) -> bool:
        return True

    def _sanitize(self) -> None:
        if not self.may_judge():
            self._dead_nodes = []
            return
        super()._sanitize()


def rendezvous_state(handler: DynamicRendezvousHandler) -> Any:
    """The rendezvous state as ``handler`` last read it."""
    return handler._state_holder.state


def this_node(handler: Any) -> Any:
    """``handler``'s node descriptor (None for a handler without one)."""
    return getattr(handler, "_this_node", None)


def new_node_descriptor(local_addr: str | None) -> Any:
    """A node descriptor as torch's dynamic handler makes its own."""
    return DynamicRendezvousHandler._node_desc_generator.generate(local_addr)


def state_holder(handler: Any) -> Any | None:
    """The state holder of a dynamic handler (None for another handler, or a holder that
    cannot remove expired nodes)."""
    holder = getattr(handler, "_state_holder", None)
    return holder if holder is not None and hasattr(holder, "_sanitize") else None


def private_state_holder(handler: Any) -> Any | None:
    """A state holder of ``handler``'s rendezvous of this caller's own (None where
    ``state_holder`` is None): it reads and writes the same shared state by the same rules
    (its class, backend and settings: etcd-v3's outage-aware judging included), with a
    cache nobody else touches. For a thread that writes while the handler's own holder is
    in use by its round (``next_rendezvous`` in the agent's loop): torch's holder is not
    thread-safe; two holders of one state meet by its compare-and-swap."""
    holder = state_holder(handler)
    if holder is None:
        return None
    own = copy.copy(holder)
    own._dirty = False
    own._last_sync_time = -1  # its first sync reads the backend (state and token)
    own._cache_duration = 0   # and so does every one after it
    own._dead_nodes = []
    return own


def heartbeat_lock(handler: Any) -> threading.Lock | None:
    """The lock a dynamic handler's heartbeat thread holds while it writes the state."""
    return getattr(handler, "_heartbeat_lock", None)


def stop_heartbeats(handler: Any, seconds: float = 5.0) -> None:
    """Stop a dynamic handler's heartbeats (what its shutdown does besides closing the
    rendezvous), waiting up to ``seconds`` for one under way (torch joins its thread; a
    heartbeat to a silent store could take the store's timeout); nothing for another
    handler."""
    stop = getattr(handler, "_stop_heartbeats", None)
    if callable(stop):
        thread = threading.Thread(target=stop, name="stop-heartbeats", daemon=True)
        thread.start()
        thread.join(seconds)


def remove_expired_nodes(holder: Any) -> None:
    """torch's removal of the nodes whose heartbeats expired, this round's epilogue
    included, on ``holder``'s state."""
    holder._sanitize()
