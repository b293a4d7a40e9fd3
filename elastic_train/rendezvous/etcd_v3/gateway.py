"""etcd's v3 JSON gateway, the wire format: keys and values in base64, ranges by their end
key, transactions of at most ``MAX_TXN_OPS`` operations, and the short cause of a failed
request (client.py and watch.py speak it)."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from elastic_train.rendezvous.etcd_v3.kv import KeyValue

__all__ = ["MAX_TXN_OPS", "absent", "b64", "chunks", "failure_reason", "key_value",
           "prefix_end", "put_request", "stream_session", "unb64"]

T = TypeVar("T")

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: str) -> str:
    """The first key after every key starting with ``prefix`` (etcd's range_end)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return b64(bytes(raw))


def key_value(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(key=unb64(raw["key"]).decode(), value=unb64(raw.get("value")),
                    mod_revision=int(raw.get("mod_revision", 0)),
                    create_revision=int(raw.get("create_revision", 0)))


def chunks(items: Sequence[T], size: int = MAX_TXN_OPS) -> Iterable[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


# The informative part of a requests / urllib3 error, most specific first.
_CAUSES = [re.compile(p) for p in (
    r"certificate verify failed[^'\")(]*", r"\[Errno -?\d+\] [^'\")]+", r"timed out",
    r"Connection (?:refused|reset|aborted)[^'\")]*", r"\[SSL[^\]]*\][^'\")(]*")]


def failure_reason(exc: BaseException) -> str:
    """The short cause of an etcd3gw / requests error (not its 300-character repr)."""
    detail = getattr(exc, "detail_text", None) or str(exc)
    try:
        message = json.loads(detail).get("message")
        if message:
            return str(message)
    except (ValueError, AttributeError):
        pass
    for cause in _CAUSES:
        found = cause.search(detail)
        if found:
            return found.group(0).strip()
    return (detail.strip().splitlines() or [type(exc).__name__])[0][:160]


def absent(key: str) -> dict[str, Any]:
    """The txn compare "``key`` does not exist"."""
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def put_request(key: str, value: bytes, lease: int) -> dict[str, Any]:
    request: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        request["lease"] = str(lease)
    return request


def stream_session(shared: Any) -> Any:
    """A session like the client's (TLS files, CA, auth token; no proxies from the
    environment) with connections of its own, for one watch stream."""
    import requests

    own = requests.Session()
    own.trust_env = False
    own.verify = shared.verify
    own.cert = shared.cert
    own.headers.update(shared.headers)
    return own
