"""The run's append-only event log: one JSON line per step and per event, written by rank 0.

Lines are appended and flushed as they happen; a crash can tear at most the last line,
which readers skip. Reports and the end-of-run summary are drawn from this file alone.
Observers (the worker's metrics, rank 0's progress display) see every record as it is made,
on every rank, whether or not this rank writes the file. An observer that raises is logged
(with its traceback, once) and never fails the emit: watching a job must not stop it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_train.events.line_file import LineFile
from elastic_train.events.schema import Event, EventRecord

log = logging.getLogger(__name__)

EventObserver = Callable[[Mapping[str, Any]], None]
"""Called with every record (``time``, ``event`` and its fields) right after it is made."""


def _name(observer: EventObserver) -> str:
    return getattr(observer, "__qualname__", None) or type(observer).__name__


class EventLog:
    """Appends events to the run's event log; a disabled log (ranks > 0) drops them.

    ``observers`` are called with every record, also when the log is disabled, one record
    at a time (under the log's lock: the checkpoint writer thread emits too).
    """

    def __init__(self, path: Path, enabled: bool = True,
                 observers: Sequence[EventObserver] = ()) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self.observers = tuple(observers)
        self._file: LineFile | None = None
        self._lock = threading.Lock()  # the checkpoint writer thread emits too
        self._failed: set[int] = set()  # observers (by index) whose failure was logged

    def emit(self, record: EventRecord) -> None:
        """Append one record (events/schema.py) and show it to the observers."""
        if not self.enabled and not self.observers:
            return
        fields = record.fields()
        with self._lock:
            self._emit(record.event, fields)

    def emit_raw(self, event: str, **fields: Any) -> None:
        """Append a record given as a name and fields (replays of read records, tests)."""
        if not self.enabled and not self.observers:
            return
        with self._lock:
            self._emit(event, fields)

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        record = {"time": round(time.time(), 6), "event": str(event), **fields}
        if self.enabled:
            if self._file is None:
                self._file = LineFile(self.path, "the event log")
            self._file.write(json.dumps(record, separators=(",", ":")))
        for index, observer in enumerate(self.observers):
            try:
                observer(record)
            except Exception:
                if index not in self._failed:
                    self._failed.add(index)
                    log.exception("an observer of the event log (%s) failed on a %r record: "
                                  "training goes on, what it shows may be stale (later "
                                  "failures of it are not logged)", _name(observer), event)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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


def read_events_backwards(path: Path, block: int = 1 << 16) -> Iterator[dict[str, Any]]:
    """Yield the complete events of a log newest first, reading from its end in blocks."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        f.seek(0, 2)
        position, tail = f.tell(), b""
        while position > 0:
            size = min(block, position)
            position -= size
            f.seek(position)
            lines = (f.read(size) + tail).split(b"\n")
            tail = lines.pop(0)  # may continue in the previous block
            for line in reversed(lines):
                record = _parse(line)
                if record is not None:
                    yield record
        record = _parse(tail)
        if record is not None:
            yield record


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "event" in record else None


@dataclass(frozen=True)
class PreviousIncarnation:
    """What the log says about the incarnation before this one, within the same launch.

    ``world_size``: the world it ended at (its last step's; a world re-formed in place may
    have changed it since its start)."""

    world_size: int | None
    restart: int
    last_step_time: float | None
    last_step: int | None = None
    """Its newest step (None: it made none)."""
    last_seen: float | None = None
    """Time of its newest event: its last sign of life."""
    stopped: dict[str, Any] | None = None
    """Its ``stopped`` event, if it stopped on purpose (a checkpoint write failed)."""


def previous_incarnation(path: Path, run_id: str) -> PreviousIncarnation | None:
    """The newest ``start`` of ``run_id`` not followed by its ``end``, with its last step
    and last event.

    None when there is none: a first start, or the previous launch of this run finished.
    """
    last_step: dict[str, Any] | None = None
    stopped: dict[str, Any] | None = None
    last_seen = None
    for record in read_events_backwards(path):
        kind = record["event"]
        if last_seen is None:
            last_seen = record.get("time")
        if kind == Event.END:
            return None
        if kind == Event.STEP and last_step is None:
            last_step = record
        if kind == Event.STOPPED and stopped is None:
            stopped = record
        if kind == Event.START:
            if record.get("run_id") != run_id:
                return None
            world = last_step.get("world_size") if last_step else None
            return PreviousIncarnation(
                world or record.get("world_size"), int(record.get("restart", 0)),
                last_step.get("time") if last_step else None,
                int(last_step["step"]) if last_step else None, last_seen, stopped)
    return None
