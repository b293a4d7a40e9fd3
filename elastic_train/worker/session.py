"""Make an existing hand-written DDP loop fault-tolerant by changing a handful of lines.

::

    session = ElasticSession("runs/mine", checkpoint_every=50)   # was: init_process_group
    loader = session.dataloader(dataset, batch_size=32)           # was: DistributedSampler
    session.restore(model=model, optimizer=optimizer)             # was: barrier + torch.load
    for epoch in session.epochs(EPOCHS):                          # was: range + set_epoch
        for x, y in loader:
            ...                                                   # the step, unchanged
            if session.step(loss):                                # new: count, checkpoint
                break                                             # (SIGTERM: epochs() ends)
    session.close()                                               # was: rank-0 torch.save

The session uses the same checkpoint format, restore protocol, sampler and event log as the
built-in trainer, so ``elastic-train checkpoints`` and reports work on its runs too.

The protocol around the loop (start, restore, the per-step vote, stops, the final
checkpoint) is the worker runtime's (worker/runtime.py), the same as the built-in trainer's.
Preemption: SIGTERM on any rank becomes a vote that every rank sees at the same step (one
small all-reduce per step), rank 0 checkpoints that step, ``step()`` returns True, and the
workers exit 0 after ``close()``, within the budget: a SIGTERM on every node. On some
nodes only (a spot node reclaimed) those nodes leave alone once ``LEAVE_GRACE`` passed:
their ``step()`` returns True and their ``close()`` raises ``NodeLeftAloneError`` (exit
143), while the others' ``step()`` re-forms the world without them and their loop goes
on. Without live recovery every rank stops with them, and the others' ``close()`` raises
``NodeStoppedError`` (a non-zero exit), so that their agents start them again.
``on_save_failure="stop"`` makes a checkpoint that rank 0 cannot write stop every rank at
the same step: ``step()`` raises ``CheckpointStopError`` with one line saying what to fix.

Live recovery (under ``elastic-train run SCRIPT``, agent/live_agent.py): a worker or node lost,
or a node joining, re-forms the world in place, with the same protocol as the built-in
trainer (worker/runtime.py: ``failed_step``, ``recover``). A hand-written loop's step has no commit
point before ``optimizer.step()``, so the session makes one: ``wrap(model)`` gives DDP a
gradient all-reduce that records a failure instead of raising it
(``data_parallel.forgiving_allreduce_hook``), the ``step()`` of the registered optimizers and
LR schedulers does nothing in a step that failed (a registered GradScaler's ``update()``
keeps its scale; ``step_failed`` tells the loop's own code), and ``step(loss)`` then re-forms the
world: the survivors keep their processes and state, the lowest rank holding the newest
step sends it to the others, the sampler and the session's DataLoader go back to the step
in flight (redone, nothing else), and the DDP module moves to the new process group. A
model wrapped with ``parallelism="fsdp"`` or ``"hsdp"`` (gloo) is the same, its FSDP2
collectives forgiving in the same way, and on a re-formation it is sharded again on the new
mesh in the loop's own model object, with the registered optimizers pointed at its new
parameters (worker/loop_sharding.py); its values come from the replica group, else from
the newest checkpoint (worker/sharded_recovery.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Mapping, Sized
from pathlib import Path
from typing import Any, overload

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from elastic_train.checkpoint.export import (
    check_weights_file,
    export_checkpoint,
    write_weights,
)
from elastic_train.checkpoint.manager import CheckpointManager, Stateful
from elastic_train.config import (
    PARALLELISMS,
    CheckpointConfig,
    RecoveryMode,
    StorageConfig,
    run_location,
)
from elastic_train.config_options import storage_from_options
from elastic_train.errors import ConfigError, LiveRecoveryError
from elastic_train.events.log import EventLog
from elastic_train.events.schema import Step
from elastic_train.worker import data_parallel, distributed, sharded_recovery
from elastic_train.worker.batching import global_batch
from elastic_train.worker.bootstrap import join_world, place_worker
from elastic_train.worker.data_parallel import StepFailures
from elastic_train.worker.distributed import Group
from elastic_train.worker.env import WorkerEnv, read_worker_env
from elastic_train.worker.loop_sharding import LoopShardedModel
from elastic_train.worker.process_name import name_process
from elastic_train.worker.runtime import WorkerRuntime
from elastic_train.worker.sampler import ElasticBatchSampler
from elastic_train.worker.seeding import derive_seed
from elastic_train.worker.session_loader import ElasticDataLoader
from elastic_train.worker.session_options import check_session_options
from elastic_train.worker.sharded_recovery import ShardedLive
from elastic_train.worker.step_gates import skip_failed_steps
from elastic_train.worker.timeline import process_start_time
from elastic_train.worker.watchdog import NoWatchdog, StepWatchdog

LIVE_NOT_SHARDED = ("a hand-written loop's sharded model (wrap(parallelism=\"fsdp\" or "
                    "\"hsdp\")) is not recovered in place {why}: this job restarts from its "
                    "newest sharded checkpoint on a failure instead "
                    "(ElasticSession(..., recovery=\"restart\") silences this line)")
LIVE_NEEDS_WRAP = ("live recovery needs the model wrapped by session.wrap(model) (in place "
                   "of DDP(model)), before restore(): this job restarts from its newest "
                   "checkpoint on a failure instead (ElasticSession(..., recovery=\"restart\") "
                   "says so and silences this line)")


class _Counter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class ElasticSession:
    """The process group, a resumable sampler and checkpoints for a hand-written loop."""

    def __init__(self, run_dir: str | Path, *, checkpoint_every: int | None = 100,
                 checkpoint_interval: float | None = None, keep_checkpoints: int = 3,
                 seed: int = 0, backend: str = "auto", timeout_seconds: float = 120.0,
                 preemption_budget: float | None = 25.0, on_save_failure: str = "continue",
                 deterministic: bool = False, recovery: str = RecoveryMode.LIVE,
                 step_timeout: float | None = None, env: WorkerEnv | None = None,
                 storage: Mapping[str, Any] | StorageConfig | None = None) -> None:
        """``preemption_budget``: seconds a SIGTERM'd job has to checkpoint and exit (keep
        it below the grace period, 30 s on Kubernetes); None leaves SIGTERM to Python.
        ``on_save_failure``: ``continue`` (train on, keep the last good checkpoint, warn)
        or ``stop`` (every rank stops at the same step; see the module docstring).
        ``deterministic``: deterministic CUDA kernels (worker/determinism.py), for a bitwise
        resume on a GPU. ``recovery``: ``live`` (re-form the world in place, under
        ``elastic-train run``; see the module docstring) or ``restart`` (every failure
        restarts the workers from the newest checkpoint). ``step_timeout``: seconds without
        a completed step after which a rank is named as hung (a stopped process, a wedged
        collective) and killed where it runs on this host, so that the world re-forms
        (live recovery) or the job restarts, instead of waiting out ``timeout_seconds``;
        None (the default): no step watchdog (the built-in job's ``--step-timeout``).
        ``run_dir`` may be ``s3://BUCKET/PREFIX``; ``storage``: how to reach it (the keys of
        ``--storage-opt``, e.g. ``{"endpoint_url": ...}``); credentials come from ``AWS_*``
        variables or profiles (docs/object-storage.md)."""
        check_session_options(checkpoint_every=checkpoint_every,
                              preemption_budget=preemption_budget,
                              on_save_failure=on_save_failure, recovery=recovery,
                              step_timeout=step_timeout)
        if not isinstance(storage, StorageConfig):
            storage = storage_from_options([f"{k}={v}" for k, v in (storage or {}).items()])
        place = place_worker(env or read_worker_env(), run_dir, recovery=recovery,
                             storage=storage,
                             backend=backend, timeout_seconds=timeout_seconds,
                             restart_spelling='ElasticSession(..., recovery="restart")',
                             deterministic=deterministic)
        self.live = place.live
        env = place.env
        self.run_dir = run_location(run_dir)
        self.seed = seed
        layout = place.run_dir
        group = join_world(place, backend, timeout_seconds)
        policy = CheckpointConfig(checkpoint_every, checkpoint_interval, keep_checkpoints,
                                  on_save_failure=on_save_failure)
        self.runtime = WorkerRuntime(layout, env, group, policy,
                                     preemption_budget=preemption_budget,
                                     save_failure_option="on_save_failure").install()
        self.runtime.live = self.live
        if self.live is not None:  # its name in ps follows its rank (a re-formation moves it)
            self.runtime.on_moved.append(lambda moved: name_process(moved.rank))
        self._counter = _Counter()
        self._calls = 0
        """``step()`` calls, failed steps included (``steps()`` checks them)."""
        self._objects: dict[str, Stateful] = {}
        self._sampler: ElasticBatchSampler | None = None
        self._batch_sizes: tuple[int | None, int | None] = (None, None)
        self._own_loader = False
        self._ddps: list[DistributedDataParallel] = []
        self._sharded: LoopShardedModel | None = None
        self._failures = StepFailures()
        self._step_timeout = step_timeout
        self._watchdog: StepWatchdog | NoWatchdog = NoWatchdog()

    @property
    def env(self) -> WorkerEnv:
        """This worker's place in the job (rank, world, node); live recovery changes it."""
        return self.runtime.env

    @property
    def group(self) -> Group:
        """This worker's process group (a new one after each live recovery)."""
        return self.runtime.group

    @property
    def events(self) -> EventLog:
        """The run's event log (rank 0 writes it)."""
        return self.runtime.events

    @property
    def checkpoints(self) -> CheckpointManager:
        """The run's checkpoints: when to save, rank 0's writes, the restore."""
        return self.runtime.checkpoints

    @property
    def stopped_at(self) -> int | None:
        """The step the job stopped at after a SIGTERM (``step()`` returned True), or None."""
        return self.runtime.stopped_at

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def device(self) -> torch.device:
        return self.group.device

    @property
    def step_count(self) -> int:
        """Optimizer steps done so far (restored ones included)."""
        return self._counter.step

    def sampler(self, dataset: Sized, batch_size: int | None = None, *,
                global_batch_size: int | None = None) -> ElasticBatchSampler:
        """A DataLoader ``batch_sampler`` over this rank's share of each step's batch.

        Give exactly one size (see ``dataloader()``). Prefer ``dataloader()``: a DataLoader
        you build yourself must get its own ``generator=``, otherwise it draws from torch's
        global generator whenever an epoch starts, and a resumed run's dropout shifts.
        """
        total = global_batch(batch_size, global_batch_size, self.world_size)
        self._batch_sizes = (batch_size, global_batch_size)
        self._sampler = ElasticBatchSampler(len(dataset), total, self.rank, self.world_size,
                                            self.seed)
        self._own_loader = False
        return self._sampler

    def dataloader(self, dataset: Sized, batch_size: int | None = None, *,
                   global_batch_size: int | None = None, **kwargs: Any) -> DataLoader:
        """A DataLoader over this rank's share of each step's batch, resumable mid-epoch.

        ``batch_size`` is **per rank**, PyTorch's convention: a step trains on
        ``batch_size * world_size`` samples, so the optimisation changes with the world
        size. ``global_batch_size`` is the step's batch over **all** ranks, like the built-in
        job's ``--batch-size``: the optimisation does not depend on the world size (a world
        size that does not divide it gives some ranks one sample more). Give one of them.
        ``kwargs`` go to ``DataLoader`` (``num_workers``, ``collate_fn``, ...). Randomness
        inside the dataset should derive from the sample index to stay exact on resume.
        """
        generator = torch.Generator().manual_seed(derive_seed(self.seed, "dataloader"))
        sampler = self.sampler(dataset, batch_size, global_batch_size=global_batch_size)
        self._own_loader = True
        return ElasticDataLoader(dataset, batch_sampler=sampler, generator=generator,
                                  **kwargs)

    def wrap(self, model: torch.nn.Module, *, parallelism: str = "ddp",
             replica_group_size: int = 0, **ddp_options: Any) -> torch.nn.Module:
        """``DistributedDataParallel(model)`` on this session's world (was: ``DDP(model)``),
        or, with ``parallelism="fsdp"`` or ``"hsdp"``, the model sharded by FSDP2 on this
        world's mesh (was: ``fully_shard`` per layer; ``replica_group_size``: hsdp's ranks
        per replica, 0: one group per node).

        Call it before ``restore()``, and build the optimizer after it (a sharded model's
        parameters are new). Under live recovery, the session keeps this module across
        re-formations and makes its collectives ones whose failure the session recovers
        from (module docstring): DDP moves to each new process group; a sharded model is
        sharded again on each new mesh, in the same object, and the optimizers registered
        with ``restore()`` are pointed at its new parameters (worker/loop_sharding.py).
        ``ddp_options`` go to DDP (``device_ids`` defaults to this worker's GPU).
        """
        if parallelism not in PARALLELISMS:
            raise ConfigError(f"wrap(parallelism={parallelism!r}) is invalid: use one of "
                              f"{', '.join(PARALLELISMS)}")
        if parallelism != "ddp":
            return self._shard(model, parallelism, replica_group_size)
        in_sync = False
        if self.live is not None and self.live.arriving:
            # Started into a running world: built, it joins; restore() receives the state.
            self.runtime.join_arriving()
            in_sync = True
        if self.device.type == "cuda":
            ddp_options.setdefault("device_ids", [self.device.index])
        ddp = DistributedDataParallel(model, init_sync=not in_sync, **ddp_options)
        if self.live is not None:
            ddp.register_comm_hook(self._failures, data_parallel.forgiving_allreduce_hook)
        self._ddps.append(ddp)
        return ddp

    def _shard(self, model: torch.nn.Module, parallelism: str,
               replica_group_size: int) -> torch.nn.Module:
        if isinstance(self.run_dir, str):
            raise ConfigError(f"wrap(parallelism={parallelism!r}) with an object store "
                              f"run directory ({self.run_dir}) is not supported yet: "
                              "sharded checkpoints need a filesystem every node shares")
        if self._sharded is not None:
            raise ConfigError("wrap(parallelism=...) was called twice: a session shards one "
                              "model (its checkpoints hold one sharded model)")
        # On gloo the session's collectives record a failure instead of raising it; on
        # NCCL FSDP2 runs its own, whose failure raises in the loop (restart path).
        live = self.live is not None and self.group.backend == "gloo"
        self._sharded = LoopShardedModel(
            model, parallelism, replica_group_size or self.env.local_world_size,
            data_parallel.forgiving_collective(self._failures) if live else None,
            rebuildable=live)
        if self.live is not None and self.live.arriving:
            # Started into a running world: sharded on its mesh; restore() receives the state.
            self.runtime.join_arriving()
        return self._sharded.shard(self.group)

    def _not_live(self, objects: Mapping[str, Stateful]) -> str | None:
        """Why this loop cannot re-form the world in place (None: it can)."""
        if self._sharded is None:
            return None if self._ddps else LIVE_NEEDS_WRAP
        why = None
        if self.group.backend != "gloo":
            why = (f"on {self.group.backend} yet (its collectives' failures reach the loop "
                   "as errors; gloo's are recorded and the step redone)")
        elif self._sharded.not_rebuildable:
            why = f"here: {self._sharded.not_rebuildable}"
        elif objects.get("model") is not self._sharded.model:
            why = "here: restore(model=...) must be the model session.wrap(...) returned"
        return None if why is None else LIVE_NOT_SHARDED.format(why=why)

    def _rebuild_sharded(self) -> Mapping[str, Stateful]:
        """The sharded model built again on the re-formed world's mesh, in place; the
        registered optimizers pointed at its parameters (runtime.rejoin calls it)."""
        assert self._sharded is not None
        self._sharded.rebuild(self.group, [o for o in self._objects.values()
                                           if isinstance(o, torch.optim.Optimizer)])
        return self._objects

    def _held(self) -> ShardedLive | None:
        """A sharded model's side of a re-formation: what this rank holds, kept aside."""
        if self._sharded is None:
            return None
        return ShardedLive(sharded_recovery.hold(self._objects), self._rebuild_sharded)

    def restore(self, **objects: Stateful) -> int:
        """Register what to checkpoint (``model=`` is required) and load the newest checkpoint.

        Returns the step resumed at (0 for a fresh run). Every rank must call it.
        """
        if "model" not in objects:
            raise ConfigError("restore() needs model=...: the model is what checkpoints hold")
        self._objects = {**objects, "session": self._counter}
        if self._sampler is not None:
            self._objects["sampler"] = self._sampler
        live = self.live
        why = self._not_live(self._objects) if live is not None else None
        if live is not None and why is not None:
            if self.rank == 0 and self.env.restart_count == 0:  # once per job
                print(f"elastic_train: {why}", file=sys.stderr, flush=True)
            live.close()
            self.live = self.runtime.live = None
            live = None
        if live is not None and live.arriving:
            started = process_start_time()
            received = ShardedLive(None, self._rebuild_sharded) if self._sharded else None
            self.runtime.recover(
                self._objects,
                lambda: self.runtime.arrive(self._objects, started, sharded=received), None,
                received)
            self._follow_world()
            step = self.step_count
        else:
            self.runtime.start(total_steps=None)
            restored = self.runtime.restore(self._objects)
            step = 0 if restored is None else restored.step
        self.runtime.hold_state()
        if live is not None:
            for obj in objects.values():
                skip_failed_steps(obj, self._failures)
            live.ready()
            live.start()
        self._watch_steps()
        torch.manual_seed(derive_seed(self.seed, "step", self.step_count, self.rank))
        return step

    def _watch_steps(self) -> None:
        """A step watchdog for this world, from now on (``step_timeout``)."""
        self._watchdog.stop()
        self._watchdog = self.runtime.step_watchdog(self._step_timeout).start()
        self._watchdog.phase("the loop's step")

    @property
    def step_failed(self) -> bool:
        """True from a failed collective of the wrapped model (DDP's gradient all-reduce, a
        sharded model's all-gathers and reduce-scatters: a peer lost) to the next
        ``step()``: this step is not applied and will be redone. State the loop changes
        after ``optimizer.step()`` by itself (an EMA of the weights) should skip it then:
        ``if not session.step_failed: ema.update(model)``. Always False without live
        recovery (a failure there raises)."""
        return self._failures.error is not None

    def epochs(self, count: int) -> Iterator[int]:
        """Epoch numbers from the resumed one to ``count - 1``; positions the sampler.

        A resume right at the end of an epoch starts with the next one (not with an empty
        epoch). An epoch that a live recovery through a checkpoint took the sampler back
        before comes again, whole. Ends early after a stop (``step()`` returned True).
        """
        epoch = self._first_epoch()
        if epoch >= count and self.step_count > 0:
            self._say_finished(f"epoch {epoch} of {count}", "the epoch count")
        while epoch < count:
            if self.stopped_at is not None:
                return
            if self._sampler is not None:
                self._sampler.set_epoch(epoch)
            yield epoch
            if self._sampler is not None and self._sampler.epoch != epoch:
                # A live recovery through a checkpoint took the sampler back to an earlier
                # epoch (the loader finished that one): go on from where it stands.
                epoch = self._first_epoch()
            else:
                epoch += 1

    @overload
    def steps(self, total: int) -> Iterator[int]: ...

    @overload
    def steps(self, total: int, loader: DataLoader) -> Iterator[tuple[int, Any]]: ...

    def steps(self, total: int, loader: DataLoader | None = None) -> Iterator[Any]:
        """A step loop: ``for step in session.steps(total):`` runs steps ``step_count`` (the
        resumed one, 0 on a fresh run) to ``total - 1``, so a resumed run does not train
        ``total`` more steps. Call ``step()`` once in each; ends early after a stop.

        With ``loader`` (a ``dataloader()`` of this session) it yields ``(step, batch)`` and
        goes from epoch to epoch as the data runs out, resuming mid-epoch.
        """
        if self.step_count >= total:
            if self.step_count > 0:
                self._say_finished(f"step {self.step_count} of {total}", "the total steps")
            return
        if loader is None:
            while self.step_count < total and self.stopped_at is None:
                before = self._calls
                yield self.step_count
                self._check_stepped(before)
            return
        if self._sampler is None or loader.batch_sampler is not self._sampler:
            raise ConfigError("steps(total, loader): the loader must be this session's "
                              "dataloader(...), whose position the checkpoints keep")
        epoch = self._first_epoch()
        while self.step_count < total and self.stopped_at is None:
            self._sampler.set_epoch(epoch)
            if len(self._sampler) == 0:  # else this loop would go on from empty epoch to epoch
                raise ConfigError(f"the step's batch of {self._sampler.batch_size} samples "
                                  f"exceeds the {self._sampler.sampler.num_samples} samples "
                                  "of the dataset: use a smaller batch size or more data")
            for batch in loader:
                if self.step_count >= total or self.stopped_at is not None:
                    return
                before = self._calls
                yield self.step_count, batch
                self._check_stepped(before)
            # The epoch the loader just finished, the next after it: not always ``epoch +
            # 1``, as a live recovery through a checkpoint may take the sampler back.
            epoch = self._first_epoch()

    def _check_stepped(self, calls_before: int) -> None:
        if self._calls == calls_before and self.stopped_at is None:
            raise ConfigError(f"step {self.step_count} ended without session.step(): call it "
                              "once per step of a steps() loop, after optimizer.step()")

    def _first_epoch(self) -> int:
        if self._sampler is None:
            return 0
        return self._sampler.epoch + (1 if self._sampler.epoch_finished else 0)

    def _say_finished(self, where: str, what: str) -> None:
        """A rerun of a finished run directory trains nothing: say so, and what to do."""
        if self.rank == 0:
            print(f"elastic_train: {self.run_dir} is finished: its newest checkpoint is at "
                  f"{where}; nothing to train (raise {what} to train on, or use a new run "
                  "directory to start afresh)", file=sys.stderr, flush=True)

    def step(self, loss: float | torch.Tensor | None = None) -> bool:
        """Call after each optimizer step: counts it, advances the sampler, checkpoints.

        Returns True when the job is being stopped (SIGTERM on any rank): this step is
        then checkpointed; leave the training loop and call ``close()``. Raises
        ``CheckpointStopError`` on every rank when rank 0 could not write a checkpoint and
        ``on_save_failure`` is ``stop``.
        """
        if not self._objects:
            raise ConfigError("call restore(model=..., optimizer=...) before the first step()")
        if self.stopped_at is not None:
            raise ConfigError(f"step() after the stop at step {self.stopped_at}: leave the "
                              "training loop when step() returns True, then call close()")
        self._calls += 1
        failure = self._failures.take()
        if failure is not None:  # this step's gradient all-reduce failed: not applied
            failed_at = time.time()
            if not self.runtime.failed_step(failure):
                raise failure
            self._recover_in_place(failed_at, attempted=self.step_count + 1)
            return False
        self._counter.step += 1
        self._watchdog.progress(self.step_count)
        if self._sampler is not None:
            self._sampler.advance()
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else loss
        self.events.emit(Step(step=self.step_count, loss=value, world_size=self.world_size,
                              restart=self.env.restart_count))
        try:
            vote = self.runtime.vote()
        except Exception as exc:  # this step is applied here: the others may take it
            failed_at = time.time()
            if not self.runtime.failed_step(exc):
                raise
            self._recover_in_place(failed_at)
            return False
        if vote.ends_loop:
            self._watchdog.stop()  # the stop's checkpoint may take long: not a stalled step
            self.runtime.end(self.step_count, self._objects, vote)
            return True
        self.runtime.save_if_due(self.step_count, self._objects, vote=vote)
        if vote.reform:  # a node is ready to join: re-form at this step boundary
            self._recover_in_place(time.time(), failed=False)
        torch.manual_seed(derive_seed(self.seed, "step", self.step_count, self.rank))
        return False

    def _recover_in_place(self, failed_at: float, *, attempted: int | None = None,
                          failed: bool = True) -> None:
        """Re-form the world with the workers of the new generation, keeping this process
        and its state (runtime.recover); ``attempted``: the step that failed here before
        it was applied (redone unless a member finished it), None when this process holds
        its last step applied (a failed vote after it, or a step boundary: ``failed``
        False)."""
        if self._sampler is not None and not self._own_loader and self._sampler.read_ahead > 1:
            raise LiveRecoveryError(
                f"the DataLoader read {self._sampler.read_ahead} batches ahead of the step "
                "(worker processes), cut for the old world: build it with "
                "session.dataloader(...), which starts again at the step to redo; the job "
                "restarts from its newest checkpoint")
        self._watchdog.stop()
        for obj in self._objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)
        step = self.step_count
        held = self._held()  # a sharded model is built again on the new mesh
        self.runtime.recover(
            self._objects,
            lambda: self.runtime.rejoin(self._objects, step=step, attempted=attempted,
                                        failed_at=failed_at, failed=failed, sharded=held),
            step, held)
        self._follow_world()
        self._watch_steps()

    def _follow_world(self) -> None:
        """After a re-formation: DDP on the new process group, the sampler's share of the
        new world from the step to train on, that step's randomness."""
        for ddp in self._ddps:
            data_parallel.renew_ddp(ddp)
        if self._sampler is not None:
            total = global_batch(*self._batch_sizes, self.world_size)
            self._sampler.reshard(self.rank, self.world_size, total)
        torch.manual_seed(derive_seed(self.seed, "step", self.step_count, self.rank))

    def close(self, export: str | Path | None = None) -> None:
        """Write the final checkpoint, wait for every rank, and leave the process group.

        ``export``: a file that rank 0 writes the final model weights to, a plain state
        dict (``.pt``, ``.pth``, ``.bin``: ``torch.save``; ``.safetensors``), where a
        tutorial's final ``torch.save(model.state_dict(), ...)`` put them.

        After a stop (``step()`` returned True) the checkpoint is written already and the
        run is not over: no final checkpoint, no export, no ``end`` event. A node that was
        not signalled then raises ``NodeStoppedError`` (see the module docstring).
        """
        if export is not None:
            check_weights_file(Path(export))
        self._watchdog.stop()  # the final checkpoint may take long: not a stalled step
        if self.stopped_at is None:
            target = None if export is None or not self._objects else Path(export)
            model = self._objects.get("model")

            def export() -> None:
                assert target is not None and model is not None
                if self._sharded is not None:  # rank 0 gathers them from the checkpoint
                    export_checkpoint(self.runtime.checkpoints.store, target, self.step_count)
                else:
                    write_weights(model.state_dict(), target)

            self.runtime.end(self.step_count, self._objects,
                             then=None if target is None else export)
        self._leave()
        self.runtime.raise_if_node_stopped()

    def _leave(self) -> None:
        self._watchdog.stop()
        self.runtime.close()
        distributed.destroy_group()

    def __enter__(self) -> ElasticSession:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._leave()
