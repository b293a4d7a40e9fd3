"""torchrun's options as ``elastic-train run`` takes them, and how their values are settled.

Every option of torchrun (``torch.distributed.run``) is accepted with torchrun's meaning;
one that cannot be is in ``REFUSED`` with why and what to use instead (a unit test checks
the installed torch's list against both). Values come, first found: the command line,
torchrun's ``PET_<NAME>`` variable, then a default. Three defaults are ours, not
torchrun's (``OUR_DEFAULTS``: 2 workers per node, 3 restarts, a random rendezvous id on one
node); they apply only where no ``PET_*`` variable of torchrun's options is set. With any
set (a Kubeflow PyTorchJob: the operator configures torchrun that way) every default is
torchrun's (``TORCHRUN_DEFAULTS``), so the job gets the world it got under torchrun.

Free of torch imports: the launcher reads these before it imports torch.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Mapping

from elastic_train.agent.environment import option_default, torchrun_environment
from elastic_train.errors import ConfigError
from elastic_train.rendezvous.config import DEFAULT_BACKEND, SINGLE_NODE_ENDPOINT

OUR_DEFAULTS: dict[str, object] = {"nproc_per_node": "2", "max_restarts": 3,
                                   "rdzv_backend": DEFAULT_BACKEND, "rdzv_id": ""}
"""Ours where they differ from torchrun's; ``rdzv_id`` "": random for one node, required
for more (rendezvous/config.py)."""
TORCHRUN_DEFAULTS: dict[str, object] = {"nproc_per_node": "1", "max_restarts": 0,
                                        "rdzv_backend": "static", "rdzv_id": "none"}
"""torchrun's (torch 2.11-2.14's parser; a unit test checks them against the installed one)."""
TORCHRUN_MASTER_PORT = 29500
"""torchrun's master port when none is given (``torch.distributed.run.run``)."""

REFUSED: dict[str, str] = {}
"""torchrun options ``elastic-train run`` refuses: option -> one line saying why and what to
use instead. Empty: every option of torchrun 2.11 to 2.14 is taken (a newer torch's new
options go here, or into the parser, before its test passes)."""

START_METHODS = {"spawn": "subprocess", "fork": "forkserver", "forkserver": "forkserver"}
"""torchrun's --start-method -> our --worker-start: spawn starts a fresh interpreter per
worker (our subprocess start); fork and forkserver fork it from a process that has torch
imported (our forkserver)."""


def add_torchrun_options(p: argparse.ArgumentParser) -> None:
    """torchrun's options, with torchrun's spellings (``-`` and ``_``) and meanings. Options
    whose default depends on the launch (ours or torchrun's) default to None here
    (``resolve``)."""
    opt = p.add_argument
    opt("--nnodes", default="1", help="nodes, N or MIN:MAX (default 1)")
    opt("--nproc-per-node", "--nproc_per_node", default=None,
        help="workers per node (default 2; torchrun's 1 with PET_* variables set)")
    opt("--rdzv-backend", "--rdzv_backend", default=None,
        help=f"{DEFAULT_BACKEND} (default), etcd, etcd-v2, etcd-v3, static, or any registered "
             "backend (torchrun's default, static, with PET_* variables set or with "
             "--master-port)")
    opt("--rdzv-endpoint", "--rdzv_endpoint", default="",
        help="HOST:PORT of the rendezvous (default: a free port on 127.0.0.1 for one node)")
    opt("--rdzv-id", "--rdzv_id", default=None,
        help="job id shared by all nodes (default: random for one node, required for more; "
             "torchrun's 'none' with PET_* variables set)")
    opt("--rdzv-conf", "--rdzv_conf", default="", help="KEY=VALUE,... for the backend")
    opt("--standalone", action="store_true",
        help="one node, c10d on a free local port, a random id (torchrun's; overrides "
             "--rdzv-*)")
    opt("--max-restarts", "--max_restarts", type=int, default=None,
        help="worker group restarts before the job fails (default 3; torchrun's 0 with "
             "PET_* variables set)")
    opt("--monitor-interval", "--monitor_interval", type=float, default=0.1,
        help="seconds between the agent's checks of its workers (default 0.1)")
    opt("--start-method", "--start_method", choices=sorted(START_METHODS), default=None,
        help="torchrun's; here it picks the worker start when --worker-start is not given: "
             "spawn -> subprocess, fork or forkserver -> forkserver")
    opt("--event-log-handler", "--event_log_handler", default="null",
        help="torchrun's event handler for the agent's events (default null)")
    opt("--role", default="default", help="the workers' role name (ROLE_NAME; default "
                                          "'default')")
    opt("-m", "--module", action="store_true",
        help="the target is a module, run as 'python -m MODULE'")
    opt("--no-python", "--no_python", action="store_true",
        help="the target is a program, run without python (subprocess workers)")
    opt("--run-path", "--run_path", action="store_true",
        help="run the script with runpy in the worker process (what elastic-train's "
             "workers do anyway)")
    opt("--log-dir", "--log_dir", default=None)
    opt("-r", "--redirects", default="0")
    opt("-t", "--tee", default="0")
    opt("--local-ranks-filter", "--local_ranks_filter", default="",
        help="show only these local ranks' output on the console (e.g. 0)")
    opt("--duplicate-stdout-filters", "--duplicate_stdout_filters", default=[])
    opt("--duplicate-stderr-filters", "--duplicate_stderr_filters", default=[])
    opt("--node-rank", "--node_rank", type=int, default=0)
    opt("--master-addr", "--master_addr", default="127.0.0.1",
        help="the static rendezvous' host (default 127.0.0.1)")
    opt("--master-port", "--master_port", type=int, default=None,
        help=f"the static rendezvous' port (torchrun's default {TORCHRUN_MASTER_PORT}); "
             "given without --rdzv-backend, the rendezvous is static, as with torchrun")
    opt("--local-addr", "--local_addr", default=None)
    opt("--logs-specs", "--logs_specs", default=None)
    opt("--numa-binding", "--numa_binding", default=None,
        choices=["node", "socket", "exclusive", "core-complex"])
    opt("--signals-to-handle", "--signals_to_handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    opt("--shutdown-timeout", "--shutdown_timeout", type=int, default=None,
        help="seconds the agent waits after SIGTERM before it SIGKILLs a worker "
             "(torch's default: 30; keep it above --preemption-budget)")
    opt("--virtual-local-rank", "--virtual_local_rank", action="store_true")
    # torch 2.14's: taken on every torch (an older one gets them as said in each's help)
    opt("--log-line-prefix-template", "--log_line_prefix_template", default="",
        help="the prefix of each tee'd console line, with ${role_name}, ${local_rank}, "
             "${rank} and ${hostname} (torch's default '[${role_name}${local_rank}]:'); on a "
             "torch before 2.14, whose torchrun lacks the option, set "
             "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE instead, which it reads")
    opt("--print-completion", "--print_completion", action=PrintCompletion,
        choices=completion_shells(),
        help="print a shell completion script for elastic-train to stdout and exit (e.g. "
             "--print-completion zsh > ~/.zsh/completions/_elastic-train); needs the "
             "optional shtab package, as torchrun's")


def completion_shells() -> list[str]:
    """The shells ``--print-completion`` takes: shtab's, or torchrun's list without it."""
    try:
        import shtab
    except ImportError:
        shtab = None
    return list(getattr(shtab, "SUPPORTED_SHELLS", None) or ("bash", "zsh", "tcsh"))


class PrintCompletion(argparse.Action):
    """``--print-completion SHELL`` (torchrun's, torch 2.14): a completion script, derived
    by shtab from the parsers, for the ``elastic-train`` command and its ``run`` options,
    on stdout; then exit. Without shtab: one line, exit 1, as torchrun."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        try:
            import shtab
        except ImportError:
            parser.exit(1, f"elastic-train: error: {option_string} needs the shtab package: "
                           "pip install shtab\n")
        command = argparse.ArgumentParser(prog="elastic-train")
        commands = command.add_subparsers(dest="command")
        commands.add_parser("run", parents=[parser], add_help=False,
                            help="run an elastic training job")
        for name, what in (("checkpoints", "list, verify or export checkpoints"),
                           ("report", "draw a run from its event log")):
            commands.add_parser(name, help=what)
        print(shtab.complete(command, shell=str(values)))
        parser.exit()


def apply_pet_defaults(p: argparse.ArgumentParser) -> None:
    """Every option's default from its ``PET_*`` variable, where set (agent_env)."""
    for action in p._actions:
        action.default = option_default(action.dest, action.default)


def resolve(ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Settle the options in ``ns`` that were left to a default (None), as torchrun would
    with any ``PET_*`` variable of its set, else with ``OUR_DEFAULTS``; then the worker
    start and the rendezvous, as torchrun's ``run`` does. ConfigError on a contradiction."""
    torchrun_like = bool(torchrun_environment(environ))
    defaults = TORCHRUN_DEFAULTS if torchrun_like else OUR_DEFAULTS
    for dest in ("nproc_per_node", "max_restarts"):
        if getattr(ns, dest) is None:
            setattr(ns, dest, defaults[dest])
    ns.worker_start = _worker_start(ns)
    if ns.module and ns.no_python:
        raise ConfigError("-m/--module and --no-python cannot go together: a module needs "
                          "python; give one of them")
    _resolve_rendezvous(ns, torchrun_like)


def _worker_start(ns: argparse.Namespace) -> str:
    chosen = ns.worker_start
    if ns.start_method is not None:
        if ns.start_method not in START_METHODS:  # PET_START_METHOD is not checked by argparse
            raise ConfigError(f"--start-method {ns.start_method!r} is invalid: use one of "
                              f"{', '.join(sorted(START_METHODS))}")
        mapped = START_METHODS[ns.start_method]
        if chosen is not None and chosen != mapped:
            raise ConfigError(f"--start-method {ns.start_method} means --worker-start "
                              f"{mapped}, not {chosen}: give one of them")
        chosen = mapped
    if ns.no_python:
        if chosen == "forkserver":
            raise ConfigError("--no-python runs a program, which cannot be forked from a "
                              "Python server: use --worker-start subprocess (or leave it out)")
        return "subprocess"
    return chosen or "forkserver"


def _resolve_rendezvous(ns: argparse.Namespace, torchrun_like: bool) -> None:
    if ns.standalone:  # torchrun's run(): explicit --rdzv-* are ignored
        ns.rdzv_backend, ns.rdzv_endpoint, ns.rdzv_id = "c10d", SINGLE_NODE_ENDPOINT, None
    elif ns.rdzv_backend is None:
        if torchrun_like or ns.master_port is not None:
            ns.rdzv_backend = "static"
        else:
            ns.rdzv_backend = OUR_DEFAULTS["rdzv_backend"]
    if ns.rdzv_backend == "static" and not ns.rdzv_endpoint and ns.master_port is None \
            and _max_nodes(ns.nnodes) == 1:  # torchrun's run(): one node needs no master
        ns.rdzv_backend, ns.rdzv_endpoint, ns.rdzv_id = "c10d", SINGLE_NODE_ENDPOINT, None
    if ns.rdzv_id is None:
        ns.rdzv_id = (str(TORCHRUN_DEFAULTS["rdzv_id"]) if torchrun_like
                      else str(OUR_DEFAULTS["rdzv_id"]))
        if ns.standalone or ns.rdzv_endpoint == SINGLE_NODE_ENDPOINT:
            ns.rdzv_id = uuid.uuid4().hex[:12]
    if ns.rdzv_backend == "static" and not ns.rdzv_id:
        ns.rdzv_id = str(TORCHRUN_DEFAULTS["rdzv_id"])  # unused by the static rendezvous
    if ns.rdzv_backend == "static" and not ns.rdzv_endpoint:
        ns.rdzv_endpoint = f"{ns.master_addr}:{ns.master_port or TORCHRUN_MASTER_PORT}"
    if ns.master_port is None:
        ns.master_port = TORCHRUN_MASTER_PORT


def _max_nodes(nnodes: str) -> int:
    try:
        return int(nnodes.split(":")[-1])
    except ValueError:
        raise ConfigError(f"--nnodes {nnodes!r} is invalid: write N or MIN:MAX") from None


def refused_line(argv: list[str]) -> str | None:
    """The one line for the first refused torchrun option in ``argv``, if any."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in REFUSED:
            return f"{flag} is not supported by elastic-train run: {REFUSED[flag]}"
    return None
