"""The memory tier of checkpoints, the agent's side: a snapshot holder per agent.

An HTTP server (stdlib ``ThreadingHTTPServer``, one thread per request) that keeps the
newest snapshot of the run in this agent's memory, as opaque bytes and a JSON manifest:
nothing is ever unpickled here. The agent outlives its workers, so when every worker dies
(the restart path) the next incarnation restores from here instead of the run directory.
The protocol is live/memory_tier.py's; the workers' client is worker/memory_tier.py; the
HTTP side (requests to answers) is agent/holder_http.py.

- **Bounded memory**: one snapshot per run, the newest by ``(writer_epoch, step)`` (an
  older one is refused, 409; the newest of the previous writer epoch is not kept), so a
  holder costs about one payload, plus the one arriving while it is checked (sha256 and
  length, before it replaces the held one), plus one being sent to a reader that started
  before a replacement. A payload over ``max_bytes`` is refused (413) before it is read.
  A sharded checkpoint's parts are kept per ``(run, part)``, the newest two of each (a
  rank killed while the others offer the next save leaves that one incomplete: the one
  before still is): this node's ranks' and the copies of another node's, about four times
  the node's share of the model; a part beyond the newest save's world (it shrank) is let
  go.
- **Two nodes**: a snapshot a worker offers is copied to one other agent's holder before the
  holder answers (``replica_order``: the next agent of the rendezvous round on another host,
  else on this one; one more is tried if that one fails). The answer says how many copies
  are held (1 or 2) and where. Peers come from the rendezvous store
  (agent/holder_directory.py).
- **Bounded waits**: a peer is called with a 1 s connect timeout (a host that is gone costs
  that, a dead agent refuses at once) and is skipped for ``PEER_DOWN_SECONDS`` after a
  failure, ``PEER_SILENT_SECONDS`` after one that did not answer (a frozen agent: its
  kernel accepts); reads and writes time out after ``IO_SECONDS`` each, and a copy's
  answer within ``replica_answer_seconds`` (what a peer needs to check the bytes). The
  worker waits for the copy, and the next save for the worker: a frozen peer cost a
  training loop 9.8 s of a 10 s wait, then again 5 s later (CI, stop 45).
- **Every request carries the holder's bearer token** (random per holder,
  ``secrets.token_urlsafe``); a wrong one is refused (401) and nothing is kept.
- It listens on the address the agent uses for the job (``holder_address``), on a port
  the kernel picks.
- **Written behind**: with an ``s3://`` run directory the holder also uploads the payload
  it keeps to the run's object store when its worker asks (``POST UPLOAD_PATH``,
  agent/write_behind.py), so the training process never runs the upload.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastic_train.agent.holder_http import IO_SECONDS, HolderServer
from elastic_train.agent.write_behind import PayloadUploads
from elastic_train.errors import ElasticTrainError
from elastic_train.live.environment import MEMORY_TIER, set_for_workers
from elastic_train.live.memory_tier import (
    BEARER,
    MANIFEST_HEADER,
    REPLICA_HEADER,
    SNAPSHOT_PATH,
    Endpoint,
    HolderEntry,
    Response,
    call,
    check_manifest,
    encode_manifest,
    is_newer,
    newest_of,
    newest_query,
    part_of,
    payload_query,
    replica_order,
    same_snapshot,
    snapshot_key,
)

__all__ = ["DEFAULT_MAX_BYTES", "SnapshotHolder", "held_for_workers", "holder_address",
           "parse_size"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 16 * 1024 ** 3
"""The largest payload a holder takes by default (``--memory-tier-limit``)."""
CONNECT_SECONDS = 1.0
"""How long a peer holder may take to accept a connection."""
NEWEST_SECONDS = 2.0
"""How long a peer may take to say what it holds (``GET NEWEST_PATH``)."""
PEER_DOWN_SECONDS = 5.0
"""How long a peer that failed a call is skipped."""
PEER_SILENT_SECONDS = 30.0
"""How long a peer that did not answer in time is skipped: frozen or cut off, it is left
out of the world meanwhile, and a thawed one is copied to again once this is over."""
REPLICA_ANSWER_SECONDS = 3.0
"""What a copy's answer may take beyond the time to check its bytes (``VERIFY_RATE``)."""
VERIFY_RATE = 200e6
"""Bytes per second a peer checks a copy at (sha256, well below a core's speed)."""


def replica_answer_seconds(size: int) -> float:
    """How long one read or write of a copy of ``size`` bytes may wait on a peer."""
    return REPLICA_ANSWER_SECONDS + size / VERIFY_RATE
REPLICA_TRIES = 2
"""Peers tried in turn for the second copy."""
KEPT_PER_PART = 2
"""Snapshots kept of each part of a sharded checkpoint (the newest, and the one before)."""


def parse_size(text: str) -> int:
    """``--memory-tier-limit``: bytes, or a number with K, M, G or T (powers of 1024)."""
    units = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = units.get(value[-1:], 1)
    number = value[:-1] if value[-1:] in units else value
    try:
        size = int(float(number) * scale)
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"{text!r}: give a size in bytes, or with K, M, G or T (e.g. 16G)")
    return size


def holder_address(single_node: bool, local_addr: str | None, endpoint_host: str | None
                   ) -> tuple[str, str]:
    """``(address to listen on, address the other agents reach it at)``: loopback for a
    job of one node; across nodes the address of the interface that holds ``--local-addr``
    or, without one, that this host reaches the rendezvous endpoint by (network.py, the
    interface the workers advertise); where neither tells, every interface (as the agent's
    own store listens then) reached at ``--local-addr`` or this host's name."""
    from elastic_train.network import worker_interface

    if single_node:
        return "127.0.0.1", "127.0.0.1"
    try:
        interface = worker_interface(local_addr, endpoint_host)
    except ElasticTrainError:
        interface = None
    if interface is not None:
        return interface.address, interface.address
    return "", local_addr or socket.getfqdn()


@dataclass
class _Held:
    manifest: dict[str, Any]
    payload: bytearray  # never changed once held


class SnapshotHolder:
    """One agent's snapshot holder (see the module). ``start`` serves it, ``close`` stops
    it; ``set_peers`` tells it the other agents' holders."""

    def __init__(self, bind_host: str = "127.0.0.1", advertised_host: str | None = None, *,
                 run_id: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 token: str | None = None) -> None:
        self.bind_host = bind_host
        self.host = advertised_host or bind_host or socket.getfqdn()
        """The host the other agents reach this holder at (its peers prefer other hosts)."""
        self.run_id = run_id
        """The run whose snapshots it keeps (another's are refused); None: any run."""
        self.max_bytes = max_bytes
        self.token = token or secrets.token_urlsafe(32)
        self._held: dict[tuple[str, int | None], list[_Held]] = {}
        """By ``(run_id, part)``, newest first: part None is an unsharded snapshot (one
        kept), a part of a sharded one keeps ``KEPT_PER_PART``."""
        self.uploads = PayloadUploads()
        """The payloads it uploads to the run's object store for its workers."""
        self._lock = threading.Lock()
        self._peers: list[HolderEntry] = []
        self._down_until: dict[str, float] = {}
        self._server: HolderServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""
        """``http://HOST:PORT`` once started."""

    # ---- life ------------------------------------------------------------------------------
    def start(self) -> SnapshotHolder:
        self._server = HolderServer((self.bind_host, 0), self)
        port = self._server.server_address[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.1},
                                        name="memory-tier-holder", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and let go of what is held."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            self._held.clear()

    def __enter__(self) -> SnapshotHolder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def endpoint(self) -> Endpoint:
        """What this agent's workers are told (``live.environment.MEMORY_TIER``)."""
        return Endpoint(self.url, self.token, self.max_bytes)

    def entry(self, rank: int) -> HolderEntry:
        """What this agent publishes for the others, as group rank ``rank``."""
        return HolderEntry(self.url, self.token, self.host, rank)

    def set_peers(self, entries: Sequence[HolderEntry]) -> None:
        """The holders of the round's agents (this one's entry may be among them)."""
        order = replica_order(self.url, self.host, entries)
        with self._lock:
            self._peers = order

    @property
    def peers(self) -> list[HolderEntry]:
        with self._lock:
            return list(self._peers)

    def held(self, run_id: str, part: int | None = None) -> dict[str, Any] | None:
        """The manifest of what this holder keeps for ``run_id`` (its ``part``)."""
        with self._lock:
            found = self._held.get((run_id, part))
            return dict(found[0].manifest) if found else None

    def kept(self, run_id: str, part: int) -> list[dict[str, Any]]:
        """The manifests this holder keeps of ``part`` of ``run_id``'s sharded
        checkpoints, newest first."""
        with self._lock:
            return [dict(h.manifest) for h in self._held.get((run_id, part), [])]

    # ---- what the handler does ---------------------------------------------------------
    def authorized(self, header: str | None) -> bool:
        given = header[len(BEARER):] if header and header.startswith(BEARER) else ""
        return hmac.compare_digest(given.encode(), self.token.encode())

    def refusal(self, manifest: Mapping[str, Any]) -> tuple[int, str] | None:
        """Why a PUT of ``manifest`` is refused before its body is read (None: it is not)."""
        if self.run_id is not None and manifest["run_id"] != self.run_id:
            return 409, (f"this holder keeps run {self.run_id!r}'s snapshots, not "
                         f"{manifest['run_id']!r}'s")
        if manifest["bytes"] > self.max_bytes:
            return 413, (f"a payload of {manifest['bytes']} bytes is over this holder's "
                         f"limit of {self.max_bytes} (--memory-tier-limit)")
        held = self.held(manifest["run_id"], part_of(manifest))
        if not is_newer(manifest, held):
            assert held is not None
            return 409, (f"a newer snapshot is held (writer epoch {held['writer_epoch']}, "
                         f"step {held['step']})")
        return None

    def keep(self, manifest: dict[str, Any], payload: bytearray) -> bool:
        """Keep ``payload`` (checked already) unless a newer one arrived meanwhile."""
        run_id, part = manifest["run_id"], part_of(manifest)
        with self._lock:
            held = self._held.get((run_id, part), [])
            if not is_newer(manifest, held[0].manifest if held else None):
                return False
            older = [h for h in held if snapshot_key(h.manifest) != snapshot_key(manifest)]
            self._held[(run_id, part)] = [_Held(manifest, payload)] + (
                older[:KEPT_PER_PART - 1] if part is not None else [])
            if part is not None:  # parts beyond this save's world (it shrank) are let go
                for key in [k for k, h in self._held.items() if k[0] == run_id
                            and k[1] is not None and k[1] >= manifest["parts"]
                            and is_newer(manifest, h[0].manifest)]:
                    del self._held[key]
        log.debug("memory tier: holding step %d (writer epoch %d, part %s, %d bytes)",
                  manifest["step"], manifest["writer_epoch"], part, len(payload))
        return True

    def replicate(self, manifest: Mapping[str, Any], payload: bytearray) -> list[str]:
        """Copy the snapshot to one peer holder (the first of ``replica_order`` that takes
        it); the urls it is now held at besides this one."""
        tried = 0
        for peer in self._live_peers():
            if tried == REPLICA_TRIES:
                break
            tried += 1
            try:
                answer = call(Endpoint(peer.url, peer.token), "PUT", SNAPSHOT_PATH, payload,
                              {MANIFEST_HEADER: encode_manifest(manifest), REPLICA_HEADER: "1",
                               "Content-Type": "application/octet-stream"},
                              connect_seconds=CONNECT_SECONDS,
                              io_seconds=replica_answer_seconds(len(payload)))
            except OSError as exc:
                self._mark_down(peer.url, silent=isinstance(exc, TimeoutError))
                log.warning("memory tier: the holder at %s (%s) did not take a copy of step "
                            "%s: %s", peer.url, peer.host, manifest["step"], exc)
                continue
            if answer.status == 200:
                return [peer.url]
            log.warning("memory tier: the holder at %s refused a copy of step %s (%d: %s)",
                        peer.url, manifest["step"], answer.status, _error_of(answer))
        return []

    def newest(self, run_id: str, ask_peers: bool, part: int | None = None
               ) -> tuple[dict[str, Any] | None, list[str], list[dict[str, Any]]]:
        """The newest manifest of ``run_id`` (its ``part``) held here or (``ask_peers``)
        by a peer, the urls that hold it, and (a part) every snapshot of that part held
        here or there, newest first (``kept``)."""
        mine = self.kept(run_id, part) if part is not None else []
        found: list[tuple[str, dict[str, Any] | None, list[dict[str, Any]]]] = [
            (self.url, self.held(run_id, part), mine)]
        if ask_peers:
            found += self._ask_peers(run_id, part)
        best = newest_of(m for _, m, _ in found)
        if best is None:
            return None, [], []
        kept: list[dict[str, Any]] = []
        for manifest in sorted((k for _, _, ks in found for k in ks), key=snapshot_key,
                               reverse=True):
            if not any(same_snapshot(manifest, k) for k in kept):
                kept.append(manifest)
        return best, [url for url, m, _ in found
                      if m is not None and same_snapshot(m, best)], kept

    def local_payload(self, wanted: Mapping[str, Any]) -> bytearray | None:
        with self._lock:
            held = self._held.get((wanted["run_id"], part_of(wanted)), [])
        for one in held:
            if same_snapshot(one.manifest, wanted):
                return one.payload
        return None

    def peer_payload(self, wanted: Mapping[str, Any]) -> Response | None:
        """A peer's answer with the payload ``wanted`` still to read (None: no peer has it)."""
        for peer in self._live_peers():
            try:
                answer = call(Endpoint(peer.url, peer.token), "GET",
                              payload_query(wanted, peers=False),
                              connect_seconds=CONNECT_SECONDS, io_seconds=IO_SECONDS,
                              stream=True)
            except OSError as exc:
                self._mark_down(peer.url, silent=isinstance(exc, TimeoutError))
                continue
            if answer.status == 200:
                return answer
        return None

    # ---- peers -----------------------------------------------------------------------------
    def _live_peers(self) -> list[HolderEntry]:
        now = time.monotonic()
        with self._lock:
            return [p for p in self._peers if self._down_until.get(p.url, 0.0) <= now]

    def _mark_down(self, url: str, silent: bool = False) -> None:
        skip = PEER_SILENT_SECONDS if silent else PEER_DOWN_SECONDS
        with self._lock:
            self._down_until[url] = time.monotonic() + skip

    def _ask_peers(self, run_id: str, part: int | None
                   ) -> list[tuple[str, dict[str, Any] | None, list[dict[str, Any]]]]:
        """What each live peer holds for ``run_id`` (its ``part``: also every snapshot of
        it kept), asked at once (bounded)."""
        answers: list[tuple[str, dict[str, Any] | None, list[dict[str, Any]]]] = []
        lock = threading.Lock()
        path = newest_query(run_id, peers=False, part=part)

        def ask(peer: HolderEntry) -> None:
            try:
                answer = call(Endpoint(peer.url, peer.token), "GET", path,
                              connect_seconds=CONNECT_SECONDS, io_seconds=NEWEST_SECONDS)
                found = answer.json() if answer.status == 200 else {}
                manifest = check_manifest(found["manifest"]) if found.get("manifest") else None
                kept = [check_manifest(k) for k in found.get("kept") or []]
            except (OSError, ValueError, KeyError, AttributeError, TypeError):
                self._mark_down(peer.url)
                return
            with lock:
                answers.append((peer.url, manifest, kept))

        threads = [threading.Thread(target=ask, args=(p,), daemon=True)
                   for p in self._live_peers()]
        for t in threads:
            t.start()
        deadline = time.monotonic() + CONNECT_SECONDS + NEWEST_SECONDS + 0.5
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with lock:
            return list(answers)


def _error_of(answer: Response) -> str:
    try:
        return str(answer.json().get("error", ""))
    except (ValueError, AttributeError):
        return answer.body[:200].decode(errors="replace")



@contextlib.contextmanager
def held_for_workers(bind_host: str, advertised_host: str, run_id: str | None,
                     max_bytes: int) -> Iterator[SnapshotHolder]:
    """This agent's holder, serving until the block ends; its url and token reach the
    workers it starts (``live.environment.MEMORY_TIER``, agent/environment.py)."""
    holder = SnapshotHolder(bind_host, advertised_host, run_id=run_id, max_bytes=max_bytes)
    holder.start()
    try:
        set_for_workers(MEMORY_TIER, holder.endpoint.to_json())
        log.info("memory tier: this agent holds the newest snapshot at %s (up to %d bytes)",
                 holder.url, max_bytes)
        yield holder
    finally:
        holder.close()
