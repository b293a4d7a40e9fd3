"""Prometheus metrics of one worker, kept up to date from the records of the run's event log.

Each worker builds a ``WorkerMetrics`` on a registry it is given (never prometheus-client's
global default) and serves it on its own port (``observe/metrics_server.py``). Its values come from
the same records that rank 0 writes to ``events.jsonl`` (``observe``), so the endpoint, the
log and the report agree. Every series carries the bounded labels ``run_id``, ``rank`` and
``node``; names follow Prometheus' conventions (one prefix, base units, ``_total``). The
``rank`` label is the worker's rank now: a live re-formation that moves a worker to another
rank (a node before it was lost) moves its series too (``moved``), values kept.

Rank 0 alone saves checkpoints and reads the event log (the ``rendezvous`` record tells it
about the incarnation before), so the checkpoint-save, last-good-checkpoint, skipped,
recovery and lost-work series come from rank 0 (absent elsewhere).
"""

from __future__ import annotations

import platform
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from elastic_train import __version__
from elastic_train.batch_shares import shard_bounds
from elastic_train.errors import MetricsError
from elastic_train.events.schema import Event

PREFIX = "elastic_train"
LABELS = ("run_id", "rank", "node")
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                      300.0, 600.0)
THROUGHPUT_WINDOW = 20
"""Steps over which ``samples_per_second`` is measured (wall time, pauses included)."""


class ObservedProcess(Protocol):
    """What the metrics know of the worker they observe (worker/env.py's ``WorkerEnv`` is
    one): declared here so that observe/ depends on no worker module."""

    @property
    def rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def run_id(self) -> str: ...

    @property
    def restart_count(self) -> int: ...

    @property
    def max_restarts(self) -> int: ...

    @property
    def rendezvous_seconds(self) -> float | None: ...

    @property
    def prometheus_multiproc_dir(self) -> str | None: ...


def check_single_process_mode(env: ObservedProcess) -> None:
    """Refuse prometheus-client's multiprocess mode: dead workers' series would stay forever.

    The mode switches on when ``PROMETHEUS_MULTIPROC_DIR`` is present at all, even empty.
    """
    if env.prometheus_multiproc_dir is not None:
        raise MetricsError(
            f"PROMETHEUS_MULTIPROC_DIR is set (to {env.prometheus_multiproc_dir!r}), which puts "
            "prometheus-client in multiprocess mode; every worker serves its own endpoint "
            "instead: unset it for the job, or pass --metrics-port 0 to run without metrics")


class _Lazy:
    """A labelled gauge created at its first value: absent from /metrics until it is known
    (a restarted worker must not claim step 0 or a last step at time 0)."""

    def __init__(self, family: Gauge, labels: dict[str, str]) -> None:
        self._family = family
        self._labels = labels
        self._child: Any = None

    def set(self, value: float) -> None:
        if self._child is None:
            self._child = self._family.labels(**self._labels)
        self._child.set(value)


class _CurrentRank(Collector):
    """Serves the series of ``inner`` with the ``rank`` label set to ``rank`` at each
    scrape (the series are built once, under the rank the worker started with)."""

    def __init__(self, inner: CollectorRegistry, rank: int) -> None:
        self._inner = inner
        self.rank = rank

    def describe(self) -> list[Metric]:
        """The families served (a registry filtering by name, ``/metrics?name[]=``, needs
        them: the outer registry does not describe collectors by itself)."""
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        rank = str(self.rank)
        for family in self._inner.collect():
            moved = Metric(family.name, family.documentation, family.type, family.unit)
            moved.samples = [sample._replace(labels={**sample.labels, "rank": rank})
                             if "rank" in sample.labels else sample
                             for sample in family.samples]
            yield moved


class WorkerMetrics:
    """The metrics of one worker process.

    ``batch_size`` is the configured global batch (this rank counts its share of each step's
    global batch, which a batch policy may change on a resize). Nothing is served here: see
    ``metrics_server``.
    """

    def __init__(self, registry: CollectorRegistry, env: ObservedProcess, batch_size: int, *,
                 min_world_size: int = 0, node: str | None = None) -> None:
        self.rank = env.rank
        series = CollectorRegistry()  # every labelled series, served with the current rank
        self._served = _CurrentRank(series, env.rank)  # registered once every family exists
        self.batch_size = batch_size
        self._previous: Mapping[str, Any] = {}   # rank 0: the rendezvous record
        self._world = env.world_size
        self._first_step_seen = False
        self._window: deque[tuple[float, int]] = deque(maxlen=THROUGHPUT_WINDOW + 1)
        self._samples_done = 0
        labels = {"run_id": env.run_id, "rank": str(env.rank),
                  "node": node or platform.node() or "unknown"}

        def family(kind: Any, name: str, doc: str, extra: tuple[str, ...] = (),
                   **kwargs: Any) -> Any:
            return kind(f"{PREFIX}_{name}", doc, labelnames=[*LABELS, *extra],
                        registry=series, **kwargs)

        def now(kind: Any, name: str, doc: str, **kwargs: Any) -> Any:
            return family(kind, name, doc, **kwargs).labels(**labels)

        def later(name: str, doc: str) -> _Lazy:
            return _Lazy(family(Gauge, name, doc), labels)

        now(Info, "build", "Versions of elastic_train, torch and Python in this worker").info(
            {"version": __version__, "torch_version": torch.__version__,
             "python_version": platform.python_version()})
        # Known from the start of the process.
        self.steps = now(Counter, "steps", "Optimizer steps this worker process completed (a "
                         "restarted worker counts from 0 again)")
        self.samples = now(Counter, "samples", "Samples this rank trained on (its share of "
                           "every global batch)")
        self.world_size = now(Gauge, "world_size", "Ranks in this incarnation's job")
        self.restarts = now(Counter, "restarts", "Worker-group restarts before this "
                            "incarnation (torchelastic's restart count)")
        self.max_restarts = now(Gauge, "max_restarts", "Restarts the agent allows before it "
                                "fails the job")
        self.step_duration = now(Histogram, "step_duration_seconds", "Seconds of compute per "
                                 "optimizer step (forward, backward, update, loss all-reduce)",
                                 buckets=STEP_BUCKETS)
        save = family(Histogram, "checkpoint_save_duration_seconds", "Rank 0: seconds per "
                      "checkpoint save, by stage (wait: for the previous save's persist, "
                      "snapshot: the copy made at once, copy_wait: the next optimizer step "
                      "waiting for the overlapped copy; training waits for these three; "
                      "persist: serialise and write, in the background unless synchronous)",
                      extra=("stage",), buckets=CHECKPOINT_BUCKETS)
        # stage -> (histogram, the checkpoint_saved field it observes)
        self.save_stages = {stage: (save.labels(**labels, stage=stage), field)
                            for stage, field in (("wait", "waited_seconds"),
                                                 ("snapshot", "snapshot_seconds"),
                                                 ("copy_wait", "copy_wait_seconds"),
                                                 ("persist", "persist_seconds"))}
        self.load_duration = now(Histogram, "checkpoint_load_duration_seconds", "Seconds to "
                                 "find, verify and load the checkpoint at a (re)start",
                                 buckets=CHECKPOINT_BUCKETS)
        self.skipped = now(Counter, "checkpoints_skipped", "Rank 0: corrupt checkpoints "
                           "skipped at restore")
        self.failed = now(Counter, "checkpoint_failures", "Rank 0: checkpoint writes that "
                          "failed (disk full, permissions); the last good one stays")
        recoveries = family(Counter, "recoveries", "Recoveries this worker took part in, by "
                            "kind: live (the world re-formed in place, state from a peer) or "
                            "restart (every worker restarted from the newest checkpoint)",
                            extra=("kind",))
        self.recoveries = {kind: recoveries.labels(**labels, kind=kind)
                           for kind in ("live", "restart")}
        self.live_recovery_duration = now(
            Histogram, "live_recovery_duration_seconds", "Seconds from the agent noticing a "
            "lost worker to the state in place on every rank (live recovery)",
            buckets=CHECKPOINT_BUCKETS)
        self.steps_redone = now(Counter, "recovery_steps_redone", "Steps whose work a "
                                "recovery threw away (live: at most the step in flight)")
        self.state_transfer_bytes = now(Counter, "state_transfer_bytes", "Bytes of training "
                                        "state sent between workers by live recoveries")
        self.divergences = family(Counter, "replica_divergences", "Rank 0: checks of the "
                                  "replicas' state (--verify-every) that found a suspect "
                                  "rank, by that rank and its node (silent data corruption)",
                                  extra=("suspect_rank", "suspect_node"))
        self.stragglers = family(Counter, "stragglers", "Rank 0: ranks named stragglers "
                                 "(--straggler-policy: compute slower than the others' median "
                                 "by the factor over the window), by that rank and its node",
                                 extra=("suspect_rank", "suspect_node"))
        self._labels = labels
        self.world_size.set(env.world_size)
        self.restarts.inc(env.restart_count)
        self.max_restarts.set(env.max_restarts)
        if min_world_size:
            now(Gauge, "min_world_size", "World size below which the job is degraded "
                "(--min-world-size)").set(min_world_size)
        # Known later (or on rank 0 only): absent until then.
        self.step = later("step", "The job's newest completed optimizer step (restored "
                          "steps included)")
        self.step_time = later("last_step_timestamp_seconds", "Unix time the newest step ended")
        self.target_step = later("target_step", "The step the run trains to")
        self.epoch = later("epoch", "Epoch of the newest step")
        self.loss = later("loss", "Loss of the newest step (mean over the global batch)")
        self.learning_rate = later("learning_rate", "Learning rate of the newest step")
        self.samples_per_second = later("samples_per_second", "This rank's samples per second "
                                        f"of wall time over the last {THROUGHPUT_WINDOW} steps "
                                        "(checkpoint pauses included)")
        self.checkpoint_size = later("checkpoint_size_bytes", "Rank 0: bytes of the newest "
                                     "checkpoint written")
        self.last_checkpoint_time = later("last_checkpoint_timestamp_seconds", "Rank 0: Unix "
                                          "time the newest good checkpoint was written (saved "
                                          "or restored)")
        self.last_checkpoint_step = later("last_checkpoint_step", "Rank 0: step of the newest "
                                          "good checkpoint")
        self.rendezvous = later("rendezvous_duration_seconds", "Seconds of the agent's "
                                "rendezvous that formed this incarnation, as torch's agent "
                                "measures it (passed on by elastic-train run; absent under "
                                "plain torchrun)")
        self.group_init = later("process_group_init_seconds", "Seconds this worker took to "
                                "form its process group (joining the store until every rank "
                                "arrived)")
        self.to_group = later("time_to_process_group_seconds", "Seconds from the worker "
                              "process' start to its process group being ready")
        self.to_first_step = later("time_to_first_step_seconds", "Seconds from the worker "
                                   "process' start to the end of its first step")
        self.recovery = later("recovery_seconds", "Rank 0, after a restart: seconds from the "
                              "failed incarnation's last logged event to the end of the first "
                              "step after the restart")
        self.compute_seconds = later("step_compute_seconds", "Seconds of the newest step's "
                                     "local part on this rank (data and forward passes: no "
                                     "collective), what --straggler-policy compares")
        self.straggler_score = later("straggler_score", "This rank's step compute over the "
                                     "other ranks' median at the newest step (1: as fast)")
        self.lost_steps = later("lost_steps", "Rank 0, after a restart: steps done before the "
                                "failure that are redone (newest step logged minus the step "
                                "resumed from)")
        if env.rendezvous_seconds is not None:
            self.rendezvous.set(env.rendezvous_seconds)
        registry.register(self._served)
        ProcessCollector(registry=registry)
        self._handlers: dict[str, Callable[[Mapping[str, Any]], None]] = {
            Event.START: self._on_start, Event.RENDEZVOUS: self._on_rendezvous,
            Event.STARTUP: self._on_startup, Event.STEP: self._on_step,
            Event.CHECKPOINT_SAVED: self._on_saved, Event.CHECKPOINT_LOADED: self._on_loaded,
            Event.CHECKPOINT_SKIPPED: self._on_skipped, Event.RECOVERY: self._on_recovery,
            Event.CHECKPOINT_FAILED: lambda record: self.failed.inc(),
            Event.REPLICAS_DIVERGED: self._on_diverged, Event.STRAGGLER: self._on_straggler,
        }

    def moved(self, env: ObservedProcess) -> None:
        """This worker's new place after the world re-formed in place: its series follow
        its rank, and its share of each global batch is counted at that rank."""
        self.rank = self._served.rank = env.rank
        self._world = env.world_size
        self.world_size.set(env.world_size)

    def observe(self, record: Mapping[str, Any]) -> None:
        """Update the metrics from one event-log record (an ``EventObserver``)."""
        handler = self._handlers.get(record["event"])
        if handler is not None:
            handler(record)

    # ---- one handler per event -----------------------------------------------------------
    def _on_start(self, record: Mapping[str, Any]) -> None:
        self._world = int(record.get("world_size") or self._world)
        self.world_size.set(self._world)
        if record.get("total_steps"):
            self.target_step.set(record["total_steps"])

    def _on_rendezvous(self, record: Mapping[str, Any]) -> None:
        self._previous = record

    def _on_startup(self, record: Mapping[str, Any]) -> None:
        """The trainer's start-up timeline (Unix times), logged at the first step."""
        began, ready = record.get("group_began"), record.get("group_ready")
        start, first = record.get("process_start"), record.get("first_step_done")
        if began is not None and ready is not None:
            self.group_init.set(ready - began)
        if start is not None and ready is not None:
            self.to_group.set(ready - start)
        if start is not None and first is not None:
            self.to_first_step.set(first - start)

    def _on_step(self, record: Mapping[str, Any]) -> None:
        now = float(record["time"])
        step = int(record["step"])
        begin, end = shard_bounds(int(record.get("global_batch") or self.batch_size), self.rank,
                                  int(record.get("world_size") or self._world))
        share = end - begin
        self.steps.inc()
        self.samples.inc(share)
        self.step.set(step)
        self.step_time.set(now)
        for gauge, key in ((self.loss, "loss"), (self.learning_rate, "lr"),
                           (self.epoch, "epoch"), (self.world_size, "world_size"),
                           (self.compute_seconds, "compute_seconds"),
                           (self.straggler_score, "straggler_score")):
            if record.get(key) is not None:
                gauge.set(record[key])
        if record.get("seconds") is not None:
            self.step_duration.observe(record["seconds"])
        self._samples_done += share
        self._window.append((now, self._samples_done))
        (t0, s0), (t1, s1) = self._window[0], self._window[-1]
        if t1 > t0:
            self.samples_per_second.set((s1 - s0) / (t1 - t0))
        if not self._first_step_seen:
            self._first_step_seen = True
            last_seen = self._previous.get("previous_last_seen")
            last_step = self._previous.get("previous_last_step")
            if last_seen is not None:
                self.recovery.set(max(0.0, now - last_seen))
            if last_step is not None:
                self.lost_steps.set(max(0, last_step - (step - 1)))

    def _on_saved(self, record: Mapping[str, Any]) -> None:
        for histogram, field in self.save_stages.values():
            histogram.observe(record.get(field) or 0.0)
        if record.get("bytes") is not None:
            self.checkpoint_size.set(record["bytes"])
        self._good_checkpoint(int(record["step"]), float(record["time"]))

    def _on_loaded(self, record: Mapping[str, Any]) -> None:
        if record.get("seconds") is not None:
            self.load_duration.observe(record["seconds"])
        self.step.set(int(record["step"]))
        if self.rank == 0 and record.get("saved_time") is not None:
            self._good_checkpoint(int(record["step"]), float(record["saved_time"]))

    def _on_recovery(self, record: Mapping[str, Any]) -> None:
        kind = record.get("kind")
        if kind in self.recoveries:
            self.recoveries[kind].inc()
        if kind == "live" and record.get("seconds") is not None:
            self.live_recovery_duration.observe(record["seconds"])
        self.steps_redone.inc(record.get("steps_redone") or 0)
        self.state_transfer_bytes.inc(record.get("bytes") or 0 if kind == "live" else 0)

    def _on_diverged(self, record: Mapping[str, Any]) -> None:
        for rank, node in zip(record.get("suspects") or [], record.get("nodes") or [],
                              strict=False):
            self.divergences.labels(**self._labels, suspect_rank=str(rank),
                                    suspect_node=str(node)).inc()

    def _on_straggler(self, record: Mapping[str, Any]) -> None:
        if self.rank == 0:  # every rank names the same one: counted once
            self.stragglers.labels(**self._labels, suspect_rank=str(record["rank"]),
                                   suspect_node=str(record["node"])).inc()

    def _on_skipped(self, record: Mapping[str, Any]) -> None:
        self.skipped.inc()

    def _good_checkpoint(self, step: int, when: float) -> None:
        self.last_checkpoint_step.set(step)
        self.last_checkpoint_time.set(when)
