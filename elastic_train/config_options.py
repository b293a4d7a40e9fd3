"""A job's command-line options: one table (``OPTIONS``: every config-file field has its
option), the strict parser, and the merge of defaults < config file < options into a
validated ``JobConfig`` (config.py)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_train.config import (
    SECTIONS,
    STORAGE_KEYS,
    JobConfig,
    StorageConfig,
    run_location,
    validate,
)
from elastic_train.config_file import check_file_types, read_config_file
from elastic_train.errors import ConfigError

__all__ = ["OPTIONS", "Option", "add_job_arguments", "config_from_namespace", "job_parser",
           "parse_job_args", "storage_from_options"]


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
