"""Every private name of torch we rely on still exists in the installed torch, with the
signature we use: declared by each side's seam module, checked here in one place."""

from __future__ import annotations

import importlib

import pytest

from elastic_train.torch_private import Private, missing

SEAMS = ["elastic_train.agent.torch_seams", "elastic_train.worker.torch_seams"]


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
