"""Step watchdog: a rank that stops making progress becomes a failure the agent restarts.

Each rank runs a thread that publishes a heartbeat (time, step, phase) into the process
group's store every ``interval`` seconds, and watches its own training loop. When no step
has completed for ``step_timeout`` seconds, it reads every rank's heartbeat, names the rank
that went quiet (a stopped or wedged process stops beating) and where it was, records a
``hang`` event, and exits the worker non-zero: torch's agent then restarts the group, which
resumes from the newest checkpoint. Collective timeouts are the second line of defence.

Under live recovery (``replaces_killed=True``) a rank that killed a stuck peer on its host
does not exit: the agent starts that peer again and the world re-forms in place
(worker/live_world.py); the watchdog waits another ``step_timeout`` before it judges again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 75
_KEY = "elastic_train/heartbeat/{rank}"


class StepWatchdog:
    """Heartbeats for this rank; fails the worker when its loop stalls."""

    def __init__(self, store: Any | None, rank: int, world_size: int, step_timeout: float,
                 report: Callable[[dict[str, Any]], None], interval: float = 1.0,
                 replaces_killed: bool = False) -> None:
        self.store = store
        self.replaces_killed = replaces_killed
        self.rank = rank
        self.world_size = world_size
        self.step_timeout = step_timeout
        self.interval = min(interval, step_timeout / 4)
        self.report = report
        self.step = 0
        self.where = "starting"
        self._last_progress = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-watchdog", daemon=True)

    def start(self) -> StepWatchdog:
        self._last_progress = time.monotonic()
        self._beat()  # at once: a rank stopped before its first interval is still known
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def phase(self, where: str) -> None:
        """Say what the loop is doing now (cheap: an attribute)."""
        self.where = where

    def progress(self, step: int) -> None:
        """A step completed."""
        self.step = step
        self._last_progress = time.monotonic()

    def _beat(self) -> None:
        if self.store is None:
            return
        record = {"time": time.time(), "step": self.step, "where": self.where,
                  "pid": os.getpid(), "host": socket.gethostname()}
        try:
            self.store.set(_KEY.format(rank=self.rank), json.dumps(record))
        except Exception:  # a store that is gone must not kill the watchdog itself
            pass

    def peers(self) -> dict[int, dict[str, Any]]:
        """The last heartbeat of every rank that published one (the store permitting)."""
        out: dict[int, dict[str, Any]] = {}
        if self.store is None:
            return out
        for rank in range(self.world_size):
            key = _KEY.format(rank=rank)
            try:
                if self.store.check([key]):
                    out[rank] = json.loads(self.store.get(key))
            except Exception:
                continue
        return out

    def diagnose(self) -> dict[str, Any]:
        """Who is stuck, and where, as far as the heartbeats tell (no side effects)."""
        now = time.time()
        peers = self.peers()
        stale = {r: hb for r, hb in peers.items() if now - hb["time"] > 3 * self.interval}
        silent = [r for r in range(self.world_size) if r not in peers]
        suspects = sorted(stale) + silent
        stalled_for = time.monotonic() - self._last_progress
        if suspects:
            first = suspects[0]
            hb = stale.get(first)
            detail = (f"rank {first} last heard {now - hb['time']:.1f}s ago at step "
                      f"{hb['step']} ({hb['where']})" if hb else
                      f"rank {first} never sent a heartbeat")
        else:
            first, hb = None, None
            detail = "every rank is alive: a collective or the data may be stuck"
        return {
            "killed_pid": None,
            "stuck_host": hb.get("host") if hb else None,
            "stuck_pid": hb.get("pid") if hb else None,
            "detected_by": self.rank, "step": self.step, "where": self.where,
            "stalled_seconds": round(stalled_for, 3), "stuck_rank": first,
            "suspects": suspects,
            "message": (f"rank {self.rank}: no step completed for {stalled_for:.1f}s "
                        f"(--step-timeout {self.step_timeout:g}) at step {self.step + 1} "
                        f"({self.where}); {detail}; failing this worker so that the job "
                        "restarts from the newest checkpoint"),
        }

    @staticmethod
    def _end_local_peer(finding: dict[str, Any]) -> None:
        """Kill a stuck rank that runs on this host: a stopped process ignores the agent's
        SIGTERM for its whole shutdown timeout (30 s), which would delay the restart."""
        pid = finding.get("stuck_pid")
        if not pid or finding.get("stuck_host") != socket.gethostname():
            return
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        finding["killed_pid"] = int(pid)
        finding["message"] = finding["message"].replace(
            "; failing this worker", f"; killed it (pid {pid}); failing this worker")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._beat()
            if time.monotonic() - self._last_progress > self.step_timeout:
                finding = self.diagnose()
                self._end_local_peer(finding)
                if self.replaces_killed and finding["killed_pid"] is not None \
                        and finding["stuck_rank"] != self.rank:
                    finding["message"] = finding["message"].replace(
                        "failing this worker so that the job restarts from the newest "
                        "checkpoint", "the agent starts it again and the world re-forms in "
                        "place (live recovery)")
                    log.error("%s", finding["message"])
                    self.report(finding)
                    self._last_progress = time.monotonic()
                    continue
                log.error("%s", finding["message"])
                try:
                    self.report(finding)
                finally:
                    os._exit(HANG_EXIT_CODE)


class NoWatchdog:
    """Stands in for ``StepWatchdog`` when there is no step timeout."""

    def start(self) -> NoWatchdog:
        return self

    def stop(self) -> None: ...

    def phase(self, where: str) -> None: ...

    def progress(self, step: int) -> None: ...
