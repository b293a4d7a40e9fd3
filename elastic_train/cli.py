"""The ``elastic-train`` command: run a job, inspect and verify its checkpoints.

torch is imported where a command needs it, not here: ``run`` starts its workers' server
before this process imports torch (see agent/worker_start.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from elastic_train import __version__
from elastic_train.config import run_location
from elastic_train.config_options import storage_from_options
from elastic_train.errors import ElasticTrainError
from elastic_train.process_exit import exit_command
from elastic_train.rundir import RunDir

if TYPE_CHECKING:
    from elastic_train.checkpoint.api import CheckpointStorage

USAGE = """usage: elastic-train <command> [options]

commands:
  run [torchrun options] [job options]   run an elastic training job (default: 2 workers,
                                         embedded c10d rendezvous); 'run --help' for more
  checkpoints list RUN_DIR [--json]      every checkpoint: step, world size, time, size,
                                         valid or not, and the model weights' sha256
  checkpoints verify RUN_DIR             exit 1 if any checkpoint is corrupt
  checkpoints export RUN_DIR OUT [--step N]
                                         write the model weights of the newest valid
                                         checkpoint (or step N) to OUT: .safetensors, or
                                         .pt/.pth/.bin for torch.load(weights_only=True)
  report RUN_DIR [--output PNG]          draw the run from its event log (loss, throughput,
                                         world size; failures, restarts, resizes and
                                         checkpoints marked) into RUN_DIR/report.png, and
                                         write a summary (report.txt)
  --version                              print the version
"""


def _checkpoint_store(run_dir: RunDir) -> CheckpointStorage:
    _check_run_dir(run_dir)
    return run_dir.checkpoint_store()


def _checkpoint_rows(store: CheckpointStorage) -> list[dict[str, Any]]:
    rows = []
    for info in store.list():
        verdict = store.verify(info)
        rows.append({
            "step": info.step,
            "path": str(info.path),
            "world_size": info.world_size,
            "time": info.time,
            "bytes": info.size_bytes,
            "valid": verdict.valid,
            "problem": verdict.problem,
            "model_digest": info.model_digest,
            "certified": bool((info.manifest or {}).get("replicas_verified")),
        })
    return rows


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _check_run_dir(run_dir: RunDir) -> None:
    if not run_dir.exists():
        raise ElasticTrainError(f"run directory {run_dir} does not exist: pass the --run-dir "
                                "of a job")


def _run_dir_arguments(parser: argparse.ArgumentParser) -> None:
    """RUN_DIR (a path or s3://BUCKET/PREFIX) and how to reach an object store."""
    parser.add_argument("run_dir", type=run_location, metavar="RUN_DIR",
                        help="the job's --run-dir: a path or s3://BUCKET/PREFIX")
    parser.add_argument("--storage-opt", dest="storage_opt", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="as the job's --storage-opt (endpoint_url, region, profile, ...)")


def _layout(ns: argparse.Namespace) -> RunDir:
    return RunDir(ns.run_dir, storage_from_options(ns.storage_opt))


def checkpoints_list(run_dir: RunDir, as_json: bool) -> int:
    store = _checkpoint_store(run_dir)
    rows = _checkpoint_rows(store)
    leftovers = [str(p) for p in store.leftovers()]
    if as_json:
        print(json.dumps({"run_dir": str(run_dir), "checkpoints": rows,
                          "leftovers": leftovers}, indent=2))
        return 0
    if not rows:
        print(f"no checkpoints under {RunDir(run_dir).checkpoints}")
    else:
        print(f"{'STEP':>8}  {'WORLD':>5}  {'TIME (UTC)':<19}  {'SIZE':>10}  {'VALID':<5}  "
              f"{'CERTIFIED':<9}  MODEL SHA256")
        for r in rows:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["time"])) \
                if r["time"] else "-"
            valid = "yes" if r["valid"] else "NO"
            certified = "yes" if r["certified"] else "-"
            print(f"{r['step']:>8}  {r['world_size'] or '-':>5}  {when:<19}  "
                  f"{_human_bytes(r['bytes']):>10}  {valid:<5}  {certified:<9}  "
                  f"{r['model_digest'] or '-'}")
            if not r["valid"]:
                print(f"{'':>8}  ^ {r['problem']}")
    for path in leftovers:
        print(f"leftover of an unfinished save (removed at the next start): {path}")
    return 0


def checkpoints_verify(run_dir: RunDir) -> int:
    rows = _checkpoint_rows(_checkpoint_store(run_dir))
    bad = [r for r in rows if not r["valid"]]
    for r in rows:
        state = "ok" if r["valid"] else f"CORRUPT: {r['problem']}"
        print(f"{r['path']}: {state}")
    if not rows:
        print(f"no checkpoints under {RunDir(run_dir).checkpoints}")
    if bad:
        print(f"{len(bad)} of {len(rows)} checkpoints are corrupt", file=sys.stderr)
        return 1
    return 0


def checkpoints_export(run_dir: RunDir, out: Path, step: int | None) -> int:
    from elastic_train.checkpoint.export import export_checkpoint

    result = export_checkpoint(_checkpoint_store(run_dir), out, step)
    print(f"exported step {result.step} of {run_dir} ({result.tensors} tensors, "
          f"{_human_bytes(result.bytes)}, model sha256 {result.model_digest}) to {out}")
    return 0


def _checkpoints(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="elastic-train checkpoints", allow_abbrev=False)
    sub = parser.add_subparsers(dest="action", required=True)
    p_list = sub.add_parser("list", help="list checkpoints with validity and digests")
    _run_dir_arguments(p_list)
    p_list.add_argument("--json", action="store_true")
    p_verify = sub.add_parser("verify", help="exit 1 if any checkpoint is corrupt")
    _run_dir_arguments(p_verify)
    p_export = sub.add_parser(
        "export", help="write a checkpoint's model weights to a .safetensors or .pt file")
    _run_dir_arguments(p_export)
    p_export.add_argument("out", type=Path,
                          help="the file to write: .safetensors, or .pt, .pth, .bin (torch)")
    p_export.add_argument("--step", type=int, default=None, metavar="N",
                          help="the checkpoint of step N (default: the newest valid one)")
    ns = parser.parse_args(list(argv))
    if ns.action == "list":
        return checkpoints_list(_layout(ns), ns.json)
    if ns.action == "export":
        return checkpoints_export(_layout(ns), ns.out, ns.step)
    return checkpoints_verify(_layout(ns))


def _report(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="elastic-train report", allow_abbrev=False,
        description="Draw a run from its event log and summarise it.")
    _run_dir_arguments(parser)
    parser.add_argument("--output", type=Path, default=None, metavar="PNG",
                        help="where the picture goes (default RUN_DIR/report.png; for "
                             "s3:// this host's local directory of it); the "
                             "summary goes beside it as .txt")
    parser.add_argument("--run-id", default=None,
                        help="which run of the log (default: the newest)")
    parser.add_argument("--no-plot", action="store_true",
                        help="only the summary (no matplotlib needed)")
    ns = parser.parse_args(list(argv))
    layout = _layout(ns)
    _check_run_dir(layout)
    from elastic_train.observe.report import write_report

    report = write_report(layout, ns.output, ns.run_id, plot=not ns.no_plot)
    print(report.text, end="")
    written = [p for p in (report.image_path, report.summary_path) if p is not None]
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    try:
        if command == "--version":
            print(f"elastic-train {__version__}")
            return 0
        if command == "run":
            from elastic_train.agent.launch import main as launch_main

            return launch_main(rest)
        if command == "checkpoints":
            return _checkpoints(rest)
        if command == "report":
            return _report(rest)
    except ElasticTrainError as exc:
        print(f"elastic-train: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"elastic-train: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    return 2


# Exit status of a command whose reader closed stdout early (``... | head -3``): 141, what a
# shell reports for a program killed by SIGPIPE (128 + 13), as for cat, seq or grep there.
# Not 0: the output was not all delivered (`verify | head` must not pass for a success), and
# scripts under `set -o pipefail` already treat 141 from a pipeline's writer as they do for
# those tools.
BROKEN_PIPE_EXIT = 141


def console() -> NoReturn:
    """The ``elastic-train`` console script.

    Python ignores SIGPIPE, so a closed stdout raises BrokenPipeError (while printing or at
    the final flush): end quietly then, as Python's docs on SIGPIPE recommend, with stdout
    pointed at /dev/null so that the interpreter's own flush at exit does not raise again.
    """
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        code = BROKEN_PIPE_EXIT
    exit_command(code)
