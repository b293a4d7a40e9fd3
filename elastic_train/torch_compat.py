"""The installed torch against what elastic_train relies on, checked at start.

``TESTED`` is the one list of the torch versions the compatibility run passed on
(``make test-compat``, docs/torch-versions.md). What elastic_train relies on beyond
torch's public API is what the two seams declare (``REQUIRED`` of agent/torch_seams.py and
worker/torch_seams.py; torch_private.py checks each name). At start:

- a torch that lacks or reshaped one of those names is refused in one line: its version,
  the names it lacks (those in the modules torch has imported by then, when one of them is
  missing: a refusal in milliseconds after torch's import; else all), the tested versions
  (``TorchUnsupportedError``, exit 2);
- a torch newer (or older) than every tested one, with every name there, runs, with one
  line saying so.

``elastic-train run`` checks both seams before any worker starts (``check_at_launch``) and
tells its workers so; a worker checks its own seam once per process (``check_in_worker``),
unless its launcher did. The seams' declarations are read from their source, not imported:
a seam imports some of those names itself, so on a torch without them it would not import.

Free of torch imports at module level (the launcher imports this before torch).
"""

from __future__ import annotations

import ast
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from elastic_train.errors import ElasticTrainError
from elastic_train.torch_private import Private, problems

__all__ = ["CHECKED", "SEAMS", "TESTED", "TorchUnsupportedError", "check", "check_at_launch",
           "check_in_worker", "declared", "notice_line", "refusal_line"]

TESTED: tuple[str, ...] = ("2.11.0", "2.12.1", "2.13.0", "2.14.1")
"""The torch versions the compatibility run passed on, oldest first (its results:
benchmarks/results/compat-*; pyproject.toml's lower bound is the first)."""

AGENT_SEAM = "elastic_train.agent.torch_seams"
WORKER_SEAM = "elastic_train.worker.torch_seams"
SEAMS: tuple[str, ...] = (AGENT_SEAM, WORKER_SEAM)

CHECKED = "ELASTIC_TRAIN_TORCH_CHECKED"
"""Set by the launcher for its workers to the torch version it checked: they skip their own
check of that version."""

_PACKAGE = Path(__file__).resolve().parent
_checked_here: str | None = None


class TorchUnsupportedError(ElasticTrainError):
    """The installed torch lacks or reshaped a private name elastic_train relies on."""

    exit_code = 2


def declared(seam: str) -> tuple[Private, ...]:
    """``seam``'s ``REQUIRED`` (a module of this package), read from its source: a tuple of
    ``Private(...)`` calls whose arguments are string constants, tuples of them, or
    module-level names bound to a string. tests/unit/test_torch_compat.py checks that this
    reads what importing the seam gives."""
    path = _PACKAGE.joinpath(*seam.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text(), str(path))
    names: dict[str, object] = {}
    required = None
    for node in tree.body:
        target, value = _assignment(node)
        if target is None or value is None:
            continue
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            names[target] = value.value
        elif target == "REQUIRED":
            required = value
    if not isinstance(required, ast.Tuple):
        raise ValueError(f"{path}: REQUIRED is not a tuple of Private(...)")

    def value_of(node: ast.expr) -> object:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.Tuple):
            return tuple(value_of(item) for item in node.elts)
        raise ValueError(f"{path}:{node.lineno}: {ast.unparse(node)} is not a constant")

    declared_names = []
    for call in required.elts:
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id == "Private"):
            raise ValueError(f"{path}:{call.lineno}: {ast.unparse(call)} is not Private(...)")
        args = [value_of(arg) for arg in call.args]
        kwargs = {kw.arg: value_of(kw.value) for kw in call.keywords if kw.arg}
        declared_names.append(Private(*args, **kwargs))  # type: ignore[arg-type]
    return tuple(declared_names)


def _assignment(node: ast.stmt) -> tuple[str | None, ast.expr | None]:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 \
            and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id, node.value
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id, node.value
    return None, None


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version ("2.14.1+cu130" -> (2, 14))."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def refusal_line(version: str, found: Iterable[tuple[Private, str]]) -> str:
    """The one line that refuses torch ``version`` for ``found`` (name, problem)."""
    names = ", ".join(f"{p.module}.{p.path} ("
                      f"{'gone' if problem == f'{p.path} is gone' else problem})"
                      for p, problem in found)
    return (f"torch {version} lacks what elastic_train relies on: {names}; elastic_train "
            f"was tested with torch {', '.join(TESTED)}: install one of those")


def notice_line(version: str) -> str | None:
    """The one line for a torch outside the tested releases whose names are all there (None
    for a tested release: its patch level is not compared)."""
    release = _release(version)
    tested = ", ".join(TESTED)
    if release > _release(TESTED[-1]):
        return (f"torch {version} is newer than the versions elastic_train was tested with "
                f"({tested}); every private name of torch it relies on is there, so it runs")
    if release < _release(TESTED[0]):
        return (f"torch {version} is older than the versions elastic_train was tested with "
                f"({tested}); every private name of torch it relies on is there, so it runs")
    return None


def check(seams: Iterable[str] = SEAMS) -> str | None:
    """Check the installed torch against ``seams``: raise ``TorchUnsupportedError`` (its
    one line) if a name is missing or reshaped, else return ``notice_line`` (or None)."""
    import importlib

    import torch

    required = [private for seam in seams for private in declared(seam)]
    # The names in modules already imported first (milliseconds): a torch without one of
    # them is refused at once, without importing the others' modules (DTensor's and
    # FSDP2's: most of a second on 2 cores), which a launch imports later anyway.
    found = problems([p for p in required if p.module in sys.modules])
    if not found:
        found = problems([p for p in required if p.module not in sys.modules])
    for seam in seams if not found else ():  # the names hold: do the seams import too?
        try:
            importlib.import_module(seam)
        except ImportError as exc:
            found.append((Private(seam, "import", "(its imports)"),
                          f"{seam} does not import: {exc}"))
    if found:
        raise TorchUnsupportedError(refusal_line(torch.__version__, found))
    return notice_line(torch.__version__)


def check_at_launch() -> None:
    """The launcher's check, before any worker starts: every seam; its notice on stderr;
    the workers it starts next told the version it checked (``CHECKED``)."""
    import torch

    from elastic_train.agent.environment import set_for_workers

    line = check()
    if line:
        print(f"elastic-train: {line}", file=sys.stderr, flush=True)
    set_for_workers(CHECKED, torch.__version__)


def check_in_worker(rank: int, environ: Mapping[str, str] | None = None) -> None:
    """A worker's check of its own seam, once per process and skipped where its launcher
    checked this torch; the notice from rank 0 only. Raises ``TorchUnsupportedError``."""
    global _checked_here
    import torch

    from elastic_train.live.environment import WORKER_ENV_FILE, read_env_file

    env = os.environ if environ is None else environ
    version = torch.__version__
    if _checked_here == version or env.get(CHECKED) == version:
        return
    path = env.get(WORKER_ENV_FILE)
    if path and read_env_file(path).get(CHECKED) == version:
        return
    line = check((WORKER_SEAM,))
    _checked_here = version
    if line and rank == 0:
        print(f"elastic_train: {line}", file=sys.stderr, flush=True)
