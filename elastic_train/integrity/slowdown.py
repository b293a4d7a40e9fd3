"""``--inject-slowdown RANK:FACTOR[:STEP]``: the straggler drill. From optimizer step STEP
(default 0) on, rank RANK's worker process runs at 1/FACTOR of its speed: a helper process
stops and continues it (SIGSTOP / SIGCONT) on a duty cycle, ``PERIOD`` seconds long, running
1/FACTOR of it. A real slowdown of the whole process, as a throttled GPU, a CPU quota or a
noisy neighbour makes it, not a sleep inside our own step: the worker's own timings see it as
they would see a slow machine (docs/wrong-or-slow-nodes.md).

The helper ends with the worker (it watches the worker's pid) and on SIGTERM, leaving the
worker running (a SIGCONT on every way out). Run as ``python -m elastic_train.integrity.slowdown
PID FACTOR``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = ["PERIOD", "SlowdownDrill", "duty_cycle"]

PERIOD = 0.01
"""Seconds of one stop-and-run cycle: short against a step, so that every step is slowed."""


@dataclass(frozen=True)
class SlowdownDrill:
    """One planned slowdown (config.py checks the text's shape)."""

    rank: int
    factor: float
    step: int = 0

    @classmethod
    def parse(cls, text: str) -> SlowdownDrill | None:
        """The drill ``text`` describes (None for an empty text)."""
        if not text:
            return None
        parts = text.split(":")
        factor = float(parts[1])
        if factor <= 1.0:
            raise ValueError(f"--inject-slowdown factor {factor}: above 1 (2 runs the rank "
                             "at half its speed)")
        return cls(int(parts[0]), factor, int(parts[2]) if len(parts) > 2 else 0)

    def due(self, rank: int, step: int) -> bool:
        return rank == self.rank and step >= self.step

    def start(self, pid: int | None = None) -> subprocess.Popen[bytes]:
        """Start the helper that slows process ``pid`` (this one by default)."""
        return subprocess.Popen([sys.executable, "-m", "elastic_train.integrity.slowdown",
                                 str(pid or os.getpid()), str(self.factor)],
                                stdin=subprocess.DEVNULL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def duty_cycle(pid: int, factor: float, period: float = PERIOD,
               until: float | None = None) -> None:
    """Stop and continue ``pid`` so that it runs 1/``factor`` of the time, until it is gone
    (or ``until``, a monotonic time, for tests); it is left running."""
    running = period / factor
    stopped = period - running
    try:
        while _alive(pid) and (until is None or time.monotonic() < until):
            os.kill(pid, signal.SIGCONT)
            time.sleep(running)
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped)
    except ProcessLookupError:
        return
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def main(argv: list[str]) -> int:
    pid, factor = int(argv[0]), float(argv[1])
    # SIGTERM ends the loop through the finally above: the worker is left running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    duty_cycle(pid, factor)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
