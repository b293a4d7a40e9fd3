"""Where a live agent finds the job's current plan, across rendezvous rounds.

Every plan is committed by compare-and-swap of the job's plan key (live/coordination.py)
from the plan it replaces. That key must outlive the rendezvous round, and on a backend
whose worlds re-form across nodes every agent of the job must reach it: so it lives in the
rendezvous' own store, under a key of the job. Which backends can hold it is said by the
rendezvous' table (rendezvous/backends.py: ``re_forms_across_nodes``), and
agent/live_agent.py turns live recovery across nodes off on the others.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import WorkerGroup

from elastic_train.rendezvous.backends import names_with

__all__ = ["ACROSS_NODES", "job_store"]

ACROSS_NODES = names_with("re_forms_across_nodes")
"""Rendezvous backends whose jobs re-form in place across nodes (rendezvous/backends.py;
tested with each)."""


def job_store(worker_group: WorkerGroup, node_store: dist.Store | None) -> dist.Store:
    """Where the job's current plan is kept, across rendezvous rounds: the rendezvous'
    own store (c10d's TCPStore, etcd) under a key of the job, not of the round. Every
    plan is committed there by compare-and-swap from the plan it replaces, a round's
    first plan from whatever is there: so a coordinator whose world was superseded by
    a newer round (a node cut off while the others formed that round without it)
    commits nothing, although no one else ever wrote in its own round's store.

    On a backend whose worlds never re-form across nodes (torch's ``etcd``, whose
    store has no compare-and-swap), only a round of one agent re-forms in place: its
    plans stay in this agent's own store (``node_store``), where no other agent could
    commit one."""
    if worker_group.spec.rdzv_handler.get_backend() not in ACROSS_NODES:
        assert node_store is not None
        return dist.PrefixStore("elastic_train/job", node_store)
    store = worker_group.store
    if isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return dist.PrefixStore(f"elastic_train/{worker_group.spec.rdzv_handler.get_run_id()}",
                            store)
