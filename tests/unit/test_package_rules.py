"""Rules of the package's shape that a reader relies on, checked on its source (ast).

- Collectives are made in worker/distributed.py only (and DDP's gradient all-reduce in
  worker/data_parallel.py) (every rank must reach them in the same
  order: that is reviewable only if they sit in one place).
- The run directory's layout is spelled in rundir.py only.
- The worker's protocol lives in worker/runtime.py, which knows neither of its two loops.
- The two processes stay apart: ``worker/`` imports nothing of ``agent/``; ``agent/``
  imports of ``worker/`` only what it launches (the entrypoints) and the environment reader
  it checks before launching; ``live/``, the contract both share, imports neither.
- Every folder and top-level module has its place in one order (``LAYERS``, lowest first):
  it imports only what comes before it (imports inside functions count too), so there is
  no cycle between them and a reader knows which way every arrow points.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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
    if relative(path) in ("worker/distributed.py", "worker/data_parallel.py"):  # + DDP's hooks
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
    runtime = imported_modules(ast.parse((PACKAGE / "worker/runtime.py").read_text()))
    for upper in ("trainer", "session", "train", "cli", "launch", "metrics", "progress"):
        assert f"elastic_train.{upper}" not in runtime, upper
    users = {relative(p) for p in SOURCES
             if "elastic_train.worker.runtime" in imported_modules(ast.parse(p.read_text()))}
    assert users == {"worker/trainer.py", "worker/session.py"}


def package_imports(folder: str) -> dict[str, set[str]]:
    """{file under elastic_train/FOLDER: the elastic_train modules it imports}."""
    return {relative(p): {m for m in imported_modules(ast.parse(p.read_text()))
                          if m.startswith("elastic_train.")}
            for p in SOURCES if relative(p).startswith(f"{folder}/")}


def reaching(folder: str, into: str) -> list[str]:
    return sorted(f"{source} imports {module}"
                  for source, modules in package_imports(folder).items()
                  for module in modules if module.startswith(f"elastic_train.{into}."))


AGENT_MAY_IMPORT_FROM_WORKER = {
    "elastic_train.worker.entrypoints", "elastic_train.worker.script_worker",  # it launches
    "elastic_train.worker.env",  # the environment its workers will read, checked first
}


def test_the_worker_imports_nothing_of_the_agent() -> None:
    assert reaching("worker", "agent") == []


def test_the_agent_imports_of_the_worker_only_what_it_launches() -> None:
    found = [line for line in reaching("agent", "worker")
             if not any(line.endswith(f" imports {m}") or f" imports {m}." in line
                        for m in AGENT_MAY_IMPORT_FROM_WORKER)]
    assert found == []


@pytest.mark.parametrize("side", ["agent", "worker"])
def test_the_live_contract_imports_neither_side(side: str) -> None:
    assert reaching("live", side) == []


def test_the_layering_checks_see_the_packages() -> None:
    assert package_imports("agent") and package_imports("worker") and package_imports("live")
    assert "elastic_train.worker.entrypoints" in {m for ms in package_imports("agent").values()
                                                  for m in ms}


def test_the_agent_names_the_built_in_jobs_entry_point_without_importing_its_code() -> None:
    """torch pickles the entry point by reference for the forkserver (worker/entrypoints.py):
    naming it must not import the training code into the agent (1.4 s of a rejoining
    agent's start, on its way to the rendezvous)."""
    code = ("import pickle, sys\n"
            "from elastic_train.worker.entrypoints import run_worker\n"
            "named = pickle.loads(pickle.dumps(run_worker))\n"
            "print(named is run_worker, 'elastic_train.worker.train' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["True", "False"]


def test_the_launcher_imports_no_torch_before_it_starts_the_workers_server() -> None:
    """The forkserver imports torch while the launcher does (agent/worker_start.py): a
    module-level import of torch on the launcher's path serialises the two (a torch seam
    imported at load cost 0.45 s of every job's start, bench.py's 'job start')."""
    code = ("import sys, elastic_train.cli, elastic_train.agent.launch, "
            "elastic_train.agent.worker_start; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


LAYERS = (
    # the ground: no elastic_train import, or errors only
    "errors", "process_exit", "thread_priority", "torch_private", "network", "batch_shares",
    "config_file", "config", "config_options",
    # what a process is made of, torch-free where it says so
    "events", "live", "tasks", "torch_compat", "integrity",
    # services: the rendezvous (agent side), checkpoints, the run directory, what users see
    "rendezvous", "checkpoint", "rundir", "observe",
    # the two processes, the worker below the agent that launches it
    "worker", "agent",
    # the entry points
    "cli", "train", "__main__",
)
"""Every unit of the package (a folder, or a module at its top), lowest first: a unit imports
only units before it. The package's root (``elastic_train/__init__.py``: the public names,
loaded on first use) is above them all; importing its ``__version__`` is no arrow."""


def unit_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def arrows_against_the_layers(sources: dict[str, set[str]]) -> list[str]:
    """``FILE imports MODULE`` for every import of a unit that is not below the file's own
    unit (``sources``: each file, relative to the package, and the modules it imports)."""
    rank = {unit: i for i, unit in enumerate(LAYERS)}
    found = []
    for source, modules in sorted(sources.items()):
        own = unit_of(PACKAGE / source)
        if own == "__init__":  # the package's root
            continue
        seen = set()
        for module in sorted(modules):  # the shortest name of a unit first
            parts = module.split(".")
            if parts[0] != "elastic_train" or len(parts) < 2 or parts[1] == "__version__" \
                    or parts[1] == own or parts[1] in seen:
                continue
            target = parts[1]
            seen.add(target)
            if target not in rank:
                found.append(f"{source} imports {module} (a unit LAYERS does not name)")
            elif rank[target] >= rank[own]:
                found.append(f"{source} imports {module} ({own} may import only units "
                             f"before it in LAYERS)")
    return found


def test_every_unit_of_the_package_has_its_place_in_the_layers() -> None:
    units = {unit_of(p) for p in SOURCES} - {"__init__"}
    assert units == set(LAYERS), (sorted(units - set(LAYERS)), sorted(set(LAYERS) - units))


def test_every_import_points_down_the_layers() -> None:
    sources = {relative(p): {m for m in imported_modules(ast.parse(p.read_text()))
                             if m.startswith("elastic_train.")} for p in SOURCES}
    assert arrows_against_the_layers(sources) == []


def test_an_import_up_the_layers_is_found() -> None:
    bad = {"checkpoint/manager.py": {"elastic_train.worker.distributed",
                                      "elastic_train.events.log", "elastic_train.__version__"},
           "rendezvous/forget.py": {"elastic_train.agent.torch_seams"},
           "observe/metrics.py": {"elastic_train.observe.events", "elastic_train.nowhere.x"}}
    assert arrows_against_the_layers(bad) == [
        "checkpoint/manager.py imports elastic_train.worker.distributed (checkpoint may "
        "import only units before it in LAYERS)",
        "observe/metrics.py imports elastic_train.nowhere.x (a unit LAYERS does not name)",
        "rendezvous/forget.py imports elastic_train.agent.torch_seams (rendezvous may import "
        "only units before it in LAYERS)"]


MAX_LINES = 500
STILL_LONGER = {  # each may only shrink, until it is split (issue 40)
    "checkpoint/manager.py": 550, "worker/runtime.py": 611, "worker/session.py": 603,
    "agent/live_agent.py": 593,
    "agent/launch.py": 551, "live/coordination.py": 531,
}
"""Modules over ``MAX_LINES`` today, with their length now: none may grow, none may join."""


def test_no_module_is_over_500_lines_and_the_longer_ones_only_shrink() -> None:
    lengths = {relative(p): len(p.read_text().splitlines()) for p in SOURCES}
    over = {name: n for name, n in lengths.items() if n > MAX_LINES}
    grown = {name: (n, STILL_LONGER.get(name)) for name, n in over.items()
             if n > STILL_LONGER.get(name, MAX_LINES)}
    assert grown == {}, f"split these (at most {MAX_LINES} lines a module): {grown}"
    done = sorted(set(STILL_LONGER) - set(over))
    assert done == [], f"{done} are at most {MAX_LINES} lines now: drop them from STILL_LONGER"
