"""The ``etcd-v3`` rendezvous handler: torch's ``DynamicRendezvousHandler`` on etcd v3.

``build_handler`` composes it from a ``KV`` (a real etcd or a fake): the backend holds the
rendezvous state, the store serves the agents, one lease expires both. The handler is
torch's, with two additions (``EtcdV3RendezvousHandler``):

- it notices when it is no longer a participant of the round it joined — the others took
  it for dead (missed heartbeats) and formed a world without it — and then reports a
  waiting node, so its agent restarts its workers and rejoins instead of training on as a
  second, split-off world;
- it times each rendezvous and hands the duration to the workers the agent spawns next
  (``elastic-train run`` replaces it with the agent's own, slightly longer, measurement).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from elastic_train.env import RENDEZVOUS_SECONDS, set_for_workers
from elastic_train.rendezvous.backend import EtcdV3RendezvousBackend
from elastic_train.rendezvous.client import KV, EtcdKV
from elastic_train.rendezvous.lease import SharedLease
from elastic_train.rendezvous.options import EtcdV3Options
from elastic_train.rendezvous.store import EtcdStore

log = logging.getLogger(__name__)


class EtcdV3RendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, with split-world detection and timing (module doc)."""

    _joined_round: int | None = None

    def next_rendezvous(self) -> RendezvousInfo:
        started = time.monotonic()
        info = super().next_rendezvous()
        self._joined_round = self._state_holder.state.round
        set_for_workers(RENDEZVOUS_SECONDS, f"{time.monotonic() - started:.3f}")
        return info

    def num_nodes_waiting(self) -> int:
        waiting = super().num_nodes_waiting()
        state = self._state_holder.state
        if self._joined_round is not None and not state.closed and (
                state.round != self._joined_round or self._this_node not in state.participants):
            log.warning("this node is no longer part of rendezvous round %s (now round %s): "
                        "the others took it for dead; rejoining", self._joined_round,
                        state.round)
            self._joined_round = None
            return max(waiting, 1)
        return waiting


def connect(options: EtcdV3Options) -> EtcdKV:
    """The etcd client the options describe (no request is made yet)."""
    return EtcdKV(options.endpoint, options.credentials, options.request_timeout)


def build_handler(kv: KV, options: EtcdV3Options, run_id: str, min_nodes: int,
                  max_nodes: int, local_addr: str | None = None) -> EtcdV3RendezvousHandler:
    """A rendezvous handler for ``run_id`` on ``kv`` (a real etcd or a fake)."""
    lease = SharedLease(kv, options.state_ttl)
    backend = EtcdV3RendezvousBackend(kv, run_id, options.key_prefix, lease)
    store = EtcdStore(kv, f"{options.key_prefix}/{run_id}/store/", lease,
                      timedelta(seconds=options.read_timeout))
    timeout = RendezvousTimeout(
        join=timedelta(seconds=options.join_timeout),
        last_call=timedelta(seconds=options.last_call_timeout),
        close=timedelta(seconds=options.close_timeout),
        heartbeat=timedelta(seconds=options.heartbeat_timeout))
    return EtcdV3RendezvousHandler.from_backend(
        run_id, store, backend, min_nodes, max_nodes, local_addr, timeout,
        keep_alive_interval=options.keep_alive_interval,  # type: ignore[arg-type]
        keep_alive_max_attempt=options.keep_alive_max_attempt)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's creator for ``--rdzv-backend etcd-v3``."""
    options = EtcdV3Options.parse(params.endpoint, params.config)
    return build_handler(connect(options), options, params.run_id, params.min_nodes,
                         params.max_nodes, params.local_addr)
