"""An append-only file of lines that a full disk does not end: the event log and the sample
records.

A line that cannot be written (``ENOSPC``, ``EDQUOT``, an I/O error) is kept in memory with
the ones after it, up to ``HELD_LINES``, and written, in order, by the first append that
finds space again; training goes on meanwhile (a full disk is a fault the job survives:
its checkpoints fail and are retried, --on-save-failure decides). One warning when the
outage starts, one when it ends. A crash that tore the file's last line is mended by
starting a fresh line.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import deque
from pathlib import Path

log = logging.getLogger(__name__)

HELD_LINES = 100_000
"""Lines kept in memory while the disk refuses them (the oldest go first beyond it)."""


def ends_torn(path: Path) -> bool:
    """Whether the file's last line lacks its newline (a crash in mid-write)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            if f.tell() == 0:
                return False
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except OSError:
        return False


class LineFile:
    """Lines appended to ``path`` (see the module); ``what`` names it in warnings.

    Each line is one ``write`` on a file opened for appending; a line the disk refuses in
    part is cut off again (``ftruncate`` to where it began), so the file never holds half
    a line nor a line twice (Python's buffered files keep what they could not write and
    write it again later: a line held here too then came out twice)."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = Path(path)
        self.what = what
        self._fd: int | None = None
        self._held: deque[bytes] = deque(maxlen=HELD_LINES)
        self._dropped = 0
        self._outage = False

    def write(self, line: str) -> None:
        """Append ``line`` (no newline in it), after any lines held back."""
        if len(self._held) == HELD_LINES:
            self._dropped += 1
        self._held.append(line.encode() + b"\n")
        self._drain()

    def _drain(self) -> None:
        try:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                torn = ends_torn(self.path)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                if torn:  # a crash tore the last line: start a fresh one
                    self._append(b"\n")
            while self._held:
                self._append(self._held[0])
                self._held.popleft()
        except OSError as exc:
            self._failed(exc)
            return
        if self._outage:
            log.warning("%s written again after the disk refused it (%d older line(s) "
                        "lost)", self.what, self._dropped)
            self._outage, self._dropped = False, 0

    def _append(self, data: bytes) -> None:
        """``data`` at the end of the file, whole or not at all."""
        assert self._fd is not None
        start = os.lseek(self._fd, 0, os.SEEK_END)
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError:
            if done:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)
            raise

    def _failed(self, exc: OSError) -> None:
        """The file refused a line: keep it and the ones after it."""
        if not self._outage:
            log.warning("%s %s could not be written (%s): its lines are kept in memory and "
                        "written once there is space; training goes on", self.what,
                        self.path, exc.strerror or exc)
            self._outage = True

    def flush(self) -> None:
        """Nothing is buffered here: each line is written as it comes (or held)."""

    def close(self) -> None:
        """Write what is held if there is space now, then close."""
        if self._held:
            self._drain()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
