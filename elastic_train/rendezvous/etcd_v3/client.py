"""The one module that talks to etcd: ``EtcdKV``, kv.py's ``KV`` over etcd's v3 JSON gateway
(gateway.py's wire format, watch.py's streams), on top of ``etcd3gw`` (plain HTTP, no
grpc/protobuf pins): reads, writes, compare-and-swap transactions, leases, watches.

Every failure to reach or use etcd becomes torch's ``RendezvousConnectionError`` with one
line naming the endpoint, the operation and what to check (``EtcdUnreachableError`` when
nothing answered: worth retrying).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic_train.rendezvous.etcd_v3.gateway import (
    MAX_TXN_OPS,
    absent,
    b64,
    chunks,
    failure_reason,
    key_value,
    prefix_end,
    put_request,
    stream_session,
)
from elastic_train.rendezvous.etcd_v3.kv import (
    EtcdUnreachableError,
    KeyValue,
    LeaseNotFound,
    Watch,
)
from elastic_train.rendezvous.etcd_v3.watch import StreamWatch, watch_refusal

__all__ = ["Credentials", "Endpoint", "EtcdKV"]

T = TypeVar("T")


class _TokenExpired(Exception):
    """etcd no longer knows our auth token (it expires when unused): log in again."""


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
            raise self._error(operation, failed, failure_reason(failed)) from exc
        except exceptions.Etcd3Exception as exc:
            reason = failure_reason(exc)
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
            result = client.post(client.get_url("/kv/range"), json={"key": b64(key)})
            kvs = result.get("kvs") or []
            return key_value(kvs[0]) if kvs else None

        return self._call(f"reading {key}", fn)

    def get_many(self, keys: Sequence[str]) -> dict[str, KeyValue]:
        found: dict[str, KeyValue] = {}
        for chunk in chunks(list(keys)):
            def fn(client: Any, chunk: Sequence[str] = chunk) -> None:
                ops = [{"request_range": {"key": b64(k)}} for k in chunk]
                result = self._txn(client, [], ops, [])
                for response in result.get("responses", []):
                    for raw in response.get("response_range", {}).get("kvs") or []:
                        kv = key_value(raw)
                        found[kv.key] = kv

            self._call(f"reading {' and '.join(chunk)}" if len(chunk) <= 2
                       else f"reading {len(chunk)} keys", fn)
        return found

    def count_prefix(self, prefix: str) -> int:
        def fn(client: Any) -> int:
            result = client.post(client.get_url("/kv/range"), json={
                "key": b64(prefix), "range_end": prefix_end(prefix), "count_only": True})
            return int(result.get("count", 0))

        return self._call(f"counting keys under {prefix}", fn)

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.put_many([(key, value)], lease)

    def put_many(self, items: Sequence[tuple[str, bytes]], lease: int = 0) -> None:
        for chunk in chunks(list(items)):
            def fn(client: Any, chunk: Sequence[tuple[str, bytes]] = chunk) -> None:
                ops = [{"request_put": put_request(k, v, lease)} for k, v in chunk]
                self._txn(client, [], ops, [])

            self._call(f"writing {chunk[0][0]}" if len(chunk) == 1
                       else f"writing {len(chunk)} keys", fn)

    def swap(self, key: str, value: bytes, revision: int, lease: int = 0
             ) -> tuple[bool, KeyValue | None]:
        compare = {"key": b64(key), "target": "MOD", "result": "EQUAL",
                   "mod_revision": str(revision)}
        return self._swap(key, value, compare, lease)

    def swap_value(self, key: str, value: bytes, expected: bytes | None, lease: int = 0
                   ) -> tuple[bool, KeyValue | None]:
        if expected is None:
            compare = {"key": b64(key), "target": "CREATE", "result": "EQUAL",
                       "create_revision": "0"}
        else:
            compare = {"key": b64(key), "target": "VALUE", "result": "EQUAL",
                       "value": b64(expected)}
        return self._swap(key, value, compare, lease)

    def _swap(self, key: str, value: bytes, compare: dict[str, Any], lease: int
              ) -> tuple[bool, KeyValue | None]:
        def fn(client: Any) -> tuple[bool, KeyValue | None]:
            result = self._txn(client, [compare], [{"request_put": put_request(key, value, lease)}],
                               [{"request_range": {"key": b64(key)}}])
            if result.get("succeeded", False):
                # The put's revision is the key's new mod_revision; no need to read it back.
                revision = int(result["header"]["revision"])
                return True, KeyValue(key, value, revision, 0)
            kvs = (result.get("responses") or [{}])[0].get("response_range", {}).get("kvs")
            return False, (key_value(kvs[0]) if kvs else None)

        return self._call(f"updating {key}", fn)

    def delete(self, key: str) -> bool:
        def fn(client: Any) -> bool:
            result = client.post(client.get_url("/kv/deleterange"), json={"key": b64(key)})
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
                "key": b64(prefix), "range_end": prefix_end(prefix),
                "sort_order": "ASCEND", "sort_target": "KEY"})
            kvs = [key_value(raw) for raw in result.get("kvs") or []]
            return kvs, int(result["header"]["revision"])

        return self._call(f"reading the keys under {prefix}", fn)

    def put_and_claim(self, key: str, value: bytes, claim: str, claim_value: bytes,
                      prefix: str, lease: int = 0) -> tuple[bool, list[KeyValue], int]:
        def fn(client: Any) -> tuple[bool, list[KeyValue], int]:
            put = {"request_put": put_request(key, value, lease)}
            result = self._txn(
                client, [absent(claim)],
                [put, {"request_put": put_request(claim, claim_value, lease)}],
                [put, {"request_range": {"key": b64(prefix), "range_end": prefix_end(prefix),
                                         "sort_order": "ASCEND", "sort_target": "KEY"}}])
            revision = int(result["header"]["revision"])
            if result.get("succeeded", False):
                return True, [], revision
            responses = result.get("responses") or [{}, {}]
            raw = responses[1].get("response_range", {}).get("kvs") or []
            return False, [key_value(kv) for kv in raw], revision

        return self._call(f"joining at {key}", fn)

    def put_many_if_absent(self, guard: str, items: Sequence[tuple[str, bytes]],
                           lease: int = 0) -> bool:
        if len(items) > MAX_TXN_OPS:
            raise ValueError(f"{len(items)} keys in one transaction: etcd allows "
                             f"{MAX_TXN_OPS} (--max-txn-ops)")

        def fn(client: Any) -> bool:
            ops = [{"request_put": put_request(k, v, lease)} for k, v in items]
            return bool(self._txn(client, [absent(guard)], ops, []).get("succeeded", False))

        return self._call(f"creating {guard} and {len(items)} keys", fn)

    def watch_prefix(self, prefix: str, start_revision: int) -> Watch:
        operation = f"watching {prefix}"

        def fn(client: Any) -> Any:
            from etcd3gw import exceptions

            if self._credentials.user:
                # A cheap read first: it logs in (again, if the token expired) so that the
                # stream below carries a valid token in the session's Authorization header.
                client.post(client.get_url("/kv/range"), json={
                    "key": b64(prefix), "range_end": prefix_end(prefix), "count_only": True})
            request = {"create_request": {"key": b64(prefix), "range_end": prefix_end(prefix),
                                          "start_revision": str(start_revision)}}
            # A connection of its own: a stream closed by cancel() in one thread must never
            # be a pooled connection that another request has taken meanwhile.
            session = stream_session(client.session)
            # A read timeout until etcd confirms the watch (at once); StreamWatch then lifts
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
                refusal = watch_refusal(message)
                if refusal is not None:  # e.g. an expired token: _call logs in again
                    raise exceptions.Etcd3Exception(json.dumps({"message": refusal}))
            except BaseException:
                response.close()
                session.close()
                raise
            return session, response, lines, message

        session, response, lines, first = self._call(operation, fn)
        return StreamWatch(self.endpoint, prefix, session, response, lines, first)


