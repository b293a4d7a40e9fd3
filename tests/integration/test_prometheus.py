"""A real Prometheus (deploy/'s config and alert rules) scrapes a real 2-worker elastic job
(``elastic-train run``) while one worker is SIGKILLed: both workers' series, the restart
counter going up, the world size, steps continuing after the restart, values equal to the
event log's, the alert rules and every dashboard query on that data; and ``elastic-train
report`` draws the run.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elastic_train import cli
from elastic_train.batch_shares import shard_bounds
from tests.integration import harness, prom
from tests.unit.test_report import png_size

pytestmark = pytest.mark.slow

STEPS, EVERY, BATCH = 80, 20, 16
TIMEOUT = 180
DASHBOARD = harness.REPO / "deploy" / "grafana" / "elastic-train.json"


@dataclass
class Observed:
    """The killed-and-restarted job, and the Prometheus that watched it (None: not installed)."""

    run_dir: Path
    events: list[dict[str, Any]]
    base_port: int
    prometheus: prom.Prometheus | None

    def first(self, kind: str, **fields: Any) -> dict[str, Any]:
        return next(e for e in self.events if e["event"] == kind
                    and all(e.get(k) == v for k, v in fields.items()))

    @property
    def began(self) -> float:
        return self.first("start")["time"]

    @property
    def ended(self) -> float:
        return self.first("end")["time"]

    @property
    def final(self) -> float:
        """A time after the workers' last scrape: they linger for it after the end."""
        return self.ended + 10

    def server(self) -> prom.Prometheus:
        prom.tool("prometheus")   # skips (fails under CI) when Prometheus is not installed
        assert self.prometheus is not None
        return self.prometheus


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    work = tmp_path_factory.mktemp("observed")
    base = harness.free_ports(2)
    server = None
    if prom.available("prometheus"):
        server = prom.start(work / "prometheus", [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"])
    run_dir = work / "run"
    # Paced steps (50 ms): the kill must land mid-training, after Prometheus has seen step
    # 25; unpaced, a fast machine finished the 80 steps before its scrape saw them.
    job = harness.elastic_run(run_dir, [
        "--task", "tests.integration.paced_task:make_task", "--task-opt", "pace=0.05",
        "--max-restarts", "2", "--preset", "tiny", "--steps", str(STEPS),
        "--batch-size", str(BATCH), "--checkpoint-every", str(EVERY),
        "--metrics-port", str(base), "--metrics-address", "127.0.0.1", "--metrics-linger", "30",
        "--min-world-size", "2", "--recovery", "restart"])
    try:
        if server is not None:   # kill once Prometheus has seen both workers past step 25
            def alive() -> None:
                assert job.proc.poll() is None, f"job ended before the kill: {job.report()}"

            server.wait_for("elastic_train_step >= 25",
                            lambda r: {s["metric"]["rank"] for s in r} == {"0", "1"},
                            timeout=TIMEOUT, alive=alive)
        else:
            job.wait_for_event(lambda e: e["event"] == "step" and e["step"] == 25, TIMEOUT)
        job.kill_worker(1)
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    yield Observed(run_dir, job.events(), base, server)
    if server is not None:
        server.stop()


def series(result: list[dict[str, Any]], label: str = "rank") -> dict[str, list[float]]:
    """{label value: values} of a range query's result."""
    return {s["metric"].get(label, ""): [float(v) for _, v in s["values"]] for s in result}


def instant(result: list[dict[str, Any]], label: str = "rank") -> dict[str, float]:
    return {s["metric"].get(label, ""): float(s["value"][1]) for s in result}


def test_prometheus_sees_both_workers_restart_and_keep_stepping(observed: Observed) -> None:
    server = observed.server()
    start, end = observed.began - 1, observed.final
    targets = server.query("group by (rank, instance, job, cluster) "
                           "(last_over_time(elastic_train_build_info[10m]))", at=end)
    assert sorted((t["metric"]["rank"], t["metric"]["instance"], t["metric"]["job"],
                   t["metric"]["cluster"]) for t in targets) == [
        ("0", f"127.0.0.1:{observed.base_port}", "elastic_train", "test"),
        ("1", f"127.0.0.1:{observed.base_port + 1}", "elastic_train", "test")]
    # The restart counter went from 0 to 1 on both workers, and never back.
    restarts = series(server.query_range("max by (rank) (elastic_train_restarts_total)",
                                         start, end, 0.1))
    for rank in ("0", "1"):
        values = restarts[rank]
        assert values[0] == 0 and values[-1] == 1 and values == sorted(values), values
    # The world size stayed 2 in both incarnations.
    world = series(server.query_range("elastic_train_world_size", start, end, 0.1))
    assert set(world) == {"0", "1"} and {v for vs in world.values() for v in vs} == {2.0}
    # Steps went on after the restart, up to the last one.
    after = series(server.query_range(
        "max by (rank) (elastic_train_step and on (rank) (elastic_train_restarts_total == 1))",
        start, end, 0.1))
    for rank in ("0", "1"):
        steps = after[rank]
        assert steps == sorted(steps) and len(set(steps)) >= 2 and steps[-1] == STEPS, steps


def test_prometheus_values_equal_the_event_log(observed: Observed) -> None:
    server = observed.server()
    restart = observed.first("start", restart=1)
    before = [e for e in observed.events if e["time"] < restart["time"]]
    resumed_from = observed.first("checkpoint_loaded")["step"]
    last_step = [e for e in before if e["event"] == "step"][-1]["step"]
    first_after = next(e for e in observed.events
                       if e["event"] == "step" and e["time"] > restart["time"])
    saves_after = [e for e in observed.events
                   if e["event"] == "checkpoint_saved" and e["time"] > restart["time"]]

    def last(expr: str) -> dict[str, float]:
        return instant(server.query(f"last_over_time({expr}[10m])", at=observed.final))

    assert last("elastic_train_lost_steps") == {"0": last_step - resumed_from}
    assert last("elastic_train_recovery_seconds")["0"] == pytest.approx(
        first_after["time"] - before[-1]["time"], abs=1e-5)
    assert last("elastic_train_restarts_total") == {"0": 1, "1": 1}
    assert last("elastic_train_steps_total") == {"0": STEPS - resumed_from,
                                                 "1": STEPS - resumed_from}
    shares = {r: shard_bounds(BATCH, r, 2) for r in (0, 1)}
    assert last("elastic_train_samples_total") == {
        str(r): (STEPS - resumed_from) * (stop - start) for r, (start, stop) in shares.items()}
    assert last("elastic_train_checkpoint_load_duration_seconds_count") == {"0": 1, "1": 1}
    assert last('elastic_train_checkpoint_save_duration_seconds_count{stage="persist"}') == \
        {"0": len(saves_after), "1": 0}
    assert last("elastic_train_last_checkpoint_step") == {"0": STEPS}
    assert last("elastic_train_step") == {"0": STEPS, "1": STEPS}
    # The agent's rendezvous of the restart, as torch measured it, reached both workers.
    assert last("elastic_train_rendezvous_duration_seconds") == {
        "0": restart_rendezvous(observed), "1": restart_rendezvous(observed)}


def restart_rendezvous(observed: Observed) -> float:
    seconds = observed.first("rendezvous", restart=1)["seconds"]
    assert seconds is not None and seconds > 0
    return seconds


def test_alert_rules_load_evaluate_and_fire_on_the_restart(observed: Observed) -> None:
    server = observed.server()
    rules = [r for g in server.api("rules")["groups"] for r in g["rules"]]
    assert len(rules) == 7
    assert all(r["health"] == "ok" for r in rules), rules
    fired = server.query('max by (alertname, run_id) (max_over_time('
                         'ALERTS{alertstate="firing"}[10m]))', at=observed.final)
    # --max-restarts 2 and one restart: half the budget is spent; nothing else is wrong.
    assert [(a["metric"]["alertname"], a["metric"]["run_id"]) for a in fired] == [
        ("ElasticTrainRestartsBurning", observed.first("start")["run_id"])]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every panel of the Grafana dashboard."""
    data = json.loads(DASHBOARD.read_text())
    panels = [p for top in data["panels"] for p in [top, *top.get("panels", [])]]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def test_every_dashboard_query_returns_data(observed: Observed) -> None:
    """Over the run, as a dashboard draws it: one instant would miss a panel whose series
    the restarted workers set only at their final checkpoint, scraped after the end."""
    server = observed.server()
    at = observed.ended
    began = observed.first("start")["time"]
    for title, expr in dashboard_queries():
        concrete = expr.replace("$run_id", ".*").replace("$__rate_interval", "5s")
        assert "$" not in concrete, (title, concrete)
        assert server.query_range(concrete, began, time.time(), 0.5), \
            f"panel {title!r}: no data for {concrete}"
    annotation = json.loads(DASHBOARD.read_text())["annotations"]["list"][0]["expr"]
    server.query(annotation.replace("$run_id", ".*"), at=at)   # valid PromQL
    run_ids = server.api("label/run_id/values", **{"match[]": "elastic_train_build_info"})
    assert observed.first("start")["run_id"] in run_ids


def test_report_draws_the_failed_run(observed: Observed,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", str(observed.run_dir)]) == 0
    out = capsys.readouterr()
    assert out.out.endswith(f"wrote {observed.run_dir / 'report.png'}, "
                            f"{observed.run_dir / 'report.txt'}\n")
    assert png_size(observed.run_dir / "report.png") == (1500, 1050)
    assert (observed.run_dir / "report.png").stat().st_size > 50_000   # drawn, not blank
    text = (observed.run_dir / "report.txt").read_text()
    assert out.out.startswith(text)
    loaded = observed.first("checkpoint_loaded")["step"]
    match = re.search(r"failure 1 +after step (\d+); resumed from step (\d+) \((\d+) steps "
                      r"redone\); training again [\d.]+ s after the last sign of life", text)
    assert match, text
    after, resumed, redone = map(int, match.groups())
    assert resumed == loaded and redone == after - loaded
    assert f"{STEPS}/{STEPS} steps" in text and "restarts survived 1" in text
