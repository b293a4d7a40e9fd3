"""A full run directory, for real: a tmpfs of a few kilobytes filled to the last byte.

What the fault campaign found on a full disk (tests/chaos: ``disk_full``): workers crashed
writing the event log and the sample records, and a writer claim written while the disk
was full was left empty, read as a world started from scratch, and superseded every
checkpoint (none verified; the job died). Here: the logs hold their lines until there is
space and lose none; a claim waits for space and is never left empty or torn.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_train.checkpoint import fence as fence_module
from elastic_train.checkpoint.fence import WriterFence
from elastic_train.events.line_file import LineFile
from tests.chaos import disk as chaos_disk


@contextlib.contextmanager
def small_disk(path: Path) -> Iterator[Path]:
    """A tmpfs of 64 KiB (chaos/disk.py): root only."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("mounting a tmpfs needs root (CI runs the suite as root)")
        pytest.skip("mounting a tmpfs needs root")
    with chaos_disk.small_disk(path, "64k") as mounted:
        yield mounted


def test_a_log_on_a_full_disk_keeps_its_lines_and_writes_them_once_there_is_space(
        tmp_path: Path) -> None:
    """The disk fills in the middle of a line (4 KiB left, lines of ~100 bytes): the line
    is cut off again and held with the ones after it; once there is space every line is
    there once, in order, none torn (the fault campaign found a step's record twice, and
    torn event lines, where a buffered file wrote again what it had kept)."""
    with small_disk(tmp_path / "disk") as disk:
        log = LineFile(disk / "events.jsonl", "the event log")
        log.write(json.dumps({"n": 0}))
        gap = disk / "gap"
        gap.write_bytes(b"\0" * 4096)
        ballast = chaos_disk.fill(disk)
        gap.unlink()  # 4 KiB free: some lines fit, one is cut, the rest wait
        for n in range(1, 200):
            log.write(json.dumps({"n": n, "pad": "x" * 80}))
        ballast.unlink()
        log.write(json.dumps({"n": 200}))
        log.close()
        lines = (disk / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["n"] for line in lines] == list(range(201))


def test_a_claim_on_a_full_disk_waits_for_space_and_is_never_left_empty(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with small_disk(tmp_path / "disk") as disk:
        writers = WriterFence(disk / "writers")
        (disk / "writers").mkdir()
        ballast = chaos_disk.fill(disk)
        monkeypatch.setattr(fence_module, "CLAIM_WAIT_SECONDS", 0.5)
        with pytest.raises(OSError):  # no space for long: the claim fails, leaves nothing
            writers.claim(40, "r1")
        assert writers.claims() == [] and os.listdir(disk / "writers") == []
        monkeypatch.setattr(fence_module, "CLAIM_WAIT_SECONDS", 30.0)
        threading.Timer(1.0, ballast.unlink).start()
        started = time.monotonic()
        epoch = writers.claim(40, "r1")  # waits for the space
        assert 0.9 < time.monotonic() - started < 10
        (claim,) = writers.claims()
        assert (epoch, claim.epoch, claim.resumed_from, claim.run_id) == (1, 1, 40, "r1")


def test_a_full_run_directory_is_no_bad_input(tmp_path: Path) -> None:
    """A worker started again while the disk is full goes on (its checkpoints fail until
    there is space) instead of failing as if the run dir were unwritable (exit 2, which
    spent the node's restarts in the fault campaign)."""
    from elastic_train.errors import ConfigError
    from elastic_train.rundir import RunDir

    with small_disk(tmp_path / "disk") as disk:
        run = RunDir(disk / "run").prepare()
        chaos_disk.fill(disk)
        assert RunDir(disk / "run").prepare().root == run.root
        with pytest.raises(ConfigError, match="is not writable"):  # a new one is
            RunDir(disk / "elsewhere").prepare()
