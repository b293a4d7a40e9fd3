"""A run dir on a small file system of its own, and a ballast that fills it: the campaign's
``disk_full`` fault and tests/integration/test_full_disk.py. Mounting needs root."""

from __future__ import annotations

import contextlib
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


def fill(directory: Path) -> Path:
    """A ballast file in ``directory`` that takes every free byte of its file system
    (unbuffered: nothing is left to flush when the disk refuses)."""
    ballast = directory / "ballast"
    with open(ballast, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * (1 << 16))
    return ballast
