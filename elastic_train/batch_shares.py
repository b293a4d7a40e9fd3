"""How one global batch is shared among the ranks of a world: the one rule that the sampler
(worker/sampler.py) splits by and the metrics (observe/metrics.py) count each rank's
samples by. Pure, torch-free."""

from __future__ import annotations

__all__ = ["shard_bounds"]


def shard_bounds(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s share of a batch of ``batch_size`` split ``world_size``
    ways: contiguous, sizes differing by at most one, the larger ones first."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
