"""The environment variables our agent sets for its workers, beyond torchrun's, and the
file of values it learns after a forked worker's environment was fixed.

Defined once here, the contract both sides read: the agent writes them
(``set_for_workers``, from agent/, and from rendezvous/ for the round's duration), the
worker reads them (worker/env.py).
"""

from __future__ import annotations

import json
import os

__all__ = ["LIVE_GENERATION", "LIVE_RECOVERY", "LIVE_STORE", "MEMORY_TIER",
           "RENDEZVOUS_SECONDS", "STOP_NOTE", "WORKER_ENV_FILE", "read_env_file",
           "read_stop_note", "set_for_workers", "set_rendezvous_seconds"]

# Set by the agent for its workers (agent/environment.py). How long their rendezvous took,
# after each one (rendezvous/timing.py, rendezvous/etcd_v3/state_key.py):
RENDEZVOUS_SECONDS = "ELASTIC_TRAIN_RENDEZVOUS_SECONDS"
# A JSON file of values the agent learned after a forked worker's environment was fixed,
# read over the environment (``set_for_workers`` writes it):
WORKER_ENV_FILE = "ELASTIC_TRAIN_WORKER_ENV_FILE"
# Live recovery (agent/live_agent.py sets them): "1" when the agent restarts single workers into the
# running world; the generation a restarted worker joins:
LIVE_RECOVERY = "ELASTIC_TRAIN_LIVE_RECOVERY"
LIVE_GENERATION = "ELASTIC_TRAIN_LIVE_GENERATION"
# HOST:PORT of the store the agent keeps for its workers' process groups under live recovery
# (it outlives any worker, rank 0 included):
LIVE_STORE = "ELASTIC_TRAIN_LIVE_STORE"
# The memory tier of checkpoints (live/memory_tier.py): JSON {"url", "token", "max_bytes"}
# of the snapshot holder of the worker's own agent (agent/snapshot_holder.py); absent when
# there is none (--memory-tier off, plain torchrun, no agent):
MEMORY_TIER = "ELASTIC_TRAIN_MEMORY_TIER"
# A file the agent writes, before it stops its own workers (torch's restart path: the
# world starts again from the newest checkpoint), with why: a SIGTERM that finds it is the
# agent's own doing, not a preemption of the node (agent/environment.py writes it,
# worker/preemption.py reads it). Absent while no such stop is under way:
STOP_NOTE = "ELASTIC_TRAIN_STOP_NOTE"


def read_env_file(path: str) -> dict[str, str]:
    """The variables in the file named by ``WORKER_ENV_FILE``; {} if it is missing or bad."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def read_stop_note(path: str | None) -> str | None:
    """Why the agent stops its workers (``STOP_NOTE``'s file), or None: no such stop.
    Cheap enough for a signal handler (one small read)."""
    if not path:
        return None
    try:
        with open(path) as f:
            return f.read(512).strip() or "restart"
    except OSError:
        return None


def set_for_workers(key: str, value: str) -> None:
    """Set a variable in this (agent) process for the workers it starts next.

    Subprocess workers inherit the agent's environment. Workers forked from a forkserver
    inherit the *server's*, fixed when it started; for them the value also goes into the
    file named by ``WORKER_ENV_FILE``, which the worker overlays (worker/env.py).
    """
    os.environ[key] = value
    path = os.environ.get(WORKER_ENV_FILE)
    if path:
        values = read_env_file(path)
        values[key] = value
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(values, f)
        os.replace(tmp, path)


def set_rendezvous_seconds(seconds: float) -> None:
    """How long this agent's last rendezvous took, for the workers it starts next
    (``WorkerEnv.rendezvous_seconds``)."""
    set_for_workers(RENDEZVOUS_SECONDS, f"{seconds:.3f}")
