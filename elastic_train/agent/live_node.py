"""A live agent as a member of the job's worlds: what it opens the first time its group can
re-form in place, and holds for the rest of its life.

- **Its own store**, a TCPStore: its workers read each generation there and report back
  (agent/worker_messages.py; their keys carry torch's restart count), the other agents
  call it there (live/peers.py), and its HOST:PORT is the agent's id in a plan
  (``address``).
- **Its side of the coordination** (live/coordination.py's ``Coordinator``), which holds
  the plan the agent applies.
- **The failure detector** (agent/silent_peers.py), when ``--peer-timeout`` is on: where
  it answers pings (``beat``) goes into every plan.

Kept apart from agent/live_agent.py's hooks, which use a ``LiveNode`` and never build one
piece by piece.
"""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.rendezvous import RendezvousHandler

from elastic_train.agent.live_options import LiveOptions
from elastic_train.agent.silent_peers import SilentPeers
from elastic_train.agent.store_binding import listening_store
from elastic_train.agent.store_watch import STORE_ANSWER_SECONDS
from elastic_train.agent.wake import Wakeup
from elastic_train.agent.worker_messages import WorkerMessages
from elastic_train.live.coordination import FOLLOW_SECONDS, Coordinator
from elastic_train.live.peers import PeerStores, bounded
from elastic_train.live.plan import Plan
from elastic_train.rendezvous.backends import capabilities
from elastic_train.rendezvous.forget import round_node_ids

__all__ = ["LiveNode"]


def open_node_store(worker_group: WorkerGroup, listen_host: str | None
                    ) -> tuple[dist.TCPStore, str]:
    """The agent's own store, for the agent's life (the workers' keys carry the restart
    count), and the host its clients reach it at."""
    options: dict[str, Any] = {"wait_for_workers": False, "timeout": timedelta(seconds=60)}
    if listen_host is not None:  # where its clients are (agent/store_binding.py)
        return listening_store(listen_host, 0, **options), listen_host
    store = dist.TCPStore(worker_group.master_addr or "127.0.0.1", 0, is_master=True,
                          **options)
    return store, worker_group.spec.local_addr or socket.getfqdn()


class LiveNode:
    """This agent's store, id, coordinator and failure detector (see the module).

    ``wake``: the agent loop's wake-up, set by a push to the store and by the detector;
    ``check_store``: run in a thread when a peer falls silent on c10d (agent/store_watch.py)."""

    def __init__(self, worker_group: WorkerGroup, options: LiveOptions, wake: Wakeup,
                 check_store: Callable[[], None]) -> None:
        self.store, host = open_node_store(worker_group, options.listen_host)
        self.address = f"{host}:{self.store.port}"
        """This agent's id in a plan: HOST:PORT of its store."""
        c10d = capabilities(worker_group.spec.rdzv_handler.get_backend()).store_in_an_agent
        self.silence: SilentPeers | None = None
        if options.peer_timeout > 0:
            self.silence = SilentPeers(options.listen_host, host, options.peer_timeout,
                                       wake.set, check_store if c10d else None)
        self.coordinator = Coordinator(
            self.address, self.store, PeerStores(timeout=FOLLOW_SECONDS), options.min_nodes,
            # c10d's store is a TCPStore in one agent: should that node fall silent (or
            # this one be cut off), torch's client would wait forever
            bounded=functools.partial(bounded, seconds=STORE_ANSWER_SECONDS) if c10d
            else lambda call: call(), suspects=self.silent)
        self.beat = self.silence.beat if self.silence is not None else ""
        """Where this agent answers the failure detector's pings (HOST:PORT; "": nowhere)."""
        # its own client, where the store listens (only on --local-addr across hosts)
        wake.watch(self.store, options.listen_host or "127.0.0.1")

    @property
    def plan(self) -> Plan | None:
        """The generation this agent applies (None: none, or torch's way)."""
        return self.coordinator.plan

    def adopt(self, plan: Plan, raw: bytes) -> None:
        """Take ``plan`` as this agent's generation; the detector watches its members."""
        self.coordinator.adopt(plan, raw)
        if self.silence is not None:
            self.silence.adopted(self.address, plan)

    def left_out_of_the_round(self, handler: RendezvousHandler
                              ) -> contextlib.AbstractContextManager[None]:
        """While the agent waits in a rendezvous round: the generation's members that are
        silent leave the rendezvous at once (agent/silent_peers.py)."""
        plan = self.coordinator.plan
        if self.silence is None or plan is None:
            return contextlib.nullcontext()
        return self.silence.left_out_of_the_round(plan, handler)

    def silent_in_round(self, handler: RendezvousHandler) -> Callable[[list[int]], bool]:
        """Whether a member of the round ``handler`` just closed, by its rank there, is an
        agent of the current generation that the failure detector suspects now, not merely
        since the plan (its wait ends at once: agent/round_ranks.py, live/round_waits.py)."""

        def silent(ranks: list[int]) -> bool:
            plan = self.coordinator.plan
            suspects = self.silence.silent_now(plan) if self.silence and plan else set()
            if plan is None or not suspects:
                return False
            nodes = {m.rdzv_node for m in plan.members if m.agent in suspects}
            return bool(nodes & set(round_node_ids(handler, ranks)))

        return silent

    def silent(self) -> set[str]:
        """Members of the current generation the failure detector suspects now."""
        if self.silence is None or self.coordinator.plan is None:
            return set()
        return self.silence.silent(self.coordinator.plan)

    def messages(self, run_id: str, restart_count: int) -> WorkerMessages:
        """The store as this agent's workers of incarnation ``restart_count`` use it."""
        return WorkerMessages(self.store, run_id, restart_count)

    def close(self) -> None:
        """Stop the failure detector (the store lives as long as the process)."""
        if self.silence is not None:
            self.silence.close()
