"""Every private name of torch the checkpoint code (checkpoint/) uses, in one place
(``REQUIRED`` declares them; tests/unit/test_torch_seams.py checks that the installed torch
still has each, and that no other module of checkpoint/ touches one).

- ``dtensor_chunk``: where a rank's shard of a DTensor sits in the whole tensor (the
  protocol torch's own distributed checkpoint reads shards by), for a sharded
  checkpoint's index (checkpoint/sharded.py) and the worker's sharded recovery.
"""

from __future__ import annotations

from typing import Any

from elastic_train.torch_private import Private

__all__ = ["REQUIRED", "dtensor_chunk"]

REQUIRED: tuple[Private, ...] = (
    Private("torch.distributed.tensor", "DTensor.__create_chunk_list__",
            "where a rank's shard of a sharded tensor sits in the whole (dtensor_chunk: a "
            "sharded checkpoint's index, checkpoint/sharded.py)", params=()),
)


def dtensor_chunk(tensor: Any) -> tuple[list[int], list[int]]:
    """``(offsets, sizes)`` of this rank's local part of DTensor ``tensor`` in the whole
    tensor."""
    chunks = tensor.__create_chunk_list__()
    if len(chunks) != 1:
        raise ValueError(f"a DTensor with {len(chunks)} local chunks is not supported")
    return list(chunks[0].offsets), list(chunks[0].sizes)
