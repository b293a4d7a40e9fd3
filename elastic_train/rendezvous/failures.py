"""One actionable line for the rendezvous errors torch raises without a message.

torch is imported when a line is asked for, not at load: the launcher imports this before
it imports torch (agent/worker_start.py).
"""

from __future__ import annotations

from elastic_train.rendezvous.backends import capabilities


def rendezvous_failure_line(exc: BaseException, *, backend: str, endpoint: str, run_id: str,
                            nnodes: str) -> str | None:
    """The line for ``exc`` if it is a rendezvous error torch leaves unexplained, else None.

    ``backend``, ``endpoint``, ``run_id`` and ``nnodes`` are the launch's ``--rdzv-*`` and
    ``--nnodes`` options as the user gave them.
    """
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    where = f"rendezvous {run_id!r} ({backend} at {endpoint})"
    if isinstance(exc, RendezvousClosedError):
        return (f"{where} is closed: a job with this --rdzv-id already finished; use a new "
                "--rdzv-id")
    if isinstance(exc, RendezvousConnectionError) and capabilities(backend).store_in_an_agent:
        return (f"{where}: the store refused this node (the node that held it was lost, "
                f"or started again with a new store): a {backend} job cannot outlive its "
                "store's "
                "node; restart the job (it resumes from its newest checkpoint), or run it "
                "on --rdzv-backend etcd-v3, which survives the loss of any node")
    if isinstance(exc, RendezvousTimeoutError):
        return (f"{where} did not complete within its join_timeout: start the other nodes "
                f"(--nnodes {nnodes}) or lower the minimum")
    return None
