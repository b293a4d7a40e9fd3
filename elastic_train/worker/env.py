"""The workers' reader of the process environment: what torchrun tells a worker about itself.

The names of the variables our agent adds are the contract's (live/environment.py); the
agent's side — torchrun's ``PET_*`` defaults it reads and what it sets for the workers — is
agent/environment.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from elastic_train.live.environment import (
    LIVE_GENERATION,
    LIVE_RECOVERY,
    LIVE_STORE,
    MEMORY_TIER,
    RENDEZVOUS_SECONDS,
    STOP_NOTE,
    WORKER_ENV_FILE,
    read_env_file,
)


@dataclass(frozen=True)
class WorkerEnv:
    """A worker's place in the job, as torch.distributed.elastic sets it.

    Outside torchrun (plain ``python -m elastic_train.train``) this describes a world of one.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = "local"
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    use_agent_store: bool = False
    under_torchrun: bool = False
    prometheus_multiproc_dir: str | None = None
    group_world_size: int = 1
    rendezvous_seconds: float | None = None
    live_recovery: bool = False
    """The agent restarts single workers into the running world (``elastic-train run``)."""
    live_generation: int = 0
    """Non-zero: this worker was started again into generation N of a running world."""
    live_store: str | None = None
    """HOST:PORT of the agent's store for live recovery."""
    memory_tier: str | None = None
    """JSON of the agent's snapshot holder (live/memory_tier.py's ``Endpoint``); None: no
    memory tier (--memory-tier off, plain torchrun)."""
    stop_note: str | None = None
    """Where the agent says that a SIGTERM is its own stop, not a preemption (``STOP_NOTE``;
    None: plain torchrun, every SIGTERM is a preemption)."""

    @property
    def first(self) -> bool:
        """This process belongs to the job's first incarnation: no restart yet, and not
        started again into a running world (a drill fires once per job)."""
        return self.restart_count == 0 and not self.live_generation

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def single_node(self) -> bool:
        """All ranks run under one agent (so they share one restart count)."""
        return self.world_size == self.local_world_size


def _int(environ: Mapping[str, str], key: str, default: int) -> int:
    value = environ.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} is not an integer") from None


def _seconds(environ: Mapping[str, str], key: str) -> float | None:
    try:
        return float(environ[key])
    except (KeyError, ValueError):
        return None


def read_worker_env(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    """Read RANK, WORLD_SIZE, TORCHELASTIC_* and MASTER_* into a WorkerEnv."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    if env.get(WORKER_ENV_FILE):
        env = {**env, **read_env_file(env[WORKER_ENV_FILE])}
    port = _int(env, "MASTER_PORT", 0)
    return WorkerEnv(
        rank=_int(env, "RANK", 0),
        local_rank=_int(env, "LOCAL_RANK", 0),
        world_size=_int(env, "WORLD_SIZE", 1),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
        group_rank=_int(env, "GROUP_RANK", 0),
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS", 0),
        run_id=env.get("TORCHELASTIC_RUN_ID", "local") or "local",
        master_addr=env.get("MASTER_ADDR", "127.0.0.1") or "127.0.0.1",
        master_port=port or None,
        use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        under_torchrun="TORCHELASTIC_RUN_ID" in env,
        # prometheus-client switches to multiprocess mode when either spelling is present,
        # even empty; None means absent.
        prometheus_multiproc_dir=env.get("PROMETHEUS_MULTIPROC_DIR",
                                         env.get("prometheus_multiproc_dir")),
        group_world_size=_int(env, "GROUP_WORLD_SIZE", 1),
        rendezvous_seconds=_seconds(env, RENDEZVOUS_SECONDS),
        live_recovery=env.get(LIVE_RECOVERY) == "1",
        live_generation=_int(env, LIVE_GENERATION, 0),
        live_store=env.get(LIVE_STORE) or None,
        memory_tier=env.get(MEMORY_TIER) or None,
        stop_note=env.get(STOP_NOTE) or None,
    )
