"""torchrun's creator for ``--rdzv-backend etcd-v3`` (rendezvous/plugin.py calls it): the
options parsed, the etcd client made, and the handler of the design they ask for
(``design=leases``, the default: leases.py; ``design=state-key``: state_key.py)."""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousParameters

from elastic_train.rendezvous.etcd_v3.client import EtcdKV
from elastic_train.rendezvous.etcd_v3.options import EtcdV3Options
from elastic_train.rendezvous.etcd_v3.state_key import build_handler

__all__ = ["connect", "create_handler"]


def connect(options: EtcdV3Options) -> EtcdKV:
    """The etcd client the options describe (no request is made yet)."""
    return EtcdKV(options.endpoint, options.credentials, options.request_timeout)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's creator for ``--rdzv-backend etcd-v3``: ``design=leases`` (the default,
    leases.py) or ``design=state-key`` (state_key.py)."""
    options = EtcdV3Options.parse(params.endpoint, params.config)
    if options.design == "leases":
        from elastic_train.rendezvous.etcd_v3.leases import LeaseRendezvousHandler

        return LeaseRendezvousHandler(connect(options), options, params.run_id,
                                      params.min_nodes, params.max_nodes, params.local_addr)
    return build_handler(connect(options), options, params.run_id, params.min_nodes,
                         params.max_nodes, params.local_addr)
