"""The agent's end of live/messages.py: what a live agent reads of its workers' reports in
its own store, and what it tells them there.

The workers of one incarnation (torch's restart count) use the agent's store under
``store_prefix(run_id, restart)``. They report there that the world holds its state
(``READY_KEY``), that they left the training loop (``FINISHED_KEY``) and that a collective
failed (``FAILED_COLLECTIVE_KEY``); the agent announces each generation there
(``Announcement``, ``GENERATION_KEY``), or that none comes (``RESTARTING_KEY``). Kept out of
agent/live_agent.py, whose hooks ask and tell through ``WorkerMessages`` and never spell a
key; the worker's end is worker/live_world.py.
"""

from __future__ import annotations

import contextlib
import json

import torch.distributed as dist

from elastic_train.live.coordination import local_value
from elastic_train.live.messages import (
    FAILED_COLLECTIVE_KEY,
    FINISHED_KEY,
    GENERATION_KEY,
    LEFT_KEY,
    READY_KEY,
    RESTARTING_KEY,
    Announcement,
    announcement_key,
    store_prefix,
)
from elastic_train.live.plan import Plan

__all__ = ["WorkerMessages"]


class WorkerMessages:
    """An agent's store as its workers of one incarnation use it (``store``: under their
    prefix, distributed.store_prefix)."""

    def __init__(self, node_store: dist.Store, run_id: str, restart_count: int) -> None:
        self.store = dist.PrefixStore(store_prefix(run_id, restart_count), node_store)

    # ---- their reports ----------------------------------------------------------------------
    def ready(self) -> bool:
        """The world holds its state (restored, or received)."""
        return self.store.check([READY_KEY])

    def finished(self) -> bool:
        """A worker left the training loop for good."""
        return self.store.check([FINISHED_KEY])

    def left_at(self) -> int | None:
        """The step this node's workers left the job at, alone (a SIGTERM on this node
        only), or None."""
        raw = local_value(self.store, LEFT_KEY)
        return int(raw) if raw is not None else None

    def holding(self) -> bool:
        """The workers hold the state and train: restored, and still in the loop."""
        return self.ready() and not self.finished()

    def why_not_live(self) -> str | None:
        """None when a lost worker can be replaced in place, as far as the workers tell;
        else why not."""
        if not self.ready():
            return "the workers had not restored their state yet"
        if self.finished():
            return "the workers had left the training loop"
        return None

    def failed_collective(self, generation: int) -> bool:
        """A worker saw a collective fail in ``generation`` or later (or nodes leave)."""
        return self._report(generation) is not None

    def leaving(self, generation: int) -> set[int]:
        """The nodes (group ranks in ``generation``) that the workers saw leave alone at a
        step boundary of ``generation`` or later: the world re-forms without them."""
        report = self._report(generation)
        return {int(n) for n in report.get("leaving", ())} if report is not None else set()

    def _report(self, generation: int) -> dict | None:
        raw = local_value(self.store, FAILED_COLLECTIVE_KEY)
        if raw is None:
            return None
        report = json.loads(raw)
        return report if int(report["generation"]) >= generation else None

    # ---- what the agent tells them ----------------------------------------------------------
    def announce(self, agent: str, plan: Plan, mode: str) -> None:
        """Tell the workers about ``plan`` (``agent``: this agent's id in it): ``abort``
        (fail your collectives and re-form now), ``boundary`` (re-form at the end of your
        step, once the workers that start are ready) or ``start`` (for workers that start
        into it)."""
        self.store.set(announcement_key(plan.generation),
                       Announcement(mode, agent, plan).encode())
        self.store.set(GENERATION_KEY, str(plan.generation))

    def release(self) -> None:
        """Tell the workers that no new generation comes (``RESTARTING_KEY``): one waiting
        for it after a failed step fails at once, instead of at its timeout while torch's
        agent waits for it to stop."""
        with contextlib.suppress(RuntimeError, OSError):
            self.store.set(RESTARTING_KEY, "1")
