"""Preemption: SIGTERM (what Kubernetes and spot instances send) becomes a clean stop.

The handler only sets a flag. The trainer folds the flag into the collective it already
does each step, so every rank learns of a stop request at the same step boundary (a vote,
not a race), rank 0 writes a checkpoint, and all exit 0. A watchdog bounds the whole stop
by a budget chosen below the grace period: past it the process exits at once, non-zero,
and the last good checkpoint stays.

A SIGTERM is a preemption of this node unless the agent left a note that the stop is its
own (``STOP_NOTE``: a restart from the newest checkpoint): then ``by_agent`` says why, and
the vote treats it as a restart of the workers, never as the job's end.

Until the worker holds the training state (``arm``: restored, or received from the
others), a SIGTERM ends it at once (exit 143): it has nothing to checkpoint, and it may be
waiting where no step boundary comes (a worker started into a world whose members all
died waits for a state no one holds), so a flag would only wait out the budget.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

from elastic_train.errors import NodeStoppedError
from elastic_train.live.environment import read_stop_note

log = logging.getLogger(__name__)


class StopRequest:
    """Turns the given signals into a flag and starts the budget watchdog on the first one."""

    def __init__(self, budget_seconds: float, signals: tuple[int, ...] = (signal.SIGTERM,),
                 note: str | None = None):
        self.budget_seconds = budget_seconds
        self.signals = signals
        self.note = note
        """The agent's stop note (``STOP_NOTE``: WorkerEnv.stop_note), read when a signal
        comes; None: every signal is a preemption."""
        self.signal_name: str | None = None
        self.received_at: float | None = None
        self.by_agent: str | None = None
        """Why this worker's agent stopped it itself (a restart), or None: a preemption."""
        self._previous: dict[int, object] = {}
        self._watchdog: threading.Timer | None = None
        self.armed = False
        """Whether this worker holds the training state (see the module)."""

    def arm(self) -> None:
        """The worker holds the training state: a signal now stops it at a step boundary."""
        self.armed = True

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    @property
    def preempted(self) -> bool:
        """A signal came, and not from the agent's own stop."""
        return self.requested and self.by_agent is None

    def seconds_since(self) -> float:
        """Seconds since the signal came (0.0 before one)."""
        return 0.0 if self.received_at is None else time.monotonic() - self.received_at

    def event_fields(self) -> dict[str, object]:
        """This rank's view of the stop, for the ``preempted`` event."""
        waited = None if self.received_at is None else \
            round(time.monotonic() - self.received_at, 6)
        return {"signal": self.signal_name, "rank_signalled": self.requested,
                "seconds_since_signal": waited}

    def install(self) -> StopRequest:
        """Install the handlers (main thread only)."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.armed:
            os.write(2, f"elastic_train: {signal.Signals(signum).name} before this worker "
                        "held the training state: exiting now (nothing to checkpoint; the "
                        "newest checkpoint stands)\n".encode())
            os._exit(128 + signum)
        if self.received_at is not None:
            return
        self.received_at = time.monotonic()
        self.signal_name = signal.Signals(signum).name
        self.by_agent = read_stop_note(self.note)
        self._watchdog = threading.Timer(self.budget_seconds, self._overrun)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _overrun(self) -> None:
        log.error("%s: the stop did not finish within the %.1fs preemption budget; exiting "
                  "now without a new checkpoint (the last good one stays)", self.signal_name,
                  self.budget_seconds)
        os._exit(1)


def node_stopped(stopped_nodes: list[int], step: int) -> NodeStoppedError:
    """The error of a node that was not signalled but stopped with the signalled ones."""
    return NodeStoppedError(
        f"node(s) {stopped_nodes} stopped at step {step} (preempted); this node "
        "checkpointed with them and restarts to go on without them")
