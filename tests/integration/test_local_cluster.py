"""deploy/local/cluster.py: etcd, two agents and Prometheus on loopback train a job to the
end; Prometheus scrapes both workers; Ctrl-C tears everything down, nothing left running."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elastic_train.events.log import read_events
from elastic_train.rundir import EVENTS_FILE
from tests import etcd_server, procfs
from tests.integration import harness, prom

pytestmark = pytest.mark.slow
SCRIPT = harness.REPO / "deploy" / "local" / "cluster.py"
STEPS = 40


class Lines:
    """The script's stdout, read on a thread so that waits can have deadlines."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if match := re.search(pattern, line):
                        return match
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matching {pattern!r} within {timeout}s: "
                                         f"{self.lines}")
                self._changed.wait(left)


def pid_alive(pid: int) -> bool:
    """A zombie is gone for our purposes (its parent has not reaped it yet)."""
    return procfs.alive(pid)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_readme_command_is_this_script() -> None:
    command = harness.readme_command("deploy/local/cluster.py")
    assert command.startswith("python deploy/local/cluster.py --dir ")


def test_the_local_cluster_trains_is_scraped_and_tears_down(tmp_path: Path) -> None:
    etcd_server.etcd_binary()
    prom.tool("prometheus")
    metrics = harness.free_ports(2)
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--metrics-port", str(metrics),
         "--linger", "120", "--scrape-interval", "500ms", "--steps", str(STEPS),
         "--preset", "tiny", "--checkpoint-every", "10", "--log-every", "5",
         "--metrics-linger", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=harness.REPO,
        env=harness.job_env(), start_new_session=True)
    try:
        out = Lines(proc)
        etcd = out.wait_for(r"^etcd: 127\.0\.0\.1:(\d+) \(pid (\d+)\)", 60)
        url = out.wait_for(r"^prometheus: (http://127\.0\.0\.1:(\d+)) \(pid (\d+)\)", 60)
        nodes = [int(out.wait_for(rf"^node-{i}: pid (\d+)", 30).group(1)) for i in range(2)]
        server = prom.Prometheus(proc, url.group(1), tmp_path / "prometheus.log")  # type: ignore[arg-type]

        # Both workers are scraped (Kubernetes: the PodMonitor). At some point each, not both
        # at one instant: the tiny run trains for about two seconds, and Prometheus applies
        # file-discovered targets up to 5 s late, so a fast start can finish training first;
        # --metrics-linger keeps each worker's endpoint until one scrape of its final values
        # (without it the run could end before the first scrape: seen after other jobs).
        server.wait_for('max_over_time(up{cluster="local"}[10m]) == 1', lambda r: len(r) == 2,
                        timeout=120)
        out.wait_for(r"^job ended: exit codes \[0, 0\]$", 240)
        steps = server.wait_for('max by (rank) (last_over_time(elastic_train_step[10m]))',
                                lambda r: len(r) == 2, timeout=30)
        assert {s["metric"]["rank"] for s in steps} == {"0", "1"}
        assert max(float(s["value"][1]) for s in steps) > 0

        # The run reached its end on two nodes, through our etcd-v3 rendezvous.
        events = list(read_events(tmp_path / "run" / EVENTS_FILE))
        assert [e["step"] for e in events if e["event"] == "end"] == [STEPS]
        assert [e["world_size"] for e in events if e["event"] == "step"][-1] == 2

        proc.send_signal(signal.SIGINT)  # Ctrl-C ends the linger
        assert proc.wait(timeout=90) == 0
        out.wait_for(r"^torn down$", 1)
        services = [int(etcd.group(2)), int(url.group(3))]
        assert [pid for pid in [*nodes, *services] if pid_alive(pid)] == []
        for port in (int(etcd.group(1)), int(url.group(2)), metrics, metrics + 1):
            assert port_free(port), port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
