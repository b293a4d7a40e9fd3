"""When to checkpoint, rank-0 save (snapshot, then persist), and barrier-guarded restore.

Save is split in two stages: a *snapshot* copies every state dict into reused host buffers
(the only part training waits for), and a *persist* serialises, checksums and atomically
writes it (storage.py) on a background thread, at most one in flight. A failed write
(disk full, permissions) is logged at once, counted and recorded as ``checkpoint_failed``;
the checkpoints already on disk stay. What follows is the job's ``--on-save-failure``
policy: ``continue`` tries again at the next due step, ``stop`` leaves the failure in
``failed``, and every rank stops at the next step (worker/save_failure.py). The final
checkpoint is persisted in the foreground, so a run never ends without it. The agents'
memory tier gets each snapshot before the durable write (memory_offers.py).

Restore is the same on every rank and in the same order: rank 0 chooses what to load (the
memory tier's snapshot or the newest durable checkpoint that verifies and fits: restore.py)
and broadcasts its choice; every rank loads it; a vote (all-reduce) makes every rank fail
together if any could not load.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch

from elastic_train.checkpoint import sharded, sharded_save
from elastic_train.checkpoint.api import (
    CheckpointInfo,
    CheckpointStorage,
    Serialized,
)
from elastic_train.checkpoint.fence import WriterFence
from elastic_train.checkpoint.memory_offers import MemoryOffers, MemoryTier
from elastic_train.checkpoint.persister import BackgroundPersister
from elastic_train.checkpoint.restore import (
    MemoryRestoreFailed,
    Restored,
    Sources,
    choose,
    load_chosen,
)
from elastic_train.checkpoint.snapshot import (
    PendingCopies,
    SnapshotBuffers,
    Stateful,
    changed_only_by_step,
)
from elastic_train.checkpoint.storage import (
    model_digest,
    serialize,
    tensor_shapes,
)
from elastic_train.config import CheckpointConfig
from elastic_train.errors import (
    CheckpointError,
    CheckpointFencedError,
    CheckpointMismatchError,
    CheckpointWriteError,
    StorageError,
)
from elastic_train.events.log import EventLog
from elastic_train.events.schema import (
    CheckpointDeleted,
    CheckpointFailed,
    CheckpointFenced,
    CheckpointLoaded,
    CheckpointSaved,
    CheckpointWaited,
)

__all__ = ["CheckpointManager", "MemoryTier", "Ranks", "Restored", "Stateful",
           "snapshot_state"]

log = logging.getLogger(__name__)


class Ranks(Protocol):
    """The ranks a checkpoint manager agrees with, as it uses them (worker/distributed.py's
    ``Group`` is one): who it is, and the three collectives of a save and a restore, each
    reached by every rank in the same order."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff ``flag`` is true on every rank."""
        ...

    def broadcast_json(self, value: Any, src: int = 0) -> Any:
        """``value`` of rank ``src`` on every rank."""
        ...

    def barrier(self) -> None:
        """Wait for every rank."""
        ...


def snapshot_state(objects: Mapping[str, Stateful]) -> dict[str, Any]:
    """A one-off snapshot into fresh buffers (the manager reuses its own)."""
    return SnapshotBuffers().copy(objects)


class CheckpointManager:
    """Checkpoints of one run, used identically by every rank."""

    def __init__(self, store: CheckpointStorage, group: Ranks, policy: CheckpointConfig,
                 events: EventLog, meta: Mapping[str, Any] | None = None,
                 fence: WriterFence | None = None,
                 on_commit: Callable[[], None] | None = None,
                 memory: MemoryTier | None = None) -> None:
        self.store = store
        self.memory = memory
        """The agents' memory tier (worker/memory_tier.py): the newest snapshot held on two
        nodes, written before the durable store; None outside ``elastic-train run``."""
        self._offers = MemoryOffers(memory) if memory is not None else None
        self.memory_copies: int | None = None
        """How many agents hold the newest snapshot in memory (None: not offered)."""
        self.memory_seconds: float | None = None
        self.uploaded_by: str | None = None
        """Who uploaded the last payload to an object store: ``agent`` (written behind the
        memory tier) or ``worker``; None on a filesystem."""
        self.on_commit = on_commit
        """Called after each checkpoint is committed (an object store's logs follow it)."""
        self.fence = fence
        self.epoch: int | None = None
        """This world's writer epoch (fence.py), claimed by rank 0 at the restore."""
        self.fenced: CheckpointFencedError | None = None
        """Set when a newer world owns the checkpoints: this world must stop."""
        self.group = group
        self.policy = policy
        self.events = events
        self.meta = dict(meta or {})
        self.saved = 0
        self.failures = 0
        self.failed: CheckpointWriteError | None = None
        """The newest failed periodic write (rank 0); the ``stop`` policy acts on it."""
        self.last_saved_step: int | None = None
        self.waits = 0
        """Saves that waited for the previous persist (said once, counted at ``finish``)."""
        self.waited_seconds = 0.0
        self._waits_told = 0
        self._last_save_time = time.monotonic()
        self._buffers = SnapshotBuffers()
        self._persister = BackgroundPersister()
        self._copies_in_flight: PendingCopies | None = None  # the next step waits for them
        self.generation = 0
        """The generation of the world this rank is in (live recovery): a sharded save's
        temp directory is this world's own."""
        self._shards_awaited: threading.Event | None = None
        """Set to give up a sharded save whose shards rank 0 still waits for (``reformed``)."""
        # Optimizers whose step waits for copies in flight (weak: an id could be reused).
        self._guarded: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    # ---- restore -------------------------------------------------------------------------
    def restore(self, objects: Mapping[str, Stateful]) -> Restored | None:
        """Load the newest valid checkpoint into ``objects`` on every rank; None if none.

        The agents' memory tier is tried first when it holds a snapshot at least as new
        as the newest durable checkpoint; if any rank cannot read it, every rank restores
        from the run directory instead."""
        # A save of this rank's still in flight (the world re-formed in place while it was
        # written) ends first, committed or given up; the collective below then waits for
        # every rank's: rank 0 sees the run directory as it will stay, and its sweep of
        # leftovers removes no temp directory a save still writes (a write it cut short
        # reported "not written: free space or fix permissions", and counted for
        # --on-save-failure stop).
        self._finish_pending(report_wait=False)
        # Every rank must reach the memory tier (a plain torchrun node joined to ours has
        # no agent holder): else every rank restores from the run directory.
        use_memory = self.group.all_true(self.memory is not None)
        try:
            return self._restore(objects, use_memory=use_memory)
        except MemoryRestoreFailed:
            return self._restore(objects, use_memory=False)

    def _restore(self, objects: Mapping[str, Stateful], use_memory: bool) -> Restored | None:
        started = time.monotonic()
        sources = Sources(self.store, self.events, self.fence, self.memory)
        decision: dict[str, Any] | None = None
        if self.group.rank == 0:
            try:
                model = objects["model"]
                decision = choose(sources, tensor_shapes(model.state_dict()), use_memory,
                                  sharded.is_sharded(model))
                if self.fence is not None and "error" not in decision:
                    decision["epoch"] = self.fence.claim(decision["step"],
                                                         str(self.meta.get("run_id")))
            except StorageError as exc:  # every rank fails with the same line
                decision = {"error": f"cannot restore from {self.store.root}: {exc}"}
        decision = self.group.broadcast_json(decision)
        self.epoch = decision.get("epoch")
        if "error" in decision:
            kind = CheckpointMismatchError if decision.get("mismatch") else CheckpointError
            raise kind(decision["error"])
        if decision["step"] is None:
            self.group.barrier()
            return None
        from_memory = decision.get("memory")
        path, failure = load_chosen(decision, sources, objects, self.group.device)
        if not self.group.all_true(failure is None):
            if from_memory is not None and not isinstance(failure, CheckpointMismatchError):
                log.warning("restoring from the agents' memory failed (%s): restoring from "
                            "%s instead", failure or "on another rank", self.store.root)
                raise MemoryRestoreFailed()
            raise failure or CheckpointError(
                f"another rank could not load checkpoint {path}: see its error above")
        self._last_save_time = time.monotonic()
        self.last_saved_step = decision["step"]
        seconds = time.monotonic() - started
        self.events.emit(CheckpointLoaded(step=decision["step"], path=str(path),
                                          model_digest=decision.get("model_digest"),
                                          saved_world_size=decision.get("world_size"),
                                          saved_time=decision.get("time"),
                                          world_size=self.group.world_size,
                                          seconds=round(seconds, 6),
                                          source="storage" if from_memory is None
                                          else "memory"))
        if from_memory is not None and decision["step"] > decision["durable_step"]:
            # The memory tier held a save the run directory lacks (a rank died before its
            # commit): write it now, so that the run directory has every checkpoint the
            # policy asked for, in the background as any other.
            self.last_saved_step = None
            self.save(decision["step"], objects, reason="from_memory")
        return Restored(decision["step"], path, decision.get("world_size"), seconds)

    # ---- save ----------------------------------------------------------------------------
    def due(self, step: int, interval_due: bool | None = None) -> bool:
        """Whether the policy asks for a checkpoint after ``step``: every N steps, or
        ``--checkpoint-interval`` seconds since the last one (``interval_due``: whether
        every rank agreed it has passed, the step's vote; None: this rank's own clock,
        enough where rank 0 alone saves)."""
        if step == self.last_saved_step:
            return False
        every = self.policy.every_steps
        if every is not None and step % every == 0:
            return True
        return self.interval_passed() if interval_due is None else interval_due

    def interval_passed(self) -> bool:
        """``--checkpoint-interval`` seconds have passed since the last save or restore
        (this rank's clock: rank 0's decides for a sharded save, through the vote)."""
        interval = self.policy.every_seconds
        return interval is not None and time.monotonic() - self._last_save_time >= interval

    def save(self, step: int, objects: Mapping[str, Stateful], reason: str = "periodic",
             wait: bool = False, overlap_with: torch.optim.Optimizer | None = None) -> None:
        """Rank 0 snapshots the state and persists it; other ranks return at once.

        Training waits only for the snapshot: the persist runs in the background unless
        ``wait`` (the final checkpoint) or the policy is synchronous. A snapshot waits for
        the previous persist only while that one is still running, and says so.

        With ``overlap_with`` (the optimizer of a loop that changes parameters and their
        optimizer state only in its ``step()``), those tensors are copied while the next
        forward and backward run, and that optimizer's next ``step()`` waits for the copy
        (snapshot.py); the seconds it waited are the event's ``copy_wait_seconds``.
        """
        if sharded.is_sharded(objects["model"]):
            self._save_sharded(step, objects, reason, wait)
            return
        if self.group.rank != 0:
            return
        waited = self._finish_pending()
        if step == self.last_saved_step:
            return
        background = not wait and self.policy.asynchronous
        deferred = changed_only_by_step(overlap_with) if background and overlap_with else ()
        started, snapshot_at = time.monotonic(), time.time()
        snapshot, pending = self._buffers.begin(objects, deferred)
        snapshot_seconds = time.monotonic() - started
        self._last_save_time = time.monotonic()
        if pending is not None and overlap_with is not None:
            self._guard_next_step(overlap_with, pending)

        def persist() -> None:
            if pending is not None:
                pending.wait()
            began, cpu_began = time.monotonic(), time.thread_time()
            info = self.persist(step, snapshot)
            self.last_saved_step = step
            self.saved += 1
            self.events.emit(CheckpointSaved(
                step=step, path=str(info.path), reason=reason, bytes=info.size_bytes,
                model_digest=info.model_digest, snapshot_at=round(snapshot_at, 6),
                snapshot_seconds=round(snapshot_seconds, 6),
                copy_seconds=None if pending is None else round(pending.copy_seconds or 0.0, 6),
                copy_wait_seconds=None if pending is None else round(pending.training_waited, 6),
                persist_seconds=round(time.monotonic() - began, 6),
                persist_cpu_seconds=round(time.thread_time() - cpu_began, 6),
                waited_seconds=round(waited, 6),
                memory_copies=self.memory_copies, uploaded_by=self.uploaded_by,
                memory_seconds=None if self.memory_seconds is None
                else round(self.memory_seconds, 6)))

        self._dispatch(step, persist, wait)

    def _dispatch(self, step: int, persist: Callable[[], None], wait: bool) -> None:
        """Run ``persist`` in the background, or now when ``wait`` (the final checkpoint:
        its failure raises to the caller) or when the policy is synchronous. A failed
        periodic write is reported at once (``_failed``) and left to the policy."""

        def reported() -> None:
            try:
                persist()
            except CheckpointWriteError as exc:
                if not wait:  # the final one fails the run: its caller reports it
                    self._failed(exc)
                raise

        if wait:
            reported()
        elif not self.policy.asynchronous:
            try:
                reported()
            except CheckpointWriteError:
                pass  # reported by _failed, handled by the policy like a background failure
        else:
            self._persister.submit(step, reported)

    @contextlib.contextmanager
    def _committing(self, step: int) -> Iterator[None]:
        """Around a write of checkpoint ``step``: a newer world's fence is recorded and
        raised; a storage failure becomes ``checkpoint_failed`` and a
        ``CheckpointWriteError`` (the last good checkpoint stays as it was)."""
        try:
            yield
        except CheckpointFencedError as exc:
            self.fenced = exc
            log.error("%s", exc)
            self.events.emit(CheckpointFenced(step=step, epoch=exc.epoch,
                                              newer_epoch=exc.newer_epoch))
            raise
        except (OSError, StorageError) as exc:
            reason = str(exc) if isinstance(exc, StorageError) else exc.strerror or str(exc)
            self.events.emit(CheckpointFailed(step=step, error=str(exc),
                                              policy=self.policy.on_save_failure))
            raise CheckpointWriteError(step, self.store.root, reason) from exc

    def _save_sharded(self, step: int, objects: Mapping[str, Stateful], reason: str,
                      wait: bool) -> None:
        """Every rank copies its shards (training waits for that alone) and writes them in
        the background; rank 0 commits once every rank's are in (checkpoint/sharded_save.py)."""
        waited = self._finish_pending()
        if step == self.last_saved_step:
            return
        started, snapshot_at = time.monotonic(), time.time()
        shot = sharded.snapshot(objects, self.group.rank, self.group.world_size,
                                self._buffers)
        snapshot_seconds = time.monotonic() - started
        self._last_save_time = time.monotonic()
        staging = sharded.staging_dir(self.store.root, step, self.epoch, self.generation)
        abandoned = self._shards_awaited = threading.Event()

        def persist() -> None:
            encoded = sharded_save.encode(shot)
            if self._offers is not None and self._memory_used(step):
                self._offers.offer_parts(step, self.epoch, self.generation, encoded,
                                         shot.world_size)
                self._memory_told()
            if self.group.rank != 0:
                try:
                    sharded_save.write_rank(staging, shot, encoded)
                except OSError as exc:  # rank 0 waits for this shard in vain and reports it
                    log.warning("rank %d could not write its shard of checkpoint %d: %s",
                                self.group.rank, step, exc)
                    if wait:  # the final one fails the run on this rank too
                        raise CheckpointWriteError(step, self.store.root,
                                                   exc.strerror or str(exc)) from exc
                    return
                self.last_saved_step = step
                return
            began, cpu_began = time.monotonic(), time.thread_time()
            try:
                with self._committing(step):
                    sharded_save.write_rank(staging, shot, encoded)
                    info = sharded_save.commit(self.store, step, staging, shot.world_size,
                                          {**self.meta, "writer_epoch": self.epoch},
                                          timeout=self.policy.shard_timeout_seconds,
                                          before_commit=lambda: self._check_fence(step),
                                          abandoned=abandoned)
            except sharded_save.SaveAbandoned as exc:  # not a failure: that world is gone
                log.warning("checkpoint %d was given up: %s; the newest committed one "
                            "stays", step, exc)
                return
            self._after_commit(step)
            self.last_saved_step = step
            self.saved += 1
            self.events.emit(CheckpointSaved(
                step=step, path=str(info.path), reason=reason, bytes=info.size_bytes,
                model_digest=info.model_digest, snapshot_at=round(snapshot_at, 6),
                snapshot_seconds=round(snapshot_seconds, 6),
                persist_seconds=round(time.monotonic() - began, 6),
                persist_cpu_seconds=round(time.thread_time() - cpu_began, 6),
                waited_seconds=round(waited, 6), memory_copies=self.memory_copies,
                memory_seconds=None if self.memory_seconds is None
                else round(self.memory_seconds, 6)))

        self._dispatch(step, persist, wait)

    def _guard_next_step(self, optimizer: torch.optim.Optimizer, pending: PendingCopies) -> None:
        """Make ``optimizer``'s next step wait for ``pending``.

        The hook is registered once and stays (torch iterates the hooks while calling
        them: one cannot remove itself); without copies in flight it does nothing.
        """
        self._copies_in_flight = pending
        if optimizer in self._guarded:
            return

        def before_step(*_: Any) -> None:
            pending, self._copies_in_flight = self._copies_in_flight, None
            if pending is not None:
                pending.wait_for_training()

        optimizer.register_step_pre_hook(before_step)
        self._guarded.add(optimizer)

    def _failed(self, exc: CheckpointWriteError) -> None:
        """Report a failed periodic write at once (on the thread that wrote it)."""
        self.failures += 1
        self.failed = exc
        if self.policy.on_save_failure == "stop":
            then = "every rank stops at the next step (--on-save-failure stop)"
        else:
            then = ("training goes on and the next checkpoint is tried when due "
                    "(--on-save-failure continue)")
        log.warning("checkpoint %d was not written: %s; %s", exc.step, exc, then)

    def _finish_pending(self, report_wait: bool = True) -> float:
        """Wait for the persist in flight, report a failure; return the seconds waited."""
        busy = self._persister.busy
        started = time.monotonic()
        result = self._persister.wait()
        waited = time.monotonic() - started if busy else 0.0
        self._copies_in_flight = None  # done: the persist waited for them
        if report_wait and busy and waited > 0.001:
            self.waits += 1
            self.waited_seconds += waited
            if self.waits == 1:
                log.warning("checkpoint save waited %.3fs for the previous persist (step %s) "
                            "to finish: checkpoints are due faster than the disk writes them "
                            "(said once; the run's count comes at its end)",
                            waited, result.step if result else "?")
            self.events.emit(CheckpointWaited(seconds=round(waited, 6),
                                              step=result.step if result else None))
        if result is not None and result.error is not None and not isinstance(
                result.error, CheckpointWriteError | CheckpointFencedError):  # reported
            self.failures += 1
            log.error("checkpoint %d was not written: %s", result.step, result.error)
        return waited

    def reformed(self) -> None:
        """This rank's world re-forms in place: a sharded save of the world before whose
        shards are not all in is given up (a lost rank never writes its shard), so that no
        save waits for it."""
        if self._shards_awaited is not None:
            self._shards_awaited.set()

    def join_epoch(self, epoch: int) -> None:
        """This worker is now a member of a world that owns writer epoch ``epoch`` (the
        world re-formed in place). A persist of its own still in flight finishes first,
        fenced by the epoch it was written under; a fence that an older world of this
        worker met no longer stops it (it left that world for this one)."""
        if epoch != self.epoch:
            self._finish_pending(report_wait=False)
        self.epoch = epoch
        if self.fenced is not None and self.fenced.newer_epoch <= epoch:
            self.fenced = None

    def finish(self) -> None:
        """Wait for the persist in flight (shutdown); say how often saves waited."""
        self._finish_pending(report_wait=False)  # on every rank: a sharded save's writer
        if self.group.rank != 0:
            return
        if self.waits > 1 and self.waits != self._waits_told:
            self._waits_told = self.waits
            log.warning("%d checkpoint saves waited for the previous persist (%.3fs in all): "
                        "checkpoint less often (checkpoint_every, --checkpoint-every) or to a "
                        "faster disk", self.waits, self.waited_seconds)

    def _check_fence(self, step: int) -> None:
        if self.fence is not None and self.epoch is not None:
            self.fence.check(self.epoch, step)

    def _memory_used(self, step: int) -> bool:
        """Before offering checkpoint ``step``: whether this world may offer it (a stale
        one offers nothing; its durable write meets the same fence and reports it)."""
        self.memory_copies = self.memory_seconds = None
        try:
            self._check_fence(step)
        except (CheckpointFencedError, StorageError):
            return False
        return True

    def _memory_told(self) -> None:
        assert self._offers is not None
        self.memory_copies, self.memory_seconds = self._offers.copies, self._offers.seconds

    def persist(self, step: int, snapshot: Mapping[str, Any]) -> CheckpointInfo:
        """Write a snapshot atomically, then apply retention (raises CheckpointWriteError)."""
        model_state = snapshot["model"]
        meta = {
            **self.meta,
            "writer_epoch": self.epoch,
            "world_size": self.group.world_size,
            "model_digest": model_digest(model_state),
            "model_shapes": tensor_shapes(model_state),
        }
        payload: Mapping[str, Any] | Serialized = snapshot
        in_object_store = self.store.remote
        if self.memory is not None or in_object_store:
            payload = serialize(snapshot)  # once: for the memory tier and the object store
        offered = None
        if self._offers is not None and self._memory_used(step):
            assert isinstance(payload, Serialized)
            offered = self._offers.offer(step, self.epoch, payload, meta)
            self._memory_told()
        self.uploaded_by = "worker" if in_object_store else None
        extra: dict[str, Any] = {}
        if offered is not None and in_object_store:
            assert self._offers is not None
            extra["upload"] = self._offers.upload_behind(
                offered, lambda by: setattr(self, "uploaded_by", by))
        with self._committing(step):
            info = self.store.write(step, payload, meta,
                                    before_commit=lambda: self._check_fence(step), **extra)
        self._after_commit(step)
        return info

    def _after_commit(self, step: int) -> None:
        """Retention, and what follows a commit (an object store's logs)."""
        try:
            for path in self.store.apply_retention(self.policy.keep, newest=step):
                self.events.emit(CheckpointDeleted(path=str(path), reason="retention"))
        except (OSError, StorageError) as exc:  # committed; the older ones go next time
            log.warning("retention after checkpoint %d did not finish (%s): the older "
                        "checkpoints are deleted after the next one", step, exc)
        if self.on_commit is not None:
            self.on_commit()
