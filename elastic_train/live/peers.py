"""Live recovery across nodes: how agents reach each other's stores.

Each agent keeps a TCPStore for its workers (agent/live_agent.py); its HOST:PORT is the agent's
id in a plan (live/plan.py). Agents use these stores for everything a re-formation needs
quickly, and the rendezvous store only to commit a plan:

- a coordinator tells every member of the generation before that a re-formation started
  (``NOTICE_KEY`` in each one's store); a member whose store refuses the connection, or
  does not answer within ``PROBE_SECONDS``, is taken for lost at once (its agent died), so
  nobody waits out a heartbeat or a lease for it;
- members put their ``Arrival`` in the coordinator's store, and read the plan from it.

Nothing here is polled in steady state: an agent reads only its own store (local), and
peers only during a re-formation.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from elastic_train.live.coordination import PREFIX, offer
from elastic_train.process_exit import left_in_c

T = TypeVar("T")

WAKE_KEY = f"{PREFIX}/wake"
"""A queue in each agent's store: whoever leaves the agent something to act on (a peer's
call, a worker's failed collective) pushes to it, and the agent acts at once instead of at
its next --monitor-interval."""
PROBE_SECONDS = 2.0
"""How long a coordinator waits for a member's store to accept a connection: an agent that
died refuses at once; a host that is gone does not answer."""


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def reachable(address: str, timeout: float = PROBE_SECONDS) -> bool:
    """Whether something accepts TCP connections at HOST:PORT within ``timeout``."""
    try:
        with socket.create_connection(split_address(address), timeout=timeout):
            return True
    except OSError:
        return False


REFUSAL_PROBE_SECONDS = 0.2
"""How long a look for a refusal waits for a connection (a refusal is the kernel's answer:
it comes at once or never)."""
REFUSAL_EVERY = 0.1
"""Seconds between looks for a refusal while a call to a peer is under way."""


def refuses(address: str, timeout: float = REFUSAL_PROBE_SECONDS) -> bool:
    """Whether HOST:PORT refuses connections: nothing listens there, so the agent that did
    is gone. A frozen process's kernel still accepts, a host cut off does not answer:
    neither is a refusal."""
    try:
        with socket.create_connection(split_address(address), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class PeerStores:
    """Clients of other agents' stores, one per address, made on first use."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._clients: dict[str, dist.Store] = {}
        self._lock = threading.Lock()

    def client(self, address: str) -> dist.Store:
        """A client of the store at ``address``; raises ``ConnectionError`` when nothing
        answers there. Checked first, a kept client too: torch's client, its connection
        reset by an agent that died since, reconnects and retries until its timeout (a
        killed node that had rejoined cost the next coordinator 4 s: the fault campaign's
        host kills, 2.7-4.3 s where others took 0.2 s)."""
        with self._lock:
            found = self._clients.get(address)
        if not reachable(address):
            self.forget(address)
            raise ConnectionError(f"no agent answers at {address}")
        if found is not None:
            return found
        host, port = split_address(address)
        # Connect within PROBE_SECONDS: an agent dying just now may have accepted the probe
        # and refuse the store's own connection, which torch retries until the timeout.
        made = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=PROBE_SECONDS))
        made.set_timeout(timedelta(seconds=self.timeout))
        with self._lock:
            self._clients.setdefault(address, made)
            return self._clients[address]

    def forget(self, address: str) -> None:
        with self._lock:
            self._clients.pop(address, None)

    def tell(self, address: str, key: str, value: str | bytes,
             keep: Callable[[bytes, bytes], bool] | None = None) -> bool:
        """Set ``key`` in the store at ``address`` and wake that agent; False when that
        agent is gone, or silent for ``2 * PROBE_SECONDS``. With ``keep``, a value there
        that ``keep(present, value)`` prefers stays (compare-and-swap): several callers'
        values meet in one key."""

        def call() -> None:
            client = self.client(address)
            if keep is None:
                client.set(key, value)
            else:
                offer(client, key, value if isinstance(value, bytes) else value.encode(),
                      keep)
            wake(client)
            # A set is never answered: on a connection kept from an earlier call to an
            # agent that died since, it lands in the kernel's buffer and "succeeds". A read
            # is answered, or fails at once on the reset connection.
            if not client.check([key]):
                raise ConnectionError(f"the store at {address} did not keep {key}")

        try:
            bounded(call, 2 * PROBE_SECONDS, gone=lambda: refuses(address))
            return True
        except (ConnectionError, RuntimeError, OSError, TimeoutError):
            self.forget(address)
            return False

    def tell_all(self, addresses: Iterable[str], key: str, value: str | bytes,
                 abandon: Callable[[], Iterable[str]] = tuple,
                 keep: Callable[[bytes, bytes], bool] | None = None) -> set[str]:
        """Set ``key`` in every store at once; the addresses where it was set. A call
        still under way to an address in ``abandon()`` (the members the failure detector
        suspects now) is not waited for: a process dying with its host up takes
        connections (its kernel does) and answers none while its memory is freed, and the
        call would wait out its bound (2 x PROBE_SECONDS: the fault campaign's host
        kills cost 4 s where the detector knew in 1.5 s)."""
        told: set[str] = set()
        lock = threading.Lock()

        def one(address: str) -> None:
            if self.tell(address, key, value, keep):
                with lock:
                    told.add(address)

        threads = {a: threading.Thread(target=one, args=(a,), daemon=True) for a in addresses}
        for t in threads.values():
            t.start()
        deadline = time.monotonic() + 2 * PROBE_SECONDS + 1.0
        while time.monotonic() < deadline:
            pending = {a for a, t in threads.items() if t.is_alive()}
            if not pending or pending <= set(abandon()):
                break
            next(iter(threads[a] for a in pending)).join(0.05)
        with lock:
            return set(told)

    def read(self, address: str, key: str, timeout: float) -> bytes | None:
        """The value of ``key`` at ``address`` once it is set (None: not within ``timeout``,
        or that agent is gone)."""
        def call() -> bytes:
            client = self.client(address)
            client.wait([key], timedelta(seconds=timeout))
            return bytes(client.get(key))

        try:
            return bounded(call, timeout + PROBE_SECONDS, gone=lambda: refuses(address))
        except (ConnectionError, RuntimeError, OSError, TimeoutError):
            self.forget(address)
            return None


def bounded(call: Callable[[], T], seconds: float, gone: Callable[[], bool] | None = None
            ) -> T:
    """``call()``'s result, or ``TimeoutError`` after ``seconds``. torch's TCPStore client
    waits without bound for the answer of a server that accepted the connection but is
    silent (its process frozen, its host cut off after the connection was made); such a
    call is left behind in a daemon thread, and the caller goes on.

    ``gone``: asked every ``REFUSAL_EVERY`` s while the call is under way; once true, the
    call is given up (``ConnectionError``). For a peer that died just as it was called:
    torch's client, its connection reset, connects again and again, each refused, until
    its timeout (the fault campaign's host kills: up to 1.6 s to the next step where the
    others took 0.2 s, the caller waiting for the failure detector)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # handed to the caller
            error.append(exc)

    thread = threading.Thread(target=run, name="peer-store-call", daemon=True)
    thread.start()
    # Noted at once: a caller may stop waiting for it before ``seconds`` (tell_all gives
    # up on a suspected member), and a process that exits while it is inside torch's
    # client must end at once, not run its shutdown beside it (its retries' C++ lines
    # came after the agent's last line; at worst the shutdown aborts).
    left_in_c(thread)
    deadline = time.monotonic() + seconds
    while True:
        thread.join(min(REFUSAL_EVERY, max(0.0, deadline - time.monotonic()))
                    if gone is not None else seconds)
        if not thread.is_alive():
            break
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no answer within {seconds:g} s")
        if gone is not None and gone():
            raise ConnectionError("the peer refuses connections now (its agent is gone)")
    if error:
        raise error[0]
    return result[0]


def wake(store: dist.Store) -> None:
    """Wake the agent whose store this is (see ``WAKE_KEY``; a torch without store queues,
    before 2.6, leaves it to the agent's next --monitor-interval)."""
    with contextlib.suppress(AttributeError, RuntimeError, OSError):
        store.queue_push(WAKE_KEY, b"1")
