"""Live recovery, the worker's side: a world that re-forms in place after a worker is lost.

The agent (live_agent.py) starts again only the worker that died and announces a new
*generation* of the world in the store it keeps for its workers (``env.live_store``: it
outlives every worker, unlike the store rank 0 hosts under ``env://``) (``GENERATION_KEY`` under
``distributed.store_prefix(run_id, restart)``). Every worker of the world:

- watches that key from a thread; a newer generation fails its collectives at once
  (``distributed.abort_collectives``), so a survivor blocked on any peer leaves its step;
- after a failed step, waits for the announcement (``announced``): a failure that no
  announcement explains is the worker's own and is raised as before, so that the agent's
  restart path takes over;
- joins the generation (``join``): a store barrier of all ``world_size`` members, moved on
  to the next generation if one is announced meanwhile (a member lost again), then a new
  process group under the generation's own key prefix.

What the members do next, the state exchange, is the runtime's (runtime.WorkerRuntime.
share_state): the lowest rank holding the newest step sends the state to every member
behind it.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from elastic_train import distributed
from elastic_train.distributed import Group
from elastic_train.env import WorkerEnv
from elastic_train.errors import LiveRecoveryError

GENERATION_KEY = "live/generation"
READY_KEY = "live/ready"
"""Set once the world holds its state (restored, or received): a worker lost before that
has no survivor to take the state from, so the agent restarts the group instead."""
FINISHED_KEY = "live/finished"
"""Set when a worker left the training loop for good: a worker lost after that cannot be
replaced in place (the others no longer meet), so the agent restarts the group instead."""
WATCH_INTERVAL = 0.05
"""Seconds between a worker's reads of the generation key."""
ANNOUNCE_TIMEOUT = 10.0
"""Seconds a worker whose step failed waits for the agent to announce a lost peer (the
agent notices a dead worker within its monitor interval, 0.1 s by default)."""


def failure_key(generation: int) -> str:
    """Where the agent says which ranks it restarted for ``generation``, and when."""
    return f"live/{generation}/failure"


def joined_key(generation: int) -> str:
    return f"live/{generation}/joined"


@dataclass(frozen=True)
class Failure:
    """What the agent announced with a generation."""

    ranks: list[int]
    detected_at: float | None


class LiveWorld:
    """This worker's membership in a world that re-forms in place (one per worker process).

    ``generation``: the one this worker starts in (0, or the one it was started again
    into); ``form_group(generation)`` forms the process group of a generation.
    """

    def __init__(self, env: WorkerEnv, generation: int, timeout_seconds: float,
                 form_group: Callable[[int], Group]) -> None:
        self.env = env
        self.generation = generation
        self.timeout_seconds = timeout_seconds
        self._form_group = form_group
        prefix = distributed.store_prefix(env.run_id, env.restart_count)
        timeout = timedelta(seconds=timeout_seconds)
        self._store = dist.PrefixStore(prefix, distributed.live_store(env, timeout))
        self._watch_store = dist.PrefixStore(prefix, distributed.live_store(env, timeout))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="live-recovery-watch",
                                        daemon=True)

    # ---- watching ---------------------------------------------------------------------------
    def start(self) -> LiveWorld:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def ready(self) -> None:
        """The world holds its state (see ``READY_KEY``)."""
        with contextlib.suppress(Exception):
            self._store.set(READY_KEY, "1")

    def finished(self) -> None:
        """This worker left the training loop (see ``FINISHED_KEY``)."""
        with contextlib.suppress(Exception):
            self._store.set(FINISHED_KEY, "1")

    def latest(self) -> int:
        """The newest generation the agent announced."""
        return int(self._store.add(GENERATION_KEY, 0))

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL):
            try:
                latest = int(self._watch_store.add(GENERATION_KEY, 0))
            except Exception:  # the agent's store is gone: the job is ending
                return
            if latest > self.generation:
                distributed.abort_collectives(
                    f"a worker was lost; the world re-forms as generation {latest}", latest)

    def announced(self, timeout: float = ANNOUNCE_TIMEOUT) -> int | None:
        """After a failed step: the newer generation the agent announced, or None if none
        comes within ``timeout`` (the failure was this worker's own)."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                latest = self.latest()
                if latest > self.generation:
                    return latest
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    # ---- re-forming -------------------------------------------------------------------------
    def join(self) -> Group:
        """Meet every member of the newest generation; form its process group.

        Raises ``LiveRecoveryError`` when the members are not all there within the group's
        timeout (the agent then restarts the job from its checkpoint).
        """
        deadline = time.monotonic() + self.timeout_seconds
        generation = max(self.latest(), self.generation)
        world = self.env.world_size
        while True:
            self._store.add(joined_key(generation), 1)
            while True:
                latest = self.latest()
                if latest > generation:  # a member was lost again: meet in the next one
                    generation = latest
                    break
                if int(self._store.add(joined_key(generation), 0)) >= world:
                    self.generation = generation
                    return self._form_group(generation)
                if time.monotonic() >= deadline:
                    raise LiveRecoveryError(
                        f"the world did not re-form: {self._store.add(joined_key(generation), 0)}"
                        f" of {world} workers came back within {self.timeout_seconds:g} s "
                        "(--collective-timeout); the job restarts from its newest checkpoint")
                time.sleep(0.005)

    def failure(self, generation: int) -> Failure:
        """What the agent said about ``generation``'s failure."""
        try:
            if self._store.check([failure_key(generation)]):
                data = json.loads(self._store.get(failure_key(generation)).decode())
                return Failure([int(r) for r in data.get("ranks", [])],
                               data.get("detected_at"))
        except (RuntimeError, ValueError):
            pass
        return Failure([], None)
