"""The DataLoader ``ElasticSession.dataloader`` makes: its iterator starts again at the step
to train on when the world re-formed in place (what it read ahead, prefetched by its worker
processes, was cut for the old world or belongs to a step now redone)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

__all__ = ["ElasticDataLoader"]


class ElasticDataLoader(DataLoader):
    """A DataLoader over an ``ElasticBatchSampler`` that follows its reshards."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return _RestartingIterator(self)


class _RestartingIterator:
    def __init__(self, loader: ElasticDataLoader) -> None:
        self._loader = loader
        self._sampler = loader.batch_sampler
        self._seen = self._sampler.reshards
        self._inner = DataLoader.__iter__(loader)

    def __iter__(self) -> _RestartingIterator:
        return self

    def __next__(self) -> Any:
        if self._sampler.reshards != self._seen:
            self._seen = self._sampler.reshards
            self._inner = DataLoader.__iter__(self._loader)
        return next(self._inner)

    def __len__(self) -> int:
        return len(self._sampler)
