"""``--record-samples``: one line per rank and step in RUN_DIR/samples/rank-R.jsonl, the
sample ids the step gave that rank, for audits (each sample once per epoch). A step redone
is recorded again: the last line of a (step, rank) is the one that counts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from elastic_train.events.line_file import LineFile

__all__ = ["SampleRecords"]


class SampleRecords:
    """This worker's record file, opened at its first line (``path_of(rank)``; ``track``
    publishes it where the run dir is an object store)."""

    def __init__(self, path_of: Callable[[int], Path], track: Callable[[Path], None]) -> None:
        self._path_of, self._track = path_of, track
        self._file: LineFile | None = None
        self._rank: int | None = None

    def write(self, *, step: int, epoch: int, offset: int, indices: torch.Tensor,
              world_size: int, restart: int, generation: int, rank: int) -> None:
        if self._file is not None and rank != self._rank:
            self.close()  # the world re-formed: each rank's samples go to its own file
        if self._file is None:
            path = self._path_of(rank)
            self._file, self._rank = LineFile(path, "the sample records"), rank
            self._track(path)
        self._file.write(json.dumps({
            "time": round(time.time(), 6), "step": step, "epoch": epoch, "offset": offset,
            "world_size": world_size, "restart": restart, "generation": generation,
            "rank": rank, "indices": indices.tolist()}))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
