"""The memory tier of checkpoints, the worker's side: its own agent's snapshot holder.

``MemoryTierClient.from_env()`` finds the holder of the worker's agent
(``live.environment.MEMORY_TIER``; None outside ``elastic-train run`` or with
``--memory-tier off``). The checkpoint manager offers each snapshot it persists
(``offer``: the serialized payload and its manifest, before the durable write; a failure
means "memory tier unavailable" and the durable write goes on) and, at a restart, compares
``newest()`` with the newest durable checkpoint; every rank then ``fetch``es the payload
(checked against the manifest's sha256 and length) and loads it itself, weights only. The
holder copies each snapshot to a second node and answers for its peers, so a worker only
ever talks to its own agent. With an ``s3://`` run directory the manager then asks the
holder to ``upload`` the offered bytes to the payload's object (agent/write_behind.py):
the training process runs no bulk S3 work. Every call is bounded (``CONNECT_SECONDS``,
``IO_SECONDS``).
Protocol: live/memory_tier.py; the holder: agent/snapshot_holder.py.
"""

from __future__ import annotations

import hashlib
import http.client
import json
from collections.abc import Mapping
from typing import Any

from elastic_train.errors import MemoryTierError, StorageRefusedError, StorageUnavailableError
from elastic_train.live.memory_tier import (
    MANIFEST_HEADER,
    SNAPSHOT_PATH,
    UPLOAD_PATH,
    Endpoint,
    Response,
    call,
    check_manifest,
    encode_manifest,
    newest_query,
    payload_query,
)
from elastic_train.worker.env import read_worker_env

__all__ = ["MemoryTierClient"]

CONNECT_SECONDS = 2.0
"""How long the agent's holder may take to accept a connection (it is on this host)."""
IO_SECONDS = 15.0
"""How long one read or write may take: the holder answers an offer after its copy to a
peer (a dead peer costs it about 1 s) and ``newest`` after asking its peers (at most 3.5 s);
a payload moves in many reads, each bounded."""
COPY_RATE = 100e6
"""Bytes per second a holder's copy to its peer is given, on top of ``IO_SECONDS``, before
an offer stops waiting for its answer (the copy is made before the holder answers)."""
UPLOAD_RATE = 5e6
"""The slowest upload to an object store an ``upload`` waits out (bytes per second), on
top of every retry its client options allow, before it gives up on the holder."""


class MemoryTierClient:
    """Calls to the agent's snapshot holder at ``endpoint``, for run ``run_id``."""

    def __init__(self, endpoint: Endpoint, run_id: str) -> None:
        self.endpoint = endpoint
        self.run_id = run_id
        self.held_by: list[str] = []
        """Where the last offer is held (holders' urls)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MemoryTierClient | None:
        """The client of this worker's agent's holder; None when the agent has none (the
        variable is absent: plain torchrun, --memory-tier off, a process outside an agent).
        Raises ``MemoryTierError`` when the variable is there but unreadable."""
        env = read_worker_env(environ)
        if not env.memory_tier:
            return None
        try:
            endpoint = Endpoint.from_json(env.memory_tier)
        except ValueError as exc:
            raise MemoryTierError(f"the memory tier's variable holds no holder ({exc}): "
                                  "unset it, or run under elastic-train run") from None
        return cls(endpoint, env.run_id)

    def offer(self, manifest: Mapping[str, Any], payload: bytes | bytearray | memoryview
              ) -> int:
        """Give the holder ``payload`` (``manifest``: at least run_id, writer_epoch, step,
        sha256 and bytes; run_id defaults to this worker's); the number of copies held now
        (1: this node's only, 2: another node's too). Raises ``MemoryTierError``."""
        checked = self._checked({"run_id": self.run_id, **manifest})
        if len(payload) != checked["bytes"]:
            raise MemoryTierError(f"memory tier: the payload has {len(payload)} bytes, its "
                                  f"manifest says {checked['bytes']}: a caller's bug")
        limit = self.endpoint.max_bytes
        if limit and len(payload) > limit:
            raise MemoryTierError(f"memory tier: step {checked['step']}'s {len(payload)} "
                                  f"bytes are over the holders' limit of {limit} "
                                  "(--memory-tier-limit): only the durable store has it")
        answer = self._call("PUT", SNAPSHOT_PATH, payload,
                            {MANIFEST_HEADER: encode_manifest(checked),
                             "Content-Type": "application/octet-stream"},
                            IO_SECONDS + len(payload) / COPY_RATE)
        if answer.status != 200:
            raise self._refused(answer, f"did not take step {checked['step']}")
        data = answer.json()
        self.held_by = [str(u) for u in data.get("held_by", [])]
        return int(data.get("copies", 1))

    def upload(self, manifest: Mapping[str, Any], url: str, client_options: Mapping[str, Any]
               ) -> float:
        """Have the holder upload the payload ``manifest`` names (offered before) to the
        object ``url``, reached with ``client_options`` (``ObjectStore.client_options``);
        the seconds the holder took, once the bytes are in.

        Raises ``MemoryTierError`` when the holder could not try (it holds that step no
        more, it is gone, its agent has no S3 client for these options: the caller
        uploads itself) and the store's own error (``StorageRefusedError``,
        ``StorageUnavailableError``, its line) when the holder tried and the store said no."""
        checked = self._checked({"run_id": self.run_id, **manifest})
        body = json.dumps({"url": url, "storage": dict(client_options)}).encode()
        attempts = int(client_options.get("max_attempts") or 3)
        patience = (float(client_options.get("connect_timeout") or 5.0)
                    + float(client_options.get("read_timeout") or 20.0)) * attempts
        answer = self._call("POST", payload_query(checked, peers=False, path=UPLOAD_PATH),
                            body, {"Content-Type": "application/json"},
                            IO_SECONDS + 2 * patience + checked["bytes"] / UPLOAD_RATE)
        if answer.status == 200:
            return float(answer.json().get("seconds", 0.0))
        if answer.status == 502:
            found = answer.json()
            failure = {"refused": StorageRefusedError,
                       "unavailable": StorageUnavailableError}.get(found.get("kind"))
            if failure is not None:
                raise failure(str(found.get("error", "")))
        raise self._refused(answer, f"did not upload step {checked['step']} to {url}")

    def newest(self, part: int | None = None) -> dict[str, Any] | None:
        """The manifest of the newest snapshot of this run (of a sharded checkpoint's
        ``part``) that the agents' holders keep (this node's and its peers'), or None.
        Raises ``MemoryTierError``."""
        answer = self._call("GET", newest_query(self.run_id, peers=True, part=part))
        if answer.status != 200:
            raise self._refused(answer, "did not say what it holds")
        try:
            found = answer.json().get("manifest")
            return check_manifest(found) if found is not None else None
        except (ValueError, AttributeError) as exc:
            raise MemoryTierError(f"memory tier: the holder at {self.endpoint.url} answered "
                                  f"a bad manifest ({exc})") from None

    def kept(self, part: int) -> list[dict[str, Any]]:
        """Every snapshot of ``part`` of this run's sharded checkpoints that the agents'
        holders keep, newest first. Raises ``MemoryTierError``."""
        answer = self._call("GET", newest_query(self.run_id, peers=True, part=part))
        if answer.status != 200:
            raise self._refused(answer, f"did not say which snapshots of part {part} it holds")
        try:
            return [check_manifest(k) for k in answer.json().get("kept") or []]
        except (ValueError, AttributeError) as exc:
            raise MemoryTierError(f"memory tier: the holder at {self.endpoint.url} answered "
                                  f"a bad manifest ({exc})") from None

    def fetch(self, manifest: Mapping[str, Any]) -> bytes:
        """The payload ``manifest`` names, from this node's holder or through it from a
        peer's; checked against the manifest's length and sha256. Raises
        ``MemoryTierError`` (not held anymore, or corrupt)."""
        checked = self._checked({"run_id": self.run_id, **manifest})
        answer = self._call("GET", payload_query(checked, peers=True))
        if answer.status != 200:
            raise self._refused(answer, f"has no step {checked['step']} to give")
        payload = answer.body
        if len(payload) != checked["bytes"]:
            raise MemoryTierError(f"memory tier: step {checked['step']} came with "
                                  f"{len(payload)} of {checked['bytes']} bytes (a holder went "
                                  "away while sending): restore from the durable store")
        if hashlib.sha256(payload).hexdigest() != checked["sha256"]:
            raise MemoryTierError(f"memory tier: step {checked['step']}'s bytes do not match "
                                  "its sha256: restore from the durable store")
        return payload

    # ---- calls -----------------------------------------------------------------------------
    def _checked(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return check_manifest(manifest)
        except ValueError as exc:
            raise MemoryTierError(f"memory tier: {exc}: a caller's bug") from None

    def _call(self, method: str, path: str, body: bytes | bytearray | memoryview | None = None,
              headers: Mapping[str, str] | None = None, io_seconds: float = IO_SECONDS
              ) -> Response:
        try:
            return call(self.endpoint, method, path, body, headers,
                        connect_seconds=CONNECT_SECONDS, io_seconds=io_seconds)
        except (OSError, http.client.HTTPException) as exc:
            raise MemoryTierError(f"memory tier: the agent's holder at {self.endpoint.url} "
                                  f"did not answer ({type(exc).__name__}: {exc}): its agent "
                                  "is gone or stuck; the durable store is used") from None

    def _refused(self, answer: Response, what: str) -> MemoryTierError:
        try:
            reason = str(answer.json().get("error", ""))
        except (ValueError, AttributeError):
            reason = ""
        return MemoryTierError(f"memory tier: the holder at {self.endpoint.url} {what} "
                               f"({answer.status}: {reason or 'no reason given'})")
