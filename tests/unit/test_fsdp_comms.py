"""FSDP2's collectives as the worker's seam hands them to torch (worker/torch_seams.py
``fsdp_comms``), run on the installed torch in a one-rank gloo group: the names they call
differ across torch versions (2.13 renamed them), which the compatibility run found on 2.12
(make test-compat; docs/torch-versions.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from elastic_train.worker.torch_seams import fsdp_comms


def test_the_all_gather_and_reduce_scatter_run_on_this_torch(tmp_path: Path) -> None:
    launched: list[tuple[Any, ...]] = []

    def run(launch: Any, *tensors: torch.Tensor) -> None:
        launched.append(tensors)
        launch().wait()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        all_gather, reduce_scatter = fsdp_comms(run)
        group = dist.group.WORLD
        source = torch.arange(6, dtype=torch.float32)
        gathered = all_gather.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
        all_gather(gathered, source, group)
        assert torch.equal(gathered, source)
        reduced = reduce_scatter.allocate((6,), dtype=torch.float32,
                                          device=torch.device("cpu"))
        reduce_scatter(reduced, source * 2, group, dist.ReduceOp.SUM)
        assert torch.equal(reduced, source * 2)
        assert len(launched) == 2
    finally:
        dist.destroy_process_group()
