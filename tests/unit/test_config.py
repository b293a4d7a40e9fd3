"""Unit tests of job configuration: defaults, config files, options and their error messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastic_train.config import (
    CheckpointConfig,
    DistributedConfig,
    JobConfig,
    MetricsConfig,
    TrainConfig,
)
from elastic_train.config_options import OPTIONS, parse_job_args
from elastic_train.errors import ConfigError

HELP = ": see 'elastic_train.train --help'"


def _error(argv: list[str]) -> str:
    """The message of the ConfigError that ``argv`` raises; it must be one line."""
    with pytest.raises(ConfigError) as caught:
        parse_job_args(argv)
    message = str(caught.value)
    assert "\n" not in message and message.strip() == message and message
    return message


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- defaults -----------------------------------------------------------------------------


def test_defaults_without_options() -> None:
    config = parse_job_args([])
    assert config == JobConfig()
    assert config.run_dir == Path("runs/default")
    assert config.train == TrainConfig(
        task="gpt", task_options={}, steps=500, batch_size=16, micro_batch_size=0,
        batch_policy="constant", lr=3e-3,
        warmup_steps=20, lr_schedule="cosine", grad_clip=1.0, seed=0, log_every=10,
        record_samples=False)
    assert config.checkpoint == CheckpointConfig(every_steps=50, every_seconds=None, keep=3)
    assert config.distributed == DistributedConfig(backend="auto", timeout_seconds=120.0)
    assert config.metrics == MetricsConfig(port=9450, address="0.0.0.0", linger_seconds=0.0,
                                           min_world_size=0)


# --- every option sets its field ----------------------------------------------------------

# flag -> (text on the command line, the value it must set); every value is not the default.
VALID: dict[str, tuple[str, Any]] = {
    "--run-dir": ("/somewhere/run-7", Path("/somewhere/run-7")),
    "--task": ("my_pkg.tasks:make", "my_pkg.tasks:make"),
    "--steps": ("77", 77),
    "--batch-size": ("12", 12),
    "--micro-batch-size": ("3", 3),
    "--batch-policy": ("scale-lr", "scale-lr"),
    "--lr": ("0.25", 0.25),
    "--warmup-steps": ("0", 0),
    "--lr-schedule": ("constant", "constant"),
    "--grad-clip": ("0", 0.0),
    "--seed": ("1234", 1234),
    "--log-every": ("5", 5),
    "--record-samples": ("yes", True),
    "--deterministic": ("true", True),
    "--parallelism": ("fsdp", "fsdp"),
    "--replica-group-size": ("4", 4),
    "--verify-every": ("10", 10),
    "--inject-bitflip": ("1:12:optimizer:3:7", "1:12:optimizer:3:7"),
    "--straggler-policy": ("off", "off"),
    "--straggler-factor": ("2.5", 2.5),
    "--straggler-window": ("7", 7),
    "--inject-slowdown": ("2:1.5:30", "2:1.5:30"),
    "--checkpoint-every": ("25", 25),
    "--checkpoint-interval": ("90.5", 90.5),
    "--keep-checkpoints": ("7", 7),
    "--async-checkpoint": ("false", False),
    "--on-save-failure": ("stop", "stop"),
    "--backend": ("gloo", "gloo"),
    "--collective-timeout": ("30", 30.0),
    "--preemption-budget": ("12.5", 12.5),
    "--step-timeout": ("off", None),
    "--recovery": ("restart", "restart"),
    "--metrics-port": ("0", 0),
    "--metrics-address": ("127.0.0.1", "127.0.0.1"),
    "--metrics-linger": ("20", 20.0),
    "--min-world-size": ("4", 4),
}


def _field(config: JobConfig, section: str, name: str) -> Any:
    return getattr(getattr(config, section), name) if section else getattr(config, name)


def test_the_table_of_valid_values_covers_every_option() -> None:
    assert set(VALID) == {opt.flag for opt in OPTIONS}


@pytest.mark.parametrize("opt", OPTIONS, ids=[opt.flag for opt in OPTIONS])
def test_every_option_sets_its_field(opt: Any) -> None:
    text, expected = VALID[opt.flag]
    default = _field(JobConfig(), opt.section, opt.name)
    assert expected != default, "pick a value that differs from the default"
    config = parse_job_args([opt.flag, text])
    value = _field(config, opt.section, opt.name)
    assert value == expected
    assert type(value) is type(expected)
    # ...and nothing else.
    for other in OPTIONS:
        if other is not opt:
            assert _field(config, other.section, other.name) == \
                _field(JobConfig(), other.section, other.name)


@pytest.mark.parametrize(("text", "expected"), [
    ("1", True), ("true", True), ("Yes", True), ("on", True),
    ("0", False), ("false", False), ("NO", False), ("off", False)])
def test_boolean_options_accept_the_usual_spellings(text: str, expected: bool) -> None:
    assert parse_job_args(["--record-samples", text]).train.record_samples is expected


@pytest.mark.parametrize("text", ["off", "none", "OFF"])
def test_checkpoint_every_off_gives_none(text: str) -> None:
    config = parse_job_args(["--checkpoint-every", text, "--checkpoint-interval", "60"])
    assert config.checkpoint.every_steps is None
    assert config.checkpoint.every_seconds == 60.0
    assert parse_job_args(["--checkpoint-interval", text]).checkpoint.every_seconds is None


# --- config files -------------------------------------------------------------------------

TOML = """\
run_dir = "runs/from-file"

[train]
steps = 400
lr = 0.01
task_options = { preset = "small", corpus = "data/x.txt" }

[checkpoint]
every_steps = 20
keep = 5

[distributed]
backend = "gloo"
timeout_seconds = 45.0
"""

FILE_DATA = {
    "run_dir": "runs/from-file",
    "train": {"steps": 400, "lr": 0.01,
              "task_options": {"preset": "small", "corpus": "data/x.txt"}},
    "checkpoint": {"every_steps": 20, "keep": 5},
    "distributed": {"backend": "gloo", "timeout_seconds": 45.0},
}


def _expected_from_file() -> JobConfig:
    return JobConfig(
        run_dir=Path("runs/from-file"),
        train=TrainConfig(steps=400, lr=0.01,
                          task_options={"preset": "small", "corpus": "data/x.txt"}),
        checkpoint=CheckpointConfig(every_steps=20, keep=5),
        distributed=DistributedConfig(backend="gloo", timeout_seconds=45.0),
    )


def test_toml_and_json_config_files_load_the_same(tmp_path: Path) -> None:
    toml = _write(tmp_path / "job.toml", TOML)
    js = _write(tmp_path / "job.json", json.dumps(FILE_DATA))
    assert parse_job_args(["--config", str(toml)]) == _expected_from_file()
    assert parse_job_args(["--config", str(js)]) == _expected_from_file()


@pytest.mark.parametrize("suffix", ["toml", "json"])
def test_the_command_line_overrides_the_file_in_every_section(tmp_path: Path,
                                                              suffix: str) -> None:
    text = TOML if suffix == "toml" else json.dumps(FILE_DATA)
    path = _write(tmp_path / f"job.{suffix}", text)
    config = parse_job_args([
        "--config", str(path), "--run-dir", "runs/cli", "--steps", "9",
        "--checkpoint-every", "3", "--backend", "nccl", "--collective-timeout", "5"])
    assert config.run_dir == Path("runs/cli")
    assert config.train.steps == 9
    assert config.train.lr == 0.01                       # from the file, not overridden
    assert config.checkpoint.every_steps == 3
    assert config.checkpoint.keep == 5                   # from the file
    assert config.distributed.backend == "nccl"
    assert config.distributed.timeout_seconds == 5.0
    assert config.train.task_options == {"preset": "small", "corpus": "data/x.txt"}
    # The order of --config among the options does not matter.
    later = parse_job_args(["--steps", "9", "--config", str(path)])
    assert later.train.steps == 9


def test_task_options_repeat_and_the_shortcuts_land_in_task_options() -> None:
    config = parse_job_args(["--task-opt", "a=1", "--task-opt", "b=x=y", "--task-opt", "c=",
                             "--preset", "medium", "--corpus", "/data/c.txt"])
    assert config.train.task_options == {"a": "1", "b": "x=y", "c": "",
                                         "preset": "medium", "corpus": "/data/c.txt"}
    # The last of a repeated key wins.
    assert parse_job_args(["--task-opt", "a=1", "--task-opt", "a=2"]).train.task_options == \
        {"a": "2"}


def test_command_line_task_options_override_the_files(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.toml", TOML)
    config = parse_job_args(["--config", str(path), "--task-opt", "preset=large",
                             "--task-opt", "extra=1"])
    assert config.train.task_options == {"preset": "large", "corpus": "data/x.txt",
                                         "extra": "1"}
    config = parse_job_args(["--config", str(path), "--preset", "tiny",
                             "--corpus", "other.txt"])
    assert config.train.task_options == {"preset": "tiny", "corpus": "other.txt"}


def test_to_dict_round_trips_through_a_json_config_file(tmp_path: Path) -> None:
    original = parse_job_args([
        "--run-dir", str(tmp_path / "run"), "--task", "pkg.mod:factory", "--steps", "11",
        "--batch-size", "6", "--micro-batch-size", "2", "--lr", "0.5", "--warmup-steps", "0",
        "--lr-schedule", "constant", "--grad-clip", "0", "--seed", "9", "--log-every", "2",
        "--record-samples", "true", "--checkpoint-every", "off", "--checkpoint-interval",
        "12.5", "--keep-checkpoints", "4", "--backend", "gloo", "--collective-timeout", "8",
        "--metrics-port", "9500", "--metrics-address", "::1", "--metrics-linger", "2.5",
        "--min-world-size", "2",
        "--task-opt", "preset=tiny", "--task-opt", "dropout=0.1"])
    data = original.to_dict()
    assert data["run_dir"] == str(tmp_path / "run")
    assert set(data) == {"run_dir", "train", "checkpoint", "distributed", "metrics", "storage"}
    path = _write(tmp_path / "saved.json", json.dumps(data))
    assert parse_job_args(["--config", str(path)]) == original
    # The defaults round-trip too (every_seconds is None there).
    path = _write(tmp_path / "defaults.json", json.dumps(JobConfig().to_dict()))
    assert parse_job_args(["--config", str(path)]) == JobConfig()


# --- errors: each a ConfigError with a one-line message -----------------------------------


def test_unknown_option() -> None:
    assert _error(["--stepz", "3"]) == f"unrecognized arguments: --stepz 3{HELP}"


def test_an_abbreviated_option_is_refused_not_guessed() -> None:
    assert _error(["--step", "3"]) == f"unrecognized arguments: --step 3{HELP}"
    assert _error(["--check", "3"]) == f"unrecognized arguments: --check 3{HELP}"


def test_an_option_without_its_value() -> None:
    assert _error(["--steps"]) == f"argument --steps: expected one argument{HELP}"


def test_unknown_top_level_config_key_with_hint(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.toml", "[trian]\nsteps = 3\n")
    assert _error(["--config", str(path)]) == (
        f"unknown config key 'trian' (did you mean 'train'?): remove it from {path}; "
        "known: run_dir, train, checkpoint, distributed, metrics, storage")


def test_unknown_config_key_in_a_section_with_hint(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.toml", "[train]\nstepz = 3\n")
    message = _error(["--config", str(path)])
    assert message.startswith(
        f"unknown config key in [train] 'stepz' (did you mean 'steps'?): remove it from {path}; "
        "known: task, task_options, steps, batch_size,")
    path = _write(tmp_path / "job2.json", json.dumps({"checkpoint": {"kep": 2}}))
    assert _error(["--config", str(path)]).startswith(
        "unknown config key in [checkpoint] 'kep' (did you mean 'keep'?)")


def test_unknown_key_without_a_close_match_has_no_hint(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.toml", "zzzzzz = 1\n")
    message = _error(["--config", str(path)])
    assert message.startswith("unknown config key 'zzzzzz': remove it from")
    assert "did you mean" not in message


def test_a_section_that_is_not_a_table(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.toml", "train = 3\n")
    assert _error(["--config", str(path)]) == f"config file {path}: [train] must be a table"


def test_a_file_that_is_not_a_table(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.json", "[1, 2]")
    assert _error(["--config", str(path)]) == \
        f"config file {path} must hold a table of sections, not <class 'list'>"


@pytest.mark.parametrize(("line", "message"), [
    ('steps = "ten"', "[train] steps = 'ten' is invalid: expected int"),
    ("steps = true", "[train] steps = True is invalid: expected int"),
    ("steps = 2.5", "[train] steps = 2.5 is invalid: expected int"),
    ("lr = true", "[train] lr = True is invalid: expected float"),
    ('task = 3', "[train] task = 3 is invalid: expected str"),
    ("record_samples = 1", "[train] record_samples = 1 is invalid: expected bool"),
    ('task_options = "preset=small"',
     "[train] task_options = 'preset=small' is invalid: expected Mapping[str, OptionValue]"),
])
def test_wrong_type_in_the_file(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path / "job.toml", f"[train]\n{line}\n")
    assert _error(["--config", str(path)]) == message


def test_wrong_type_in_other_sections(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.toml", "[checkpoint]\nevery_steps = 1.5\n")
    assert _error(["--config", str(path)]) == \
        "[checkpoint] every_steps = 1.5 is invalid: expected int | None"
    path = _write(tmp_path / "job2.toml", "[distributed]\nbackend = 1\n")
    assert _error(["--config", str(path)]) == \
        "[distributed] backend = 1 is invalid: expected str"
    path = _write(tmp_path / "job3.toml", "[metrics]\nport = \"9450\"\n")
    assert _error(["--config", str(path)]) == \
        "[metrics] port = '9450' is invalid: expected int"


def test_an_int_is_accepted_for_a_float_field(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.toml", "[train]\nlr = 1\n[checkpoint]\nevery_seconds = 30\n")
    config = parse_job_args(["--config", str(path)])
    assert config.train.lr == 1
    assert config.checkpoint.every_seconds == 30


@pytest.mark.parametrize("text", ['{"run_dir": 5}', '{"run_dir": null}'])
def test_wrong_type_of_run_dir_in_the_file(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path / "job.json", text)
    assert "run_dir" in _error(["--config", str(path)])


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0"], "--steps 0 is invalid: it must be a positive number of steps"),
    (["--steps", "-1"], "--steps -1 is invalid: it must be a positive number of steps"),
    (["--checkpoint-every", "0"],
     "--checkpoint-every 0 is invalid: it must be a positive number of steps, or 'off'"),
    (["--checkpoint-interval", "0"],
     "--checkpoint-interval 0.0 is invalid: it must be a positive number of seconds, or 'off'"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints 0 is invalid: it must be at least 1"),
    (["--lr", "0"], "--lr 0.0 is invalid: it must be positive"),
    (["--lr", "-0.1"], "--lr -0.1 is invalid: it must be positive"),
    (["--batch-size", "0"], "--batch-size 0 is invalid: it must be a positive number of samples"),
    (["--lr-schedule", "linear"],
     "--lr-schedule linear is invalid: it must be 'cosine' or 'constant'"),
    (["--batch-policy", "grow"],
     "--batch-policy grow is invalid: it must be 'constant' or 'scale-lr'"),
    (["--backend", "mpi"], "--backend mpi is invalid: it must be 'auto', 'gloo' or 'nccl'"),
    (["--on-save-failure", "halt"],
     "--on-save-failure halt is invalid: it must be 'continue' or 'stop'"),
    (["--task-opt", "novalue"], "--task-opt 'novalue' is invalid: write it as KEY=VALUE"),
    (["--task-opt", "=v"], "--task-opt '=v' is invalid: write it as KEY=VALUE"),
    (["--steps", "ten"], "--steps 'ten' is invalid: expected int"),
    (["--lr", "fast"], "--lr 'fast' is invalid: expected float"),
    (["--record-samples", "maybe"], "--record-samples 'maybe' is invalid: expected bool"),
    (["--metrics-port", "-1"],
     "--metrics-port -1 is invalid: it must be a TCP port (0 turns metrics off)"),
    (["--metrics-port", "70000"],
     "--metrics-port 70000 is invalid: it must be a TCP port (0 turns metrics off)"),
    (["--metrics-address", " "],
     "--metrics-address ' ' is invalid: it must be an address to bind, e.g. 0.0.0.0 or "
     "127.0.0.1"),
    (["--metrics-linger", "-1"], "--metrics-linger -1.0 is invalid: it must be >= 0"),
    (["--min-world-size", "-2"], "--min-world-size -2 is invalid: it must be >= 0 (0: not set)"),
    (["--recovery", "inplace"], "--recovery inplace is invalid: it must be 'live' or 'restart'"),
    (["--replica-group-size", "-1"],
     "--replica-group-size -1 is invalid: it must be >= 0 (0: one group per node)"),
    (["--verify-every", "-1"], "--verify-every -1 is invalid: it must be >= 0 (0 turns it off)"),
    (["--straggler-policy", "evict"], "--straggler-policy evict is invalid: it must be 'off' "
     "or 'warn' (eviction is not built yet)"),
    (["--straggler-factor", "1"], "--straggler-factor 1.0 is invalid: it must be above 1"),
    (["--straggler-window", "0"], "--straggler-window 0 is invalid: it must be >= 1 step"),
    (["--inject-slowdown", "1:1"], "--inject-slowdown '1:1' is invalid: it must be "
     "RANK:FACTOR[:STEP], FACTOR above 1"),
    (["--inject-slowdown", "x"], "--inject-slowdown 'x' is invalid: it must be "
     "RANK:FACTOR[:STEP], FACTOR above 1"),
    (["--inject-bitflip", "1:x"], "--inject-bitflip '1:x' is invalid: it must be "
     "RANK:STEP[:weight|optimizer[:INDEX[:BIT]]]"),
    (["--inject-bitflip", "1:5:gradient"], "--inject-bitflip '1:5:gradient' is invalid: it "
     "must be RANK:STEP[:weight|optimizer[:INDEX[:BIT]]]"),
    (["--parallelism", "fsdp", "--run-dir", "s3://bucket/run"],
     "--parallelism fsdp with an object store run directory (s3://bucket/run) is not "
     "supported yet: sharded checkpoints need a filesystem every node shares; use such a "
     "--run-dir"),
])
def test_invalid_values_name_the_option_and_the_requirement(argv: list[str],
                                                            message: str) -> None:
    assert _error(argv) == message


def test_values_from_the_file_are_validated_too(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.toml", "[train]\nsteps = 0\n")
    assert _error(["--config", str(path)]) == \
        "--steps 0 is invalid: it must be a positive number of steps"
    # ...and a valid command-line value repairs a bad file value.
    assert parse_job_args(["--config", str(path), "--steps", "5"]).train.steps == 5


def test_missing_config_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    assert _error(["--config", str(path)]) == \
        f"config file {path} does not exist: pass --config with a .toml or .json"
    assert _error(["--config", str(tmp_path)]).startswith(f"config file {tmp_path} does not")


def test_unparsable_config_files(tmp_path: Path) -> None:
    path = _write(tmp_path / "job.toml", "[train]\nsteps = = 3\n")
    message = _error(["--config", str(path)])
    assert message.startswith(f"config file {path} cannot be parsed (")
    assert "line 2" in message
    assert message.endswith("): fix its syntax")
    path = _write(tmp_path / "job.json", '{"train": {"steps": 3,}}')
    message = _error(["--config", str(path)])
    assert message.startswith(f"config file {path} cannot be parsed (")
    assert message.endswith("): fix its syntax")


def test_the_save_failure_policy_from_a_file_is_checked_like_the_option(tmp_path: Path) -> None:
    good = _write(tmp_path / "good.toml", '[checkpoint]\non_save_failure = "stop"\n')
    assert parse_job_args(["--config", str(good)]).checkpoint.on_save_failure == "stop"
    assert parse_job_args(["--config", str(good), "--on-save-failure", "continue"]
                          ).checkpoint.on_save_failure == "continue"
    bad = _write(tmp_path / "bad.toml", '[checkpoint]\non_save_failure = "pause"\n')
    assert _error(["--config", str(bad)]) == \
        "--on-save-failure pause is invalid: it must be 'continue' or 'stop'"
    typed = _write(tmp_path / "typed.toml", "[checkpoint]\non_save_failure = 1\n")
    assert _error(["--config", str(typed)]) == \
        "[checkpoint] on_save_failure = 1 is invalid: expected str"


@pytest.mark.parametrize(("parallelism", "world", "group", "shape"), [
    ("fsdp", 3, 0, (3,)), ("hsdp", 4, 2, (2, 2)), ("hsdp", 6, 3, (2, 3)),
    ("hsdp", 2, 2, (1, 2))])
def test_the_mesh_splits_the_world_into_replica_groups(parallelism: str, world: int,
                                                       group: int, shape: tuple[int, ...]
                                                       ) -> None:
    from elastic_train.config import mesh_shape

    assert mesh_shape(parallelism, world, group) == shape
