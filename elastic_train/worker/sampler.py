"""A resumable, resize-aware sampler.

The order of an epoch is a permutation derived from (seed, epoch); the sampler's whole
state is (epoch, samples of that epoch consumed). Each optimizer step takes the next
``global_batch`` indices of the order and splits them among today's ranks, so a resume —
at the same or at another world size — continues exactly where the last checkpoint was,
with no sample of the epoch repeated or skipped. The tail of an epoch that cannot fill a
global batch is dropped (like ``drop_last=True``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from elastic_train.batch_shares import shard_bounds
from elastic_train.worker.seeding import derive_seed


@dataclass(frozen=True)
class GlobalBatch:
    """The indices of one optimizer step: ``indices`` is the whole global batch."""

    epoch: int
    offset: int
    indices: torch.Tensor

    def shard(self, rank: int, world_size: int) -> torch.Tensor:
        """This rank's contiguous part (sizes differ by at most one)."""
        start, stop = shard_bounds(len(self.indices), rank, world_size)
        return self.indices[start:stop]


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of ``range(num_samples)`` used in ``epoch``."""
    generator = torch.Generator().manual_seed(derive_seed(seed, "data-order", epoch))
    return torch.randperm(num_samples, generator=generator)


class ResumableSampler:
    """Hands out global batches in (seed, epoch) order; state is (epoch, consumed)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples <= 0:
            raise ValueError("a sampler needs at least one sample")
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0
        self.consumed = 0
        self._order: tuple[int, torch.Tensor] | None = None

    def order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.num_samples, self.seed, epoch))
        return self._order[1]

    def next_batch(self, global_batch: int) -> GlobalBatch:
        """The next ``global_batch`` indices; rolls to the next epoch when this one is short."""
        if global_batch > self.num_samples:
            raise ValueError(f"global batch {global_batch} exceeds the {self.num_samples} "
                             "samples of the dataset")
        if self.consumed + global_batch > self.num_samples:
            self.epoch += 1
            self.consumed = 0
        indices = self.order(self.epoch)[self.consumed:self.consumed + global_batch]
        batch = GlobalBatch(self.epoch, self.consumed, indices)
        self.consumed += global_batch
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for {state['num_samples']} samples with seed {state['seed']}, "
                f"this dataset has {self.num_samples} samples with seed {self.seed}")
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])


class ElasticBatchSampler:
    """A drop-in for ``DistributedSampler`` in hand-written loops: a DataLoader batch sampler.

    Give it to ``DataLoader(dataset, batch_sampler=...)``. ``batch_size`` is the global
    batch; each rank yields its share of every global batch of the epoch, starting at the
    resumed offset. The training loop calls ``advance()`` after each optimizer step (the
    DataLoader may prefetch, so what was yielded is not what was trained on).
    """

    def __init__(self, dataset_len: int, batch_size: int, rank: int, world_size: int,
                 seed: int = 0) -> None:
        self.sampler = ResumableSampler(dataset_len, seed)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self._cursor = 0
        """Offset in the epoch's order of the next batch handed out."""
        self.reshards = 0
        """How often the world re-formed under this sampler (a loader restarts its
        iterator when this changes: what it read ahead is stale)."""

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` — unless it is the epoch being resumed, whose offset is kept."""
        if epoch != self.sampler.epoch:
            self.sampler.epoch, self.sampler.consumed = epoch, 0

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __len__(self) -> int:
        return (self.sampler.num_samples - self.sampler.consumed) // self.batch_size

    @property
    def epoch_finished(self) -> bool:
        """Whether the current epoch was started and has no full batch left (a resume
        right at its end)."""
        return self.sampler.consumed > 0 and len(self) == 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        epoch = self.sampler.epoch
        self._cursor = self.sampler.consumed
        while self.sampler.epoch == epoch:
            offset = self._cursor
            if offset + self.batch_size > self.sampler.num_samples:
                return
            self._cursor = offset + self.batch_size
            lo, hi = shard_bounds(self.batch_size, self.rank, self.world_size)
            yield self.sampler.order(epoch)[offset + lo:offset + hi].tolist()

    @property
    def read_ahead(self) -> int:
        """Batches handed out and not yet trained on (a DataLoader's prefetch)."""
        return max(0, (self._cursor - self.sampler.consumed) // self.batch_size)

    def reshard(self, rank: int, world_size: int, batch_size: int) -> None:
        """The world re-formed in place: this rank's new share, and the next batch handed
        out is the next one to train on (the step in flight is redone)."""
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self._cursor = self.sampler.consumed
        self.reshards += 1

    def advance(self) -> None:
        """Record that one more global batch was trained on."""
        self.sampler.consumed += self.batch_size

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
