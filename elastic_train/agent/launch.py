"""``elastic-train run``: torch's elastic agent in-process, with our defaults and a pre-flight.

Launcher options are torchrun's, every one of them (agent/launch_options.py, which also settles
whose defaults apply), plus ``--worker-start``, ``--hot-spare``, ``--peer-timeout`` and
``--memory-tier`` (agent/snapshot_holder.py); given a script (or
``-m MODULE``), every worker runs it (worker/script_worker.py); else everything after the launcher
options is a job option for ``elastic_train.train``, checked here before any process
starts so that bad input fails in a second with one line instead of after every restart is
burnt. The rendezvous service is checked too (reachable, the API the backend needs), and
the rendezvous options get their defaults (rendezvous/config.py). Option defaults come
from torchrun's ``PET_*`` variables (agent/environment.py). torch's agent log lines name a failed
worker's global rank (agent/logs.py).

torch is imported inside the functions that need it, not at the top: the workers' forkserver
starts first, so that it imports torch while this process does (agent/worker_start.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from elastic_train.agent.failure_detector import INTERVAL as PING_INTERVAL
from elastic_train.agent.failure_detector import MIN_TIMEOUT as MIN_PEER_TIMEOUT
from elastic_train.agent.failure_detector import TIMEOUT as PEER_TIMEOUT
from elastic_train.agent.launch_options import (
    add_torchrun_options,
    apply_pet_defaults,
    refused_line,
    resolve,
)
from elastic_train.agent.snapshot_holder import DEFAULT_MAX_BYTES, parse_size
from elastic_train.agent.worker_start import worker_processes, workers_released_on_close
from elastic_train.config import JobConfig, RecoveryMode, mesh_shape
from elastic_train.config_options import parse_job_args
from elastic_train.errors import ConfigError, ElasticTrainError, NodeLeftError
from elastic_train.rendezvous.config import (
    parse_rdzv_conf,
    rdzv_conf_with_defaults,
    rendezvous_endpoint,
    rendezvous_id,
)
from elastic_train.rendezvous.failures import rendezvous_failure_line
from elastic_train.rundir import RunDir
from elastic_train.worker.env import read_worker_env

if TYPE_CHECKING:
    from elastic_train.agent.snapshot_holder import SnapshotHolder

log = logging.getLogger(__name__)

_IMPORTED_AT = time.monotonic()
"""When the launcher's module was imported: its process's start, give or take Python's own."""

WORKER_MODULE = "elastic_train.train"
SCRIPT_RUNNER = "elastic_train.worker.script_worker"
"""What subprocess workers run a script or module through (script_worker.main)."""

def launcher_parser(prog: str = "elastic-train run") -> argparse.ArgumentParser:
    """torchrun's options (agent/launch_options.py) and ours; defaults from ``PET_*``."""
    p = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False, add_help=False,
        description="Run an elastic training job: the built-in trainer (job options; see "
                    "--help-job) or, as torchrun, a script: elastic-train run [options] "
                    "train.py [args] (or -m MODULE [args]).",
        epilog="Every option of torchrun is taken, with torchrun's meaning. Three defaults "
               "are ours: --nproc-per-node 2, --max-restarts 3, and a random --rdzv-id on one "
               "node (required for more); with any PET_* variable of torchrun's options set "
               "(as the Kubeflow operator launches torchrun) every default is torchrun's "
               "(1 worker per node, 0 restarts, rendezvous id 'none', static rendezvous "
               "unless --rdzv-backend is given). A script gets the restart path: every "
               "worker restarts from the script's own checkpoint; ElasticSession adds live "
               "recovery and exact resume (docs/running-jobs.md).")
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--help-job", action="store_true", help="show the job options")
    add_torchrun_options(p)
    p.add_argument("--worker-start", choices=("forkserver", "subprocess"), default=None,
                   help="forkserver (default): workers fork from a process that imported torch "
                        "once, so a restart skips the imports; subprocess: a fresh "
                        "python process each time, as torchrun does")
    p.add_argument("--hot-spare", choices=("on", "off"), default="on",
                   help="on (default; the built-in job under live recovery): keep one worker "
                        "per node forked and built ahead, which takes the place of the next "
                        "worker that fails, so its replacement skips the fork and the build; "
                        "off: fork the replacement when a worker fails")
    p.add_argument("--peer-timeout", type=peer_timeout, default=PEER_TIMEOUT, metavar="S",
                   help=f"seconds without an answer after which a node's agent is taken for "
                        f"lost (the agents' failure detector; default {PEER_TIMEOUT:g}; a few "
                        "seconds on hosts that stall, 0: off, silent nodes are then seen at "
                        "their lease or heartbeat expiry)")
    p.add_argument("--memory-tier", choices=("on", "off"), default="on",
                   help="on (default): each agent keeps the newest checkpoint its workers "
                        "offer in memory, and a copy of it on one other node's agent, so a "
                        "restart of every worker restores from memory; it costs each agent "
                        "about one checkpoint's bytes of host memory (two while a new one "
                        "arrives), and the node that saves sends each checkpoint once more "
                        "over the network; off: none")
    p.add_argument("--memory-tier-limit", type=memory_tier_limit, default=DEFAULT_MAX_BYTES,
                   metavar="SIZE",
                   help="the largest checkpoint the agents keep in memory (bytes, or with "
                        "K, M, G, T; default 16G): a larger one goes to the run directory "
                        "only")
    apply_pet_defaults(p)
    return p


def memory_tier_limit(text: str) -> int:
    """``--memory-tier-limit``: a size (snapshot_holder.parse_size)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def peer_timeout(text: str) -> float:
    """``--peer-timeout``: 0 (off) or at least ``MIN_PEER_TIMEOUT`` seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value != 0 and not value >= MIN_PEER_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give 0 (off) or a number of seconds of at least {MIN_PEER_TIMEOUT:g} "
            f"(the detector pings every {PING_INTERVAL:g} s)")
    return value


def script_command(argv: Sequence[str], parser: argparse.ArgumentParser
                   ) -> tuple[list[str], list[str]] | None:
    """``(launcher options, [script, its arguments...])`` when ``argv`` runs a script,
    torchrun's form (``elastic-train run [options] train.py [args]``: the first argument
    that is neither a launcher option nor its value); None for the built-in job (its job
    options come first)."""
    takes_value = {flag: action.nargs != 0 for action in parser._actions
                   for flag in action.option_strings}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            return list(argv[:i]), list(argv[i:])
        flag = arg.split("=", 1)[0]
        if flag not in takes_value:
            return None
        i += 2 if takes_value[flag] and "=" not in arg else 1
    return None


def torchrun_argv(ns: argparse.Namespace, job_args: Sequence[str],
                  script: Sequence[str] = ()) -> list[str]:
    """The torchrun command line equivalent to ``ns`` (without the program name; settled
    by ``launch_options.resolve``); the built-in job with ``job_args``, or ``script``
    (``[target, args...]``), which subprocess workers run through ``SCRIPT_RUNNER``."""
    endpoint = rendezvous_endpoint(ns.nnodes, ns.rdzv_endpoint)
    run_id = rendezvous_id(ns.nnodes, ns.rdzv_id)
    argv = [
        f"--nnodes={ns.nnodes}", f"--nproc-per-node={ns.nproc_per_node}",
        f"--rdzv-backend={ns.rdzv_backend}", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={ns.max_restarts}", f"--monitor-interval={ns.monitor_interval}",
        f"--node-rank={ns.node_rank}", f"--master-addr={ns.master_addr}",
        f"--master-port={ns.master_port}", f"--redirects={ns.redirects}", f"--tee={ns.tee}",
        f"--role={ns.role}", f"--event-log-handler={ns.event_log_handler}",
        f"--signals-to-handle={ns.signals_to_handle}",
    ]
    conf = rdzv_conf_with_defaults(ns.rdzv_backend, ns.rdzv_conf)
    if conf:
        argv.append(f"--rdzv-conf={conf}")
    for flag, value in (("--local-addr", ns.local_addr), ("--log-dir", ns.log_dir),
                        ("--shutdown-timeout", ns.shutdown_timeout),
                        ("--local-ranks-filter", ns.local_ranks_filter),
                        ("--duplicate-stdout-filters", ns.duplicate_stdout_filters),
                        ("--duplicate-stderr-filters", ns.duplicate_stderr_filters),
                        ("--logs-specs", ns.logs_specs), ("--numa-binding", ns.numa_binding),
                        ("--log-line-prefix-template", ns.log_line_prefix_template)):
        if value not in (None, "", []):
            argv.append(f"{flag}={value}")
    if ns.virtual_local_rank:
        argv.append("--virtual-local-rank")
    if not script:
        return [*argv, "-m", WORKER_MODULE, *job_args]
    if ns.no_python:
        return [*argv, "--no-python", *script]
    return [*argv, "-m", SCRIPT_RUNNER, *(["-m"] if ns.module else []), *script]


_DROPPED_ON_OLDER_TORCH = {
    "--shutdown-timeout": "the agent waits torch's default, 30 s, before it SIGKILLs a worker",
    "--log-line-prefix-template": "tee'd lines keep torch's default prefix; set "
                                  "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, which it reads, instead",
}
"""Options of ours that an older torch's torchrun lacks (``--shutdown-timeout`` is torchrun's
since 2.12, ``--log-line-prefix-template`` since 2.14), and what a job gets without them."""


def options_torchrun_knows(cmd: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``cmd`` without the options of ours that this torch's torchrun lacks, each said once
    with what the job gets instead."""
    known = {flag for action in parser._actions for flag in action.option_strings}
    kept = []
    for arg in cmd:
        flag = arg.split("=", 1)[0]
        if flag in _DROPPED_ON_OLDER_TORCH and flag not in known:
            print(f"elastic-train: torch {_torch_version()}'s torchrun has no {flag}: "
                  f"{_DROPPED_ON_OLDER_TORCH[flag]}", file=sys.stderr)
            continue
        kept.append(arg)
    return kept


def _torch_version() -> str:
    import torch

    return torch.__version__


def preflight(config: JobConfig, nproc_per_node: str = "1", nnodes: str = "1") -> None:
    """Fail fast on what every worker would fail on: run dir, task, incompatible checkpoint,
    metrics ports in use, replica groups that do not divide a world size of the job."""
    import torch

    from elastic_train.agent.torch_seams import initialisation_skipped
    from elastic_train.checkpoint.storage import check_compatible, check_kind, tensor_shapes
    from elastic_train.observe.metrics import check_single_process_mode
    from elastic_train.observe.metrics_server import check_ports_free
    from elastic_train.tasks.base import TaskContext
    from elastic_train.tasks.loader import load_task

    group = config.train.replica_group_size
    if config.train.parallelism == "hsdp" and group and nproc_per_node.isdigit():
        low, _, high = nnodes.partition(":")
        if low.isdigit() and (high or low).isdigit():
            for n in range(int(low), int(high or low) + 1):
                mesh_shape("hsdp", n * int(nproc_per_node), group)
    run_dir = RunDir(config.run_dir, config.storage).prepare()
    task = load_task(config.train.task, TaskContext(config.train.task_options,
                                                    config.train.seed, config.run_dir))
    try:  # shapes only: no weights, no initialisation (torch_seams.initialisation_skipped)
        with torch.device("meta"), initialisation_skipped():
            shapes = tensor_shapes(task.build_model().state_dict())
    except Exception as exc:  # a model that cannot be built on meta: the workers will check
        log.debug("skipping the checkpoint pre-check: %s", exc)
    else:
        for info in run_dir.checkpoint_store().list():
            if info.manifest is not None:
                check_kind(info.path, info.manifest, config.train.parallelism != "ddp")
                check_compatible(info, shapes)
                break
    if config.metrics.port:
        check_single_process_mode(read_worker_env())
        if nproc_per_node.isdigit():
            check_ports_free(config.metrics.address, config.metrics.port, int(nproc_per_node))


def first_failure_line(exc: BaseException) -> str:
    """One line naming the failed rank and its error, from torch's ChildFailedError."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    rank, failure = min(failures.items(), key=lambda item: item[1].timestamp)
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message).strip().splitlines()[0] if str(message).strip() else ""
    if not text or text.startswith("To enable traceback"):
        text = f"exit code {failure.exitcode}"
    return f"rank {rank} failed: {text}"


def _launch(args: argparse.Namespace, job_args: Sequence[str], worker_start: str,
            recovery: str = RecoveryMode.LIVE, script: Sequence[str] = (), hot_spare: bool = False,
            peer_seconds: float = PEER_TIMEOUT, memory_tier: int | None = None) -> None:
    """Run the elastic agent in this process until the job ends (``recovery``: the job's
    --recovery; agent/live_agent.py; a script's ElasticSession chooses for itself; ``hot_spare``:
    --hot-spare, for the built-in job under live recovery: live/spare.py; ``peer_seconds``:
    --peer-timeout, agent/failure_detector.py; ``memory_tier``: the largest snapshot the
    agent's holder keeps, None: --memory-tier off, agent/snapshot_holder.py)."""

    from elastic_train.agent.live_agent import live_agent_installed
    from elastic_train.agent.store_binding import node_store_host, rendezvous_store_on_loopback
    from elastic_train.rendezvous.config import single_node

    listen_host = node_store_host(single_node(args.nnodes), args.local_addr)
    spare = hot_spare and not script and recovery == RecoveryMode.LIVE
    try:
        join_timeout = float(parse_rdzv_conf(args.rdzv_conf).get("join_timeout", 600))
    except ValueError:
        join_timeout = 600.0  # torch's handler refuses it itself
    min_nodes = int(str(args.nnodes).split(":")[0]) if str(args.nnodes).split(":")[0] \
        .isdigit() else 1
    with memory_tier_holder(args, memory_tier) as holder, \
            live_agent_installed(recovery, listen_host, spare, peer_seconds, join_timeout,
                                 min_nodes, holder), rendezvous_store_on_loopback():
        _launch_agent(args, job_args, worker_start, script)


@contextlib.contextmanager
def memory_tier_holder(args: argparse.Namespace, max_bytes: int | None
                       ) -> Iterator[SnapshotHolder | None]:
    """This agent's snapshot holder for the job's life (None: ``--memory-tier off``),
    listening where the agent talks to the job's other nodes (``holder_address``)."""
    if max_bytes is None:
        yield None
        return
    from elastic_train.agent.snapshot_holder import held_for_workers, holder_address
    from elastic_train.rendezvous.config import single_node

    endpoint = (args.rdzv_endpoint or "").split(",")[0].split("://")[-1]
    host = endpoint.rpartition(":")[0] if ":" in endpoint else endpoint
    bind, advertised = holder_address(single_node(args.nnodes), args.local_addr, host or None)
    with held_for_workers(bind, advertised, args.rdzv_id, max_bytes) as holder:
        yield holder


def _launch_agent(args: argparse.Namespace, job_args: Sequence[str], worker_start: str,
                  script: Sequence[str] = ()) -> None:
    from elastic_train.agent.logs import global_ranks_in_logs

    with global_ranks_in_logs():
        _start_agent(args, job_args, worker_start, script)


def _start_agent(args: argparse.Namespace, job_args: Sequence[str], worker_start: str,
                 script: Sequence[str] = ()) -> None:
    from torch.distributed import run as torchrun

    if worker_start == "subprocess":
        torchrun.run(args)
        return
    from torch.distributed.launcher.api import elastic_launch

    from elastic_train.agent.torch_seams import failure_logging_warmed
    from elastic_train.worker.entrypoints import run_worker
    from elastic_train.worker.script_worker import MODULE_FLAG, run_module, run_script

    failure_logging_warmed()  # off the start's path, done before a worker can fail
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "forkserver"
    with workers_released_on_close():
        if script and script[0] == MODULE_FLAG:
            elastic_launch(config, entrypoint=run_module)(*script[1:])
        elif script:
            elastic_launch(config, entrypoint=run_script)(*script)
        else:
            elastic_launch(config, entrypoint=run_worker)(*job_args)


def _configure_logging() -> None:
    """With ``ELASTIC_TRAIN_LOG_LEVEL`` set (e.g. INFO: every step of a re-formation's
    coordination), the package's lines at that level, as the user always sees them (the
    message alone). Unset, nothing changes: WARNING and above, as Python shows them."""
    from elastic_train.agent.environment import agent_log_level

    level = agent_log_level()
    if level == "WARNING" or level not in logging.getLevelNamesMapping():
        return
    logger = logging.getLogger("elastic_train")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)


def main(argv: Sequence[str]) -> int:
    """Parse, pre-flight and launch; return the exit code."""
    _configure_logging()
    # Workers run ``python -m elastic_train.train`` and so import tasks from the working
    # directory; the pre-flight and the forkserver must see the same modules.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    parser = launcher_parser()
    refused = refused_line(list(argv))
    if refused is not None:
        print(f"elastic-train: error: {refused}", file=sys.stderr)
        return 2
    scripted = script_command(argv, parser)
    if scripted is not None:
        return _run_script(parser, *scripted)
    ns, job_args = parser.parse_known_args(list(argv))
    if ns.help or ns.help_job:
        from elastic_train.config_options import job_parser

        (job_parser("elastic-train run") if ns.help_job else parser).print_help()
        return 0
    try:
        resolve(ns)
        if ns.module or ns.no_python or ns.run_path:
            raise ConfigError("-m, --no-python and --run-path need a script or module to run: "
                              "give it after the options (elastic-train run [options] "
                              "train.py [args])")
        config = parse_job_args(job_args, prog="elastic-train run")
        cmd = torchrun_argv(ns, job_args)
        name_worker_interface(ns)
    except ElasticTrainError as exc:
        print(f"elastic-train: error: {exc}", file=sys.stderr)
        return exc.exit_code
    # The workers' server imports torch while this process does (see worker_start).
    with worker_processes(ns.worker_start, ns.nproc_per_node):
        return _checked_launch(ns, cmd, job_args, config)


def name_worker_interface(ns: argparse.Namespace) -> None:
    """For a job that may span hosts, name the interface the workers advertise to their
    peers (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, each unless set; network.py)
    before the workers' server inherits the environment. Raises ``NetworkConfigError``
    when they would advertise a loopback address to other hosts."""
    from elastic_train.agent.environment import apply_environment_defaults
    from elastic_train.network import socket_ifname_defaults
    from elastic_train.rendezvous.config import single_node

    endpoint = (ns.rdzv_endpoint or "").split(",")[0].split("://")[-1]
    host = endpoint.rpartition(":")[0] if ":" in endpoint else endpoint
    defaults = socket_ifname_defaults(not single_node(ns.nnodes), ns.local_addr, host or None,
                                      os.environ)
    if defaults:
        log.info("workers advertise interface %s to their peers (%s)",
                 next(iter(defaults.values())), ", ".join(defaults))
    apply_environment_defaults(defaults)


SCRIPT_GETS = ("elastic-train: {target} runs unmodified, as under torchrun: a failed worker "
               "restarts every worker ({start}) and the script resumes from its own "
               "checkpoint; nothing else is added. ElasticSession (7 changed lines in a "
               "tutorial loop; README) adds live recovery (survivors keep their processes) "
               "and exact resume")
"""The line a script job starts with (``--worker-start`` said as what it does)."""


def _run_script(parser: argparse.ArgumentParser, options: list[str], script: list[str]
                ) -> int:
    """``elastic-train run [options] SCRIPT [args]`` (or ``-m MODULE``, ``--no-python
    PROGRAM``): every worker runs it."""
    ns = parser.parse_args(options)
    if ns.help or ns.help_job:
        parser.print_help()
        return 0
    try:
        resolve(ns)
        _check_target(ns, script[0])
        cmd = torchrun_argv(ns, [], script)
        name_worker_interface(ns)
    except ElasticTrainError as exc:
        print(f"elastic-train: error: {exc}", file=sys.stderr)
        return exc.exit_code
    start = ("forked from a server with torch imported, no imports on a restart"
             if ns.worker_start == "forkserver" else "fresh processes, as torchrun starts")
    print(SCRIPT_GETS.format(target=script[0], start=start), file=sys.stderr, flush=True)
    with worker_processes(ns.worker_start, ns.nproc_per_node):
        return _checked_launch(ns, cmd, [], None, script)


def _check_target(ns: argparse.Namespace, target: str) -> None:
    """ConfigError unless ``target`` is what the workers can run: a file, an importable
    module (``-m``), a program (``--no-python``)."""
    if ns.module:
        if importlib.util.find_spec(target.split(".")[0]) is None:
            raise ConfigError(f"no module {target!r} to run (-m): give a module importable "
                              "from the working directory or the installed packages")
    elif ns.no_python:
        if shutil.which(target) is None:
            raise ConfigError(f"no program {target!r} to run (--no-python): give an "
                              "executable file or a command on PATH")
    elif not os.path.isfile(target):
        raise ConfigError(f"no training script at {target}: give the path of a Python file "
                          "(or job options, e.g. --task, for the built-in trainer)")


READY_LINE = ("launcher ready to join after {ready:.2f} s: torch imported by {torch:.2f} s, "
              "torch check {check:.2f} s, rendezvous and pre-flight checks {preflight:.2f} s")
"""Said (INFO) before the rendezvous: where a node's start went (the fault campaign collects
it, benchmarks/chaos.py)."""


def _checked_launch(ns: argparse.Namespace, cmd: list[str], job_args: Sequence[str],
                    config: JobConfig | None, script: Sequence[str] = ()) -> int:
    """The rendezvous and pre-flight checks, then the launch; the exit code (``config``:
    the built-in job's, None for a script)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from elastic_train.rendezvous import timing
    from elastic_train.rendezvous.preflight import check_rendezvous
    from elastic_train.torch_compat import check_at_launch

    torch_at = time.monotonic()
    try:
        check_at_launch()  # this torch against the seams, before any worker starts
        checked_at = time.monotonic()
        check_rendezvous(ns.rdzv_backend, ns.rdzv_endpoint,
                         parse_rdzv_conf(rdzv_conf_with_defaults(ns.rdzv_backend, ns.rdzv_conf)))
        if config is not None:
            preflight(config, ns.nproc_per_node, str(ns.nnodes))
    except ElasticTrainError as exc:
        print(f"elastic-train: error: {exc}", file=sys.stderr)
        return exc.exit_code
    ready_at = time.monotonic()
    log.info(READY_LINE.format(ready=ready_at - _IMPORTED_AT, torch=torch_at - _IMPORTED_AT,
                               check=checked_at - torch_at, preflight=ready_at - checked_at))
    timing.install()
    where = f" (run dir {config.run_dir})" if config is not None else f" ({script[0]})"
    args = torchrun.parse_args(options_torchrun_knows(cmd, torchrun.get_args_parser()))
    # Settled here already (launch_options.resolve): torch's parser must not take them
    # again from PET_* variables (PET_NO_PYTHON would run our runner without python).
    args.standalone, args.run_path = False, False
    args.no_python = bool(script) and ns.no_python
    args.module = not args.no_python
    try:
        _launch(args, job_args, ns.worker_start,
                config.distributed.recovery if config is not None else RecoveryMode.LIVE,
                (["-m"] if ns.module else []) + list(script), ns.hot_spare == "on",
                ns.peer_timeout, ns.memory_tier_limit if ns.memory_tier == "on" else None)
    except SignalException as exc:
        # The agent passed the signal to the workers. Non-zero here so that a restart
        # policy brings a preempted node back.
        left_at = getattr(exc, "node_left_at", None)
        if left_at is not None:  # this node alone: the others hold the state and go on
            print(f"elastic-train: stopped by {exc.sigval.name}: this node left the job at "
                  f"step {left_at}, the other nodes go on without it; run the same command "
                  f"to join again{where}", file=sys.stderr)
        else:  # every node: the workers checkpointed and exited 0
            print(f"elastic-train: stopped by {exc.sigval.name}: the workers checkpointed at "
                  f"the step they reached; rerun the same command to resume{where}",
                  file=sys.stderr)
        return 128 + int(exc.sigval)
    except NodeLeftError as exc:
        print(f"elastic-train: {exc}{where}", file=sys.stderr)
        return exc.exit_code
    except ChildFailedError as exc:
        print(f"elastic-train: job failed: {first_failure_line(exc)}{where}", file=sys.stderr)
        return 1
    except Exception as exc:  # rendezvous errors, ports in use, ...: one line, not a traceback
        line = rendezvous_failure_line(exc, backend=ns.rdzv_backend, endpoint=ns.rdzv_endpoint,
                                       run_id=ns.rdzv_id, nnodes=ns.nnodes)
        print(f"elastic-train: error: {line or type(exc).__name__ + ': '}"
              f"{'' if line else first_failure_line(exc)}", file=sys.stderr)
        return 1
    return 0
