"""How a worker process takes its place in the job: the same steps for both loops (the
built-in job's train.py and ElasticSession), written once.

1. ``place_worker``: its place comes from torchrun's environment, or, under live recovery,
   from its agent's plan (live_world.py); its process is named after its rank (ps, top);
   rank 0 prepares the run directory.
2. ``join_world``: its process group: formed now, joined as a member of the agent's
   generation (live recovery), or, for a worker that arrives in a running world,
   provisional until its model is built (the loop joins then).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from elastic_train.config import StorageConfig
from elastic_train.rundir import RunDir
from elastic_train.torch_compat import check_in_worker
from elastic_train.worker.determinism import make_deterministic
from elastic_train.worker.distributed import Group, init_group
from elastic_train.worker.env import WorkerEnv
from elastic_train.worker.live_world import LiveWorld, live_world_for
from elastic_train.worker.process_name import name_process

__all__ = ["WorkerPlace", "join_world", "place_worker"]


@dataclass(frozen=True)
class WorkerPlace:
    """Where this worker stands before its group exists: ``env`` as its agent placed it,
    ``live`` its membership in a world that re-forms in place (None: torch's restarts)."""

    env: WorkerEnv
    live: LiveWorld | None
    run_dir: RunDir


def place_worker(env: WorkerEnv, run_dir: str | Path, *, recovery: str, backend: str,
                 timeout_seconds: float, restart_spelling: str, deterministic: bool = False,
                 own_process: bool = False, storage: StorageConfig | None = None
                 ) -> WorkerPlace:
    """Step 1 (see the module). ``restart_spelling``: how this entry point spells restart
    recovery, for the line that says live recovery needs our agent. ``own_process``: the
    process is ours (the built-in job), named after its rank even where a user's would keep
    its name (no live recovery: its rank is torchrun's)."""
    check_in_worker(env.rank)  # this torch against the worker's seam (torch_compat.py)
    if deterministic:
        make_deterministic()
    live = live_world_for(recovery, env, backend, timeout_seconds, restart_spelling)
    if live is not None:  # this worker's place comes from its agent's plan
        env = live.env
    if live is not None or own_process:
        name_process(env.rank)
    layout = RunDir(run_dir, storage)
    if env.rank == 0:
        layout.prepare()
    return WorkerPlace(env, live, layout)


def join_world(place: WorkerPlace, backend: str, timeout_seconds: float) -> Group:
    """Step 2 (see the module)."""
    if place.live is not None and place.live.arriving:  # joins once its model is built
        return place.live.provisional_group()
    if place.live is not None:
        return place.live.join()
    return init_group(place.env, backend, timeout_seconds)
