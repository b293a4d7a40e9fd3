"""Rules of the package's shape that a reader relies on, checked on its source (ast).

- Collectives are made in distributed.py only (every rank must reach them in the same
  order: that is reviewable only if they sit in one place).
- The run directory's layout is spelled in rundir.py only.
- The worker's protocol lives in runtime.py, which knows neither of its two loops.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "elastic_train"
SOURCES = sorted(PACKAGE.rglob("*.py"))
COLLECTIVES = {"all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object",
               "gather", "scatter", "reduce", "reduce_scatter", "all_to_all", "send", "recv",
               "broadcast_object_list", "monitored_barrier"}
LAYOUT_NAMES = {"checkpoints", "events.jsonl", "samples"}


def relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def collective_calls(tree: ast.AST) -> list[str]:
    """``dist.<collective>(...)`` and ``torch.distributed.<collective>(...)`` calls."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed"):
                found.append(f"{owner}.{node.func.attr} (line {node.lineno})")
    return found


def layout_joins(tree: ast.AST) -> list[str]:
    """``something / "checkpoints"`` (or events.jsonl, samples) path joins."""
    return [f"/ {node.right.value!r} (line {node.lineno})" for node in ast.walk(tree)
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
            and isinstance(node.right, ast.Constant) and node.right.value in LAYOUT_NAMES]


def imported_modules(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("path", SOURCES, ids=[relative(p) for p in SOURCES])
def test_collectives_are_made_in_distributed_only(path: Path) -> None:
    if relative(path) == "distributed.py":
        return
    assert collective_calls(ast.parse(path.read_text())) == [], relative(path)


@pytest.mark.parametrize("path", SOURCES, ids=[relative(p) for p in SOURCES])
def test_the_run_dir_layout_is_spelled_in_rundir_only(path: Path) -> None:
    if relative(path) == "rundir.py":
        return
    tree = ast.parse(path.read_text())
    assert layout_joins(tree) == [], relative(path)
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert "events.jsonl" not in strings, relative(path)


def test_the_checks_find_what_they_look_for() -> None:
    bad = ast.parse("import torch.distributed as dist\n"
                    "dist.all_reduce(t)\ntorch.distributed.barrier()\n"
                    "p = run_dir / 'checkpoints'\nq = root / 'events.jsonl'\n")
    assert collective_calls(bad) == ["dist.all_reduce (line 2)",
                                     "torch.distributed.barrier (line 3)"]
    assert layout_joins(bad) == ["/ 'checkpoints' (line 4)", "/ 'events.jsonl' (line 5)"]
    good = ast.parse("distributed.barrier(group)\nx = store.barrier()\np = layout.checkpoints\n")
    assert collective_calls(good) == [] and layout_joins(good) == []


def test_the_runtime_knows_neither_of_its_loops_and_only_they_use_it() -> None:
    runtime = imported_modules(ast.parse((PACKAGE / "runtime.py").read_text()))
    for upper in ("trainer", "session", "train", "cli", "launch", "metrics", "progress"):
        assert f"elastic_train.{upper}" not in runtime, upper
    users = {relative(p) for p in SOURCES
             if "elastic_train.runtime" in imported_modules(ast.parse(p.read_text()))}
    assert users == {"trainer.py", "session.py"}
