"""The training loop: composes task, sampler, DDP and checkpoints; owns (step, samples).

Exactness: the data of step ``s`` is the next global batch of the (seed, epoch) order, split
among today's ranks; its randomness comes from (seed, step, rank); each rank's loss is
weighted by its share of the global batch, so the update is the mean over the global batch
whatever the split. A run resumed at the same world size is therefore bitwise equal to one
that never stopped. On a resize the global batch policy (worker/batching.py) says what the global
batch and the learning rate become; every step event records both.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch
from torch.nn.parallel import DistributedDataParallel

from elastic_train.checkpoint.manager import Restored
from elastic_train.config import JobConfig
from elastic_train.errors import ConfigError, ElasticTrainError
from elastic_train.events.log import EventObserver, read_events
from elastic_train.events.schema import BatchPlan as BatchPlanEvent
from elastic_train.events.schema import Startup, Step
from elastic_train.observe.progress import Progress
from elastic_train.observe.summary import RunSummary, summarize
from elastic_train.rundir import RunDir
from elastic_train.tasks.base import Task, collate
from elastic_train.worker import data_parallel, sharded_recovery, sharding, torch_seams
from elastic_train.worker.batching import WorldBatch, plan_batch
from elastic_train.worker.distributed import Group
from elastic_train.worker.drills import Drills
from elastic_train.worker.env import WorkerEnv
from elastic_train.worker.live_world import LiveWorld
from elastic_train.worker.replica_check import ReplicaCheck
from elastic_train.worker.runtime import GO_ON, Rejoined, Vote, WorkerRuntime
from elastic_train.worker.sample_records import SampleRecords
from elastic_train.worker.sampler import ResumableSampler
from elastic_train.worker.seeding import derive_seed
from elastic_train.worker.sharded_recovery import ShardedLive
from elastic_train.worker.step_parts import lr_factor, micro_batches, rounded
from elastic_train.worker.straggler_check import StragglerCheck
from elastic_train.worker.timeline import process_start_time

log = logging.getLogger(__name__)

@dataclass
class TrainerState:
    """The trainer's own resumable state.

    ``reference_world_size`` is the world size of the job's first start (0: not known,
    in checkpoints written before it was kept); the ``scale-lr`` batch policy needs it.
    """

    step: int = 0
    samples_seen: int = 0
    reference_world_size: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_seen": self.samples_seen,
                "reference_world_size": self.reference_world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.reference_world_size = int(state.get("reference_world_size", 0))


@dataclass
class Built:
    """What a worker builds from its task before it knows its place: the model (on the
    CPU) and the dataset. A hot spare builds them ahead (live/spare.py)."""

    model: torch.nn.Module
    dataset: Any


def build_task(task: Task, seed: int) -> Built:
    """The task's model, initialised from the job's seed, and its dataset."""
    torch.manual_seed(derive_seed(seed, "init"))
    model = task.build_model()
    return Built(model, task.build_dataset())


def warm_up(task: Task, built: Built, samples: int, lr: float) -> None:
    """One throwaway forward, backward and optimizer step on ``built`` (a hot spare's, on
    the CPU): a process' first step pays one-time costs (allocator, kernel set-up) that
    would otherwise fall on the step a recovery redoes. It leaves no gradients; the values
    it changes are overwritten by the state the spare receives."""
    n = max(1, min(samples, len(built.dataset)))
    batch = collate(task, [built.dataset[i] for i in range(n)])
    optimizer = task.build_optimizer(built.model, lr)
    task.loss(built.model, batch).backward()
    optimizer.step()
    built.model.zero_grad(set_to_none=True)


class Trainer:
    """Runs one incarnation of a worker: restore, train to ``steps``, final checkpoint.

    ``observers`` see every event record on this rank (the worker's metrics); rank 0 shows
    progress on ``out``.
    """

    def __init__(self, config: JobConfig, env: WorkerEnv, task: Task, group: Group,
                 out: TextIO | None = None, marks: dict[str, float] | None = None,
                 observers: Sequence[EventObserver] = (), live: LiveWorld | None = None,
                 built: Built | None = None) -> None:
        self.config = config
        self._built = built
        """The model and dataset, when built before this trainer (a hot spare's)."""
        self.env = env
        self.task = task
        self.group = group
        self.out = out or sys.stdout
        cfg = config.train
        self.progress = Progress(self.out, cfg.steps, cfg.batch_size, cfg.log_every) \
            if group.rank == 0 else None
        if self.progress is not None:
            observers = [*observers, self.progress.observe]
        self.run_dir = RunDir(config.run_dir, config.storage)
        meta = {"task": cfg.task, "task_options": dict(cfg.task_options),
                "run_id": env.run_id, "batch_size": cfg.batch_size}
        self.runtime = WorkerRuntime(
            self.run_dir, env, group, config.checkpoint,
            preemption_budget=config.distributed.preemption_budget_seconds, meta=meta,
            observers=observers, say=self._print)
        self.runtime.live = live
        self.events = self.runtime.events
        self.runtime.replicas = ReplicaCheck(cfg.verify_every, self.events, self.sharded,
                                             certify=self.runtime.checkpoints.meta)
        self.runtime.stragglers = StragglerCheck(cfg.straggler_policy, cfg.straggler_factor,
                                                 cfg.straggler_window, self.events)
        self._drills = Drills(cfg.inject_bitflip, cfg.inject_slowdown)
        self.state = TrainerState()
        self._in_flight: dict[str, Any] | None = None
        """The sampler's state before the step in flight, until every rank agreed on it."""
        # Replaced after the restore by the job's policy (see _plan_batch).
        self.plan = WorldBatch("constant", config.train.batch_size, 1.0, group.world_size,
                              group.world_size)
        self._samples = SampleRecords(self.run_dir.samples_of, self.runtime.publisher.track)
        self._marks = {"process_start": process_start_time(), **(marks or {})}

    # ---- building ------------------------------------------------------------------------
    def _build(self, arriving: bool) -> None:
        """Build the model, data and optimizer. What a hot spare built ahead is used only
        when this worker arrives in a running world (the state it receives overwrites the
        model's values); a world that starts afresh needs the seed's initial weights."""
        cfg = self.config.train
        built = self._built if arriving and self._built is not None \
            else build_task(self.task, cfg.seed)
        self._built = None
        self.model = built.model.to(self.group.device)
        if self.sharded:  # sharded in place, before the optimizer takes it
            self._shard()
        self.dataset = built.dataset
        if len(self.dataset) < cfg.batch_size:
            raise ConfigError(f"--batch-size {cfg.batch_size} exceeds the {len(self.dataset)} "
                              "samples of the dataset: use a smaller batch or more data")
        if cfg.batch_size < self.group.world_size:
            raise ConfigError(f"--batch-size {cfg.batch_size} is smaller than the world size "
                              f"{self.group.world_size}: every rank needs at least one sample")
        self.sampler = ResumableSampler(len(self.dataset), cfg.seed)
        self._build_optimizer()

    def _build_optimizer(self) -> None:
        cfg = self.config.train
        self.optimizer = self.task.build_optimizer(self.model, cfg.lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps, cfg.lr_schedule)
            * self.plan.lr_scale)

    @property
    def sharded(self) -> bool:
        """``--parallelism fsdp|hsdp``: the model is sharded by FSDP2."""
        return self.config.train.parallelism != "ddp"

    def _shard(self) -> None:
        cfg = self.config.train
        sharding.shard_model(self.model, self.group, cfg.parallelism,
                             cfg.replica_group_size or self.env.local_world_size)

    def _rebuild_sharded(self) -> dict[str, Any]:
        """A sharded model, its optimizer and scheduler built again on the mesh of the
        world just re-formed (FSDP2 keeps the group it was built on); their values come
        next (worker/sharded_recovery.py)."""
        self.group, self.env = self.runtime.group, self.runtime.env
        self.model = self.task.build_model().to(self.group.device)
        self._shard()
        self._build_optimizer()
        return self._stateful()

    def _stateful(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "trainer": self.state, "sampler": self.sampler}

    # ---- one step ------------------------------------------------------------------------
    def _step(self, ddp: DistributedDataParallel) -> tuple[float, Vote]:
        """One optimizer step; returns the global mean loss and what every rank voted."""
        cfg = self.config.train
        rank, world = self.group.rank, self.group.world_size
        self.watchdog.phase("data")
        checks = self.runtime.stragglers  # times the step's local part (no backward)
        checks.start()
        global_batch = self.plan.global_batch
        self._in_flight = self.sampler.state_dict()
        batch = self.sampler.next_batch(global_batch)
        mine = batch.shard(rank, world)
        torch.manual_seed(derive_seed(cfg.seed, "step", self.state.step, rank))
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.group.device)
        chunks = micro_batches(mine, cfg.micro_batch_size)
        for i, chunk in enumerate(chunks):
            inputs = collate(self.task, [self.dataset[int(j)] for j in chunk])
            inputs = _to_device(inputs, self.group.device)
            last = i == len(chunks) - 1
            if isinstance(ddp, DistributedDataParallel):
                context = ddp.no_sync() if not last and world > 1 \
                    else contextlib.nullcontext()
            else:  # sharded: FSDP2 reduces the accumulated gradients with the last one
                context = sharding.gradient_sync(ddp, enabled=last)
            self.watchdog.phase("forward-backward")
            with context:
                loss = self.task.loss(ddp, inputs)
                checks.pause()
                # DDP averages gradients over ranks; weighting by share * world / global
                # batch makes the result the mean over the global batch for any split.
                (loss * (len(chunk) * world / global_batch)).backward()
                checks.resume()
            loss_sum += loss.detach().double() * len(chunk)
        if cfg.record_samples:  # before the vote: a step that commits was recorded by all
            self._samples.write(
                step=self.state.step + 1, epoch=batch.epoch, offset=batch.offset, indices=mine,
                world_size=world, restart=self.env.restart_count, rank=rank,
                generation=self.runtime.live.generation if self.runtime.live else 0)
        checks.pause()
        if world > 1:
            self.watchdog.phase("all-reduce of the loss")
        # The step commits when every rank has voted, before any state changes: a worker
        # lost before that leaves every survivor's state at the previous step (live
        # recovery redoes this one); after it, a survivor holds the finished step.
        vote = self.runtime.vote(loss_sum, step=self.state.step + 1)
        self._in_flight = None
        self.watchdog.phase("optimizer")
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self._drills.after_step(rank, self.state.step, self.env.first, self.model,
                                self.optimizer)
        self.state.samples_seen += global_batch
        self.watchdog.progress(self.state.step)
        return vote.loss_sum / global_batch, vote

    # ---- the run -------------------------------------------------------------------------
    def run(self) -> RunSummary | None:
        """Train to the configured step count; return the run's summary on rank 0."""
        self.runtime.install()
        try:
            summary = self._run()
        finally:
            self.runtime.close()
        self.runtime.raise_if_node_stopped()
        return summary

    def _run(self) -> RunSummary | None:
        cfg = self.config.train
        live = self.runtime.live
        arriving = live is not None and live.arriving
        if arriving and self.sharded:  # sharded on the mesh of the world it joins
            self.group = self.runtime.join_arriving()
            self.env = self.runtime.env
        self._build(arriving)
        restored = None
        if arriving:
            assert live is not None
            # Started into a running world: built, it joins, and a member sends the state.
            received = ShardedLive(None, self._rebuild_sharded) if self.sharded else None
            self._rejoin(lambda: self.runtime.arrive(self._stateful(),
                                                     self._marks.get("process_start"),
                                                     sharded=received),
                         has_state=False, sharded=received)
        else:
            self.runtime.start(total_steps=cfg.steps, threads=torch.get_num_threads(),
                               config=self.config.to_dict())
            restored = self.runtime.restore(self._stateful())
        self.runtime.hold_state()
        if live is not None:
            live.ready()
            live.start()
        self._marks["restored"] = time.time()
        self._plan_batch(restored)
        if not arriving:
            self._announce(restored)
        ddp: DistributedDataParallel | None = self._wrap_model(in_sync=arriving)
        self._marks["ddp_ready"] = time.time()
        self.watchdog = self.runtime.step_watchdog(
            self.config.distributed.step_timeout_seconds).start()
        # A resume at the last step runs no step at all.
        first_step, vote = True, GO_ON
        while self.state.step < cfg.steps:
            began = time.monotonic()
            try:
                assert ddp is not None
                loss, vote = self._step(ddp)
            except Exception as exc:
                failed_at = time.time()
                if not self.runtime.failed_step(exc):
                    raise
                lost_peer = True
            else:
                lost_peer = False
            if lost_peer:
                assert ddp is not None
                ddp = self._recover_in_place(ddp, failed_at)
                continue
            step_seconds = time.monotonic() - began
            if first_step:  # the start-up timeline, for recovery measurements
                self.events.emit(Startup(restart=self.env.restart_count,
                                         resumed_step=self.state.step - 1,
                                         first_step_done=time.time(), marks=self._marks))
                first_step = False
            self.events.emit(Step(step=self.state.step, loss=round(loss, 6),
                                  lr=self.scheduler.get_last_lr()[0], epoch=self.sampler.epoch,
                                  world_size=self.group.world_size,
                                  samples=self.state.samples_seen,
                                  global_batch=self.plan.global_batch,
                                  seconds=round(step_seconds, 6),
                                  compute_seconds=rounded(self.runtime.stragglers.measured),
                                  straggler_score=rounded(self.runtime.stragglers.score),
                                  restart=self.env.restart_count))
            if vote.ends_loop:
                break
            if self.state.step < cfg.steps:
                # This loop changes parameters and optimizer state only in optimizer.step():
                # their copy overlaps the next forward and backward.
                self.runtime.save_if_due(self.state.step, self._stateful(),
                                         overlap_with=self.optimizer, vote=vote)
                if vote.reform:  # a node is ready to join: re-form at this step boundary
                    assert ddp is not None
                    ddp = self._recover_in_place(ddp, time.time(), at_boundary=True)
        self.watchdog.stop()  # the final save may take long: not a stalled step
        self.runtime.end(self.state.step, self._stateful(), vote)
        return self._finish()

    def _wrap_model(self, *, in_sync: bool = False) -> DistributedDataParallel:
        """DDP over this world's group; under live recovery its gradient all-reduce is one
        that a lost peer ends at once (data_parallel.abortable_allreduce_hook). A sharded
        model (``--parallelism fsdp|hsdp``) is its own wrapper: it is returned as it is.

        ``in_sync``: every rank already holds the same state (a live recovery just sent
        it), so DDP's own check and broadcast of the parameters are skipped.
        """
        if self.config.train.parallelism != "ddp":
            self.model.train()
            return self.model  # type: ignore[return-value]
        ddp = DistributedDataParallel(
            self.model,
            device_ids=[self.group.device.index] if self.group.device.type == "cuda" else None,
            init_sync=not in_sync)
        if self.runtime.live is not None:
            ddp.register_comm_hook(None, data_parallel.abortable_allreduce_hook)
        ddp.train()
        return ddp

    def _recover_in_place(self, ddp: DistributedDataParallel, failed_at: float, *,
                          at_boundary: bool = False) -> DistributedDataParallel:
        """Re-form the world with the workers of the new generation, keeping this process
        and its state. After a lost peer (``at_boundary`` False) the step in flight is
        redone unless some member finished it (then everyone takes that member's state);
        at a step boundary (a node joins) the step is committed and nothing is redone."""
        if not self.sharded:
            # The old world's DDP must not reduce gradients any more: its hooks on the
            # parameters go now, not when a garbage collection finds it.
            torch_seams.remove_gradient_hooks(ddp)
        self.watchdog.stop()
        world_before = self.group.world_size
        attempted = None if at_boundary else self.state.step + 1
        if self._in_flight is not None:  # the step did not commit here: go back before it
            self.sampler.load_state_dict(self._in_flight)
            self._in_flight = None
        self.optimizer.zero_grad(set_to_none=True)
        # A sharded model is built again on the new mesh: what this rank holds is kept aside.
        held = ShardedLive(sharded_recovery.hold(self._stateful()), self._rebuild_sharded) \
            if self.sharded else None
        self._rejoin(lambda: self.runtime.rejoin(
            self._stateful(), step=self.state.step, attempted=attempted, failed_at=failed_at,
            sharded=held), sharded=held)
        if self.group.world_size != world_before:  # the batch policy of the new world
            self._plan_batch(None)
        new_ddp = self._wrap_model(in_sync=True)
        self.watchdog = self.runtime.step_watchdog(
            self.config.distributed.step_timeout_seconds).start()
        return new_ddp

    def _rejoin(self, first: Callable[[], Rejoined], has_state: bool = True,
                sharded: ShardedLive | None = None) -> Rejoined:
        """Re-form the world (``first``), again as often as a member is lost meanwhile (a
        newer generation announced while the group forms or the state is sent); this
        worker's group and place follow."""
        rejoined = self.runtime.recover(self._stateful(), first,
                                        self.state.step if has_state else None, sharded)
        self.group, self.env = rejoined.group, self.runtime.env
        if self.group.rank == 0 and self.progress is None:  # rank 0 was lost: show on here
            cfg = self.config.train
            self.progress = Progress(self.out, cfg.steps, cfg.batch_size, cfg.log_every)
            self.events.observers = (*self.events.observers, self.progress.observe)
        return rejoined

    def _plan_batch(self, restored: Restored | None) -> None:
        """Fix this incarnation's global batch and LR scale (after the restore: W0 is in it)."""
        cfg = self.config.train
        world = self.group.world_size
        if not self.state.reference_world_size:
            known = restored.world_size if restored is not None else None
            self.state.reference_world_size = int(known or world)
        self.plan = plan_batch(cfg.batch_policy, cfg.batch_size, world,
                               self.state.reference_world_size)
        if self.plan.global_batch > len(self.dataset):
            raise ConfigError(f"the global batch of {self.plan.global_batch} samples at world "
                              f"size {world} exceeds the {len(self.dataset)} samples of the "
                              "dataset: use a smaller --batch-size or more data")
        if self.plan.policy == "scale-lr":
            # The restored optimizer holds the LR of the world that saved it: set this one's.
            step = self.scheduler.last_epoch
            lrs = [base * self.scheduler.lr_lambdas[0](step) for base in self.scheduler.base_lrs]
            for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            self.scheduler._last_lr = lrs  # what get_last_lr() reports
        self.events.emit(BatchPlanEvent(
            policy=self.plan.policy, global_batch=self.plan.global_batch,
            lr_scale=self.plan.lr_scale, lr=self.optimizer.param_groups[0]["lr"],
            step=self.state.step, world_size=world,
            reference_world_size=self.plan.reference_world_size))

    def _announce(self, restored: Restored | None) -> None:
        if self.group.rank != 0:
            return
        if restored is None:
            self._print(f"starting {self.config.train.task} from scratch: world size "
                        f"{self.group.world_size}, {self.config.train.steps} steps")
            return
        self._print(f"resumed from {restored.path} (step {restored.step}, saved at world size "
                    f"{restored.world_size}, now {self.group.world_size}; "
                    f"restart {self.env.restart_count})")
        if restored.step >= self.config.train.steps:
            self._print(f"{self.config.run_dir} is finished: its newest checkpoint is at step "
                        f"{restored.step} of --steps {self.config.train.steps}; nothing to "
                        "train (raise --steps to train on, or use a new --run-dir to start "
                        "afresh)")

    def _finish(self) -> RunSummary | None:
        self._samples.close()
        self._drills.close()
        self.events.close()
        if self.group.rank != 0 or self.progress is None or self.runtime.left:
            return None  # a node that left alone: the others go on and sum up the run
        try:
            self.runtime.publisher.publish_now()
            events = self.run_dir.gathered_events()  # every node's, for an object store
        except ElasticTrainError:
            events = self.run_dir.events
        summary = summarize(read_events(events), self.env.run_id)
        for line in summary.lines():
            self._print(line)
        self.progress.close()
        return summary

    def _print(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)
        else:
            print(text, file=self.out, flush=True)


def _to_device(value: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value
