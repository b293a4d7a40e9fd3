"""On the agent side (agent/, rendezvous/) only each folder's seam (agent/torch_seams.py,
rendezvous/torch_seams.py) touches torch's private names or replaces torch's globals; every
other module calls it (checked on the source, ast, and on the classes, imported).

What counts as touching:

- importing a private name of torch (``from torch... import _X``, ``import torch._C``);
- assigning to (or ``setattr``/``delattr`` on) an attribute of a name bound to torch by an
  import (``api.LocalElasticAgent = ...``, ``MultiprocessContext._close = ...``);
- a private attribute (``x._name``, ``getattr(x, "_name")``) that the module itself does
  not define (a ``def``, a class attribute, a ``self._name =``, a module-level name):
  someone else's private, torch's unless ``NOT_TORCH`` says whose;
- a private name that a class of the module shares with a torch class of its MRO (an
  override of torch's private hook, or torch's instance attribute read as ``self._x``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Iterable
from pathlib import Path

import pytest

from elastic_train.torch_private import _assigns

PACKAGE = Path(__file__).resolve().parents[2] / "elastic_train"
SEAMS = {"agent": "agent/torch_seams.py", "rendezvous": "rendezvous/torch_seams.py"}
SOURCES = sorted(p for folder in SEAMS for p in (PACKAGE / folder).rglob("*.py")
                 if p.relative_to(PACKAGE).as_posix() not in SEAMS.values())
NOT_TORCH = {
    "agent/worker_start.py": {"_forkserver", "_forkserver_pid", "_stop"},  # CPython's forkserver
    "agent/launch.py": {"_actions"},  # argparse's
    "agent/launch_options.py": {"_actions"},  # argparse's
    "rendezvous/etcd_v3/watch.py": {"_connection", "_fp", "_sock"},  # urllib3's, http.client's
}


def relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def torch_names(tree: ast.AST) -> set[str]:
    """Names that imports bind to torch or something of torch's."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name.split(".")[0]) for a in node.names
                         if a.name == "torch" or a.name.startswith("torch."))
        elif isinstance(node, ast.ImportFrom) and node.module \
                and (node.module == "torch" or node.module.startswith("torch.")):
            names.update(a.asname or a.name for a in node.names)
    return names


def private_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name} (line {node.lineno})" for a in node.names
                      if a.name.split(".")[0] == "torch"
                      and any(private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and node.module \
                and node.module.split(".")[0] == "torch":
            if any(private(p) for p in node.module.split(".")):
                found.append(f"from {node.module} import ... (line {node.lineno})")
            found += [f"from {node.module} import {a.name} (line {node.lineno})"
                      for a in node.names if private(a.name)]
    return found


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def torch_global_writes(tree: ast.AST) -> list[str]:
    """Assignments to (and setattr/delattr on) attributes of names bound to torch."""
    bound = torch_names(tree)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("setattr", "delattr") and node.args \
                and _root(node.args[0]) in bound:
            found.append(f"{node.func.id}({ast.unparse(node.args[0])}, ...) "
                         f"(line {node.lineno})")
        found += [f"{ast.unparse(t)} = ... (line {node.lineno})" for t in targets
                  if isinstance(t, ast.Attribute) and _root(t) in bound]
    return found


def defined_privates(tree: ast.AST) -> set[str]:
    """Private names the module defines: functions, classes, assigned names and attributes
    of its own (``self._x = ...``, class attributes)."""
    bound = torch_names(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and _root(node) not in bound:
            names.add(node.attr)
    return {n for n in names if private(n)}


def private_references(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of every private attribute the module reads, calls or writes."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            found.append((node.attr, node.lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and private(node.args[1].value):
            found.append((node.args[1].value, node.lineno))
    return found


def foreign_privates(tree: ast.AST, not_torch: Iterable[str] = ()) -> list[str]:
    """Private attributes the module uses but does not define (and no other owner is
    declared for): torch's."""
    own = defined_privates(tree) | set(not_torch)
    return sorted({f"{name} (line {line})" for name, line in private_references(tree)
                   if name not in own})


def shared_with_torch(classes: Iterable[type], names: Iterable[str]) -> list[str]:
    """``Class._name`` for each of ``names`` that a class shares with a torch class of its
    MRO (torch defines it, or assigns ``self._name`` in its source)."""
    found = []
    names = sorted(set(names))
    for cls in classes:
        torch_bases = [k for k in inspect.getmro(cls)[1:]
                       if k.__module__.split(".")[0] == "torch"]
        for name in names:
            if any(name in vars(k) or _assigns(k, name) for k in torch_bases):
                found.append(f"{cls.__name__}.{name}")
    return found


def module_name(path: Path) -> str:
    return "elastic_train." + relative(path)[:-3].replace("/", ".")


def violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = private_imports(tree) + torch_global_writes(tree) + \
        foreign_privates(tree, NOT_TORCH.get(relative(path), ()))
    module = importlib.import_module(module_name(path))
    classes = [c for c in vars(module).values()
               if inspect.isclass(c) and c.__module__ == module.__name__]
    names = defined_privates(tree) | {n for n, _ in private_references(tree)}
    return found + shared_with_torch(classes, names)


@pytest.mark.parametrize("path", SOURCES, ids=[relative(p) for p in SOURCES])
def test_only_the_seam_touches_torch_s_privates(path: Path) -> None:
    seam = SEAMS[relative(path).split("/")[0]]
    assert violations(path) == [], f"{relative(path)}: move these into {seam}"


BAD = """\
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _BackendRendezvousStateHolder
from torch.distributed.launcher import api
import torch.distributed.elastic.multiprocessing.api as mp
import torch._C
api.LocalElasticAgent = Mine
setattr(mp, "start_processes", replacement)
original = mp.MultiprocessContext._close

def forget(handler, holder):
    holder._sanitize()
    return getattr(handler, "_heartbeat_lock", None)
"""
GOOD = """\
import torch.distributed as dist
from elastic_train.agent import torch_seams
_CACHE = {}

class Mine:
    _shared = 1

    def __init__(self):
        self._count = 0

    def _helper(self):
        self._count += 1
        return self._shared, _CACHE, getattr(self, "_count")

def build(parser):
    store = dist.TCPStore("h", 1)
    store.x = 1
    return [a for a in parser._actions]
"""


def test_the_rule_finds_what_it_looks_for() -> None:
    bad = ast.parse(BAD)
    assert private_imports(bad) == [
        "from torch.distributed.elastic.rendezvous.dynamic_rendezvous import "
        "_BackendRendezvousStateHolder (line 1)", "import torch._C (line 4)"]
    assert torch_global_writes(bad) == ["api.LocalElasticAgent = ... (line 5)",
                                        "setattr(mp, ...) (line 6)"]
    assert foreign_privates(bad) == ["_close (line 7)", "_heartbeat_lock (line 11)",
                                     "_sanitize (line 10)"]
    good = ast.parse(GOOD)
    assert private_imports(good) == [] and torch_global_writes(good) == []
    assert foreign_privates(good) == ["_actions (line 18)"]
    assert foreign_privates(good, not_torch={"_actions"}) == []


def test_the_rule_finds_torch_s_privates_in_a_subclass() -> None:
    source = """\
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

class Agent(LocalElasticAgent):
    def _start_workers(self, worker_group):
        self._mine = self._pcontext
        return super()._start_workers(worker_group)
"""
    namespace: dict[str, object] = {"__name__": "snippet"}
    exec(compile(source, "snippet", "exec"), namespace)  # our own snippet
    tree = ast.parse(source)
    names = defined_privates(tree) | {n for n, _ in private_references(tree)}
    assert foreign_privates(tree) == ["_pcontext (line 5)"]
    assert shared_with_torch([namespace["Agent"]], names) == [  # type: ignore[list-item]
        "Agent._pcontext", "Agent._start_workers"]
