"""A hot spare: a worker forked and built before any failure, which becomes the replacement
of whichever worker of its node fails next (live recovery of the built-in trainer).

Without it, a failed worker's replacement is forked when the failure is found and builds
its task and model while the world waits for it (about a third of a live recovery on a
CPU). The agent keeps one spare per node (``--hot-spare``): a worker process whose
environment says ``ELASTIC_TRAIN_SPARE=1``. It loads the task, builds the model and the
dataset as every worker does, then waits on its agent's store until it is given a place
(``assign``: the environment of the worker it replaces) or its agent goes away. Given
one, it takes that environment and runs as that worker would have: it joins the running
world and receives the state from a survivor, so what it built before holds nothing a
run depends on (the state it receives overwrites the model's values).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from elastic_train.live.peers import split_address

SPARE = "ELASTIC_TRAIN_SPARE"
"""``1`` in a spare's environment until it is given a place."""
KEPT_FROM_SPARE = frozenset({"TORCHELASTIC_ERROR_FILE"})
"""What a spare keeps of its own environment when it takes a worker's: the error file its
agent reads when this process fails is the one torch named for the spare's process."""
DELAY = "ELASTIC_TRAIN_SPARE_DELAY"
"""Seconds after the workers started, or after a spare took a failed worker's place, before
the agent forks the next spare (default 1: its build would slow the start or the recovery
in flight); a spare is forked only once the world holds its state. Tests set 0."""
WAIT_SECONDS = 60.0
"""A spare's wait for its place is cut into waits this long, between which it checks that
its agent's store still answers."""


def spare_delay(environ: Mapping[str, str] = os.environ) -> float:
    """``ELASTIC_TRAIN_SPARE_DELAY`` in seconds (default 1.0; a bad value: the default)."""
    try:
        return max(0.0, float(environ.get(DELAY, "1.0")))
    except ValueError:
        return 1.0


def is_spare(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(SPARE) == "1"


def place_key(pid: int) -> str:
    """Where the agent puts the environment of the worker that process ``pid`` replaces."""
    return f"live/spare/{pid}"


def spare_env(worker_env: Mapping[str, str]) -> dict[str, str]:
    """A spare's starting environment: one of the node's workers', marked as a spare."""
    return {**worker_env, SPARE: "1"}


def assign(store: dist.Store, pid: int, worker_env: Mapping[str, str]) -> None:
    """Give spare ``pid`` the place of the worker whose environment is ``worker_env`` (empty:
    dismiss it)."""
    store.set(place_key(pid), json.dumps(dict(worker_env)))


def wait_for_place(store_address: str) -> dict[str, str] | None:
    """Block until this spare is given a place (the environment to take); None when it is
    dismissed (an empty place) or its agent's store stops answering (the agent ended)."""
    host, port = split_address(store_address)
    key = place_key(os.getpid())
    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=WAIT_SECONDS))
        while True:
            try:
                store.wait([key])
                break
            except dist.DistStoreError:  # a wait's timeout, or the store went away
                store.check([key])  # raises once the store is gone
        place = {str(k): str(v) for k, v in json.loads(store.get(key)).items()}
        return place or None
    except (RuntimeError, ValueError):  # the store is gone (DistStoreError is one)
        return None


def take_place(place: Mapping[str, str]) -> None:
    """Become the worker whose environment is ``place`` (this process' environment)."""
    for name, value in place.items():
        if name not in KEPT_FROM_SPARE:
            os.environ[name] = value
    os.environ.pop(SPARE, None)
