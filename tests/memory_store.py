"""In-memory stand-ins for coordination's ``Store`` and ``Peers`` (live/coordination.py):
thread-safe, with agents that can die, be cut off from some others, or freeze."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

from elastic_train.live.coordination import offer


class MemoryStore:
    """A key-value store with torch's ``Store`` semantics that coordination uses."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()

    @staticmethod
    def _bytes(value: str | bytes) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        self.wait([key], timedelta(seconds=5))
        with self._changed:
            return self._data[key]

    def set(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self._data[key] = self._bytes(value)
            self._changed.notify_all()

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._data for k in keys)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        with self._changed:
            current = self._data.get(key)
            if (current is None and self._bytes(expected) == b"") \
                    or current == self._bytes(expected):
                self._data[key] = self._bytes(desired)
                self._changed.notify_all()
                return self._data[key]
            return current if current is not None else self._bytes(expected)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        with self._changed:
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"keys {keys} not set within {timeout}")
                self._changed.wait(left)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self._changed:
            return [self._data[k] for k in keys]


class Network:
    """Agents' own stores by address, and who can reach whom."""

    def __init__(self) -> None:
        self.stores: dict[str, MemoryStore] = {}
        self.dead: set[str] = set()
        self.cut: set[frozenset[str]] = set()

    def store(self, address: str) -> MemoryStore:
        return self.stores.setdefault(address, MemoryStore())

    def partition(self, side: Iterable[str], other: Iterable[str]) -> None:
        self.cut |= {frozenset((a, b)) for a in side for b in other}

    def reaches(self, caller: str, address: str) -> bool:
        return address not in self.dead and frozenset((caller, address)) not in self.cut \
            and address in self.stores

    def peers(self, caller: str) -> Peers:
        return Peers(self, caller)


class Peers:
    """One agent's view of the others' stores (live/peers.PeerStores' calls)."""

    def __init__(self, network: Network, caller: str) -> None:
        self.network = network
        self.caller = caller

    def tell(self, address: str, key: str, value: str | bytes,
             keep: Callable[[bytes, bytes], bool] | None = None) -> bool:
        if not self.network.reaches(self.caller, address):
            return False
        store = self.network.stores[address]
        if keep is None:
            store.set(key, value)
        else:
            offer(store, key, value if isinstance(value, bytes) else value.encode(), keep)
        return True

    def tell_all(self, addresses: Iterable[str], key: str, value: str | bytes,
                 abandon: Callable[[], Iterable[str]] = tuple,
                 keep: Callable[[bytes, bytes], bool] | None = None) -> set[str]:
        return {a for a in addresses if self.tell(a, key, value, keep)}

    def read(self, address: str, key: str, timeout: float) -> bytes | None:
        if not self.network.reaches(self.caller, address):
            return None
        try:
            self.network.stores[address].wait([key], timedelta(seconds=timeout))
        except TimeoutError:
            return None
        return self.network.stores[address].get(key)
