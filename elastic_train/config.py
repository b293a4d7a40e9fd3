"""Job configuration: frozen dataclasses, a config file, and command-line overrides.

Precedence: built-in defaults < config file (``--config job.toml`` or ``.json``) < options.
The file has one table per section, with the same field names as the dataclasses below::

    run_dir = "runs/demo"
    [train]
    steps = 400
    task_options = { preset = "small" }
    [checkpoint]
    every_steps = 50
    [metrics]
    port = 9450

Every file field has a command-line option (the table in config_options.py's ``OPTIONS``,
which also merges the layers), so the command line can override anything the file sets. This
module: the sections, their defaults and ``validate``.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_train.errors import ConfigError

OptionValue = str | int | float | bool

BATCH_POLICIES = ("constant", "scale-lr")
PARALLELISMS = ("ddp", "fsdp", "hsdp")
SAVE_FAILURE_POLICIES = ("continue", "stop")
STRAGGLER_POLICIES = ("off", "warn")
"""``--straggler-policy``: off (not measured, not exchanged) or warn (named in a line, an
event and a metric; it trains on). Eviction (issue 41) is not built yet."""
SLOWDOWN = re.compile(r"\d+:\d+(\.\d+)?(:\d+)?")
"""``--inject-slowdown RANK:FACTOR[:STEP]`` (integrity/slowdown.py)."""
DRILL = re.compile(r"\d+:\d+(:(weight|optimizer)(:\d+(:\d+)?)?)?")


class RecoveryMode(enum.StrEnum):
    """What happens after a worker or a node is lost (``--recovery``; ElasticSession's
    ``recovery``); a str, so it compares and serialises as its value."""

    LIVE = "live"
    """Re-form the world in place: the survivors keep their processes, a restarted worker
    takes the state from one of them (under ``elastic-train run``; agent/live_agent.py)."""
    RESTART = "restart"
    """Restart every worker from the newest checkpoint (what torchrun always does)."""


RECOVERY_MODES = tuple(mode.value for mode in RecoveryMode)


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how."""

    task: str = "gpt"
    task_options: Mapping[str, OptionValue] = field(default_factory=dict)
    steps: int = 500
    batch_size: int = 16
    micro_batch_size: int = 0
    batch_policy: str = "constant"
    lr: float = 3e-3
    warmup_steps: int = 20
    lr_schedule: str = "cosine"
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    record_samples: bool = False
    deterministic: bool = False
    parallelism: str = "ddp"
    """``ddp`` (a full replica per rank), ``fsdp`` or ``hsdp`` (sharded: worker/sharding.py)."""
    replica_group_size: int = 0
    """hsdp: the ranks that shard one replica (0: one group per node, --nproc-per-node)."""
    verify_every: int = 0
    """Compare the replicas' fingerprints every N steps and at every checkpoint (0: off)."""
    inject_bitflip: str = ""
    """The drill: ``RANK:STEP[:weight|optimizer[:INDEX[:BIT]]]`` (integrity/drill.py)."""
    straggler_policy: str = "warn"
    """``off`` or ``warn``: a rank slower than its peers is named (integrity/stragglers.py)."""
    straggler_factor: float = 1.5
    straggler_window: int = 50
    inject_slowdown: str = ""
    """The straggler drill: ``RANK:FACTOR[:STEP]`` (integrity/slowdown.py)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """When to checkpoint and how many to keep."""

    every_steps: int | None = 50
    every_seconds: float | None = None
    keep: int = 3
    asynchronous: bool = True
    on_save_failure: str = "continue"
    shard_timeout_seconds: float = 600.0
    """How long rank 0 waits for every rank's shards of a sharded checkpoint."""


@dataclass(frozen=True)
class DistributedConfig:
    """Process-group settings."""

    backend: str = "auto"
    timeout_seconds: float = 120.0
    preemption_budget_seconds: float = 25.0
    step_timeout_seconds: float | None = 600.0
    recovery: str = RecoveryMode.LIVE


@dataclass(frozen=True)
class MetricsConfig:
    """Where each worker serves Prometheus metrics (``port + local rank``; port 0: off)."""

    port: int = 9450
    address: str = "0.0.0.0"
    linger_seconds: float = 0.0
    min_world_size: int = 0


@dataclass(frozen=True)
class StorageConfig:
    """How to reach an object store run directory (``s3://``): what boto3's own chain
    (``AWS_*`` variables, config files, pod identity) does not say. Never credentials."""

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    addressing_style: str | None = None
    """``path``, ``virtual`` or ``auto``; default: ``path`` with a custom endpoint."""
    local_dir: str | None = None
    """Where this node keeps its event log and sample records before they are uploaded
    (default: ``$ELASTIC_TRAIN_LOCAL_DIR``, else a directory under the system's temp)."""
    connect_timeout: float = 5.0
    read_timeout: float = 20.0
    max_attempts: int = 3
    publish_seconds: float = 10.0
    """How often a worker uploads its event log and sample records."""


STORAGE_KEYS = ("endpoint_url", "region", "profile", "addressing_style", "local_dir",
                "connect_timeout", "read_timeout", "max_attempts", "publish_seconds")


RunLocation = Path | str
"""A run directory: a local path, or an object store URL (``s3://bucket/prefix``) kept as
text (a Path would fold its ``//``)."""


def run_location(text: str | Path) -> RunLocation:
    """A run directory as given: a URL stays text, anything else is a path."""
    if isinstance(text, str) and "://" in text:
        return text
    return Path(text)


@dataclass(frozen=True)
class JobConfig:
    """A whole job: where it writes and its sections."""

    run_dir: RunLocation = Path("runs/default")
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict in the config file's layout."""
        out: dict[str, Any] = {"run_dir": str(self.run_dir)}
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
            if name == "train":
                out[name]["task_options"] = dict(self.train.task_options)
        return out


SECTIONS: dict[str, type] = {
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "distributed": DistributedConfig,
    "metrics": MetricsConfig,
    "storage": StorageConfig,
}


def _check(condition: bool, flag: str, value: Any, requirement: str) -> None:
    if not condition:
        raise ConfigError(f"{flag} {value} is invalid: it must be {requirement}")


def validate(config: JobConfig) -> JobConfig:
    """Reject values that cannot work, naming the option and what it must be."""
    t, c, d, m = config.train, config.checkpoint, config.distributed, config.metrics
    _check(bool(t.task), "--task", repr(t.task), "a built-in name or package.module:factory")
    _check(t.steps > 0, "--steps", t.steps, "a positive number of steps")
    _check(t.batch_size > 0, "--batch-size", t.batch_size, "a positive number of samples")
    _check(t.micro_batch_size >= 0, "--micro-batch-size", t.micro_batch_size, ">= 0")
    _check(t.batch_policy in BATCH_POLICIES, "--batch-policy", t.batch_policy,
           "'constant' or 'scale-lr'")
    _check(t.lr > 0, "--lr", t.lr, "positive")
    _check(t.warmup_steps >= 0, "--warmup-steps", t.warmup_steps, ">= 0")
    _check(t.lr_schedule in ("cosine", "constant"), "--lr-schedule", t.lr_schedule,
           "'cosine' or 'constant'")
    _check(t.grad_clip >= 0, "--grad-clip", t.grad_clip, ">= 0 (0 turns clipping off)")
    _check(t.log_every > 0, "--log-every", t.log_every, "a positive number of steps")
    _check(t.parallelism in PARALLELISMS, "--parallelism", t.parallelism,
           "'ddp', 'fsdp' or 'hsdp'")
    _check(t.replica_group_size >= 0, "--replica-group-size", t.replica_group_size,
           ">= 0 (0: one group per node)")
    _check(t.verify_every >= 0, "--verify-every", t.verify_every, ">= 0 (0 turns it off)")
    _check(not t.inject_bitflip or bool(DRILL.fullmatch(t.inject_bitflip)), "--inject-bitflip",
           repr(t.inject_bitflip), "RANK:STEP[:weight|optimizer[:INDEX[:BIT]]]")
    _check(t.straggler_policy in STRAGGLER_POLICIES, "--straggler-policy", t.straggler_policy,
           "'off' or 'warn' (eviction is not built yet)")
    _check(t.straggler_factor > 1, "--straggler-factor", t.straggler_factor, "above 1")
    _check(t.straggler_window >= 1, "--straggler-window", t.straggler_window, ">= 1 step")
    _check(not t.inject_slowdown or (bool(SLOWDOWN.fullmatch(t.inject_slowdown))
                                     and float(t.inject_slowdown.split(":")[1]) > 1),
           "--inject-slowdown", repr(t.inject_slowdown), "RANK:FACTOR[:STEP], FACTOR above 1")
    if t.parallelism != "ddp" and isinstance(config.run_dir, str):
        raise ConfigError(f"--parallelism {t.parallelism} with an object store run directory "
                          f"({config.run_dir}) is not supported yet: sharded checkpoints "
                          "need a filesystem every node shares; use such a --run-dir")
    _check(c.every_steps is None or c.every_steps > 0, "--checkpoint-every", c.every_steps,
           "a positive number of steps, or 'off'")
    _check(c.every_seconds is None or c.every_seconds > 0, "--checkpoint-interval",
           c.every_seconds, "a positive number of seconds, or 'off'")
    _check(c.keep >= 1, "--keep-checkpoints", c.keep, "at least 1")
    _check(c.on_save_failure in SAVE_FAILURE_POLICIES, "--on-save-failure", c.on_save_failure,
           "'continue' or 'stop'")
    _check(d.backend in ("auto", "gloo", "nccl"), "--backend", d.backend,
           "'auto', 'gloo' or 'nccl'")
    _check(d.timeout_seconds > 0, "--collective-timeout", d.timeout_seconds, "positive")
    _check(d.recovery in RECOVERY_MODES, "--recovery", d.recovery, "'live' or 'restart'")
    _check(d.step_timeout_seconds is None or d.step_timeout_seconds > 0, "--step-timeout",
           d.step_timeout_seconds, "a positive number of seconds, or 'off'")
    _check(d.preemption_budget_seconds > 0, "--preemption-budget", d.preemption_budget_seconds,
           "a positive number of seconds")
    _check(0 <= m.port <= 65535, "--metrics-port", m.port, "a TCP port (0 turns metrics off)")
    _check(bool(m.address.strip()), "--metrics-address", repr(m.address),
           "an address to bind, e.g. 0.0.0.0 or 127.0.0.1")
    _check(m.linger_seconds >= 0, "--metrics-linger", m.linger_seconds, ">= 0")
    _check(m.min_world_size >= 0, "--min-world-size", m.min_world_size, ">= 0 (0: not set)")
    return config


def mesh_shape(parallelism: str, world_size: int, replica_group_size: int
               ) -> tuple[int, ...]:
    """The device mesh's shape: ``(world,)`` for fsdp, ``(replicas, group)`` for hsdp.
    Raises ``ConfigError`` when the world cannot be split into whole replica groups."""
    if parallelism == "fsdp":
        return (world_size,)
    if replica_group_size < 1 or world_size % replica_group_size:
        raise ConfigError(
            f"--replica-group-size {replica_group_size} does not divide the world size "
            f"{world_size}: hsdp shards within groups of that many ranks; choose a size "
            "that divides every world size the job may have (--nnodes, --nproc-per-node)")
    return (world_size // replica_group_size, replica_group_size)
