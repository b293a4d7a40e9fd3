"""The ``etcd-v3`` rendezvous handler of ``design=state-key``: torch's
``DynamicRendezvousHandler`` on etcd v3 (the default design, ``leases``, is leases.py;
create.py's ``create_handler`` picks).

``build_handler`` composes it from a ``KV`` (a real etcd or a fake): the backend holds the
rendezvous state, the store serves the agents, one lease expires both. The handler is
torch's, with two additions (``EtcdV3RendezvousHandler``):

- it notices when it is no longer a participant of the round it joined — the others took
  it for dead (missed heartbeats) and formed a world without it — and then reports a
  waiting node, so its agent restarts its workers and rejoins instead of training on as a
  second, split-off world;
- it times each rendezvous and hands the duration to the workers the agent spawns next
  (``elastic-train run`` replaces it with the agent's own, slightly longer, measurement);
- it rides out an etcd outage (outage.py): training goes on while etcd is down, a
  rendezvous retries an unreachable etcd for ``connect_timeout``, and nobody is declared
  dead for heartbeats that etcd could not take.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import (
    RendezvousInfo,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    RendezvousTimeout,
)

from elastic_train.live.environment import set_rendezvous_seconds
from elastic_train.rendezvous.etcd_v3.kv import KV, EtcdUnreachableError
from elastic_train.rendezvous.etcd_v3.options import EtcdV3Options
from elastic_train.rendezvous.etcd_v3.outage import Outage, retry_unreachable
from elastic_train.rendezvous.etcd_v3.shared_lease import SharedLease
from elastic_train.rendezvous.etcd_v3.state_backend import EtcdV3RendezvousBackend
from elastic_train.rendezvous.etcd_v3.store import EtcdStore
from elastic_train.rendezvous.torch_seams import (
    JudgingStateHolder,
    new_node_descriptor,
    rendezvous_state,
    this_node,
)

log = logging.getLogger(__name__)


class _OutageAwareStateHolder(JudgingStateHolder):
    """torch's state holder, telling ``outage`` whether etcd answers, and judging no node
    dead right after an outage (see outage.py)."""

    def __init__(self, backend: RendezvousBackend, settings: RendezvousSettings,
                 outage: Outage) -> None:
        super().__init__(backend, settings)
        self._outage = outage

    def sync(self) -> bool | None:
        try:
            return super().sync()
        except EtcdUnreachableError as exc:
            self._outage.failed(exc)
            raise

    def may_judge(self) -> bool:  # after every successful read or write of the state
        self._outage.reached()
        return not self._outage.in_grace


class EtcdV3RendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous, with split-world detection, timing and outage handling
    (module doc)."""

    _joined_round: int | None = None
    _connect_timeout: float = 30.0

    def next_rendezvous(self) -> RendezvousInfo:
        started = time.monotonic()
        info = retry_unreachable(super().next_rendezvous, self._connect_timeout)
        self._joined_round = rendezvous_state(self).round
        set_rendezvous_seconds(time.monotonic() - started)
        return info

    def num_nodes_waiting(self) -> int:
        try:
            waiting = super().num_nodes_waiting()
        except EtcdUnreachableError:
            return 0  # nobody can join while etcd is down: train on (logged by the outage)
        state = rendezvous_state(self)
        if self._joined_round is not None and not state.closed and (
                state.round != self._joined_round or this_node(self) not in state.participants):
            log.warning("this node is no longer part of rendezvous round %s (now round %s): "
                        "the others took it for dead; rejoining", self._joined_round,
                        state.round)
            self._joined_round = None
            return max(waiting, 1)
        return waiting


def build_handler(kv: KV, options: EtcdV3Options, run_id: str, min_nodes: int,
                  max_nodes: int, local_addr: str | None = None) -> EtcdV3RendezvousHandler:
    """A rendezvous handler for ``run_id`` on ``kv`` (a real etcd or a fake)."""
    lease = SharedLease(kv, options.state_ttl)
    backend = EtcdV3RendezvousBackend(kv, run_id, options.key_prefix, lease)
    store = EtcdStore(kv, f"{options.key_prefix}/{run_id}/store/", lease,
                      timedelta(seconds=options.read_timeout),
                      retry_seconds=options.connect_timeout)
    timeout = RendezvousTimeout(
        join=timedelta(seconds=options.join_timeout),
        last_call=timedelta(seconds=options.last_call_timeout),
        close=timedelta(seconds=options.close_timeout),
        heartbeat=timedelta(seconds=options.heartbeat_timeout))
    # As torch's from_backend, with our state holder.
    settings = RendezvousSettings(
        run_id, min_nodes, max_nodes, timeout,
        keep_alive_interval=timedelta(seconds=options.keep_alive_interval),
        keep_alive_max_attempt=options.keep_alive_max_attempt)
    dead_after = options.keep_alive_interval * options.keep_alive_max_attempt
    holder = _OutageAwareStateHolder(backend, settings, Outage(kv.endpoint, dead_after))
    node = new_node_descriptor(local_addr)
    handler = EtcdV3RendezvousHandler(node, settings, backend.name, store, holder)
    handler._connect_timeout = options.connect_timeout
    return handler
