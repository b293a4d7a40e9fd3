"""The Kubernetes setup of k8s/ on one machine, without containers: an etcd, N agents
(the "pods", one worker each, elastic between 1 and N nodes on our etcd-v3 rendezvous)
and a Prometheus scraping every worker, all on loopback; torn down when the job ends or
on Ctrl-C.

    python deploy/local/cluster.py --dir runs/local-cluster --steps 300

Every argument it does not know is a job option (``elastic-train run --help-job``). Kill
a node to watch the job shrink and grow back: the agents' process ids are printed. Needs
``etcd`` and ``prometheus`` on PATH (Debian: etcd-server, prometheus;
scripts/install-test-deps.sh installs both).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PROMETHEUS_CONFIG = Path(__file__).resolve().parents[1] / "prometheus"
# What k8s/base/pytorchjob.yaml gives the agents (elasticPolicy.rdzvConf).
RDZV_CONF = "key_prefix=/elastic-train/rendezvous"


class ClusterError(Exception):
    """Something the cluster needs is missing or did not start."""


@dataclass
class Cluster:
    """The processes of the local cluster, in start order."""

    directory: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: Sequence[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.directory / log, "ab") as out:
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        self.procs[name] = proc
        return proc

    def stop(self, grace: float) -> None:
        """SIGTERM the agents first (they checkpoint), then the services; SIGKILL what is
        still running after ``grace`` seconds."""
        agents = [n for n in self.procs if n.startswith("node-")]
        for group in (agents, [n for n in self.procs if n not in agents]):
            for name in group:
                _signal_group(self.procs[name], signal.SIGTERM)
            deadline = time.monotonic() + grace
            for name in group:
                proc = self.procs[name]
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait(timeout=10)
                _signal_group(proc, signal.SIGKILL)  # anything the leader left behind


def _die_with_parent() -> None:
    """In the child: SIGTERM when this script dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ClusterError(f"{name} is not installed: apt-get install {package} (or run "
                           "scripts/install-test-deps.sh)")
    return path


def wait_http(url: str, proc: subprocess.Popen[bytes], what: str, log: Path,
              timeout: float) -> None:
    """Poll ``url`` until it answers 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(f"{what} exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise ClusterError(f"{what} not ready within {timeout:.0f}s; see {log}")


def start_etcd(cluster: Cluster, port: int) -> str:
    peer = free_port()
    client_url, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    proc = cluster.start("etcd", [
        binary("etcd", "etcd-server"), "--name", "local",
        "--data-dir", str(cluster.directory / "etcd"),
        "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"local={peer_url}", "--log-level", "warn", "--logger", "zap",
    ], "etcd.log")
    wait_http(f"{client_url}/health", proc, "etcd", cluster.directory / "etcd.log", 30)
    return f"127.0.0.1:{port}"


def start_prometheus(cluster: Cluster, port: int, targets: Sequence[str],
                     interval: str) -> str:
    """deploy/prometheus's config and alerts, scraping ``targets`` every ``interval``."""
    workdir = cluster.directory / "prometheus"
    (workdir / "targets").mkdir(parents=True, exist_ok=True)
    text = (PROMETHEUS_CONFIG / "prometheus.yml").read_text()
    for key in ("scrape_interval", "evaluation_interval"):
        text = text.replace(f"{key}: 15s", f"{key}: {interval}")
    (workdir / "prometheus.yml").write_text(text)
    shutil.copy(PROMETHEUS_CONFIG / "alerts.yml", workdir / "alerts.yml")
    (workdir / "targets" / "local-cluster.json").write_text(json.dumps(
        [{"targets": list(targets), "labels": {"cluster": "local"}}]))
    url = f"http://127.0.0.1:{port}"
    proc = cluster.start("prometheus", [
        binary("prometheus", "prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ], "prometheus.log")
    wait_http(f"{url}/-/ready", proc, "prometheus", cluster.directory / "prometheus.log", 60)
    return url


def agent_argv(node: int, nodes: int, endpoint: str, run_id: str, run_dir: Path,
               metrics_port: int, job_args: Sequence[str]) -> list[str]:
    """One node: what the operator's PET_* variables give `elastic-train run` in a pod."""
    return [sys.executable, "-m", "elastic_train", "run", f"--nnodes=1:{nodes}",
            "--nproc-per-node=1", "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", f"--rdzv-conf={RDZV_CONF}", "--max-restarts=100",
            f"--run-dir={run_dir}", "--metrics-address=127.0.0.1",
            f"--metrics-port={metrics_port + node}", *job_args]


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="deploy/local/cluster.py", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("runs/local-cluster"),
                   help="where the run, etcd's data and the logs go")
    p.add_argument("--nodes", type=int, default=2, help="agents to start (default 2)")
    p.add_argument("--etcd-port", type=int, default=0, help="default: a free port")
    p.add_argument("--prometheus-port", type=int, default=0, help="default: a free port")
    p.add_argument("--metrics-port", type=int, default=9450,
                   help="node i's worker serves /metrics on this + i (default 9450)")
    p.add_argument("--scrape-interval", default="2s")
    p.add_argument("--linger", type=float, default=0.0,
                   help="seconds to keep etcd and Prometheus up after the job ends (Ctrl-C "
                        "ends it early), to look at the metrics")
    p.add_argument("--grace", type=float, default=40.0,
                   help="seconds a process gets after SIGTERM at teardown")
    ns, job_args = p.parse_known_args(list(argv))
    if ns.nodes < 1:
        p.error("--nodes must be at least 1")
    return ns, job_args


def main(argv: Sequence[str]) -> int:
    ns, job_args = parse(argv)
    ns.dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(ns.dir.resolve())
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        endpoint = start_etcd(cluster, ns.etcd_port or free_port())
        targets = [f"127.0.0.1:{ns.metrics_port + i}" for i in range(ns.nodes)]
        prometheus = start_prometheus(cluster, ns.prometheus_port or free_port(), targets,
                                      ns.scrape_interval)
        run_id = f"local-{uuid.uuid4().hex[:8]}"
        print(f"etcd: {endpoint} (pid {cluster.procs['etcd'].pid})\n"
              f"prometheus: {prometheus} (pid {cluster.procs['prometheus'].pid})\n"
              f"run dir: {ns.dir / 'run'}", flush=True)
        for node in range(ns.nodes):
            proc = cluster.start(f"node-{node}", agent_argv(
                node, ns.nodes, endpoint, run_id, cluster.directory / "run", ns.metrics_port,
                job_args), f"node-{node}.log")
            print(f"node-{node}: pid {proc.pid}, log {ns.dir / f'node-{node}.log'}", flush=True)
        agents = [p for n, p in cluster.procs.items() if n.startswith("node-")]
        while not stop["signal"] and any(p.poll() is None for p in agents):
            time.sleep(0.2)
        codes = [p.poll() for p in agents]
        if not stop["signal"]:
            print(f"job ended: exit codes {codes}", flush=True)
            deadline = time.monotonic() + ns.linger
            while not stop["signal"] and time.monotonic() < deadline:
                time.sleep(0.2)
    except ClusterError as exc:
        print(f"cluster.py: error: {exc}", file=sys.stderr)
        cluster.stop(ns.grace)
        return 1
    cluster.stop(ns.grace)
    print("torn down", flush=True)
    if any(code is None for code in codes):  # stopped by a signal while training
        return 128 + stop["signal"]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
