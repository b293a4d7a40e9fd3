"""The agents' memory tier as checkpoints use it: what it offers (``MemoryTier``, served by
worker/memory_tier.py), and a save's side of it (``MemoryOffers``): each snapshot offered to
the agents' holders before its durable write, and, on an object store, the upload the
agent's holder writes behind it (agent/write_behind.py). A restore's side is restore.py.

Nothing here ever fails a save: the durable store has every checkpoint; a holder that does
not take one is said once per outage.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from elastic_train.checkpoint import sharded_save
from elastic_train.checkpoint.api import PayloadUpload, Serialized
from elastic_train.errors import ElasticTrainError, MemoryTierError, StorageRefusedError

__all__ = ["MemoryOffers", "MemoryTier"]

log = logging.getLogger(__name__)


class MemoryTier(Protocol):
    """The agents' memory tier as a checkpoint manager uses it (worker/memory_tier.py)."""

    endpoint: Any

    def offer(self, manifest: Mapping[str, Any], payload: bytes | memoryview) -> int: ...

    def newest(self) -> dict[str, Any] | None: ...

    def kept(self, part: int) -> list[dict[str, Any]]: ...

    def fetch(self, manifest: Mapping[str, Any]) -> bytes: ...

    def upload(self, manifest: Mapping[str, Any], url: str,
               client_options: Mapping[str, Any]) -> float: ...


class MemoryOffers:
    """One rank's offers to the agents' memory tier, and what the last one achieved."""

    def __init__(self, memory: MemoryTier) -> None:
        self.memory = memory
        self.copies: int | None = None
        """How many agents hold the newest snapshot in memory (None: not held)."""
        self.seconds: float | None = None
        self._failed = False
        self._upload_failed = False

    def offer(self, step: int, epoch: int | None, payload: Serialized,
              meta: Mapping[str, Any], extra: Mapping[str, Any] | None = None
              ) -> dict[str, Any] | None:
        """Give the memory tier checkpoint ``step`` (written under writer ``epoch``) before
        its durable write; the manifest it holds it under (None: not held)."""
        began = time.monotonic()
        self.copies = self.seconds = None
        manifest = {"writer_epoch": epoch if epoch is not None else 0, "step": step,
                    "sha256": payload.sha256, "bytes": payload.bytes,
                    "world_size": meta.get("world_size"), "time": time.time(),
                    "model_digest": meta.get("model_digest"), **(extra or {})}
        try:
            self.copies = self.memory.offer(manifest, payload.data)
        except ElasticTrainError as exc:
            if not self._failed:
                log.warning("the agents' memory tier did not take checkpoint %d (%s): the "
                            "durable store has it (said once per outage)", step, exc)
            self._failed = True
            return None
        self._failed = False
        self.seconds = time.monotonic() - began
        return manifest

    def offer_parts(self, step: int, epoch: int | None, generation: int,
                    encoded: sharded_save.EncodedShards, world_size: int) -> None:
        """Give the memory tier this rank's part of a sharded save (before its durable
        write): every rank offers its own (rank 0 also the common state, as part
        ``world_size``), under the same writer epoch, step and generation, so that a
        restore finds them all (restore.parts_in_memory)."""
        for part, data in encoded.payloads().items():
            if self.offer(step, epoch, Serialized(data, hashlib.sha256(data).hexdigest()),
                          {"world_size": world_size},
                          {"part": part, "parts": world_size + 1,
                           "generation": generation}) is None:
                return

    def upload_behind(self, offered: Mapping[str, Any],
                      uploaded_by: Callable[[str], None]) -> PayloadUpload:
        """The agent's holder uploads the payload it was just offered (the object store
        written behind the memory tier, agent/write_behind.py); this process uploads it
        itself where the holder could not try, or its credentials were refused (this
        process may hold others). ``uploaded_by`` is told who did: ``agent`` or
        ``worker``."""
        memory = self.memory

        def upload(url: str, options: Mapping[str, Any], payload: Serialized) -> bool:
            try:
                memory.upload(offered, url, options)
            except (MemoryTierError, StorageRefusedError) as exc:
                if not self._upload_failed:
                    log.warning("the agent did not upload checkpoint %s (%s): this worker "
                                "uploads it (said once per outage)", offered["step"], exc)
                self._upload_failed = True
                uploaded_by("worker")
                return False
            self._upload_failed = False
            uploaded_by("agent")
            return True

        return upload
