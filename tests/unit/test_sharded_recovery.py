"""The pure piece of a sharded model's live recovery (worker/sharded_recovery.py): where a
part held by one rank overlaps the part another rank needs in the new mesh. The exchange
itself runs in real jobs (tests/integration/test_sharded_jobs.py)."""

from __future__ import annotations

from elastic_train.worker.sharded_recovery import _overlap


def test_rows_held_in_a_mesh_of_two_fill_a_rank_of_a_mesh_of_three() -> None:
    # a (10, 4) tensor: rank 1 of 2 held rows 5-9; rank 1 of 3 needs rows 4-7
    mine, theirs = _overlap([4, 0], [4, 4], [5, 0], [5, 4])  # type: ignore[misc]
    assert mine == (slice(1, 4), slice(0, 4))
    assert theirs == (slice(0, 3), slice(0, 4))


def test_parts_that_only_touch_do_not_overlap() -> None:
    assert _overlap([0], [5], [5], [5]) is None
    assert _overlap([3, 0], [2, 2], [0, 2], [10, 2]) is None  # same rows, other columns


def test_a_part_inside_the_region() -> None:
    mine, theirs = _overlap([0], [10], [2], [3])  # type: ignore[misc]
    assert mine == (slice(2, 5),) and theirs == (slice(0, 3),)
