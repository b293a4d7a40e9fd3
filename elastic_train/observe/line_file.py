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
from collections import deque
from pathlib import Path
from typing import TextIO

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
    """Lines appended to ``path`` (see the module); ``what`` names it in warnings."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = Path(path)
        self.what = what
        self._file: TextIO | None = None
        self._held: deque[str] = deque(maxlen=HELD_LINES)
        self._dropped = 0
        self._outage = False

    def write(self, line: str) -> None:
        """Append ``line`` (no newline in it), after any lines held back."""
        if len(self._held) == HELD_LINES:
            self._dropped += 1
        self._held.append(line)
        self._drain()

    def _drain(self) -> None:
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                torn = ends_torn(self.path)
                self._file = open(self.path, "a", buffering=1)
                if torn:
                    self._file.write("\n")  # a crash tore the last line: start a fresh one
            while self._held:
                self._file.write(self._held[0] + "\n")
                self._held.popleft()
        except OSError as exc:
            self._failed(exc)
            return
        if self._outage:
            log.warning("%s written again after the disk refused it (%d older line(s) "
                        "lost)", self.what, self._dropped)
            self._outage, self._dropped = False, 0

    def _failed(self, exc: OSError) -> None:
        """The file refused a line: drop the handle (its buffer may hold half a line; the
        next open mends a torn end), keep the lines."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if not self._outage:
            log.warning("%s %s could not be written (%s): its lines are kept in memory and "
                        "written once there is space; training goes on", self.what,
                        self.path, exc.strerror or exc)
            self._outage = True

    def flush(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
            except OSError as exc:
                self._failed(exc)

    def close(self) -> None:
        """Write what is held if there is space now, then close."""
        if self._held:
            self._drain()
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
