"""Unit tests of the resumable, resize-aware sampler (single process, CPU, a few seconds).

The properties checked are the ones exact resume rests on: every epoch covers each sample
exactly once except the dropped tail, shards of a global batch partition it, and a resume
from a saved state — at the same or another world size — continues the very same sequence
of global batches.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from elastic_train.batch_shares import shard_bounds
from elastic_train.worker.sampler import (
    ElasticBatchSampler,
    GlobalBatch,
    ResumableSampler,
    epoch_order,
)

# --- helpers ------------------------------------------------------------------------------


def _checkpointed(state: dict[str, Any]) -> dict[str, Any]:
    """What a state dict looks like after a trip through a checkpoint file."""
    return json.loads(json.dumps(state))


@st.composite
def _plans(draw: st.DrawFn) -> dict[str, int]:
    """A dataset, a global batch, two world sizes, a run length and a resume point."""
    n = draw(st.integers(1, 500))
    batch = draw(st.integers(1, n))
    world = draw(st.integers(1, min(8, batch)))
    world_after = draw(st.integers(1, min(8, batch)))
    per_epoch = n // batch
    epochs = draw(st.integers(1, 3))
    total = per_epoch * epochs
    resume_at = draw(st.integers(0, total))
    seed = draw(st.integers(0, 2**31))
    return {"n": n, "batch": batch, "world": world, "world_after": world_after,
            "total": total, "resume_at": resume_at, "seed": seed}


def _run(n: int, seed: int, batch: int, steps: int) -> list[GlobalBatch]:
    sampler = ResumableSampler(n, seed)
    return [sampler.next_batch(batch) for _ in range(steps)]


def _check_shards(batch: GlobalBatch, world: int) -> list[int]:
    """The shards of one batch partition it in rank order, sizes within one; return them."""
    shards = [batch.shard(rank, world).tolist() for rank in range(world)]
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    flat = [i for s in shards for i in s]
    assert flat == batch.indices.tolist()          # together they are the batch, in order
    assert len(set(flat)) == len(flat)             # and pairwise disjoint
    return flat


# --- ResumableSampler: coverage, sharding and resume -------------------------------------


@settings(max_examples=80, deadline=None, database=None)
@given(_plans())
def test_resume_at_any_step_and_world_size_replays_the_same_batches(plan: dict[str, int]
                                                                     ) -> None:
    n, batch, seed = plan["n"], plan["batch"], plan["seed"]
    total, resume_at = plan["total"], plan["resume_at"]
    reference = _run(n, seed, batch, total)

    first = ResumableSampler(n, seed)
    resumed_run = [first.next_batch(batch) for _ in range(resume_at)]
    state = _checkpointed(first.state_dict())
    second = ResumableSampler(n, seed)             # a new process after the restart
    second.load_state_dict(state)
    resumed_run += [second.next_batch(batch) for _ in range(total - resume_at)]

    assert len(resumed_run) == len(reference)
    for ours, theirs in zip(resumed_run, reference, strict=True):
        assert (ours.epoch, ours.offset) == (theirs.epoch, theirs.offset)
        assert torch.equal(ours.indices, theirs.indices)

    # Every epoch, as seen by the ranks of both incarnations together.
    per_epoch = n // batch
    tail = n % batch
    by_epoch: dict[int, list[int]] = {}
    for step, gb in enumerate(resumed_run):
        world = plan["world"] if step < resume_at else plan["world_after"]
        assert len(gb.indices) == batch
        by_epoch.setdefault(gb.epoch, []).extend(_check_shards(gb, world))
    assert sorted(by_epoch) == list(range(total // per_epoch))
    for epoch, seen in by_epoch.items():
        order = epoch_order(n, seed, epoch).tolist()
        assert len(seen) == len(set(seen)) == per_epoch * batch      # no repeats
        assert seen == order[:per_epoch * batch]                     # in the epoch's order
        dropped = set(range(n)) - set(seen)
        assert len(dropped) == tail
        assert dropped == set(order[n - tail:])                      # the tail of the order
        assert set(seen) | dropped == set(range(n))


@settings(max_examples=60, deadline=None, database=None)
@given(st.integers(1, 500), st.data())
def test_batches_are_consecutive_slices_and_the_epoch_rolls_when_short(n: int,
                                                                      data: st.DataObject
                                                                      ) -> None:
    batch = data.draw(st.integers(1, n))
    sampler = ResumableSampler(n, seed=3)
    per_epoch = n // batch
    for step in range(2 * per_epoch + 1):
        gb = sampler.next_batch(batch)
        epoch, slot = divmod(step, per_epoch)
        assert gb.epoch == epoch
        assert gb.offset == slot * batch
        assert sampler.state_dict()["consumed"] == (slot + 1) * batch
        assert sampler.state_dict()["epoch"] == epoch


def test_a_batch_larger_than_the_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match="global batch 11 exceeds the 10 samples"):
        ResumableSampler(10, 0).next_batch(11)


def test_an_empty_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        ResumableSampler(0, 0)


def test_state_dict_holds_epoch_consumed_seed_and_size() -> None:
    sampler = ResumableSampler(10, seed=5)
    for _ in range(4):
        sampler.next_batch(3)
    assert sampler.state_dict() == {"epoch": 1, "consumed": 3, "seed": 5, "num_samples": 10}


@pytest.mark.parametrize("change", [{"num_samples": 11}, {"seed": 6}])
def test_loading_the_state_of_another_dataset_or_seed_is_refused(change: dict[str, int]
                                                                  ) -> None:
    donor = ResumableSampler(10, seed=5)
    donor.next_batch(3)
    state = {**donor.state_dict(), **change}
    target = ResumableSampler(10, seed=5)
    with pytest.raises(ValueError, match=r"sampler state is for \d+ samples with seed \d+"):
        target.load_state_dict(state)
    assert target.state_dict()["consumed"] == 0          # nothing was half-loaded


# --- epoch_order and shard_bounds ---------------------------------------------------------


@settings(max_examples=60, deadline=None, database=None)
@given(st.integers(1, 500), st.integers(0, 2**40), st.integers(0, 50))
def test_epoch_order_is_a_permutation_and_repeatable(n: int, seed: int, epoch: int) -> None:
    order = epoch_order(n, seed, epoch)
    assert sorted(order.tolist()) == list(range(n))
    assert torch.equal(order, epoch_order(n, seed, epoch))


def test_epoch_order_differs_between_epochs_and_seeds() -> None:
    orders = {tuple(epoch_order(100, seed, epoch).tolist())
              for seed in (0, 1, 2) for epoch in (0, 1, 2)}
    assert len(orders) == 9
    # Equal to the sampler's own order, so the audit tools may recompute it.
    sampler = ResumableSampler(100, 1)
    assert torch.equal(sampler.order(2), epoch_order(100, 1, 2))


@settings(max_examples=100, deadline=None, database=None)
@given(st.integers(0, 1000), st.integers(1, 64))
def test_shard_bounds_tile_the_batch(batch: int, world: int) -> None:
    bounds = [shard_bounds(batch, rank, world) for rank in range(world)]
    assert bounds[0][0] == 0
    assert bounds[-1][1] == batch
    for (_, stop), (start, _) in itertools.pairwise(bounds):
        assert stop == start
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert all(size >= 0 for size in sizes)


@pytest.mark.parametrize(("rank", "world"), [(-1, 4), (4, 4), (5, 4), (0, 0)])
def test_shard_bounds_rejects_ranks_outside_the_world(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match=f"rank {rank} outside world of {world}"):
        shard_bounds(8, rank, world)


# --- ElasticBatchSampler as a DataLoader batch sampler ------------------------------------


def _loader_indices(sampler: ElasticBatchSampler, n: int) -> list[list[int]]:
    loader = DataLoader(list(range(n)), batch_sampler=sampler)
    return [batch.tolist() for batch in loader]


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_batch_sampler_resumed_mid_epoch_yields_exactly_the_rest_of_the_epoch(
        data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 300), label="n")
    batch = data.draw(st.integers(1, n), label="batch")
    world = data.draw(st.integers(1, min(4, batch)), label="world")
    epoch = data.draw(st.integers(0, 3), label="epoch")
    per_epoch = n // batch
    done = data.draw(st.integers(0, per_epoch), label="advanced")
    seed = data.draw(st.integers(0, 1000), label="seed")

    before = ElasticBatchSampler(n, batch, rank=0, world_size=1, seed=seed)
    before.set_epoch(epoch)
    for _ in range(done):
        before.advance()
    state = _checkpointed(before.state_dict())

    seen: list[int] = []
    for rank in range(world):
        after = ElasticBatchSampler(n, batch, rank=rank, world_size=world, seed=seed)
        after.load_state_dict(state)
        after.set_epoch(epoch)                      # the epoch being resumed: offset kept
        assert after.epoch == epoch
        assert len(after) == per_epoch - done
        batches = _loader_indices(after, n)
        assert len(batches) == len(after)
        lo, hi = shard_bounds(batch, rank, world)
        assert all(len(b) == hi - lo for b in batches)
        seen.extend(i for b in batches for i in b)

    order = epoch_order(n, seed, epoch).tolist()
    remaining = order[done * batch:per_epoch * batch]
    assert len(seen) == len(set(seen))
    assert sorted(seen) == sorted(remaining)


def test_set_epoch_keeps_the_offset_of_the_same_epoch_and_resets_for_another() -> None:
    sampler = ElasticBatchSampler(20, 4, rank=0, world_size=1, seed=1)
    sampler.set_epoch(2)
    sampler.advance()
    sampler.advance()
    assert len(sampler) == 3
    sampler.set_epoch(2)
    assert sampler.state_dict()["consumed"] == 8
    assert len(sampler) == 3
    assert _loader_indices(sampler, 20) == [
        epoch_order(20, 1, 2)[i:i + 4].tolist() for i in (8, 12, 16)]
    sampler.set_epoch(3)
    assert sampler.epoch == 3
    assert sampler.state_dict()["consumed"] == 0
    assert len(sampler) == 5
    assert _loader_indices(sampler, 20) == [
        epoch_order(20, 1, 3)[i:i + 4].tolist() for i in range(0, 20, 4)]


def test_len_counts_the_remaining_batches_with_the_tail_dropped() -> None:
    sampler = ElasticBatchSampler(23, 5, rank=1, world_size=2, seed=0)
    assert len(sampler) == 4
    for remaining in (3, 2, 1, 0):
        sampler.advance()
        assert len(sampler) == remaining
        assert len(_loader_indices(sampler, 23)) == remaining


def test_batch_sampler_refuses_a_state_of_another_dataset() -> None:
    donor = ElasticBatchSampler(20, 4, rank=0, world_size=1, seed=1)
    with pytest.raises(ValueError, match="sampler state is for 20 samples"):
        ElasticBatchSampler(21, 4, rank=0, world_size=1, seed=1).load_state_dict(
            donor.state_dict())
