"""What a restore takes and how it is loaded: rank 0's choice between the agents' memory
tier and the durable store, and each rank's load of the choice.

The choice (``choose``, rank 0): the newest of the memory tier's snapshot (a sharded save:
every part of one save) and the newest durable checkpoint that verifies and fits the
model; memory wins a tie, and a snapshot or checkpoint a newer world superseded (fence.py)
is passed over. Leftovers of torn saves are removed, corrupt checkpoints newer than the one
chosen are set aside (kept, out of the way), never deleted. The manager broadcasts the
choice; every rank then loads it (``load_chosen``), and a vote makes every rank fail
together if any could not (checkpoint/manager.py).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_train.checkpoint import sharded, sharded_restore, storage
from elastic_train.checkpoint.api import CheckpointInfo, CheckpointStorage
from elastic_train.checkpoint.fence import WriterFence, superseded
from elastic_train.checkpoint.memory_offers import MemoryTier
from elastic_train.checkpoint.snapshot import Stateful
from elastic_train.checkpoint.storage import check_compatible, load_payload
from elastic_train.errors import CheckpointMismatchError, ElasticTrainError
from elastic_train.events.log import EventLog
from elastic_train.events.schema import CheckpointLeftoverRemoved, CheckpointSkipped

__all__ = ["MemoryRestoreFailed", "Restored", "Sources", "choose", "load_chosen"]

log = logging.getLogger(__name__)


class MemoryRestoreFailed(Exception):
    """A rank could not load the memory tier's snapshot: restore from the run directory."""


@dataclass(frozen=True)
class Restored:
    """The checkpoint every rank loaded."""

    step: int
    path: Path | str
    world_size: int | None
    seconds: float


@dataclass(frozen=True)
class Sources:
    """Where a restore may come from, and what it tells of its choice."""

    store: CheckpointStorage
    events: EventLog
    fence: WriterFence | None = None
    memory: MemoryTier | None = None

    def claims(self) -> list[Any]:
        """The writer epochs claimed so far (fence.py): what supersedes a save."""
        return self.fence.claims() if self.fence is not None else []


def choose(sources: Sources, shapes: Mapping[str, list[Any]], use_memory: bool = True,
           sharded_job: bool = False) -> dict[str, Any]:
    """Rank 0: the newest of the agents' memory snapshot and the newest durable
    checkpoint that verifies and fits (memory wins a tie), or why there is none."""
    held = None
    if use_memory:
        held = parts_in_memory(sources) if sharded_job else held_in_memory(sources)
    durable_step = max((info.step for info in sources.store.list()), default=-1) \
        if held is not None else -1
    if held is not None and held["step"] >= durable_step:
        # Nothing durable is newer: no payload is read (or downloaded) to verify it.
        _remove_leftovers(sources)
    else:
        durable = choose_durable(sources, shapes)
        if held is None or "error" in durable or (
                durable.get("step") is not None and held["step"] < durable["step"]):
            return durable
    assert held is not None
    return {"step": held["step"], "path": f"memory of {', '.join(held['held_by'])}",
            "world_size": held.get("world_size"), "model_digest": held.get("model_digest"),
            "time": held.get("time"), "memory": held["manifest"],
            "memory_parts": held.get("parts_held"), "durable_step": durable_step}


def _remove_leftovers(sources: Sources) -> None:
    for path in sources.store.remove_leftovers():
        log.warning("removed %s, left by a save or deletion that did not finish", path)
        sources.events.emit(CheckpointLeftoverRemoved(path=str(path)))


def held_in_memory(sources: Sources) -> dict[str, Any] | None:
    """The memory tier's newest snapshot of this run if no newer world superseded it."""
    memory = sources.memory
    if memory is None:
        return None
    try:
        manifest = memory.newest()
    except ElasticTrainError as exc:
        log.warning("the agents' memory tier did not answer (%s): restoring from %s",
                    exc, sources.store.root)
        return None
    if manifest is None:
        return None
    if superseded(manifest.get("writer_epoch"), int(manifest["step"]), sources.claims()):
        return None
    return {**manifest, "manifest": manifest, "held_by": [memory.endpoint.url]}


def parts_in_memory(sources: Sources) -> dict[str, Any] | None:
    """The newest sharded checkpoint the memory tier holds every part of (all offered
    by one save: the same writer epoch, step, generation and world), if no newer
    world superseded it; its parts' manifests under ``parts_held``."""
    memory = sources.memory
    if memory is None:
        return None
    try:
        sets: dict[tuple[Any, ...], dict[int, dict[str, Any]]] = {}
        first = memory.kept(0)
        for manifest in first:
            sets[save_of(manifest)] = {0: manifest}
        for part in range(1, max((int(m["parts"]) for m in first), default=0)):
            for manifest in memory.kept(part):
                if save_of(manifest) in sets:
                    sets[save_of(manifest)][part] = manifest
    except ElasticTrainError as exc:
        log.warning("the agents' memory tier did not answer (%s): restoring from %s",
                    exc, sources.store.root)
        return None
    claims = sources.claims()
    for _, parts in sorted(sets.items(), key=lambda kv: kv[0][:2], reverse=True):
        manifest = parts[0]
        if len(parts) != int(manifest["parts"]):
            log.info("the agents' memory holds %d of the %d parts of checkpoint %d: "
                     "not that one", len(parts), manifest["parts"], manifest["step"])
            continue
        if superseded(manifest.get("writer_epoch"), int(manifest["step"]), claims):
            continue
        return {**manifest, "manifest": manifest, "held_by": [memory.endpoint.url],
                "parts_held": [parts[p] for p in range(len(parts))]}
    return None


def save_of(manifest: Mapping[str, Any]) -> tuple[Any, ...]:
    """What the parts of one sharded save share: writer epoch, step, generation, world."""
    return (int(manifest["writer_epoch"]), int(manifest["step"]), manifest.get("generation"),
            manifest.get("parts"))


def choose_durable(sources: Sources, shapes: Mapping[str, list[Any]]) -> dict[str, Any]:
    """Rank 0: the newest checkpoint that verifies and fits, or why there is none."""
    store, events = sources.store, sources.events
    _remove_leftovers(sources)
    infos = store.list()
    skipped: list[CheckpointInfo] = []
    claims = sources.claims()
    for info in infos:
        written_by = (info.manifest or {}).get("writer_epoch")
        if superseded(written_by, info.step, claims):
            problem = (f"superseded: written by writer epoch {written_by} after a newer "
                       "world had resumed from an earlier step (fence.py)")
            log.warning("skipping checkpoint %s: %s", info.path, problem)
            events.emit(CheckpointSkipped(step=info.step, path=str(info.path),
                                          problem=problem))
            continue
        verdict = store.verify(info)
        if not verdict.valid:
            log.warning("skipping corrupt checkpoint %s: %s", info.path, verdict.problem)
            events.emit(CheckpointSkipped(step=info.step, path=str(info.path),
                                          problem=verdict.problem))
            skipped.append(info)
            continue
        try:
            check_compatible(info, shapes)
        except CheckpointMismatchError as exc:
            return {"error": str(exc), "mismatch": True}
        # Corrupt checkpoints newer than the one resumed would be redone and overwritten
        # by retention's count; set them aside (kept, out of the way) instead.
        for bad in skipped:
            aside = store.set_aside(bad)
            log.warning("set %s aside as %s", bad.path, aside.name)
        return {"step": info.step, "path": str(info.path), "world_size": info.world_size,
                "model_digest": info.model_digest, "time": info.time}
    if infos:
        return {"error": f"none of the {len(infos)} checkpoints under {store.root} "
                "verifies (see the warnings above): move them aside to start afresh, "
                "nothing was deleted"}
    return {"step": None}


def load_chosen(decision: Mapping[str, Any], sources: Sources,
                objects: Mapping[str, Stateful], device: torch.device
                ) -> tuple[Path | str, ElasticTrainError | None]:
    """Load the checkpoint ``decision`` names (rank 0's ``choose``, broadcast) into
    ``objects``: its path, and this rank's failure (None: loaded). Every rank calls it."""
    store, memory = sources.store, sources.memory
    from_memory = decision.get("memory")
    info = store.locate(decision["path"], decision["step"]) if from_memory is None else None
    path = decision["path"] if info is None else info.path
    try:
        map_location = device if device.type == "cuda" else "cpu"
        payload = None
        memory_parts = decision.get("memory_parts")
        if from_memory is not None and memory_parts:
            assert memory is not None
            fetch = memory.fetch
            sharded_restore.restore_from_parts(lambda part: fetch(memory_parts[part]),
                                       len(memory_parts), objects, map_location, path)
        elif from_memory is not None:
            assert memory is not None
            payload = load_payload(io.BytesIO(memory.fetch(from_memory)), path, map_location)
        else:
            assert info is not None
            payload = _load_durable(store, info, objects, map_location)
        for name, obj in (objects.items() if payload is not None else ()):
            if name not in payload:
                raise CheckpointMismatchError(
                    f"checkpoint {path} has no {name!r} state: it was written by another "
                    "program; use a new --run-dir")
            obj.load_state_dict(payload[name])
    except ElasticTrainError as exc:
        return path, exc
    except (RuntimeError, KeyError, ValueError) as exc:
        return path, CheckpointMismatchError(
            f"checkpoint {path} does not fit this job ({str(exc).splitlines()[0]}): use a "
            "new --run-dir or the options that wrote it; it was left untouched")
    return path, None


def _load_durable(store: CheckpointStorage, info: CheckpointInfo,
                  objects: Mapping[str, Stateful], map_location: str | torch.device
                  ) -> dict[str, Any] | None:
    """The payload of checkpoint ``info`` to load object by object; None when a sharded
    checkpoint was loaded into ``objects`` already (resharded to this job's mesh)."""
    if info.manifest is None:
        info = store.read_info(info.path, info.step)
    storage.check_kind(info.path, info.manifest, sharded.is_sharded(objects["model"]))
    if storage.is_sharded_checkpoint(info.manifest):
        sharded_restore.restore_into(info, objects, map_location)
        return None
    return store.load(info, map_location=map_location)
