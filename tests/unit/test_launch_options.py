"""``elastic-train run`` as a drop-in for torchrun: every option of the installed torch's
torchrun is taken (or refused with a reason), with torchrun's default unless ours is
documented; ``PET_*`` launches (the Kubeflow operator's) settle as torchrun settles them."""

from __future__ import annotations

import argparse
import logging
import os

import pytest
from torch.distributed import run as torchrun

from elastic_train.agent import launch_options
from elastic_train.agent.environment import torchrun_environment
from elastic_train.agent.launch import launcher_parser, script_command, torchrun_argv
from elastic_train.agent.launch_options import REFUSED, resolve
from elastic_train.agent.logs import GlobalRankFilter, remember_ranks
from elastic_train.errors import ConfigError

# Defaults of ours that differ from torchrun's, each for a reason said in --help.
DIFFERENT_DEFAULTS = {
    "nproc_per_node": "ours 2 (resolve; torchrun's 1 with PET_* set)",
    "max_restarts": "ours 3 (resolve; torchrun's 0 with PET_* set)",
    "rdzv_backend": "c10d (resolve; torchrun's static with PET_* set or --master-port)",
    "rdzv_id": "random for one node (resolve; torchrun's none with PET_* set)",
    "nnodes": "'1' is torchrun's '1:1'",
    "start_method": "None: picks --worker-start only when given (START_METHODS)",
}


@pytest.fixture(autouse=True)
def no_pet(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)


def torchrun_options() -> dict[str, argparse.Action]:
    """Every option string of the installed torch's torchrun -> its action."""
    return {flag: action for action in torchrun.get_args_parser()._actions
            for flag in action.option_strings}


def test_every_torchrun_option_is_taken_or_refused_with_a_reason() -> None:
    ours = launcher_parser()._option_string_actions
    missing = sorted(f for f in torchrun_options() if f not in ours and f not in REFUSED)
    assert missing == [], f"torchrun options neither taken nor in REFUSED: {missing}"
    assert all(reason.strip() for reason in REFUSED.values())


def test_taken_options_keep_torchruns_meaning_and_default() -> None:
    ours = launcher_parser()._option_string_actions
    for flag, theirs in torchrun_options().items():
        if flag in REFUSED or flag in ("-h", "--help"):
            continue
        mine = ours[flag]
        assert mine.dest == theirs.dest, flag
        assert (mine.nargs == 0) == (theirs.nargs == 0), flag  # a flag here is a flag there
        if theirs.choices:
            assert set(mine.choices or ()) == set(theirs.choices), flag
        if mine.dest == "master_port" and theirs.default == launch_options.TORCHRUN_MASTER_PORT:
            # torch 2.11's torchrun defaults to 29500 itself; 2.12 and newer to None, then
            # 29500 (None tells them --master-port was not given): ours settles the same
            assert settled([]).master_port == theirs.default
        elif mine.dest not in DIFFERENT_DEFAULTS:
            assert mine.default == theirs.default, (flag, mine.default, theirs.default)


def test_torchruns_defaults_are_the_installed_ones() -> None:
    for dest, value in launch_options.TORCHRUN_DEFAULTS.items():
        assert torchrun.get_args_parser().get_default(dest) == value, dest


def test_a_refused_option_is_one_line_with_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from elastic_train.agent.launch import main

    monkeypatch.setitem(REFUSED, "--fancy", "no such thing here: use --plain")
    assert main(["--fancy", "x", "train.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["elastic-train: error: --fancy is not supported by elastic-train run: no "
                   "such thing here: use --plain"]


def settled(argv: list[str]) -> argparse.Namespace:
    ns = launcher_parser().parse_args(argv)
    resolve(ns)
    return ns


def test_our_defaults_without_pet_variables() -> None:
    ns = settled([])
    assert (ns.nproc_per_node, ns.max_restarts, ns.rdzv_backend) == ("2", 3, "c10d")
    assert ns.worker_start == "forkserver" and ns.rdzv_id == ""


KUBEFLOW = {"PET_NNODES": "1:2", "PET_RDZV_BACKEND": "c10d",
            "PET_RDZV_ENDPOINT": "127.0.0.1:29400", "PET_MAX_RESTARTS": "2"}


@pytest.mark.parametrize("extra", [{}, {"PET_RDZV_ID": "job-7"}, {"PET_NPROC_PER_NODE": "3"},
                                   {"PET_RDZV_ID": "job-7", "PET_NPROC_PER_NODE": "3"},
                                   {"PET_NNODES": "1"}])
def test_a_pet_only_launch_settles_as_torchrun_does(monkeypatch: pytest.MonkeyPatch,
                                                    extra: dict[str, str]) -> None:
    for name, value in {**KUBEFLOW, **extra}.items():
        monkeypatch.setenv(name, value)
    assert torchrun_environment()
    ns = settled([])
    theirs = torchrun.parse_args(["train.py"])  # torch's parser reads PET_* as it is built
    assert ns.nproc_per_node == theirs.nproc_per_node
    assert ns.rdzv_id == theirs.rdzv_id
    assert ns.max_restarts == int(theirs.max_restarts)
    assert (ns.nnodes, ns.rdzv_backend, ns.rdzv_endpoint) == (
        theirs.nnodes, theirs.rdzv_backend, theirs.rdzv_endpoint)
    # and what reaches torch's agent is that world
    config, _, _ = torchrun.config_from_args(torchrun.parse_args(torchrun_argv(ns, [], ["t.py"])))
    assert config.nproc_per_node == int(theirs.nproc_per_node)
    assert config.run_id == theirs.rdzv_id


def test_the_command_line_wins_over_pet_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_STANDALONE", "1")
    ns = settled(["--nproc-per-node", "4"])
    assert ns.nproc_per_node == "4" and ns.standalone and ns.rdzv_backend == "c10d"


def test_standalone_and_master_port_as_torchrun() -> None:
    ns = settled(["--standalone", "--rdzv-backend", "etcd", "--rdzv-id", "x"])
    assert (ns.rdzv_backend, ns.rdzv_endpoint) == ("c10d", "127.0.0.1:0")
    assert ns.rdzv_id not in ("", "x", "none")
    ns = settled(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                  "--master-port", "29511"])
    assert (ns.rdzv_backend, ns.rdzv_endpoint, ns.rdzv_id) == ("static", "10.0.0.1:29511",
                                                                "none")
    ns = settled(["--master-port", "29511"])  # one node with a master port: static, as torchrun
    assert (ns.rdzv_backend, ns.rdzv_endpoint) == ("static", "127.0.0.1:29511")


@pytest.mark.parametrize(("argv", "start"), [
    ([], "forkserver"), (["--start-method", "spawn"], "subprocess"),
    (["--start-method", "fork"], "forkserver"), (["--start_method=forkserver"], "forkserver"),
    (["--no-python"], "subprocess"), (["--worker-start", "subprocess"], "subprocess"),
])
def test_start_method_maps_to_the_worker_start(argv: list[str], start: str) -> None:
    assert settled(argv).worker_start == start


@pytest.mark.parametrize(("argv", "line"), [
    (["--start-method", "spawn", "--worker-start", "forkserver"],
     "--start-method spawn means --worker-start subprocess, not forkserver: give one of them"),
    (["--no-python", "--worker-start", "forkserver"],
     "--no-python runs a program, which cannot be forked from a Python server: use "
     "--worker-start subprocess (or leave it out)"),
    (["-m", "--no-python"],
     "-m/--module and --no-python cannot go together: a module needs python; give one of them"),
])
def test_contradictions_are_one_line(argv: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as err:
        settled(argv)
    assert str(err.value) == line and err.value.exit_code == 2


def test_a_bad_pet_start_method_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_START_METHOD", "thread")
    with pytest.raises(ConfigError, match=r"^--start-method 'thread' is invalid: use one of "
                                          r"fork, forkserver, spawn$"):
        settled([])


def test_a_script_reaches_torchrun_through_our_runner_with_every_option() -> None:
    argv = ["--role", "trainer", "--local-ranks-filter", "0", "--master-port", "29512",
            "--event-log-handler", "console", "--signals-to-handle", "SIGTERM",
            "--virtual-local-rank", "-r", "3", "-t", "1", "-m"]
    options, script = script_command([*argv, "pkg.train", "--lr", "1"], launcher_parser())
    ns = settled(options)
    args = torchrun.parse_args(torchrun_argv(ns, [], script))
    assert (args.role, args.local_ranks_filter, args.master_port) == ("trainer", "0", 29512)
    assert (args.event_log_handler, args.signals_to_handle) == ("console", "SIGTERM")
    assert args.virtual_local_rank and (args.redirects, args.tee) == ("3", "1")
    assert args.module and args.training_script == "elastic_train.worker.script_worker"
    assert args.training_script_args == ["-m", "pkg.train", "--lr", "1"]


def test_failed_worker_lines_name_the_global_rank() -> None:
    remember_ranks({0: 4242, 1: 4243}, {0: {"RANK": "3"}, 1: {"RANK": "2"}})
    record = logging.LogRecord(
        "torch.distributed.elastic.multiprocessing.api", logging.ERROR, __file__, 1,
        "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)",
        (-9, 0, 4242, "run_script", "forkserver"), None)
    assert GlobalRankFilter().filter(record)
    assert record.getMessage() == ("failed (exitcode: -9) rank: 3 (local_rank: 0, pid: 4242) "
                                   "of fn: run_script (start_method: forkserver)")


# torch 2.14's options (issue 39), on whichever torch is installed.
TEMPLATE = "${hostname}:${rank}: "


def test_the_log_line_prefix_template_reaches_torchs_agent_or_is_said(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from elastic_train.agent.launch import options_torchrun_knows

    ns = settled(["--log-line-prefix-template", TEMPLATE])
    cmd = torchrun_argv(ns, [], ["t.py"])
    assert f"--log-line-prefix-template={TEMPLATE}" in cmd
    parser = torchrun.get_args_parser()
    kept = options_torchrun_knows(cmd, parser)
    monkeypatch.delenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", raising=False)
    config, _, _ = torchrun.config_from_args(torchrun.parse_args(kept))
    if "--log-line-prefix-template" in torchrun_options():  # torch 2.14 and newer
        assert kept == cmd and capsys.readouterr().err == ""
        assert config.log_line_prefix_template == TEMPLATE
        return
    import torch

    assert kept == [a for a in cmd if not a.startswith("--log-line-prefix-template")]
    assert capsys.readouterr().err == (
        f"elastic-train: torch {torch.__version__}'s torchrun has no "
        "--log-line-prefix-template: tee'd lines keep torch's default prefix; set "
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, which it reads, instead\n")
    assert config.log_line_prefix_template is None
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", TEMPLATE)  # what the line says
    config, _, _ = torchrun.config_from_args(torchrun.parse_args(kept))
    assert config.log_line_prefix_template == TEMPLATE


def test_the_log_line_prefix_template_comes_from_its_pet_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_LOG_LINE_PREFIX_TEMPLATE", TEMPLATE)
    assert settled([]).log_line_prefix_template == TEMPLATE
    assert settled(["--log_line_prefix_template", "x"]).log_line_prefix_template == "x"


def test_print_completion_without_shtab_is_one_line_and_exit_1(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(__import__("sys").modules, "shtab", None)  # import shtab fails
    with pytest.raises(SystemExit) as caught:
        launcher_parser().parse_args(["--print-completion", "bash"])
    assert caught.value.code == 1
    assert capsys.readouterr().err == ("elastic-train: error: --print-completion needs the "
                                       "shtab package: pip install shtab\n")


def test_print_completion_prints_the_commands_completion(
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("shtab", reason="shtab is optional (as for torchrun): not installed")
    with pytest.raises(SystemExit) as caught:
        launcher_parser().parse_args(["--print_completion", "bash"])
    assert caught.value.code == 0
    script = capsys.readouterr().out
    assert "elastic-train" in script and "--nproc-per-node" in script
    assert "--log-line-prefix-template" in script and "checkpoints" in script


# What Kubeflow Trainer v2's Torch plugin gives each node's container (v2.3.0; the values
# of a TrainJob "job" of 2 nodes; tests/k8s_model.py trainer_v2_env derives them).
TRAINER_V2 = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job",
              "PET_MASTER_PORT": "29500"}


@pytest.mark.parametrize("nproc", ["1", "3", "auto"])
def test_a_trainer_v2_pods_environment_settles_as_torchrun_does(
        monkeypatch: pytest.MonkeyPatch, nproc: str) -> None:
    for name, value in {**TRAINER_V2, "PET_NPROC_PER_NODE": nproc}.items():
        monkeypatch.setenv(name, value)
    ns = settled([])
    theirs = torchrun.parse_args(["train.py"])
    assert (ns.nnodes, ns.nproc_per_node, ns.node_rank, ns.rdzv_id, ns.max_restarts) == (
        theirs.nnodes, theirs.nproc_per_node, theirs.node_rank, theirs.rdzv_id,
        int(theirs.max_restarts)) == ("2", nproc, 1, "none", 0)
    assert (ns.rdzv_backend, ns.rdzv_endpoint) == ("static", "job-node-0-0.job:29500")
    ours, _, _ = torchrun.config_from_args(torchrun.parse_args(torchrun_argv(ns, [], ["t.py"])))
    config, _, _ = torchrun.config_from_args(theirs)
    for field in ("min_nodes", "max_nodes", "nproc_per_node", "run_id", "rdzv_backend",
                  "rdzv_endpoint", "max_restarts"):
        assert getattr(ours, field) == getattr(config, field), field
    assert ours.rdzv_configs["rank"] == config.rdzv_configs["rank"] == 1
