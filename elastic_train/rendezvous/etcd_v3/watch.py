"""A watch of a key prefix on etcd's JSON gateway (``KV.watch_prefix`` of client.py): one
stream (POST /v3/watch) read by a daemon thread into a ``WatchQueue``."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

from elastic_train.rendezvous.etcd_v3.gateway import failure_reason, unb64
from elastic_train.rendezvous.etcd_v3.kv import (
    EtcdUnreachableError,
    WatchCompacted,
    WatchEvent,
    WatchQueue,
)

__all__ = ["StreamWatch", "watch_refusal"]


def _stream_socket(response: Any) -> socket.socket | None:
    """The socket under a streamed ``requests`` response (urllib3 1.26 and 2.x)."""
    raw = response.raw
    sock = getattr(getattr(raw, "_connection", None), "sock", None)
    if sock is None:
        try:
            sock = raw._fp.fp.raw._sock  # http.client's buffered socket reader
        except AttributeError:
            return None
    return sock if isinstance(sock, socket.socket) else None


def watch_refusal(message: dict[str, Any]) -> str | None:
    """Why etcd refused or ended a watch (not for a compaction); None if it did not."""
    if "error" in message:
        error = message["error"]
        detail = (error.get("message") if isinstance(error, dict) else None) or error
        return str(detail)
    result = message.get("result") or {}
    if result.get("canceled") and not int(result.get("compact_revision", 0) or 0):
        # "rpc error: code = Unauthenticated desc = etcdserver: invalid auth token"
        reason = str(result.get("cancel_reason") or "etcd cancelled the watch")
        return reason.split(" desc = ", 1)[-1]
    return None


def _watch_event(raw: dict[str, Any]) -> WatchEvent:
    kv = raw.get("kv") or {}
    if raw.get("type", "PUT") == "DELETE":
        return WatchEvent("delete", unb64(kv.get("key")).decode(), b"",
                          int(kv.get("mod_revision", 0)), 0)
    return WatchEvent("put", unb64(kv.get("key")).decode(), unb64(kv.get("value")),
                      int(kv.get("mod_revision", 0)), int(kv.get("create_revision", 0)))


class StreamWatch(WatchQueue):
    """``Watch`` on one etcd gateway stream (POST /v3/watch), read by a daemon thread.

    The gateway sends one JSON object a line: {"result": {...}} with "created": true first,
    then "events" (type absent for a put, "DELETE"; revisions as strings), or "canceled"
    with "compact_revision" when the start revision is compacted; {"error": ...} when the
    gateway lost etcd. A connection reset or the end of the stream means etcd went away.
    """

    def __init__(self, endpoint: str, prefix: str, session: Any, response: Any,
                 lines: Iterator[bytes], first: dict[str, Any]) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.prefix = prefix
        self._session = session
        self._response = response
        self._lines = lines
        self._socket = _stream_socket(response)
        if self._socket is not None:
            self._socket.settimeout(None)  # idle for minutes is normal for a watch
        goes_on = self._handle(first)  # "created", maybe with events
        self._thread = threading.Thread(target=self._read, args=(goes_on,),
                                        name=f"etcd-watch {prefix}", daemon=True)
        self._thread.start()

    def _broken(self, reason: str) -> EtcdUnreachableError:
        return EtcdUnreachableError(self.endpoint, f"watching {self.prefix}: {reason}")

    def _read(self, goes_on: bool) -> None:
        try:
            if not goes_on:
                return
            for line in self._lines:
                if self.cancelled:
                    return
                if line.strip() and not self._handle(json.loads(line)):
                    return
            if not self.cancelled:
                self.fail(self._broken("the stream ended"))
        except Exception as exc:  # a reset, a truncated chunk, or our own cancel()
            if not self.cancelled:
                self.fail(self._broken(failure_reason(exc) if not isinstance(exc, ValueError)
                                        else f"unreadable message ({exc})"))
        finally:  # only this thread closes the stream (cancel() only wakes it)
            try:
                self._response.close()
                self._session.close()
            except Exception:
                pass

    def _handle(self, message: dict[str, Any]) -> bool:
        """Queue the events of one message, or the error it ends the watch with (False)."""
        result = message.get("result") or {}
        compact = int(result.get("compact_revision", 0) or 0)
        if compact:
            self.fail(WatchCompacted(compact))
            return False
        refusal = watch_refusal(message)  # {"error": ...}, or cancelled by etcd
        if refusal is not None:
            self.fail(self._broken(refusal))
            return False
        self.push([_watch_event(raw) for raw in result.get("events") or []])
        return True

    def cancel(self) -> None:
        if self.cancelled:
            return
        super().cancel()
        # close() alone does not wake a recv() blocked in the reader thread; shutdown() does,
        # and the reader thread then closes the stream itself.
        if self._socket is not None:
            try:
                self._socket.shutdown(socket.SHUT_RDWR)
                return
            except OSError:
                pass
        try:
            self._response.close()  # no socket to shut down: close from here
        except Exception:
            pass
