"""Losing a node and adding one, across agents on this machine: live recovery vs the restart
path vs the hand-written baseline, interleaved in one invocation.

For each backend (c10d, etcd-v3 on a real etcd) and each repetition, three jobs run one
after the other, in an order that rotates: the baseline (benchmarks/baseline_ddp.py under
plain torchrun agents), ours with ``--recovery restart`` (today's torchrun behaviour) and
ours with live recovery (the default). Each starts two nodes (``--nnodes 1:3``, one worker
each, the small preset), SIGKILLs one whole node (agent and worker) once the job trains,
and later starts a third. Measured on the surviving node's log:

- kill -> first step at world 1 (and steps redone: the steps done before the kill that
  the world did again);
- the survivor's pause when the node joins: its last step at world 1 -> its first at world
  2 (a step boundary, the re-formation and one step at world 2).

A phase that does not happen within its timeout (stock torchrun can hang or spend its
restarts) is counted as failed and left out of the medians. Rendezvous settings are every
backend's defaults, as a 64-node job would run them (c10d:
a 5 s last call, heartbeats every 5 s, a node dead after 3 missed; etcd-v3: a 5 s last
call, a 10 s lease). Ratios are live / restart and live / baseline of the same run.

    python benchmarks/node_recovery.py --reps 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench import BASELINE, _events, _ratio, _summary  # noqa: E402

from tests.etcd_server import EtcdServer, free_port  # noqa: E402
from tests.integration import harness  # noqa: E402

MODES = ("baseline", "restart", "live")
KILL_AFTER = 15  # steps at world 2 before the node is lost
STEPS_AT_ONE = 5  # steps at world 1 before a node joins
TIMEOUT = 120.0
FIGURES = ("kill -> first step at world 1", "steps redone", "survivor's pause on a join",
           "new node -> first step at world 2")


def _node(run_dir: Path, name: str, backend: str, endpoint: str, mode: str, host: bool
          ) -> harness.Job:
    rdzv = [f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_dir.parent.name}"]
    if backend == "c10d":
        rdzv.append(f"--rdzv-conf=last_call_timeout=5,is_host={'true' if host else 'false'}")
    common = ["--nnodes=1:3", "--nproc-per-node=1", "--max-restarts=3",
              "--monitor-interval=0.1", *rdzv]
    if mode == "baseline":
        argv = [sys.executable, "-m", "torch.distributed.run", *common, BASELINE,
                str(run_dir), "--preset", "small", "--steps", "100000", "--batch-size", "16",
                "--checkpoint-every", "10"]
        # As the README tells torchrun users across nodes: torch's shared store otherwise
        # hangs restarts (FIELD-NOTES), seen here at the join (role_info wait timeout).
        return harness.start(argv, run_dir, harness.job_env(
            {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}), log_name=name)
    argv = [sys.executable, "-m", "elastic_train", "run", *common, "--run-dir", str(run_dir),
            "--preset", "small", "--steps", "100000", "--batch-size", "16",
            "--checkpoint-every", "10", "--log-every", "1000", "--warmup-steps", "0",
            "--recovery", mode, "--metrics-port", "0"]
    return harness.start(argv, run_dir, log_name=name)


class _Failed(Exception):
    """A phase of the scenario did not happen within its timeout."""


def _wait(read: Callable[[], list[dict[str, Any]]], found: Callable[[list[dict[str, Any]]], Any],
          what: str) -> Any:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        result = found(read())
        if result:
            return result
        time.sleep(0.01)
    raise _Failed(what)


def _steps(events: list[dict[str, Any]], world: int, after: float = 0.0
           ) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "step" and e.get("world_size") == world
            and e["time"] > after]


def one_run(run_dir: Path, backend: str, endpoint: str, mode: str) -> dict[str, float]:
    """The scenario of the module doc for one job; its measurements (seconds, steps; a
    phase that failed is missing)."""
    measured: dict[str, float] = {}
    try:
        _scenario(run_dir, backend, endpoint, mode, measured)
    except _Failed as failed:
        print(f"  {run_dir.parent.name}: no {failed} within {TIMEOUT:g} s (logs in "
              f"{run_dir.parent})", flush=True)
    return measured


def _scenario(run_dir: Path, backend: str, endpoint: str, mode: str,
              measured: dict[str, float]) -> None:
    log = run_dir / ("baseline.jsonl" if mode == "baseline" else "events.jsonl")

    def read() -> list[dict[str, Any]]:
        return _events(log)

    nodes = [_node(run_dir, "node-a", backend, endpoint, mode, host=True)]
    try:
        time.sleep(0.3)  # node-a binds the c10d store first
        nodes.append(_node(run_dir, "node-b", backend, endpoint, mode, host=False))
        _wait(read, lambda ev: [e for e in _steps(ev, 2) if e["step"] >= KILL_AFTER],
              "step at world 2")
        victim = nodes[1]  # node-a keeps the c10d store (its loss would end the job)
        done = max(e["step"] for e in _steps(read(), 2))
        killed_at = victim.kill_node()
        shrunk = _wait(read, lambda ev: _steps(ev, 1, killed_at)[:1], "step at world 1")[0]
        measured["kill -> first step at world 1"] = shrunk["time"] - killed_at
        events = read()
        if mode == "live":
            recovery = next(e for e in events if e["event"] == "recovery"
                            and e["time"] > killed_at)
            redone = float(recovery["steps_redone"])
        else:
            startup = next(e for e in events if e["event"] == "startup"
                           and e["time"] > killed_at)
            redone = float(max(0, done - startup["resumed_step"]))
        measured["steps redone"] = redone
        _wait(read, lambda ev: [e for e in _steps(ev, 1, killed_at)
                                if e["step"] >= shrunk["step"] + STEPS_AT_ONE],
              "steps at world 1")
        joined_at = time.time()
        nodes.append(_node(run_dir, "node-c", backend, endpoint, mode, host=False))
        grown = _wait(read, lambda ev: _steps(ev, 2, joined_at)[:1],
                      "step at world 2 after the join")[0]
        last_alone = max((e for e in _steps(read(), 1, killed_at) if e["time"] < grown["time"]),
                         key=lambda e: e["time"])
        measured["survivor's pause on a join"] = grown["time"] - last_alone["time"]
        measured["new node -> first step at world 2"] = grown["time"] - joined_at
    finally:
        for node in nodes:
            node.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backends", default="c10d,etcd-v3")
    ns = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="et-nodes-"))
    print(f"# node loss and join ({time.strftime('%Y-%m-%d %H:%M')}, runs in {tmp})")
    etcd = EtcdServer.start() if "etcd-v3" in ns.backends else None
    try:
        for backend in ns.backends.split(","):
            results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
            for rep in range(ns.reps):
                order = MODES[rep % 3:] + MODES[:rep % 3]
                for mode in order:
                    endpoint = etcd.endpoint if backend == "etcd-v3" and etcd \
                        else f"127.0.0.1:{free_port()}"
                    run_dir = tmp / f"{backend}-{mode}-{rep}" / "run"
                    results[mode].append(one_run(run_dir, backend, endpoint, mode))
                    print(f"  {backend} {mode} {rep}: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in results[mode][-1].items()), flush=True)
            print(f"\n## {backend}: 2 nodes, one lost, one added (small preset, 1 worker per "
                  f"node, {ns.reps} repetition(s))")
            print("| figure | baseline | ours, restart | ours, live | live / restart | "
                  "live / baseline |")
            print("|---|---|---|---|---|---|")
            for key in FIGURES:
                base, restart, live = ([r[key] for r in results[m] if key in r] for m in MODES)
                print(f"| {key} | {_summary(base)} | {_summary(restart)} | {_summary(live)} | "
                      f"{_ratio(live, restart)} | {_ratio(live, base)} |")
            for mode in MODES:
                failed = sum(len(r) < len(FIGURES) for r in results[mode])
                if failed:
                    print(f"{mode}: {failed} of {ns.reps} runs failed a phase (see above)")
    finally:
        if etcd is not None:
            etcd.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
