"""The installed torch against what elastic_train relies on, checked at start.

``TESTED`` is the one list of the torch versions the compatibility run passed on
(``make test-compat``, docs/torch-versions.md). What elastic_train relies on beyond
torch's public API is what the seams declare (``REQUIRED`` of agent/torch_seams.py,
rendezvous/torch_seams.py, worker/torch_seams.py and checkpoint/torch_seams.py;
torch_private.py checks each name). At start:

- a torch that lacks or reshaped one of those names is refused in one line: its version,
  the names it lacks (those in the modules torch has imported by then, when one of them is
  missing: a refusal in milliseconds after torch's import; else all), the tested versions
  (``TorchUnsupportedError``, exit 2);
- a torch newer (or older) than every tested one, with every name there, runs, with one
  line saying so.

``elastic-train run`` checks every seam before any worker starts (``check_at_launch``) and
tells its workers so; a worker checks its own seam once per process (``check_in_worker``),
unless its launcher did. The seams' declarations are read from their source, not imported:
a seam imports some of those names itself, so on a torch without them it would not import.

A passed check is remembered on disk (``Verdicts``), keyed by what it depends on: torch's
version, build and install (its path and its ``version.py``'s time and size: a reinstall
rewrites it), and the source of the seams and of the checker. An agent started again on the
same machine (a node back after a kill, a restarted pod with the cache on a volume) skips
importing the worker side's modules only to check them: 2-3 s of its start on a loaded
2-core machine. ``ELASTIC_TRAIN_CACHE_DIR`` says where (default
``$XDG_CACHE_HOME/elastic_train``, else ``~/.cache/elastic_train``); set it empty to check
every time. A refusal is never remembered.

Free of torch imports at module level (the launcher imports this before torch).
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from elastic_train.errors import ElasticTrainError
from elastic_train.torch_private import Private, problems

__all__ = ["CACHE_DIR", "CHECKED", "SEAMS", "TESTED", "TorchUnsupportedError", "Verdicts",
           "check", "check_at_launch", "check_in_worker", "declared", "notice_line",
           "refusal_line"]

log = logging.getLogger(__name__)

TESTED: tuple[str, ...] = ("2.11.0", "2.12.1", "2.13.0", "2.14.1")
"""The torch versions the compatibility run passed on, oldest first (its results:
benchmarks/results/compat-*; pyproject.toml's lower bound is the first)."""

AGENT_SEAM = "elastic_train.agent.torch_seams"
RENDEZVOUS_SEAM = "elastic_train.rendezvous.torch_seams"
WORKER_SEAM = "elastic_train.worker.torch_seams"
CHECKPOINT_SEAM = "elastic_train.checkpoint.torch_seams"
WORKER_SEAMS: tuple[str, ...] = (WORKER_SEAM, CHECKPOINT_SEAM)
"""What a worker process uses of torch's private names: its own, and its checkpoints'."""
SEAMS: tuple[str, ...] = (AGENT_SEAM, RENDEZVOUS_SEAM, *WORKER_SEAMS)

CHECKED = "ELASTIC_TRAIN_TORCH_CHECKED"
"""Set by the launcher for its workers to the torch version it checked: they skip their own
check of that version."""

CACHE_DIR = "ELASTIC_TRAIN_CACHE_DIR"
"""Where passed checks are remembered (``Verdicts``); empty: nowhere, check every time."""

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


class Verdicts:
    """Passed checks remembered in a directory, one small JSON file per key (module doc)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Verdicts:
        """Where ``CACHE_DIR`` says (empty: nowhere), else the user's cache directory."""
        env = os.environ if environ is None else environ
        if CACHE_DIR in env:
            return cls(Path(env[CACHE_DIR]) if env[CACHE_DIR] else None)
        base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return cls(Path(base) / "elastic_train")

    @staticmethod
    def key(seams: Iterable[str]) -> str:
        """What a check's result depends on: the installed torch (version, build, path, and
        its ``version.py``'s time and size, which a reinstall rewrites) and the source of
        ``seams`` and of the checker itself."""
        import torch

        torch_dir = Path(torch.__file__).resolve().parent
        stat = (torch_dir / "version.py").stat()
        digest = hashlib.sha256()
        for part in (str(torch.__version__), str(getattr(torch.version, "git_version", "")),
                     str(torch_dir), str(stat.st_mtime_ns), str(stat.st_size), sys.version):
            digest.update(part.encode() + b"\0")
        sources = [_PACKAGE.joinpath(*seam.split(".")[1:]).with_suffix(".py")
                   for seam in seams]
        for path in [*sources, _PACKAGE / "torch_private.py", Path(__file__)]:
            digest.update(path.read_bytes() + b"\0")
        return digest.hexdigest()[:32]

    def _path(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / f"torch-check-{key}.json"

    def passed(self, key: str) -> tuple[bool, str | None]:
        """(whether a check with ``key`` passed before, the notice it returned)."""
        path = self._path(key)
        if path is None:
            return False, None
        try:
            verdict = json.loads(path.read_text())
        except (OSError, ValueError):
            return False, None
        if not isinstance(verdict, dict) or verdict.get("passed") is not True:
            return False, None
        notice = verdict.get("notice")
        return True, notice if isinstance(notice, str) else None

    def remember(self, key: str, notice: str | None) -> None:
        """Record a passed check (atomically; a directory that cannot be written: not
        remembered, the next start checks again)."""
        path = self._path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.{os.getpid()}")
            partial.write_text(json.dumps({"passed": True, "notice": notice}))
            os.replace(partial, path)
        except OSError as exc:
            log.debug("the torch check's verdict is not remembered in %s: %s",
                      self.directory, exc)


def check(seams: Iterable[str] = SEAMS, verdicts: Verdicts | None = None) -> str | None:
    """Check the installed torch against ``seams``: raise ``TorchUnsupportedError`` (its
    one line) if a name is missing or reshaped, else return ``notice_line`` (or None).
    A check that passed before with the same key (``Verdicts.key``) is not done again;
    ``verdicts`` defaults to ``Verdicts.from_environment()``."""
    seams = tuple(seams)
    verdicts = Verdicts.from_environment() if verdicts is None else verdicts
    key = Verdicts.key(seams)
    passed, notice = verdicts.passed(key)
    if passed:
        log.debug("torch check: passed before for this torch and these seams (%s)",
                  verdicts.directory)
        return notice
    notice = _check_now(seams)
    verdicts.remember(key, notice)
    return notice


def _check_now(seams: tuple[str, ...]) -> str | None:
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

    from elastic_train.live.environment import set_for_workers

    line = check()
    if line:
        print(f"elastic-train: {line}", file=sys.stderr, flush=True)
    set_for_workers(CHECKED, torch.__version__)


def check_in_worker(rank: int, environ: Mapping[str, str] | None = None) -> None:
    """A worker's check of its own seams (``WORKER_SEAMS``), once per process and skipped
    where its launcher checked this torch; the notice from rank 0 only. Raises
    ``TorchUnsupportedError``."""
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
    line = check(WORKER_SEAMS)
    _checked_here = version
    if line and rank == 0:
        print(f"elastic_train: {line}", file=sys.stderr, flush=True)
