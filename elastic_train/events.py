"""The run's append-only event log: one JSON line per step and per event, written by rank 0.

Lines are appended and flushed as they happen; a crash can tear at most the last line,
which readers skip. Reports and the end-of-run summary are drawn from this file alone.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events to ``<run_dir>/events.jsonl``; a disabled log (ranks > 0) drops them."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self._file: TextIO | None = None
        self._lock = threading.Lock()  # the checkpoint writer thread emits too

    def emit(self, event: str, **fields: Any) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._emit(event, fields)

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
            if _ends_torn(self.path):
                self._file.write("\n")  # a crash tore the last line: start a fresh one
        record = {"time": round(time.time(), 6), "event": event, **fields}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._file.close()
            self._file = None


def _ends_torn(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(0, 2)
        if f.tell() == 0:
            return False
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Yield every complete event of a log; a torn (unparsable) line is skipped."""
    try:
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "event" in record:
                    yield record
    except FileNotFoundError:
        return
