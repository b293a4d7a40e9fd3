"""The ``etcd-v3`` rendezvous for torchrun: a ``DynamicRendezvousHandler`` on etcd's v3 API.

torch finds it through the ``torchrun.handlers`` entry point (see pyproject.toml): at
import, ``torch.distributed.elastic.rendezvous`` calls ``handler_creator()`` and registers
what it returns under the entry point's name, ``etcd-v3``. So after ``pip install``,
``torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:2379 ...`` works, and so does
``elastic-train run --rdzv-backend etcd-v3``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from elastic_train.rendezvous.backend import EtcdV3RendezvousBackend
from elastic_train.rendezvous.client import KV, EtcdKV
from elastic_train.rendezvous.lease import SharedLease
from elastic_train.rendezvous.options import EtcdV3Options
from elastic_train.rendezvous.store import EtcdStore


def connect(options: EtcdV3Options) -> EtcdKV:
    """The etcd client the options describe (no request is made yet)."""
    return EtcdKV(options.endpoint, options.credentials, options.request_timeout)


def build_handler(kv: KV, options: EtcdV3Options, run_id: str, min_nodes: int,
                  max_nodes: int, local_addr: str | None = None) -> DynamicRendezvousHandler:
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
    return DynamicRendezvousHandler.from_backend(
        run_id, store, backend, min_nodes, max_nodes, local_addr, timeout,
        keep_alive_interval=options.keep_alive_interval,  # type: ignore[arg-type]
        keep_alive_max_attempt=options.keep_alive_max_attempt)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's creator for ``--rdzv-backend etcd-v3``."""
    options = EtcdV3Options.parse(params.endpoint, params.config)
    return build_handler(connect(options), options, params.run_id, params.min_nodes,
                         params.max_nodes, params.local_addr)


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: a zero-argument function returning the creator."""
    return create_handler
