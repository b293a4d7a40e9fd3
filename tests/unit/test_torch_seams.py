"""Every private name of torch we rely on still exists in the installed torch, with the
signature we use: declared by each side's seam module, checked here in one place."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from elastic_train.torch_private import Private, missing

SEAMS = ["elastic_train.agent.torch_seams", "elastic_train.rendezvous.torch_seams",
         "elastic_train.worker.torch_seams", "elastic_train.checkpoint.torch_seams"]


@pytest.mark.parametrize("seam", SEAMS)
def test_every_private_name_of_torch_we_use_still_exists(seam: str) -> None:
    required = importlib.import_module(seam).REQUIRED
    assert required, f"{seam} declares nothing"
    assert missing(required) == []


def test_the_check_names_the_torch_version_and_what_is_gone() -> None:
    import torch

    gone = Private("torch.nn.parallel", "DistributedDataParallel._no_such_helper", "for a test")
    renamed = Private("torch.nn.parallel", "DistributedDataParallel._ddp_init_helper",
                      "for a test", params=("parameters", "no_such_parameter"))
    instance = Private("torch.nn.parallel", "DistributedDataParallel._comm_hooks", "for a test")
    no_module = Private("torch.no_such_module", "x", "for a test")
    lines = missing([gone, renamed, instance, no_module])
    assert lines[0] == (f"torch {torch.__version__}: torch.nn.parallel.DistributedDataParallel."
                        "_no_such_helper: DistributedDataParallel._no_such_helper is gone "
                        "(elastic_train uses it for a test)")
    assert "_ddp_init_helper: takes (parameters, " in lines[1]
    assert lines[1].endswith("we rely on (parameters, no_such_parameter) (elastic_train uses "
                             "it for a test)")
    assert len(lines) == 3 and "torch.no_such_module does not import" in lines[2]


PACKAGE = Path(__file__).resolve().parents[2] / "elastic_train"
TORCH_OWNERS = ("torch", "dist", "c10d", "distributed_c10d")


def private_torch_uses(source: str, private_names: set[str]) -> list[str]:
    """``torch...._x`` / ``dist._x`` attributes, and any attribute named like one of the
    seam's private names (``ddp.reducer._remove_autograd_hooks()``), in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") \
                or node.attr.startswith("__"):
            continue
        owner = ast.unparse(node.value).split(".")[0]
        if owner in TORCH_OWNERS or node.attr in private_names:
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return sorted(found)


@pytest.mark.parametrize("folder", ["worker", "checkpoint"])
def test_the_worker_and_its_checkpoints_use_torch_privates_only_through_their_seam(
        folder: str) -> None:
    seam = importlib.import_module(f"elastic_train.{folder}.torch_seams")
    names = {p.path.split(".")[-1] for p in seam.REQUIRED if p.path.split(".")[-1][0] == "_"}
    found = {path.name: private_torch_uses(path.read_text(), names)
             for path in sorted((PACKAGE / folder).glob("*.py")) if path.name != "torch_seams.py"}
    assert {name: uses for name, uses in found.items() if uses} == {}


def test_a_private_use_outside_the_seam_is_found() -> None:
    from elastic_train.worker import torch_seams

    names = {p.path.split(".")[-1] for p in torch_seams.REQUIRED if p.path.split(".")[-1][0] == "_"}
    bad = "ddp.reducer._remove_autograd_hooks()\nx = dist.distributed_c10d._world\n"
    assert private_torch_uses(bad, names) == ["ddp.reducer._remove_autograd_hooks (line 1)",
                                              "dist.distributed_c10d._world (line 2)"]


def test_a_model_built_for_its_shapes_skips_only_the_initialisation() -> None:
    """The launcher's pre-check builds the model on meta with ``torch.nn.init`` left out
    (agent/torch_seams.initialisation_skipped): every function it replaces exists in this
    torch, the shapes and dtypes are those of the model built for real, and the functions
    are torch's again afterwards."""
    import torch
    import torch.nn.init as init

    from elastic_train.agent.torch_seams import INIT_FUNCTIONS, initialisation_skipped
    from elastic_train.checkpoint.storage import tensor_shapes
    from elastic_train.tasks.base import TaskContext
    from elastic_train.tasks.loader import load_task

    assert [n for n in INIT_FUNCTIONS if not callable(getattr(init, n, None))] == []
    originals = {n: getattr(init, n) for n in INIT_FUNCTIONS}
    task = load_task("gpt", TaskContext({"corpus_max_bytes": "20000"}, 0, Path("/nonexistent")))
    with torch.device("meta"), initialisation_skipped():
        assert init.normal_ is not originals["normal_"]
        skipped = tensor_shapes(task.build_model().state_dict())
    assert {n: getattr(init, n) for n in INIT_FUNCTIONS} == originals
    assert skipped == tensor_shapes(task.build_model().state_dict())
    assert len(skipped) > 10


def test_torchs_failure_formatting_is_warmed_once_by_a_thread_started_before_the_workers(
        ) -> None:
    """A worker killed in the job's first seconds must not wait for the formatter's import
    of torch._dynamo (agent/torch_seams.failure_logging_warmed): launch.py starts it before
    torch's launcher starts any worker, once per process."""
    import inspect
    import sys

    from elastic_train.agent import launch
    from elastic_train.agent.torch_seams import failure_logging_warmed

    thread = failure_logging_warmed()
    assert failure_logging_warmed() is thread and thread.name == "import-torch-dynamo"
    thread.join(120)
    assert not thread.is_alive() and "torch._dynamo" in sys.modules
    source = inspect.getsource(launch._start_agent)
    assert source.index("failure_logging_warmed()") < source.index("elastic_launch(config")
