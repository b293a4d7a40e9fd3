"""A hand-written loop's sharded model kept across re-formations (worker/loop_sharding.py),
in one process on a gloo world of one: the skeleton, the model sharded again in the same
object (torch_seams.become), the optimizer pointed at its new parameters, and the
forgiving collectives that let a failed step return. The real re-formations run in
tests/integration/test_sharded_jobs.py."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from elastic_train.worker import aborts, data_parallel
from elastic_train.worker.distributed import Group
from elastic_train.worker.loop_sharding import LoopShardedModel, meta_skeleton


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 8, bias=False)
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x) * self.scale


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[Group]:
    monkeypatch.setattr(aborts, "_aborted", None)  # another test may have left an abort
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Group(0, 1, "gloo", torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.arange(12.0).reshape(3, 4) / 10
        model(x).square().mean().backward()
        optimizer.step()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    state, _ = get_state_dict(model, [], options=StateDictOptions(full_state_dict=True))
    return state


def test_the_skeleton_has_the_structure_and_ties_but_no_storage() -> None:
    net = Net()
    net.head.weight = net.blocks[0].weight  # tied
    skeleton = meta_skeleton(net)
    assert all(p.is_meta for p in skeleton.parameters())
    assert skeleton.head.weight is skeleton.blocks[0].weight
    assert [n for n, _ in skeleton.named_parameters()] == [n for n, _ in net.named_parameters()]
    assert skeleton.scale.is_meta and not net.scale.is_meta   # the original is untouched


def test_a_model_sharded_again_in_place_trains_on_as_if_never_rebuilt(
        world_of_one: Group) -> None:
    torch.manual_seed(0)
    loop = LoopShardedModel(Net(), "fsdp", 0, None, rebuildable=True)
    model = loop.shard(world_of_one)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, 3)
    model_state, optim_state = get_state_dict(
        model, [optimizer], options=StateDictOptions(full_state_dict=True))
    old_parameters = {id(p) for p in model.parameters()}

    loop.rebuild(world_of_one, [optimizer])
    gc.collect()             # the old mesh's state freed: nothing may still point at it
    assert loop.model is model                                  # the loop's object
    assert {id(p) for p in model.parameters()}.isdisjoint(old_parameters)
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] == \
        [id(p) for p in model.parameters()]
    assert not optimizer.state                                 # filled by the recovery
    assert torch.equal(model.scale, torch.full((8,), 0.5))     # a buffer nothing loads
    set_state_dict(model, [optimizer], model_state_dict=model_state,
                   optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))
    _train(model, optimizer, 3)

    torch.manual_seed(0)
    reference = LoopShardedModel(Net(), "fsdp", 0, None, rebuildable=False).shard(world_of_one)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _train(reference, reference_optimizer, 6)
    ours, theirs = _weights(model), _weights(reference)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_model_that_cannot_be_copied_says_why_and_is_not_rebuilt() -> None:
    import threading

    net = Net()
    net.lock = threading.Lock()  # type: ignore[assignment]
    loop = LoopShardedModel(net, "fsdp", 0, None, rebuildable=True)
    assert loop.skeleton is None
    assert loop.not_rebuildable is not None
    assert loop.not_rebuildable.startswith("the model cannot be copied to the meta device "
                                           "(TypeError: cannot pickle '_thread.lock' object")


def test_a_forgiving_collective_records_the_first_failure_and_starts_no_other(
        world_of_one: Group) -> None:
    failures = data_parallel.StepFailures()
    run = data_parallel.forgiving_collective(failures)
    out = torch.zeros(3)
    run(lambda: dist.all_reduce(out.add_(2), async_op=True), out)   # a world of one: done
    assert torch.equal(out, torch.full((3,), 2.0)) and failures.error is None

    def broken() -> dist.Work:
        raise RuntimeError("Connection closed by peer")

    run(broken, out)
    assert str(failures.error) == "Connection closed by peer"
    started = []
    run(lambda: started.append(1), out)                       # the step is void already
    assert started == [] and torch.equal(out, torch.zeros(3))
    assert str(failures.take()) == "Connection closed by peer" and failures.error is None
    aborts.abort_collectives("a peer was lost")  # undone by the fixture's monkeypatch
    run(lambda: started.append(1), out)                   # a world being left
    assert started == [] and isinstance(failures.error, aborts.CollectiveAborted)
    assert str(failures.error) == "a peer was lost"
