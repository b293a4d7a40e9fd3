"""The memory tier of checkpoints: what an agent's snapshot holder and its workers (and the
other agents' holders) say to each other over HTTP. Stdlib only, torch-free.

Each agent of ``elastic-train run`` keeps a holder (agent/snapshot_holder.py): an HTTP
server on the node's job address that keeps the newest snapshot of the run in memory, as
opaque bytes and a JSON manifest (never unpickled), and copies it to one other agent's
holder before it answers. A worker talks to its own agent's holder only
(worker/memory_tier.py), found in the environment (``live.environment.MEMORY_TIER``: JSON
``{"url": ..., "token": ..., "max_bytes": ...}``); holders find each other in the job's
rendezvous store (``HOLDER_KEY``: JSON ``{"url": ..., "token": ..., "host": ...}``).

Every request carries ``Authorization: Bearer TOKEN`` (the token of the holder called).

A sharded checkpoint (``--parallelism fsdp|hsdp``) is held as parts: each rank offers its
own, its manifest naming ``part`` (the rank) and ``parts`` (the world size of the save). A
holder keeps the newest snapshot of each ``(run_id, part)``; the queries below take
``part=P`` to name one (without it: the unsharded snapshot).

- ``PUT SNAPSHOT_PATH``: the body is the payload, ``MANIFEST_HEADER`` its manifest (JSON,
  at least ``REQUIRED``). Answers 200 ``{"copies": N, "held_by": [URL, ...], "manifest": M}``;
  400 (a bad manifest, a length or sha256 that do not match), 401, 409 (a newer snapshot
  is held, or another run's), 413 (over the holder's ``max_bytes``). A PUT with
  ``REPLICA_HEADER: 1`` comes from another holder and is not copied further.
- ``GET NEWEST_PATH?run_id=R&peers=1[&part=P]``: ``{"manifest": M | null, "held_by":
  [URL, ...], "kept": [M, ...]}``, the newest of this holder's and (``peers=1``) its
  peers'; ``kept``: with ``part``, every snapshot of that part they keep, newest first.
- ``GET PAYLOAD_PATH?run_id=R&writer_epoch=E&step=S&sha256=H&peers=1[&part=P]``: the
  payload's bytes, from this holder or (``peers=1``) through it from a peer that holds them; 404.
- ``POST UPLOAD_PATH?run_id=R&writer_epoch=E&step=S&sha256=H`` (the object store written
  behind the memory tier): the body is JSON ``{"url": "s3://BUCKET/KEY", "storage": {...}}``
  (``storage``: the worker's ``StorageConfig`` fields that reach a store, its endpoint
  resolved); the holder uploads the payload it keeps to that object with its own process's
  credentials and answers once it is in: 200 ``{"seconds": T}``. 400 (a bad body, or a key
  that is not a checkpoint payload's: checkpoint/object_keys.py's ``PAYLOAD_KEY``, the only
  objects a holder writes),
  401, 404 (not held here), 502 ``{"error": LINE, "kind": "refused" | "unavailable" |
  "config"}`` (what the store or the agent's S3 client said).
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["AUTHORIZATION", "BEARER", "HOLDER_KEY", "MANIFEST_HEADER", "MAX_MANIFEST_BYTES",
           "NEWEST_PATH", "PAYLOAD_PATH", "REPLICA_HEADER", "REQUIRED",
           "SNAPSHOT_PATH", "UPLOAD_PATH",
           "Endpoint", "HolderEntry", "Response", "call", "check_manifest", "encode_manifest",
           "is_newer",
           "newest_of", "newest_query", "part_of", "payload_query", "replica_order",
           "same_snapshot", "snapshot_key"]

SNAPSHOT_PATH = "/v1/snapshot"
NEWEST_PATH = "/v1/newest"
PAYLOAD_PATH = "/v1/payload"
UPLOAD_PATH = "/v1/upload"
AUTHORIZATION = "Authorization"
BEARER = "Bearer "
MANIFEST_HEADER = "X-Elastic-Train-Manifest"
REPLICA_HEADER = "X-Elastic-Train-Replica"
MAX_MANIFEST_BYTES = 16 * 1024
"""A manifest travels in a header: its JSON stays under this."""
REQUIRED = ("run_id", "writer_epoch", "step", "sha256", "bytes")
HOLDER_KEY = "elastic_train/memory_tier/holder/{rank}"
"""Where the agent of group rank ``rank`` publishes its holder, in a rendezvous round's
store (per round: a new round's agents publish again)."""


def check_manifest(manifest: object) -> dict[str, Any]:
    """``manifest`` as a dict, checked: ``REQUIRED`` fields of the right types, JSON small
    enough for a header. Raises ``ValueError`` saying what is wrong."""
    if not isinstance(manifest, Mapping):
        raise ValueError("the manifest is not a JSON object")
    found = dict(manifest)
    missing = [k for k in REQUIRED if k not in found]
    if missing:
        raise ValueError(f"the manifest lacks {', '.join(missing)}")
    for key in ("writer_epoch", "step", "bytes"):
        if not isinstance(found[key], int) or isinstance(found[key], bool) or found[key] < 0:
            raise ValueError(f"the manifest's {key} is not a non-negative integer")
    sha = found["sha256"]
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef"
                                                         for c in sha):
        raise ValueError("the manifest's sha256 is not 64 lower-case hex digits")
    if not isinstance(found["run_id"], str) or not found["run_id"]:
        raise ValueError("the manifest's run_id is not a non-empty string")
    for key in ("part", "parts"):
        value = found.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 0):
            raise ValueError(f"the manifest's {key} is not a non-negative integer")
    if (found.get("part") is None) != (found.get("parts") is None) or (
            found.get("part") is not None and found["part"] >= found["parts"]):
        raise ValueError("the manifest's part and parts go together, part below parts")
    if len(encode_manifest(found)) > MAX_MANIFEST_BYTES:
        raise ValueError(f"the manifest is over {MAX_MANIFEST_BYTES} bytes of JSON")
    return found


def encode_manifest(manifest: Mapping[str, Any]) -> str:
    """The manifest as one line of ASCII JSON (a header's value)."""
    return json.dumps(dict(manifest), separators=(",", ":"), sort_keys=True, ensure_ascii=True)


def snapshot_key(manifest: Mapping[str, Any]) -> tuple[int, int]:
    """What orders snapshots of one run: ``(writer_epoch, step)``."""
    return int(manifest["writer_epoch"]), int(manifest["step"])


def is_newer(candidate: Mapping[str, Any], held: Mapping[str, Any] | None) -> bool:
    """Whether ``candidate`` replaces ``held``: a later ``(writer_epoch, step)``, or the
    same one (a step saved again takes the place of the first copy)."""
    return held is None or snapshot_key(candidate) >= snapshot_key(held)


def part_of(manifest: Mapping[str, Any]) -> int | None:
    """The part of a sharded checkpoint ``manifest`` names (a rank); None: unsharded."""
    part = manifest.get("part")
    return int(part) if part is not None else None


def same_snapshot(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return snapshot_key(a) == snapshot_key(b) and a["sha256"] == b["sha256"] \
        and a["run_id"] == b["run_id"] and part_of(a) == part_of(b)


def newest_of(manifests: Iterable[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The newest manifest by ``(writer_epoch, step)`` (the first seen at a tie); None
    when there is none."""
    best: Mapping[str, Any] | None = None
    for manifest in manifests:
        if manifest is not None and (best is None or snapshot_key(manifest) > snapshot_key(best)):
            best = manifest
    return dict(best) if best is not None else None


def payload_query(manifest: Mapping[str, Any], peers: bool, path: str = PAYLOAD_PATH) -> str:
    """``path`` (``PAYLOAD_PATH``, ``UPLOAD_PATH``) with the query that names
    ``manifest``'s payload."""
    query = {"run_id": manifest["run_id"], "writer_epoch": manifest["writer_epoch"],
             "step": manifest["step"], "sha256": manifest["sha256"], "peers": int(peers)}
    if part_of(manifest) is not None:
        query["part"] = part_of(manifest)
    return path + "?" + urllib.parse.urlencode(query)


def newest_query(run_id: str, peers: bool, part: int | None = None) -> str:
    """``NEWEST_PATH`` with the query for ``run_id``'s newest snapshot (of ``part``)."""
    query: dict[str, Any] = {"run_id": run_id, "peers": int(peers)}
    if part is not None:
        query["part"] = part
    return NEWEST_PATH + "?" + urllib.parse.urlencode(query)


@dataclass(frozen=True)
class Endpoint:
    """A holder as its caller knows it: where, and its token."""

    url: str
    token: str
    max_bytes: int = 0
    """0: not said (the holder enforces its own limit anyway)."""

    def to_json(self) -> str:
        return json.dumps({"url": self.url, "token": self.token, "max_bytes": self.max_bytes})

    @classmethod
    def from_json(cls, text: str) -> Endpoint:
        """Raises ``ValueError`` on anything but ``{"url": "http://...", "token": ...}``."""
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("url"), str) \
                or not isinstance(data.get("token"), str) \
                or not data["url"].startswith("http://"):
            raise ValueError("not a holder's {\"url\": \"http://...\", \"token\": ...}")
        limit = data.get("max_bytes", 0)
        return cls(data["url"], data["token"], limit if isinstance(limit, int) else 0)


@dataclass(frozen=True)
class HolderEntry:
    """An agent's holder as it publishes it for the other agents (``HOLDER_KEY``)."""

    url: str
    token: str
    host: str
    rank: int

    def to_json(self) -> str:
        return json.dumps({"url": self.url, "token": self.token, "host": self.host,
                           "rank": self.rank})

    @classmethod
    def from_json(cls, raw: str | bytes) -> HolderEntry:
        data = json.loads(raw)
        return cls(str(data["url"]), str(data["token"]), str(data["host"]), int(data["rank"]))


def replica_order(me: str, my_host: str, entries: Sequence[HolderEntry]) -> list[HolderEntry]:
    """The other holders in the order a snapshot is copied to them: on the ring of group
    ranks from the one after ``me`` (a url), those on another host first (so that one
    machine's loss leaves a copy), then those on this host. Deterministic: every agent
    computes the same order from the same round."""
    ring = sorted((e for e in entries), key=lambda e: e.rank)
    mine = next((i for i, e in enumerate(ring) if e.url == me), -1)
    start = mine + 1 if mine >= 0 else 0
    turned = [e for e in ring[start:] + ring[:start] if e.url != me]
    return [e for e in turned if e.host != my_host] + [e for e in turned if e.host == my_host]


@dataclass
class Response:
    """An answer: its status, headers (lower-case names) and, unless streamed, its body."""

    status: int
    headers: dict[str, str]
    body: bytes
    stream: http.client.HTTPResponse | None = None
    connection: http.client.HTTPConnection | None = None

    def json(self) -> Any:
        return json.loads(self.body or b"null")

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()


def call(endpoint: Endpoint, method: str, path: str, body: bytes | bytearray | memoryview
         | None = None, headers: Mapping[str, str] | None = None, *,
         connect_seconds: float = 1.0, io_seconds: float = 10.0, stream: bool = False
         ) -> Response:
    """One request to a holder; connection errors (refused, a timeout) raise ``OSError``.

    ``connect_seconds`` bounds the connection (a dead host costs that), ``io_seconds`` each
    read or write after it (not the whole transfer: a large payload over a slow link is
    not cut off while it moves). ``stream``: the body is left to read
    (``Response.stream``; close it with ``Response.close``)."""
    parsed = urllib.parse.urlsplit(endpoint.url)
    conn = http.client.HTTPConnection(parsed.hostname or "", parsed.port,
                                      timeout=connect_seconds)
    try:
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(io_seconds)
        sent = {AUTHORIZATION: BEARER + endpoint.token, **(headers or {})}
        if body is not None:
            sent["Content-Length"] = str(len(body))
        try:
            conn.request(method, path, body=body, headers=sent)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the body was read (too large): its answer may be there
        answer = conn.getresponse()
        names = {k.lower(): v for k, v in answer.getheaders()}
        if stream and answer.status == 200:
            return Response(answer.status, names, b"", answer, conn)
        data = answer.read()
    except BaseException:
        conn.close()
        raise
    conn.close()
    return Response(answer.status, names, data)
