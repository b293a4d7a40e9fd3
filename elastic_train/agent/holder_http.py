"""The memory tier's holder on HTTP: each request of the protocol (live/memory_tier.py)
checked (the bearer token, sizes, the manifest) and answered from the agent's
``SnapshotHolder`` (agent/snapshot_holder.py), one thread per request (stdlib
``ThreadingHTTPServer``). Payloads stay opaque bytes: nothing is ever unpickled here."""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import urllib.parse
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from elastic_train.agent.write_behind import UploadFailed
from elastic_train.live.memory_tier import (
    AUTHORIZATION,
    MANIFEST_HEADER,
    MAX_MANIFEST_BYTES,
    NEWEST_PATH,
    PAYLOAD_PATH,
    REPLICA_HEADER,
    SNAPSHOT_PATH,
    UPLOAD_PATH,
    Response,
    check_manifest,
)
from elastic_train.thread_priority import lower_thread_priority

if TYPE_CHECKING:
    from elastic_train.agent.snapshot_holder import SnapshotHolder

__all__ = ["CHUNK", "IO_SECONDS", "HolderServer"]

log = logging.getLogger("elastic_train.agent.snapshot_holder")

IO_SECONDS = 10.0
"""How long one read or write to a peer (or from a client) may take."""
CHUNK = 1 << 20
"""The bytes of a payload read or written at a time."""


class HolderServer(ThreadingHTTPServer):
    """The holder's server: ``holder`` answers, ``HolderRequests`` reads the requests."""

    daemon_threads = True
    allow_reuse_address = False

    def __init__(self, address: tuple[str, int], holder: SnapshotHolder) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.holder = holder
        super().__init__(address, HolderRequests)


def _wanted(query: Mapping[str, str]) -> dict[str, Any] | None:
    """The snapshot a query names (``payload_query``); None when it names none."""
    try:
        wanted: dict[str, Any] = {"run_id": query["run_id"],
                                  "writer_epoch": int(query["writer_epoch"]),
                                  "step": int(query["step"]), "sha256": query["sha256"]}
        if "part" in query:
            wanted["part"] = int(query["part"])
        return wanted
    except (KeyError, ValueError):
        return None


class HolderRequests(BaseHTTPRequestHandler):
    server_version = "elastic-train-memory-tier"
    protocol_version = "HTTP/1.0"
    timeout = IO_SECONDS
    server: HolderServer

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("memory tier: %s %s", self.address_string(), format % args)

    # ---- answers ---------------------------------------------------------------------------
    def _answer(self, status: int, payload: Mapping[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _refuse(self, status: int, line: str, body_left: int = 0) -> None:
        """Answer ``status`` with ``line``; a body of at most the limit is read and dropped
        first, so the client reads the answer rather than a reset connection."""
        if 0 < body_left <= self.server.holder.max_bytes:
            self._drain(body_left)
        self._answer(status, {"error": line})

    def _drain(self, left: int) -> None:
        while left > 0:
            chunk = self.rfile.read(min(CHUNK, left))
            if not chunk:
                return
            left -= len(chunk)

    def _query(self) -> tuple[str, dict[str, str]]:
        parsed = urllib.parse.urlsplit(self.path)
        return parsed.path, dict(urllib.parse.parse_qsl(parsed.query))

    def _length(self) -> int:
        try:
            return max(0, int(self.headers.get("Content-Length", "")))
        except ValueError:
            return -1

    # ---- requests --------------------------------------------------------------------------
    def _admitted(self, method: str, expected: str) -> tuple[dict[str, str], int] | None:
        """A write's (query, body length) when it carries the token and names
        ``expected``; else None, refused (its body drained). Writes (a checkpoint's copy,
        an upload) run at idle priority, like the checkpoint writer: never before training."""
        lower_thread_priority()
        path, query = self._query()
        length = self._length()
        if not self.server.holder.authorized(self.headers.get(AUTHORIZATION)):
            self._refuse(401, "wrong or missing bearer token", length)
            return None
        if path != expected:
            self._refuse(404, f"no {path} here ({method} {expected})", length)
            return None
        return query, length

    def do_PUT(self) -> None:
        holder = self.server.holder
        admitted = self._admitted("PUT", SNAPSHOT_PATH)
        if admitted is None:
            return
        _, length = admitted
        raw = self.headers.get(MANIFEST_HEADER, "")
        try:
            if len(raw) > MAX_MANIFEST_BYTES:
                raise ValueError(f"the manifest is over {MAX_MANIFEST_BYTES} bytes")
            manifest = check_manifest(json.loads(raw or "null"))
        except ValueError as exc:
            self._refuse(400, f"{MANIFEST_HEADER}: {exc}", length)
            return
        if length != manifest["bytes"]:
            self._refuse(400, f"Content-Length {length} is not the manifest's "
                              f"{manifest['bytes']} bytes", length)
            return
        refused = holder.refusal(manifest)
        if refused is not None:
            self._refuse(*refused, length)
            return
        payload = bytearray(length)
        view, got = memoryview(payload), 0
        while got < length:
            n = self.rfile.readinto(view[got:])
            if not n:
                break
            got += n
        if got != length:
            self._answer(400, {"error": f"the body ended after {got} of {length} bytes"})
            return
        if hashlib.sha256(payload).hexdigest() != manifest["sha256"]:
            self._answer(400, {"error": "the payload's sha256 is not the manifest's: "
                                        "corrupt in transit or in the sender's memory"})
            return
        if not holder.keep(manifest, payload):
            self._answer(409, {"error": "a newer snapshot arrived meanwhile"})
            return
        held_by = [holder.url]
        if self.headers.get(REPLICA_HEADER) != "1":
            held_by += holder.replicate(manifest, payload)
        self._answer(200, {"copies": len(held_by), "held_by": held_by,
                           "manifest": manifest})

    def do_GET(self) -> None:
        holder = self.server.holder
        if not holder.authorized(self.headers.get(AUTHORIZATION)):
            self._answer(401, {"error": "wrong or missing bearer token"})
            return
        path, query = self._query()
        ask_peers = query.get("peers") == "1"
        run_id = query.get("run_id", "")
        if not run_id:
            self._answer(400, {"error": "give run_id"})
        elif path == NEWEST_PATH:
            try:
                part = int(query["part"]) if "part" in query else None
            except ValueError:
                self._answer(400, {"error": "part is not a number"})
                return
            manifest, held_by, kept = holder.newest(run_id, ask_peers, part)
            self._answer(200, {"manifest": manifest, "held_by": held_by, "kept": kept})
        elif path == PAYLOAD_PATH:
            self._payload(query, ask_peers)
        else:
            self._answer(404, {"error": f"no {path} here"})

    def do_POST(self) -> None:
        holder = self.server.holder
        admitted = self._admitted("POST", UPLOAD_PATH)
        if admitted is None:
            return
        query, length = admitted
        if not 0 < length <= MAX_MANIFEST_BYTES:
            self._refuse(400, f"give a JSON body of at most {MAX_MANIFEST_BYTES} bytes", length)
            return
        wanted = _wanted(query)
        try:
            body = json.loads(self.rfile.read(length))
            url, options = body["url"], body.get("storage") or {}
            if wanted is None or not isinstance(url, str) or not isinstance(options, dict):
                raise ValueError("give run_id, writer_epoch, step, sha256 and a body "
                                 '{"url": "s3://...", "storage": {...}}')
        except (ValueError, KeyError, TypeError) as exc:
            self._answer(400, {"error": str(exc)})
            return
        payload = holder.local_payload(wanted)
        if payload is None:
            self._answer(404, {"error": f"step {wanted['step']} (writer epoch "
                                        f"{wanted['writer_epoch']}) is not held here"})
            return
        try:
            seconds = holder.uploads.upload(payload, url, options)
        except ValueError as exc:
            self._answer(400, {"error": str(exc)})
            return
        except UploadFailed as exc:
            self._answer(502, {"error": str(exc), "kind": exc.kind})
            return
        self._answer(200, {"seconds": round(seconds, 6)})

    def _payload(self, query: Mapping[str, str], ask_peers: bool) -> None:
        holder = self.server.holder
        wanted = _wanted(query)
        if wanted is None:
            self._answer(400, {"error": "give run_id, writer_epoch, step and sha256"})
            return
        local = holder.local_payload(wanted)
        if local is not None:
            self._send_bytes(local)
            return
        answer = holder.peer_payload(wanted) if ask_peers else None
        if answer is None:
            self._answer(404, {"error": f"no holder keeps step {wanted['step']} (writer "
                                        f"epoch {wanted['writer_epoch']}) of this run"})
            return
        try:
            self._relay(answer)
        finally:
            answer.close()

    def _send_bytes(self, payload: bytearray) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        view = memoryview(payload)
        for start in range(0, len(payload), CHUNK):
            self.wfile.write(view[start:start + CHUNK])

    def _relay(self, answer: Response) -> None:
        """Send a peer's payload on as it arrives (never all of it in memory here)."""
        assert answer.stream is not None
        length = int(answer.headers.get("content-length", "0"))
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.end_headers()
        left = length
        while left > 0:
            chunk = answer.stream.read(min(CHUNK, left))
            if not chunk:  # the peer went away: the client sees a short body
                return
            self.wfile.write(chunk)
            left -= len(chunk)



