"""The one module that talks to etcd: a small key-value API over etcd's v3 JSON gateway.

Everything the rendezvous needs from etcd is here — reads, writes, compare-and-swap
transactions, leases, watches — on top of ``etcd3gw`` (plain HTTP, no grpc/protobuf pins). The
``KV`` protocol is what the backend and the store use, so the client library is
replaceable, and an in-memory implementation can stand in for unit tests.

Every failure to reach or use etcd becomes torch's ``RendezvousConnectionError`` with one
line naming the endpoint, the operation and what to check.
"""

from __future__ import annotations

import base64
import json
import queue
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

T = TypeVar("T")

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it; ``mod_revision`` changes on every write of the key.

    ``create_revision`` is 0 when unknown (what a successful swap returns).
    """

    key: str
    value: bytes
    mod_revision: int
    create_revision: int


class EtcdUnreachableError(RendezvousConnectionError):
    """No answer from etcd at all (refused, reset, timed out): worth retrying, unlike a
    refusal by etcd itself (credentials, TLS, a missing API).

    ``waited`` is how long it was retried (None: not yet), and goes into the message.
    """

    def __init__(self, endpoint: str, detail: str, waited: float | None = None) -> None:
        self.endpoint = endpoint
        self.detail = detail
        self.waited = waited
        if waited is None:
            message = (f"cannot reach etcd at {endpoint} ({detail}): check that etcd runs "
                       "there and --rdzv-endpoint")
        else:
            message = (f"cannot reach etcd at {endpoint} for {waited:g} s ({detail}): check "
                       "that etcd runs there and --rdzv-endpoint, or wait longer with "
                       "--rdzv-conf connect_timeout=SECONDS")
        super().__init__(message)


@dataclass(frozen=True)
class WatchEvent:
    """One change under a watched prefix."""

    kind: str  # "put" or "delete"
    key: str
    value: bytes  # b"" for a delete
    mod_revision: int  # the revision of this change
    create_revision: int  # of the key (0 for a delete)


class WatchCompacted(Exception):
    """The watch's start revision was compacted away: re-read, then watch again."""

    def __init__(self, compact_revision: int) -> None:
        self.compact_revision = compact_revision
        super().__init__(f"etcd compacted the revisions before {compact_revision} that the "
                         "watch started from: re-read, then watch again")


class Watch(Protocol):
    """A stream of the changes under a key prefix (``KV.watch_prefix``)."""

    def next(self, timeout: float) -> list[WatchEvent]:
        """The events that arrived (in revision order), waiting up to ``timeout`` seconds for
        the first; [] when none came. Raises EtcdUnreachableError when the stream broke
        (etcd down or restarted) and WatchCompacted when the start revision is gone; after
        either, the watch is dead (the caller re-reads and watches again)."""
        ...

    def cancel(self) -> None:
        """Stop the watch (idempotent; makes a blocked next() return [] soon)."""
        ...


class LeaseNotFound(Exception):
    """A write named a lease that expired or was revoked; grant a new one and retry."""


class _TokenExpired(Exception):
    """etcd no longer knows our auth token (it expires when unused): log in again."""


class KV(Protocol):
    """The key-value operations the rendezvous needs (a real etcd or a fake)."""

    endpoint: str

    def get(self, key: str) -> KeyValue | None: ...

    def get_many(self, keys: Sequence[str]) -> dict[str, KeyValue]: ...

    def count_prefix(self, prefix: str) -> int: ...

    def put(self, key: str, value: bytes, lease: int = 0) -> None: ...

    def put_many(self, items: Sequence[tuple[str, bytes]], lease: int = 0) -> None: ...

    def swap(self, key: str, value: bytes, revision: int, lease: int = 0
             ) -> tuple[bool, KeyValue | None]:
        """Write ``value`` iff the key's mod_revision is ``revision`` (0: the key is absent).

        Returns (True, the new key) or (False, the current key or None if absent).
        """
        ...

    def swap_value(self, key: str, value: bytes, expected: bytes | None, lease: int = 0
                   ) -> tuple[bool, KeyValue | None]:
        """Write ``value`` iff the key holds ``expected`` (None: the key is absent)."""
        ...

    def delete(self, key: str) -> bool: ...

    def grant_lease(self, ttl: int) -> int: ...

    def version(self) -> str: ...

    def range_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` (sorted by key, with mod_revision AND create_revision)
        and the store's revision at the read (a watch from revision + 1 misses nothing)."""
        ...

    def put_many_if_absent(self, guard: str, items: Sequence[tuple[str, bytes]],
                           lease: int = 0) -> bool:
        """One txn: if ``guard`` does not exist, put every item (guard usually among them);
        whether it did. len(items) <= MAX_TXN_OPS."""
        ...

    def put_and_claim(self, key: str, value: bytes, claim: str, claim_value: bytes,
                      prefix: str, lease: int = 0) -> tuple[bool, list[KeyValue], int]:
        """One txn: put ``key``, and create ``claim`` if it does not exist, else read every
        key under ``prefix``. (claimed, the keys read (none when claimed), the revision a
        watch of ``prefix`` continues from, minus one). Both puts carry ``lease``."""
        ...

    def keep_alive(self, lease: int) -> int:
        """Renew a lease once; its TTL in seconds now, 0 if etcd no longer knows it (expired
        or revoked)."""
        ...

    def revoke_lease(self, lease: int) -> None:
        """Revoke a lease (its keys go at once); no error if it is already gone."""
        ...

    def watch_prefix(self, prefix: str, start_revision: int) -> Watch:
        """Changes under ``prefix`` from ``start_revision`` on (inclusive)."""
        ...


@dataclass(frozen=True)
class Endpoint:
    """Where etcd listens, and how to talk to it."""

    host: str
    port: int
    protocol: str = "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.protocol}://{host}:{self.port}"


@dataclass(frozen=True)
class Credentials:
    """TLS files and etcd user credentials (all optional)."""

    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _prefix_end(prefix: str) -> str:
    """The first key after every key starting with ``prefix`` (etcd's range_end)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return _b64(bytes(raw))


def _key_value(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(key=_unb64(raw["key"]).decode(), value=_unb64(raw.get("value")),
                    mod_revision=int(raw.get("mod_revision", 0)),
                    create_revision=int(raw.get("create_revision", 0)))


def _chunks(items: Sequence[T], size: int = MAX_TXN_OPS) -> Iterable[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


# The informative part of a requests / urllib3 error, most specific first.
_CAUSES = [re.compile(p) for p in (
    r"certificate verify failed[^'\")(]*", r"\[Errno -?\d+\] [^'\")]+", r"timed out",
    r"Connection (?:refused|reset|aborted)[^'\")]*", r"\[SSL[^\]]*\][^'\")(]*")]


def _reason(exc: BaseException) -> str:
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


def _counting_session(kv: EtcdKV) -> Any:
    """A ``requests`` session that adds one to ``kv.requests`` per request it sends (every
    send runs under the client's lock, see ``EtcdKV._call``)."""
    import requests

    class CountingSession(requests.Session):
        def send(self, request: Any, **kwargs: Any) -> Any:
            kv.requests += 1
            if kv.counts_into is not None:  # a lease's own client counts in its agent's
                kv.counts_into.requests += 1
            return super().send(request, **kwargs)

    return CountingSession()


class EtcdKV:
    """``KV`` on a real etcd (3.4 or newer) through its v3 JSON gateway.

    Thread-safe: the agent's keep-alive thread and its main thread share one client.
    """

    def __init__(self, endpoint: Endpoint, credentials: Credentials | None = None,
                 request_timeout: float = 10.0) -> None:
        self.endpoint = endpoint.url
        self._endpoint = endpoint
        self._credentials = credentials or Credentials()
        self._timeout = request_timeout
        self._lock = threading.RLock()
        self._client: Any = None
        self._token: str | None = None
        # HTTP requests sent to etcd so far (every read, write, txn, lease grant and
        # renewal, login, and one per watch created): what the rendezvous benchmark counts.
        self.requests = 0
        self.counts_into: EtcdKV | None = None
        """Another client whose ``requests`` count this one's too (``for_renewals``)."""
        # The HTTP client's modules now, not at the first request: importing requests
        # costs ~0.17 s of CPU, which would otherwise land inside the first rendezvous
        # (0.7 s of 0.8 with 8 agents starting together on 2 cores).
        import etcd3gw  # noqa: F401

    def for_renewals(self, timeout: float) -> EtcdKV:
        """A client of its own, with requests bounded by ``timeout``, for a lease's
        renewals: one shared with the agent's other requests would wait behind a request
        stuck for its whole timeout while etcd was cut off, and the lease could expire
        after etcd came back (the fault campaign, seed 300: etcd's cable pulled 6.3 s, and
        every node's lease expired 3 s later). Its requests count in this one's too."""
        separate = EtcdKV(self._endpoint, self._credentials, request_timeout=timeout)
        separate.counts_into = self
        return separate

    # ---- plumbing ------------------------------------------------------------------------
    def _connect(self) -> Any:
        if self._client is None:
            import etcd3gw  # deferred to the client's construction: this module stays cheap

            session = _counting_session(self)
            # Like python-etcd (torch's v2 client): no HTTP(S)_PROXY detour to an internal
            # service, and REQUESTS_CA_BUNDLE cannot replace the job's own CA file. Also
            # ~0.5 ms less per request (no proxy lookup in the environment).
            session.trust_env = False
            creds = self._credentials
            if creds.ca_cert:
                session.verify = creds.ca_cert
            if creds.cert:
                session.cert = (creds.cert, creds.key) if creds.key else creds.cert
            self._client = etcd3gw.Etcd3Client(
                host=self._endpoint.host, port=self._endpoint.port,
                protocol=self._endpoint.protocol, timeout=self._timeout,
                api_path="/v3/", session=session)
        return self._client

    def _authenticate(self, client: Any) -> None:
        creds = self._credentials
        client.session.headers.pop("Authorization", None)
        result = client.post(client.get_url("/auth/authenticate"),
                             json={"name": creds.user, "password": creds.password or ""})
        self._token = str(result["token"])
        client.session.headers["Authorization"] = self._token

    def _call(self, operation: str, fn: Callable[[Any], T]) -> T:
        with self._lock:
            client = self._attempt("connecting", lambda _: self._connect())
            for attempt in (1, 2):
                if self._credentials.user and self._token is None:
                    self._attempt(f"logging in as {self._credentials.user}",
                                  lambda c: self._authenticate(c), client)
                try:
                    return self._attempt(operation, fn, client)
                except _TokenExpired:
                    if attempt == 2:
                        raise self._error(operation, Exception(), "invalid auth token") from None
                    self._token = None  # the token expired: log in again, once
            raise AssertionError("unreachable")

    def _attempt(self, operation: str, fn: Callable[[Any], T], client: Any = None) -> T:
        """``fn(client)`` with etcd3gw's and requests' errors turned into ours."""
        import requests
        from etcd3gw import exceptions

        try:
            return fn(client)
        except requests.exceptions.RequestException as exc:  # outside etcd3gw's post
            failed = exceptions.ConnectionFailedError(str(exc))
            raise self._error(operation, failed, _reason(failed)) from exc
        except exceptions.Etcd3Exception as exc:
            reason = _reason(exc)
            if "lease not found" in reason:
                raise LeaseNotFound(reason) from None
            if "invalid auth token" in reason and self._credentials.user:
                raise _TokenExpired(reason) from None
            raise self._error(operation, exc, reason) from exc

    def _error(self, operation: str, exc: BaseException, reason: str
               ) -> RendezvousConnectionError:
        from etcd3gw import exceptions

        if isinstance(exc, (exceptions.ConnectionFailedError,
                            exceptions.ConnectionTimeoutError)):
            if "SSL" in reason or "certificate" in reason:
                return RendezvousConnectionError(
                    f"cannot reach etcd at {self.endpoint} ({operation}: {reason}): check the "
                    "TLS options ca_cert, ssl_cert, ssl_cert_key in --rdzv-conf")
            return EtcdUnreachableError(self.endpoint, f"{operation}: {reason}")
        if any(word in reason for word in ("user", "password", "auth", "permission")):
            return RendezvousConnectionError(
                f"etcd at {self.endpoint} refused {operation} ({reason}): check user and "
                "password in --rdzv-conf and the user's permissions on the key prefix")
        if reason.startswith("404") or "Not Found" in reason:
            return RendezvousConnectionError(
                f"{self.endpoint} does not serve etcd's v3 API ({operation}: {reason}): "
                "point --rdzv-endpoint at an etcd 3.4 or newer")
        return RendezvousConnectionError(
            f"etcd at {self.endpoint} failed {operation} ({reason})")

    def _txn(self, client: Any, compare: list[Any], success: list[Any],
             failure: list[Any]) -> dict[str, Any]:
        return client.transaction({"compare": compare, "success": success,
                                   "failure": failure})

    # ---- KV ------------------------------------------------------------------------------
    def version(self) -> str:
        def fn(client: Any) -> str:
            response = client.session.get(f"{self.endpoint}/version", timeout=self._timeout)
            if response.status_code != 200:
                from etcd3gw import exceptions

                raise exceptions.Etcd3Exception(f"{response.status_code} {response.reason}")
            return str(response.json()["etcdserver"])

        return self._call("reading its version", fn)

    def get(self, key: str) -> KeyValue | None:
        def fn(client: Any) -> KeyValue | None:
            result = client.post(client.get_url("/kv/range"), json={"key": _b64(key)})
            kvs = result.get("kvs") or []
            return _key_value(kvs[0]) if kvs else None

        return self._call(f"reading {key}", fn)

    def get_many(self, keys: Sequence[str]) -> dict[str, KeyValue]:
        found: dict[str, KeyValue] = {}
        for chunk in _chunks(list(keys)):
            def fn(client: Any, chunk: Sequence[str] = chunk) -> None:
                ops = [{"request_range": {"key": _b64(k)}} for k in chunk]
                result = self._txn(client, [], ops, [])
                for response in result.get("responses", []):
                    for raw in response.get("response_range", {}).get("kvs") or []:
                        kv = _key_value(raw)
                        found[kv.key] = kv

            self._call(f"reading {' and '.join(chunk)}" if len(chunk) <= 2
                       else f"reading {len(chunk)} keys", fn)
        return found

    def count_prefix(self, prefix: str) -> int:
        def fn(client: Any) -> int:
            result = client.post(client.get_url("/kv/range"), json={
                "key": _b64(prefix), "range_end": _prefix_end(prefix), "count_only": True})
            return int(result.get("count", 0))

        return self._call(f"counting keys under {prefix}", fn)

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.put_many([(key, value)], lease)

    def put_many(self, items: Sequence[tuple[str, bytes]], lease: int = 0) -> None:
        for chunk in _chunks(list(items)):
            def fn(client: Any, chunk: Sequence[tuple[str, bytes]] = chunk) -> None:
                ops = [{"request_put": _put(k, v, lease)} for k, v in chunk]
                self._txn(client, [], ops, [])

            self._call(f"writing {chunk[0][0]}" if len(chunk) == 1
                       else f"writing {len(chunk)} keys", fn)

    def swap(self, key: str, value: bytes, revision: int, lease: int = 0
             ) -> tuple[bool, KeyValue | None]:
        compare = {"key": _b64(key), "target": "MOD", "result": "EQUAL",
                   "mod_revision": str(revision)}
        return self._swap(key, value, compare, lease)

    def swap_value(self, key: str, value: bytes, expected: bytes | None, lease: int = 0
                   ) -> tuple[bool, KeyValue | None]:
        if expected is None:
            compare = {"key": _b64(key), "target": "CREATE", "result": "EQUAL",
                       "create_revision": "0"}
        else:
            compare = {"key": _b64(key), "target": "VALUE", "result": "EQUAL",
                       "value": _b64(expected)}
        return self._swap(key, value, compare, lease)

    def _swap(self, key: str, value: bytes, compare: dict[str, Any], lease: int
              ) -> tuple[bool, KeyValue | None]:
        def fn(client: Any) -> tuple[bool, KeyValue | None]:
            result = self._txn(client, [compare], [{"request_put": _put(key, value, lease)}],
                               [{"request_range": {"key": _b64(key)}}])
            if result.get("succeeded", False):
                # The put's revision is the key's new mod_revision; no need to read it back.
                revision = int(result["header"]["revision"])
                return True, KeyValue(key, value, revision, 0)
            kvs = (result.get("responses") or [{}])[0].get("response_range", {}).get("kvs")
            return False, (_key_value(kvs[0]) if kvs else None)

        return self._call(f"updating {key}", fn)

    def delete(self, key: str) -> bool:
        def fn(client: Any) -> bool:
            result = client.post(client.get_url("/kv/deleterange"), json={"key": _b64(key)})
            return int(result.get("deleted", 0)) > 0

        return self._call(f"deleting {key}", fn)

    def grant_lease(self, ttl: int) -> int:
        def fn(client: Any) -> int:
            result = client.post(client.get_url("/lease/grant"), json={"TTL": ttl, "ID": 0})
            return int(result["ID"])

        return self._call(f"granting a {ttl} s lease", fn)

    def keep_alive(self, lease: int) -> int:
        def fn(client: Any) -> int:
            # A one-message stream on the gateway: the answer comes as {"result": {...}}, and
            # without a TTL (not an error) when etcd no longer knows the lease.
            result = client.post(client.get_url("/lease/keepalive"), json={"ID": str(lease)})
            return int((result.get("result") or result).get("TTL", 0))

        try:
            return self._call(f"renewing lease {lease}", fn)
        except LeaseNotFound:
            return 0

    def revoke_lease(self, lease: int) -> None:
        def fn(client: Any) -> None:
            client.post(client.get_url("/lease/revoke"), json={"ID": str(lease)})

        try:
            self._call(f"revoking lease {lease}", fn)
        except LeaseNotFound:
            pass  # expired or revoked already: what we wanted

    def range_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        def fn(client: Any) -> tuple[list[KeyValue], int]:
            result = client.post(client.get_url("/kv/range"), json={
                "key": _b64(prefix), "range_end": _prefix_end(prefix),
                "sort_order": "ASCEND", "sort_target": "KEY"})
            kvs = [_key_value(raw) for raw in result.get("kvs") or []]
            return kvs, int(result["header"]["revision"])

        return self._call(f"reading the keys under {prefix}", fn)

    def put_and_claim(self, key: str, value: bytes, claim: str, claim_value: bytes,
                      prefix: str, lease: int = 0) -> tuple[bool, list[KeyValue], int]:
        def fn(client: Any) -> tuple[bool, list[KeyValue], int]:
            put = {"request_put": _put(key, value, lease)}
            result = self._txn(
                client, [_absent(claim)],
                [put, {"request_put": _put(claim, claim_value, lease)}],
                [put, {"request_range": {"key": _b64(prefix), "range_end": _prefix_end(prefix),
                                         "sort_order": "ASCEND", "sort_target": "KEY"}}])
            revision = int(result["header"]["revision"])
            if result.get("succeeded", False):
                return True, [], revision
            responses = result.get("responses") or [{}, {}]
            raw = responses[1].get("response_range", {}).get("kvs") or []
            return False, [_key_value(kv) for kv in raw], revision

        return self._call(f"joining at {key}", fn)

    def put_many_if_absent(self, guard: str, items: Sequence[tuple[str, bytes]],
                           lease: int = 0) -> bool:
        if len(items) > MAX_TXN_OPS:
            raise ValueError(f"{len(items)} keys in one transaction: etcd allows "
                             f"{MAX_TXN_OPS} (--max-txn-ops)")

        def fn(client: Any) -> bool:
            ops = [{"request_put": _put(k, v, lease)} for k, v in items]
            return bool(self._txn(client, [_absent(guard)], ops, []).get("succeeded", False))

        return self._call(f"creating {guard} and {len(items)} keys", fn)

    def watch_prefix(self, prefix: str, start_revision: int) -> Watch:
        operation = f"watching {prefix}"

        def fn(client: Any) -> Any:
            from etcd3gw import exceptions

            if self._credentials.user:
                # A cheap read first: it logs in (again, if the token expired) so that the
                # stream below carries a valid token in the session's Authorization header.
                client.post(client.get_url("/kv/range"), json={
                    "key": _b64(prefix), "range_end": _prefix_end(prefix), "count_only": True})
            request = {"create_request": {"key": _b64(prefix), "range_end": _prefix_end(prefix),
                                          "start_revision": str(start_revision)}}
            # A connection of its own: a stream closed by cancel() in one thread must never
            # be a pooled connection that another request has taken meanwhile.
            session = _stream_session(client.session)
            # A read timeout until etcd confirms the watch (at once); _StreamWatch then lifts
            # it, as a watch is idle for long.
            try:
                response = session.post(client.get_url("/watch"), json=request, stream=True,
                                        timeout=(self._timeout, self._timeout))
            except BaseException:
                session.close()
                raise
            try:
                if response.status_code != 200:
                    if response.status_code in (408, 504):
                        raise exceptions.ConnectionTimeoutError(response.text, response.reason)
                    if response.status_code == 503:
                        raise exceptions.ConnectionFailedError(response.text, response.reason)
                    raise exceptions.Etcd3Exception(response.text, response.reason)
                lines = response.iter_lines(chunk_size=None)
                first = next((line for line in lines if line.strip()), None)
                if first is None:
                    raise exceptions.ConnectionFailedError("the stream ended at once")
                try:
                    message = json.loads(first)
                except ValueError:
                    raise exceptions.Etcd3Exception(json.dumps(
                        {"message": f"not a watch answer: {first[:80]!r}"})) from None
                refusal = _watch_refusal(message)
                if refusal is not None:  # e.g. an expired token: _call logs in again
                    raise exceptions.Etcd3Exception(json.dumps({"message": refusal}))
            except BaseException:
                response.close()
                session.close()
                raise
            return session, response, lines, message

        session, response, lines, first = self._call(operation, fn)
        return _StreamWatch(self.endpoint, prefix, session, response, lines, first)


def _stream_session(shared: Any) -> Any:
    """A session like the client's (TLS files, CA, auth token; no proxies from the
    environment) with connections of its own, for one watch stream."""
    import requests

    own = requests.Session()
    own.trust_env = False
    own.verify = shared.verify
    own.cert = shared.cert
    own.headers.update(shared.headers)
    return own


def _absent(key: str) -> dict[str, Any]:
    """The txn compare "``key`` does not exist"."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def _put(key: str, value: bytes, lease: int) -> dict[str, Any]:
    request: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        request["lease"] = str(lease)
    return request


# ---- watches ---------------------------------------------------------------------------------

_WAKE = object()  # put on a watch's queue by cancel(): wakes a blocked next()


class _WatchQueue:
    """The consumer side of a watch: batches of events, or the error that ended the stream,
    put on a queue by a producer (the stream's reader thread, or a fake etcd)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._failure: BaseException | None = None
        self._cancelled = False

    # producer side
    def _push(self, events: list[WatchEvent]) -> None:
        if events:
            self._queue.put(events)

    def _fail(self, error: BaseException) -> None:
        self._queue.put(error)

    # Watch
    def next(self, timeout: float) -> list[WatchEvent]:
        if self._cancelled:
            return []
        if self._failure is not None:
            raise self._failure
        try:
            items = [self._queue.get(timeout=timeout) if timeout > 0
                     else self._queue.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        events: list[WatchEvent] = []
        for item in items:
            if isinstance(item, BaseException):
                self._failure = item  # nothing comes after it
                break
            if item is not _WAKE:
                events.extend(item)
        if self._cancelled:
            return []
        if self._failure is not None and not events:
            raise self._failure
        return events  # a failure behind them is raised by the next call

    def cancel(self) -> None:
        if not self._cancelled:
            self._cancelled = True
            self._queue.put(_WAKE)


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


def _watch_refusal(message: dict[str, Any]) -> str | None:
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
        return WatchEvent("delete", _unb64(kv.get("key")).decode(), b"",
                          int(kv.get("mod_revision", 0)), 0)
    return WatchEvent("put", _unb64(kv.get("key")).decode(), _unb64(kv.get("value")),
                      int(kv.get("mod_revision", 0)), int(kv.get("create_revision", 0)))


class _StreamWatch(_WatchQueue):
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
                if self._cancelled:
                    return
                if line.strip() and not self._handle(json.loads(line)):
                    return
            if not self._cancelled:
                self._fail(self._broken("the stream ended"))
        except Exception as exc:  # a reset, a truncated chunk, or our own cancel()
            if not self._cancelled:
                self._fail(self._broken(_reason(exc) if not isinstance(exc, ValueError)
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
            self._fail(WatchCompacted(compact))
            return False
        refusal = _watch_refusal(message)  # {"error": ...}, or cancelled by etcd
        if refusal is not None:
            self._fail(self._broken(refusal))
            return False
        self._push([_watch_event(raw) for raw in result.get("events") or []])
        return True

    def cancel(self) -> None:
        if self._cancelled:
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
