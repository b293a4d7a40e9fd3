"""What an agent tells its workers through its store, and what they tell it back.

The agent keeps a store for its workers (``WorkerEnv.live_store``) that outlives every
worker. Under ``store_prefix(run_id, restart)`` it announces each generation of the world
(``Announcement``: the plan and a mode); the workers set the flags below. Both sides import
these names from here: the agent (agent/live_agent.py) and the worker (worker/live_world.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from elastic_train.live.plan import Plan

__all__ = ["FAILED_COLLECTIVE_KEY", "FINISHED_KEY", "GENERATION_KEY", "LEFT_KEY", "READY_KEY",
           "RESTARTING_KEY", "Announcement", "announcement_key", "store_prefix"]


def store_prefix(run_id: str, restart_count: int) -> str:
    """The key prefix of one incarnation in an agent's store: a single-node job's process
    group in torchrun's shared store, or what a live agent tells its workers
    (worker/live_world.py)."""
    return f"elastic_train/{run_id}/restart-{restart_count}"


GENERATION_KEY = "live/generation"
READY_KEY = "live/ready"
"""Set once the world holds its state (restored, or received): a worker lost before that
has no survivor to take the state from, so the agent restarts the group instead."""
FINISHED_KEY = "live/finished"
"""Set when a worker left the training loop for good: a worker lost after that cannot be
replaced in place (the others no longer meet), so the agent restarts the group instead."""
RESTARTING_KEY = "live/restarting"
"""Set when the agent takes torch's restart path: no new generation will be announced."""
LEFT_KEY = "live/left"
"""Set (to the step) when this node's workers left the job alone at a step boundary: a
SIGTERM reached this node only, and the others went on without it."""
FAILED_COLLECTIVE_KEY = "live/failed_collective"
"""A worker's collective failed with no generation announced: its agent calls the others.
JSON: ``generation``, ``rank``, ``time``, and ``leaving``: the group ranks of nodes that
leave at this step boundary (signalled alone), re-formed without (empty: a failure)."""


def announcement_key(generation: int) -> str:
    """Where the agent puts generation ``generation``'s plan for its workers."""
    return f"live/{generation}/announcement"


@dataclass(frozen=True)
class Announcement:
    """A generation as an agent tells its workers: the plan, and what to do now (``abort``,
    ``boundary`` or ``start``: see the module); ``agent``: the agent's id in the plan."""

    mode: str
    agent: str
    plan: Plan

    def encode(self) -> str:
        return json.dumps({"mode": self.mode, "agent": self.agent,
                           "plan": self.plan.encode().decode()})

    @classmethod
    def decode(cls, data: str | bytes) -> Announcement:
        raw = json.loads(data)
        return cls(str(raw["mode"]), str(raw["agent"]), Plan.decode(raw["plan"]))
