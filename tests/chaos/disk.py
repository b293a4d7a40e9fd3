"""A run dir on a small file system of its own, and a ballast that fills it: the campaign's
``disk_full`` fault and tests/integration/test_full_disk.py. Mounting needs root."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def small_disk(path: Path, size: str = "256m") -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's spelling: ``64k``, ``256m``) at ``path``, unmounted on
    exit (with what is on it)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True, capture_output=True, timeout=30)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True,
                       timeout=30)


FILL_AT_MOST = 1 << 30
"""``fill`` refuses a file system with more room than this: the machine's own disk."""


def fill(directory: Path) -> Path:
    """A ballast file in ``directory`` that takes every free byte of its file system
    (unbuffered: nothing is left to flush when the disk refuses). Only on a small disk
    (``small_disk``): ``ValueError`` when more than ``FILL_AT_MOST`` bytes are free."""
    free = shutil.disk_usage(directory).free
    if free > FILL_AT_MOST:
        raise ValueError(f"{directory} has {free} bytes free: fill only a small_disk's run "
                         "dir (a campaign with disk_full faults: disk=True)")
    ballast = directory / "ballast"
    with open(ballast, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * (1 << 16))
    return ballast
