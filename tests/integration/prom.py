"""A real Prometheus server for tests: deploy/'s config on a loopback port, a temp storage
dir, scraping the given targets every ``interval``; queried through its HTTP API.

Every wait has a deadline. Without the ``prometheus``/``promtool`` binaries a test is
skipped, except under CI=true, where it fails (scripts/install-test-deps.sh installs them).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests import tools
from tests.integration import harness

DEPLOY = harness.REPO / "deploy" / "prometheus"


def available(name: str) -> bool:
    return tools.system_tool_available(name)


def tool(name: str) -> str:
    """The path of ``name`` (prometheus, promtool); skip, or fail under CI, when missing."""
    return tools.system_tool(name, f"{name} is not installed: run scripts/install-test-deps.sh")


def render_config(workdir: Path, targets: Sequence[str], interval: str) -> Path:
    """deploy/prometheus with ``targets`` as its file-discovered targets and every interval
    set to ``interval``; returns the config file."""
    workdir.mkdir(parents=True, exist_ok=True)
    text = (DEPLOY / "prometheus.yml").read_text()
    for key in ("scrape_interval", "evaluation_interval"):
        assert text.count(f"{key}: 15s") == 1, f"deploy/prometheus/prometheus.yml: {key}"
        text = text.replace(f"{key}: 15s", f"{key}: {interval}")
    (workdir / "prometheus.yml").write_text(text)
    shutil.copy(DEPLOY / "alerts.yml", workdir / "alerts.yml")
    (workdir / "targets").mkdir(exist_ok=True)
    (workdir / "targets" / "test.json").write_text(
        json.dumps([{"targets": list(targets), "labels": {"cluster": "test"}}]))
    return workdir / "prometheus.yml"


@dataclass
class Prometheus:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:   # a bad query answers 400 with an error
            body = json.load(exc)
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query; at: evaluation time (Unix seconds), default now."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", **params)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float
                    ) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                        step=step)["result"]

    def wait_for(self, expr: str, done: Callable[[list[dict[str, Any]]], bool],
                 timeout: float, alive: Callable[[], None] = lambda: None
                 ) -> list[dict[str, Any]]:
        """Poll ``expr`` until ``done(result)``; ``alive`` may raise to give up early."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if done(result):
                return result
            alive()
            time.sleep(0.1)
        raise AssertionError(f"Prometheus: {expr} not as awaited within {timeout}s; last "
                             f"result {result}; log: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start(workdir: Path, targets: Sequence[str], interval: str = "500ms",
          timeout: float = 30.0) -> Prometheus:
    """Start Prometheus on a free loopback port; return once it is ready."""
    binary = tool("prometheus")
    config = render_config(workdir, targets, interval)
    port = harness.free_ports(1)
    log_path = workdir / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Prometheus(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited ({proc.returncode}): {server.log()}")
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2):
                return server
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.05)
    server.stop()
    raise AssertionError(f"prometheus not ready within {timeout}s: {server.log()}")
