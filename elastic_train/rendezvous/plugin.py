"""The ``torchrun.handlers`` entry point of ``--rdzv-backend etcd-v3``.

At import, ``torch.distributed.elastic.rendezvous`` calls ``handler_creator()`` and
registers what it returns under the entry point's name, ``etcd-v3`` (pyproject.toml). So
after ``pip install``, ``torchrun --rdzv-backend=etcd-v3 --rdzv-endpoint=HOST:2379 ...``
works, and so does ``elastic-train run --rdzv-backend etcd-v3``.

This module imports nothing at load: torch loads it while its own rendezvous package is
still initialising, and the handler's modules import that package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousHandler,
        RendezvousParameters,
    )


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's creator for ``--rdzv-backend etcd-v3`` (etcd_v3/create.py)."""
    from elastic_train.rendezvous.etcd_v3.create import create_handler as create

    return create(params)


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The entry point: a zero-argument function returning the handler creator."""
    return create_handler
