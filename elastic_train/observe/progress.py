"""Rank 0's console progress, drawn from the event log's step records.

On a terminal one live line is redrawn in place (step/total, loss, samples/s, world size,
ETA); elsewhere (a log file, a pipe) a plain line is printed every ``log_every`` steps. The
choice is made from the output stream itself (``isatty``), never from the environment.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping
from typing import Any, TextIO

from elastic_train.events.schema import Event

LIVE_REDRAW_SECONDS = 0.2
LIVE_WINDOW = 20
"""Steps over which the live line averages the loss and measures throughput and ETA."""


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def format_eta(seconds: float) -> str:
    """``h:mm:ss`` (or ``m:ss`` under an hour)."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Shows progress on ``stream``; every other console line goes through ``message``."""

    def __init__(self, stream: TextIO, total_steps: int, batch_size: int, log_every: int,
                 live: bool | None = None) -> None:
        self.stream = stream
        self.total = total_steps
        self.batch_size = batch_size
        self.log_every = log_every
        self.live = is_terminal(stream) if live is None else live
        window = LIVE_WINDOW if self.live else log_every
        self._losses: deque[float] = deque(maxlen=window)
        # The window's step end times, after the time it began: pauses between steps count.
        self._marks: deque[float] = deque(maxlen=window + 1)
        self._drawn_at: float | None = None
        self._line_shown = False

    # ---- input ---------------------------------------------------------------------------
    def observe(self, record: Mapping[str, Any]) -> None:
        """An ``EventObserver``: a start resets the window, a step may draw."""
        if record["event"] == Event.START:
            self._losses.clear()
            self._marks.clear()
        elif record["event"] == Event.STEP:
            self._on_step(record)

    def message(self, text: str) -> None:
        """Print a line of its own (clearing the live line first)."""
        if self._line_shown:
            self.stream.write("\r\x1b[K")
            self._line_shown = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Leave the live line on the screen."""
        if self._line_shown:
            self.stream.write("\n")
            self.stream.flush()
            self._line_shown = False

    # ---- drawing -------------------------------------------------------------------------
    def _on_step(self, record: Mapping[str, Any]) -> None:
        step, now = int(record["step"]), float(record["time"])
        if record.get("loss") is not None:
            self._losses.append(float(record["loss"]))
        if not self._marks:
            self._marks.append(now - float(record.get("seconds") or 0.0))
        self._marks.append(now)
        last = step >= self.total
        if self.live:
            if last or self._drawn_at is None or now - self._drawn_at >= LIVE_REDRAW_SECONDS:
                self._draw_live(step, record, now, last)
        elif step % self.log_every == 0 or last:
            self.message(self._text(step, record))
            self._losses.clear()
            self._marks.clear()
            self._marks.append(now)

    def _rate(self) -> float | None:
        """Steps per second of wall time over the window."""
        elapsed = self._marks[-1] - self._marks[0] if self._marks else 0.0
        return (len(self._marks) - 1) / elapsed if elapsed > 0 else None

    def _text(self, step: int, record: Mapping[str, Any]) -> str:
        parts = [f"step {step}/{self.total}"]
        if self._losses:
            parts.append(f"loss {sum(self._losses) / len(self._losses):.4f} (mean)")
        if record.get("lr") is not None:
            parts.append(f"lr {record['lr']:.2e}")
        parts.append(f"world {record.get('world_size', '?')}")
        rate = self._rate()
        if rate is not None:
            batch = record.get("global_batch") or self.batch_size   # a policy may change it
            parts.append(f"{rate * batch:.0f} samples/s")
            parts.append(f"eta {format_eta(max(0, self.total - step) / rate)}")
        return "  ".join(parts)

    def _draw_live(self, step: int, record: Mapping[str, Any], now: float, last: bool) -> None:
        try:
            width = os.get_terminal_size(self.stream.fileno()).columns or 100
        except (AttributeError, ValueError, OSError):
            width = 100
        text = self._text(step, record)[: max(20, width - 1)]
        self.stream.write("\r" + text + "\x1b[K" + ("\n" if last else ""))
        self.stream.flush()
        self._line_shown = not last
        self._drawn_at = now
