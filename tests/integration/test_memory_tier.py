"""The memory tier with real agents: two ``elastic-train run`` nodes (c10d, one worker
each, on this machine). A snapshot that rank 0 offers is held by both agents (2 copies);
the worker of the other node reads it through its own agent; when every worker has died,
the next incarnation finds it in the agents' memory. With ``--memory-tier off`` a worker
finds no holder. The worker: user_scripts/memory_tier_worker.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration import harness

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "user_scripts" / "memory_tier_worker.py"
FAST = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=60"
TIMEOUT = 120


def results(out: Path, what: str) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{what}-*.json"))]


@pytest.mark.extended  # the same across real hosts, with a real job: test_object_store_jobs.py
def test_two_agents_hold_a_snapshot_that_outlives_every_worker(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = harness.free_ports()
    nodes = []
    for name in ("node-a", "node-b"):
        conf = f"{FAST},is_host={'true' if name == 'node-a' else 'false'}"
        argv = [sys.executable, "-m", "elastic_train", "run", "--nnodes", "2",
                "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval", "0.1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", tmp_path.name, "--rdzv-conf", conf, str(SCRIPT), str(out)]
        nodes.append(harness.start(argv, tmp_path / name, log_name=name))
    try:
        codes = [node.wait(TIMEOUT) for node in nodes]
    finally:
        for node in nodes:
            node.stop()
    logs = "\n".join(node.report() for node in nodes)
    assert codes == [0, 0], logs
    [offer] = results(out, "offer")
    assert offer["copies"] == 2, logs
    assert len(set(offer["held_by"])) == 2 and offer["url"] in offer["held_by"]
    assert all(str(u).startswith("http://127.0.0.1:") for u in offer["held_by"])
    [read] = results(out, "read")
    assert read["same"] and read["url"] != offer["url"]  # through its own agent
    restored = results(out, "restored")
    assert len(restored) == 2 and all(r["same"] for r in restored), logs
    assert restored[0]["newest"]["step"] == 7


def test_a_job_without_the_memory_tier_gives_its_workers_no_holder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = harness.start([sys.executable, "-m", "elastic_train", "run", "--nproc-per-node", "1",
                         "--memory-tier", "off", str(SCRIPT), str(out)], tmp_path / "run")
    try:
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    assert results(out, "none") == [{"restart": 0}]
