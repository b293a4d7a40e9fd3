"""deploy/: the Prometheus config and alert rules pass promtool (and the rules' own unit
tests), the example targets match the default ports, and every metric the alerts and the
Grafana dashboard name is one the workers serve. (Their queries run on real data in
tests/integration/test_prometheus.py.)"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from elastic_train.config import MetricsConfig
from elastic_train.observe.metrics import WorkerMetrics
from elastic_train.worker.env import WorkerEnv
from tests.integration.prom import tool

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMETHEUS_OWN = {"up", "ALERTS", "ALERTS_FOR_STATE"}


def served_names() -> set[str]:
    """Every sample name a worker can serve, whether it has a value yet or not."""
    registry = CollectorRegistry()
    WorkerMetrics(registry, WorkerEnv(), batch_size=2, min_world_size=1)
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",), "info": ("_info",),
                "histogram": ("_bucket", "_count", "_sum", "_created")}
    return {family.name + suffix for family in registry.collect()
            for suffix in suffixes[family.type]}


def metric_names(expr: str) -> set[str]:
    """The names of the series an expression selects."""
    return set(re.findall(r"\b((?:elastic_train|process)_[a-zA-Z0-9_]+)\b", expr))


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True,
                          timeout=60, cwd=DEPLOY / "prometheus")


@pytest.mark.parametrize("args", [("check", "config", "prometheus.yml"),
                                  ("check", "rules", "alerts.yml"),
                                  ("test", "rules", "alerts.test.yml")])
def test_promtool_accepts_the_config_and_the_rules_pass_their_tests(args: tuple[str, ...]
                                                                     ) -> None:
    done = promtool(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_the_example_targets_are_the_default_ports() -> None:
    groups = json.loads((DEPLOY / "prometheus" / "targets" / "local.json").read_text())
    base = MetricsConfig().port
    assert groups[0]["targets"] == [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]


def test_every_metric_the_alerts_name_is_served() -> None:
    text = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    exprs = re.findall(r"expr: \|?\n?((?:.|\n)*?)\n\s+(?:for|labels):", text)
    assert len(exprs) == 7
    for expr in exprs:
        names = metric_names(expr)
        assert names and names <= served_names(), (expr, names - served_names())


def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "grafana" / "elastic-train.json").read_text())


def panels(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for top in data["panels"] for p in [top, *top.get("panels", [])]]


def test_the_dashboard_is_valid_and_queries_only_served_metrics() -> None:
    data = dashboard()
    assert data["uid"] and data["title"] and data["schemaVersion"] >= 36
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert "elastic_train_build_info" in variables["run_id"]["definition"]
    ids = [p["id"] for p in panels(data)]
    assert len(ids) == len(set(ids))
    graphs = [p for p in panels(data) if p["type"] != "row"]
    assert len(graphs) >= 15
    covered: set[str] = set()
    for panel in graphs:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names and names <= served_names(), (panel["title"], names - served_names())
            assert 'run_id=~"$run_id"' in target["expr"], panel["title"]
            covered |= names
    for annotation in data["annotations"]["list"]:
        assert metric_names(annotation["expr"]) <= served_names()
    # Every metric of the worker is on the dashboard (buckets/sums count for histograms).
    stems = {re.sub(r"_(bucket|count|sum|created|total|info)$", "", n) for n in covered}
    missing = {re.sub(r"_(bucket|count|sum|created|total|info)$", "", n)
               for n in served_names() if n.startswith("elastic_train_")} - stems
    assert not missing, missing
