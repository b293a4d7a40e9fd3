"""What each rendezvous backend can do: one table, read by everything that differs by backend.

A backend is a name ``--rdzv-backend`` takes (torch's registry: its own ``c10d``, ``etcd``,
``etcd-v2``, ``static``, our ``etcd-v3``, or a user's plugin). Code that behaves differently
per backend asks ``capabilities(name)`` what the backend can do, never compares the name:
a new backend is one row here (tests/unit/test_rendezvous_backends.py fails on a comparison
of a backend's name anywhere else in the package). A name not in the table (a user's
plugin) gets ``UNKNOWN``: nothing assumed that we have not tested.

Free of torch imports: the launcher reads this before it imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BACKENDS", "UNKNOWN", "Capabilities", "capabilities", "names_with"]


@dataclass(frozen=True)
class Capabilities:
    """What one rendezvous backend can do, as this project relies on it."""

    re_forms_across_nodes: bool = False
    """Its store offers compare-and-swap to every agent of the job, across rounds: a world
    of several nodes re-forms in place (live recovery across nodes; agent/job_store.py).
    Tested with every backend that says so."""
    store_in_an_agent: bool = False
    """The rendezvous' store is a server inside one agent's process (c10d's TCPStore):
    that host's loss ends the rendezvous for everyone, which the agents watch for and say
    in one line (agent/store_watch.py, rendezvous/failures.py)."""
    heartbeats: bool = False
    """torch's keep-alive heartbeats judge a node dead (``keep_alive_interval`` x
    ``keep_alive_max_attempt``): checked like etcd-v3's options, which torch does not do
    (rendezvous/heartbeat.py)."""
    short_last_call: bool = False
    """torch's 30 s last call is shortened by default (rendezvous/config.py); etcd-v3 has
    its own defaults (etcd_v3/options.py)."""
    preflight: str | None = None
    """The check ``elastic-train run`` makes before any worker starts: ``v2-api`` (etcd's
    v2 HTTP API, python-etcd), ``v3-api`` (etcd's v3 API), or None."""


UNKNOWN = Capabilities()
"""A backend this table does not name: a plugin of the user's, taken as torch takes it."""

BACKENDS: dict[str, Capabilities] = {
    "c10d": Capabilities(re_forms_across_nodes=True, store_in_an_agent=True, heartbeats=True,
                         short_last_call=True),
    "etcd-v3": Capabilities(re_forms_across_nodes=True, preflight="v3-api"),
    "etcd-v2": Capabilities(heartbeats=True, short_last_call=True, preflight="v2-api"),
    "etcd": Capabilities(short_last_call=True, preflight="v2-api"),
    "static": Capabilities(),
}
"""Every backend this project knows, by the name ``--rdzv-backend`` takes."""


def capabilities(backend: str) -> Capabilities:
    """What ``backend`` can do (``UNKNOWN`` for a name not in the table)."""
    return BACKENDS.get(backend, UNKNOWN)


def names_with(capability: str) -> tuple[str, ...]:
    """The backends of the table that have ``capability`` (a field of ``Capabilities``
    that is true, or not None), in the table's order: for messages and help texts."""
    if capability not in Capabilities.__dataclass_fields__:
        raise ValueError(f"no rendezvous capability {capability!r}")
    return tuple(name for name, caps in BACKENDS.items()
                 if getattr(caps, capability) not in (False, None))
