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

Every file field has a command-line option (the table in ``OPTIONS``), so the command line
can override anything the file sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_train.config_file import check_file_types, read_config_file
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


@dataclass(frozen=True)
class Option:
    """One command-line option and the config field it sets ('' section: top level)."""

    flag: str
    section: str
    name: str
    help: str
    parse: Any = str
    metavar: str | None = None


def _optional_positive_int(text: str) -> int | None:
    if text.lower() in ("none", "off"):
        return None
    return int(text)


def _optional_positive_float(text: str) -> float | None:
    if text.lower() in ("none", "off"):
        return None
    return float(text)


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


OPTIONS: tuple[Option, ...] = (
    Option("--run-dir", "", "run_dir", "directory for checkpoints and the event log: a "
           "path, or s3://BUCKET/PREFIX (an object store; docs/object-storage.md)",
           run_location),
    Option("--task", "train", "task", "built-in task name (gpt) or package.module:factory"),
    Option("--steps", "train", "steps", "optimizer steps in total", int),
    Option("--batch-size", "train", "batch_size",
           "global batch: samples per optimizer step over all ranks", int),
    Option("--micro-batch-size", "train", "micro_batch_size",
           "largest per-rank forward pass; larger shares accumulate gradients (0: no limit)",
           int),
    Option("--batch-policy", "train", "batch_policy",
           "when the world size changes: 'constant' keeps the global batch (each rank's "
           "share changes), 'scale-lr' keeps each rank's batch and scales the LR with the "
           "global batch"),
    Option("--lr", "train", "lr", "peak learning rate", float),
    Option("--warmup-steps", "train", "warmup_steps", "linear warm-up steps", int),
    Option("--lr-schedule", "train", "lr_schedule", "cosine or constant after warm-up"),
    Option("--grad-clip", "train", "grad_clip", "max global gradient norm (0: off)", float),
    Option("--seed", "train", "seed", "seed of weights, data order and dropout", int),
    Option("--log-every", "train", "log_every", "print progress every N steps", int),
    Option("--record-samples", "train", "record_samples",
           "write the sample ids of every step to RUN_DIR/samples/ (for audits)", _bool,
           "BOOL"),
    Option("--deterministic", "train", "deterministic",
           "deterministic CUDA kernels (torch.use_deterministic_algorithms, "
           "CUBLAS_WORKSPACE_CONFIG): bitwise resume on a GPU, a little slower; the CPU "
           "is deterministic already", _bool, "BOOL"),
    Option("--parallelism", "train", "parallelism",
           "ddp (every rank holds the whole model), fsdp (parameters, gradients and "
           "optimizer state sharded over every rank: FSDP2) or hsdp (sharded within replica "
           "groups, replicated across them); sharded jobs write sharded checkpoints",
           str, "KIND"),
    Option("--replica-group-size", "train", "replica_group_size",
           "hsdp: ranks that shard one replica (0: one group per node)", int, "N"),
    Option("--verify-every", "train", "verify_every", "compare the replicas' state (a "
           "fingerprint per rank, one small collective) every N steps and at every "
           "checkpoint: a mismatch names the corrupt rank, no checkpoint of a corrupt state "
           "is written, and the job restarts from the newest one (0: off)", int, "N"),
    Option("--inject-bitflip", "train", "inject_bitflip", "drill: flip one bit of the "
           "first parameter ('weight') or of its first optimizer state ('optimizer') on "
           "RANK after optimizer step STEP, once per job", str,
           "RANK:STEP[:weight|optimizer[:INDEX[:BIT]]]"),
    Option("--straggler-policy", "train", "straggler_policy", "off, or warn: a rank whose "
           "step compute is slower than its peers' median by --straggler-factor over "
           "--straggler-window steps is named (a line, an event, a metric) and trains on"),
    Option("--straggler-factor", "train", "straggler_factor", "how much slower than the "
           "others' median a straggler is", float, "F"),
    Option("--straggler-window", "train", "straggler_window", "steps over which each "
           "rank's step compute is averaged before the ranks are compared", int, "W"),
    Option("--inject-slowdown", "train", "inject_slowdown", "drill: run RANK's worker at "
           "1/FACTOR of its speed from step STEP (SIGSTOP/SIGCONT on a duty cycle)", str,
           "RANK:FACTOR[:STEP]"),
    Option("--checkpoint-every", "checkpoint", "every_steps",
           "checkpoint every N steps ('off' to only use --checkpoint-interval)",
           _optional_positive_int, "N"),
    Option("--checkpoint-interval", "checkpoint", "every_seconds",
           "also checkpoint when this many seconds passed since the last one",
           _optional_positive_float, "SECONDS"),
    Option("--keep-checkpoints", "checkpoint", "keep", "newest valid checkpoints kept", int),
    Option("--async-checkpoint", "checkpoint", "asynchronous",
           "persist checkpoints on a background thread (training waits only for the copy)",
           _bool, "BOOL"),
    Option("--on-save-failure", "checkpoint", "on_save_failure",
           "when a checkpoint cannot be written (disk full, permissions): 'continue' "
           "reports it and tries again at the next checkpoint, 'stop' stops every rank at "
           "the next step and fails the job; the last good checkpoint stays either way",
           str, "POLICY"),
    Option("--backend", "distributed", "backend", "auto (gloo on CPU, nccl on CUDA), gloo, nccl"),
    Option("--collective-timeout", "distributed", "timeout_seconds",
           "seconds before a stuck collective fails the worker", float),
    Option("--step-timeout", "distributed", "step_timeout_seconds",
           "fail a worker whose loop completes no step for this long, naming the stuck rank "
           "('off' to disable)", _optional_positive_float, "SECONDS"),
    Option("--recovery", "distributed", "recovery",
           "after a worker or a node is lost: 'live' (under elastic-train run, on one node "
           "or several; the default) re-forms the world in place: the survivors keep "
           "running, a restarted worker takes the state from one of them; 'restart' "
           "restarts every worker from the newest checkpoint (what torchrun always does)",
           str, "MODE"),
    Option("--preemption-budget", "distributed", "preemption_budget_seconds",
           "seconds from SIGTERM to exit, checkpoint included; keep it below the grace period",
           float),
    Option("--metrics-port", "metrics", "port",
           "base port of the Prometheus /metrics endpoints: each worker serves PORT + its "
           "local rank (0: no metrics)", int, "PORT"),
    Option("--metrics-address", "metrics", "address",
           "address the /metrics endpoints bind (0.0.0.0: every interface)", str, "ADDR"),
    Option("--metrics-linger", "metrics", "linger_seconds",
           "after a finished run, wait up to this many seconds for one more scrape so the "
           "final values reach Prometheus (0: exit at once)", float, "SECONDS"),
    Option("--min-world-size", "metrics", "min_world_size",
           "world size below which the job counts as degraded: exported for the alert "
           "(0: not set)", int, "N"),
)


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


def _parse_task_option(text: str, flag: str = "--task-opt") -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"{flag} {text!r} is invalid: write it as KEY=VALUE")
    return key.strip(), value


def storage_from_options(texts: Sequence[str], base: Mapping[str, Any] | None = None
                         ) -> StorageConfig:
    """``--storage-opt KEY=VALUE`` texts over ``base`` (the config file's ``[storage]``)."""
    values: dict[str, Any] = dict(base or {})
    for text in texts:
        key, value = _parse_task_option(text, "--storage-opt")
        if key not in STORAGE_KEYS:
            raise ConfigError(f"--storage-opt {key}: unknown key; the keys are "
                              f"{', '.join(STORAGE_KEYS)} (credentials come from AWS_* "
                              "variables or profiles, never options)")
        field_type = {f.name: f.type for f in dataclasses.fields(StorageConfig)}[key]
        try:
            values[key] = (float(value) if field_type == "float" else
                           int(value) if field_type == "int" else value)
        except ValueError:
            raise ConfigError(f"--storage-opt {key}={value!r} is invalid: expected a "
                              f"{field_type}") from None
    style = values.get("addressing_style")
    if style not in (None, "path", "virtual", "auto"):
        raise ConfigError(f"--storage-opt addressing_style={style!r} is invalid: use path, "
                          "virtual or auto")
    return StorageConfig(**values)


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message}: see '{self.prog} --help'")


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every job option to ``parser`` (defaults suppressed: absent means 'not given')."""
    group = parser.add_argument_group("job options")
    group.add_argument("--config", type=Path, default=argparse.SUPPRESS, metavar="FILE",
                       help="TOML or JSON config file; options given here override it")
    for opt in OPTIONS:
        group.add_argument(opt.flag, dest=f"{opt.section}.{opt.name}", type=str,
                           default=argparse.SUPPRESS, metavar=opt.metavar, help=opt.help)
    group.add_argument("--task-opt", dest="task_opt", action="append", default=argparse.SUPPRESS,
                       metavar="KEY=VALUE", help="a task option (repeatable), e.g. preset=medium")
    group.add_argument("--storage-opt", dest="storage_opt", action="append",
                       default=argparse.SUPPRESS, metavar="KEY=VALUE",
                       help="how to reach an s3:// run dir (repeatable): endpoint_url, region, "
                            "profile, addressing_style, local_dir, connect_timeout, "
                            "read_timeout, max_attempts, publish_seconds")
    group.add_argument("--preset", dest="preset", default=argparse.SUPPRESS,
                       help="shortcut for --task-opt preset=NAME (built-in task: tiny, small, "
                            "medium, large)")
    group.add_argument("--corpus", dest="corpus", default=argparse.SUPPRESS,
                       help="shortcut for --task-opt corpus=PATH (built-in task)")


def job_parser(prog: str = "elastic_train.train") -> argparse.ArgumentParser:
    """The strict parser of job options alone (what ``-m elastic_train.train`` accepts)."""
    parser = _RaisingParser(prog=prog, description="elastic_train worker: job options",
                             allow_abbrev=False)
    add_job_arguments(parser)
    return parser


def config_from_namespace(ns: argparse.Namespace) -> JobConfig:
    """Merge defaults, the config file named in ``ns`` and the options set in ``ns``."""
    given = vars(ns)
    layered: dict[str, Any] = {}
    if "config" in given:
        layered = read_config_file(given["config"], SECTIONS)
    sections = {name: dict(layered.get(name, {})) for name in SECTIONS}
    for name, values in sections.items():
        check_file_types(name, SECTIONS[name], values)
    top: dict[str, Any] = {}
    if "run_dir" in layered:
        if not isinstance(layered["run_dir"], str) or not layered["run_dir"]:
            raise ConfigError(f"run_dir = {layered['run_dir']!r} is invalid: expected a path "
                              "string")
        top["run_dir"] = run_location(layered["run_dir"])
    for opt in OPTIONS:
        key = f"{opt.section}.{opt.name}"
        if key not in given:
            continue
        try:
            value = opt.parse(given[key])
        except ValueError:
            raise ConfigError(f"{opt.flag} {given[key]!r} is invalid: expected "
                              f"{getattr(opt.parse, '__name__', 'a value').strip('_')}") from None
        if opt.section:
            sections[opt.section][opt.name] = value
        else:
            top[opt.name] = value
    task_options = dict(sections["train"].get("task_options", {}))
    for text in given.get("task_opt", []):
        key, value = _parse_task_option(text)
        task_options[key] = value
    for shortcut in ("preset", "corpus"):
        if shortcut in given:
            task_options[shortcut] = given[shortcut]
    sections["train"]["task_options"] = task_options
    storage = storage_from_options(given.get("storage_opt", []), sections.pop("storage"))
    try:
        built = {name: cls(**sections[name]) for name, cls in SECTIONS.items()
                 if name != "storage"}
    except TypeError as exc:
        raise ConfigError(f"config is invalid ({exc}): check the field names") from None
    config = JobConfig(run_dir=run_location(top.get("run_dir", JobConfig.run_dir)),
                       storage=storage, **built)
    return validate(config)


def parse_job_args(argv: Sequence[str], prog: str = "elastic_train.train") -> JobConfig:
    """Parse job options strictly: an unknown option is a ConfigError."""
    return config_from_namespace(job_parser(prog).parse_args(list(argv)))
