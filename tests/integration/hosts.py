"""Jobs across the hosts of a test bed (tests/netbed.py): nodes, the shared event log, waits.

A ``Node`` is an ``elastic-train run`` agent started on a host of the bed, its output
time-stamped line by line (``<time.time()> <line>``) in ``<run dir's parent>/<name>.log``,
so a test can say when a node printed what (``wait_for_line``, ``progress``). The run dir
is shared (the hosts share this machine's file system), so the job's event log is one file
read by ``EventLog``: ``wait_for_step`` and ``wait_for_world`` bound every wait and fail
with every node's output, or early when every node has exited.

Written for the fault scenarios of issue 27: a node killed (``host.kill()``), its cable
pulled (``host.cable_down()``) or frozen (``host.freeze()``), then ``wait_for_world(1,
after=fault_time)`` for the survivors' first step at the smaller world, and the same after
``cable_up`` / ``thaw`` for the larger one.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_train.rundir import EVENTS_FILE
from tests import netbed as nb
from tests.integration import harness

Event = dict[str, Any]
PROGRESS = re.compile(rb"^step (\d+)/\d+ .*\bworld (\d+)\b")


@dataclass
class Node(harness.Job):
    """An agent on a host of the bed (``harness.Job``'s waits and reports apply)."""

    host: nb.Host | None = None

    def lines(self) -> list[tuple[float, bytes]]:
        """Every line of the node's output with the time it was printed."""
        found = []
        for raw in self.log_path.read_bytes().splitlines():
            stamp, _, line = raw.partition(b" ")
            try:
                found.append((float(stamp), line))
            except ValueError:
                continue
        return found

    def wait_for_line(self, pattern: str, after: float = 0.0, timeout: float = 60.0
                      ) -> tuple[float, re.Match[bytes]]:
        """(time, match) of the first line printed after ``after`` that matches
        ``pattern``; AssertionError after ``timeout`` or when the node exited first."""
        regex = re.compile(pattern.encode())
        deadline = time.monotonic() + timeout
        while True:
            exited = self.proc.poll() is not None
            for at, line in self.lines():
                match = regex.search(line)
                if at > after and match:
                    return at, match
            if exited:
                raise AssertionError(f"{self.log_path.stem} exited ({self.proc.returncode}) "
                                     f"before a line matching {pattern!r}:\n{self.report()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.log_path.stem}: no line matching {pattern!r} "
                                     f"within {timeout:g} s:\n{self.report()}")
            time.sleep(0.02)

    def progress(self) -> list[tuple[float, int, int]]:
        """(time, step, world size) of each progress line the node printed (the node of
        rank 0 prints them, every ``--log-every`` steps)."""
        found = []
        for at, line in self.lines():
            match = PROGRESS.match(line)
            if match:
                found.append((at, int(match[1]), int(match[2])))
        return found


def start_node(host: nb.Host, run_dir: Path, args: Sequence[str], name: str | None = None,
               env: dict[str, str] | None = None, script: bool = False) -> Node:
    """``elastic-train run`` on ``host`` with ``args`` (launcher and job options), its run
    dir ``run_dir`` (``script``: ``args`` end with a script and its arguments, which name
    the run dir themselves); output in ``run_dir.parent / f"{name or host.name}.log"``."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{name or host.name}.log"
    argv = [sys.executable, "-m", "elastic_train", "run", *args,
            *([] if script else ["--run-dir", str(run_dir)])]
    proc = host.popen(argv, env=harness.job_env({"PYTHONUNBUFFERED": "1", **(env or {})}),
                      log=log, cwd=run_dir.parent, timestamps=True)
    return Node(proc, run_dir, log, host=host)


def etcd_v3(bed: nb.Netbed, host: nb.Host, rdzv_id: str, nnodes: str = "1:2",
            nproc: int = 1, conf: str | None = None) -> list[str]:
    """Launcher options of a node on ``host`` of an etcd-v3 job on the bed's etcd host, as
    the README tells users across machines (``--local-addr`` the host's address)."""
    assert bed.etcd is not None, "make the bed with etcd=True"
    return ["--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", "etcd-v3",
            "--rdzv-endpoint", bed.etcd.endpoint, "--rdzv-id", rdzv_id,
            "--local-addr", host.ip, *(["--rdzv-conf", conf] if conf else [])]


def c10d(store: nb.Host, host: nb.Host, rdzv_id: str, port: int = 29400,
         nnodes: str = "1:2", nproc: int = 1, conf: str | None = None) -> list[str]:
    """Launcher options of a node on ``host`` of a c10d job whose store lives in the agent
    on ``store`` (``is_host`` true there only)."""
    is_host = f"is_host={'true' if host is store else 'false'}"
    return ["--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{store.ip}:{port}", "--rdzv-id", rdzv_id,
            "--local-addr", host.ip, "--rdzv-conf", ",".join(filter(None, [is_host, conf]))]


class EventLog:
    """The job's event log (shared by every node), read as it grows."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / EVENTS_FILE
        self.events: list[Event] = []
        self._offset = 0
        self._partial = b""

    def read(self) -> list[Event]:
        """Every event so far (the new ones appended to ``events``)."""
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            for line in lines:
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    continue
        return self.events

    def steps(self, world: int | None = None, after: float = 0.0) -> list[Event]:
        """Step events (at ``world``, when given) later than ``after``."""
        return [e for e in self.read() if e["event"] == "step" and e["time"] > after
                and (world is None or e.get("world_size") == world)]

    def wait(self, predicate: Callable[[Event], bool], what: str, timeout: float,
             nodes: Sequence[harness.Job] = ()) -> Event:
        """The first event matching ``predicate``. AssertionError (with every node's output)
        after ``timeout``, or once every node in ``nodes`` exited without it."""
        deadline = time.monotonic() + timeout
        while True:
            exited = bool(nodes) and all(n.proc.poll() is not None for n in nodes)
            for event in self.read():
                if predicate(event):
                    return event
            if exited or time.monotonic() > deadline:
                why = "every node exited" if exited else f"not within {timeout:g} s"
                raise AssertionError(f"no {what}: {why}\n" + report(nodes))
            time.sleep(0.01)


def wait_for_step(log: EventLog, world: int | None = None, after: float = 0.0,
                  min_step: int = 0, timeout: float = 60.0,
                  nodes: Sequence[harness.Job] = ()) -> Event:
    """The first step event later than ``after`` (at ``world``; of ``min_step`` or more)."""
    return log.wait(lambda e: e["event"] == "step" and e["time"] > after
                    and (world is None or e.get("world_size") == world)
                    and e["step"] >= min_step,
                    f"step >= {min_step} at world {world} after {after:.3f}", timeout, nodes)


def wait_for_world(log: EventLog, world: int, after: float, timeout: float = 60.0,
                   nodes: Sequence[harness.Job] = ()) -> Event:
    """The first step at world size ``world`` after ``after`` (a fault's time): the world
    shrank or grew to it."""
    return wait_for_step(log, world, after, timeout=timeout, nodes=nodes)


def report(nodes: Sequence[harness.Job]) -> str:
    """The tail of every node's output, for an assertion message."""
    return "\n".join(f"--- {n.log_path.stem} (exit {n.proc.poll()}):\n{n.report()}"
                     for n in nodes)


def wait_all(nodes: Sequence[harness.Job], timeout: float) -> list[int]:
    """Every node's exit code, waiting at most ``timeout`` in all (then AssertionError with
    every node's output; the nodes are stopped)."""
    deadline = time.monotonic() + timeout
    codes = []
    for node in nodes:
        try:
            codes.append(node.proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except Exception:
            for other in nodes:
                other.stop()
            raise AssertionError(f"the nodes did not finish within {timeout:g} s:\n"
                                 + report(nodes)) from None
    return codes
