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

``--hosts netns``: the same interleaved jobs with every node on a host of its own
(tests/netbed.py: a network namespace per host, own host name and address, a bridge
between them; etcd on a host of its own; c10d's store in node-a's agent), so that a lost
node is as silent as it is between machines. A fresh bed per job. ``--faults`` chooses
what happens to node-b once the job trains at world 2:

- ``kill``: every process of its host SIGKILLed; later node-c starts on a third host;
- ``cable``: its cable pulled (switch port down: no FIN, no RST), put back after ``--hold``
  seconds (20);
- ``freeze``: every process of its host SIGSTOPped, SIGCONTinued after ``--hold`` seconds.

Measured: fault -> first step at world 1; steps redone there; the join (node-c started,
cable back, thawed) -> first step at world 2; the survivor's pause on it (its last step at
world 1 -> its first at world 2); steps redone on the join. A phase that does not happen
within ``--timeout`` seconds (for world 1 after a cable or a freeze: within the hold) is
counted as failed, e.g. a job that re-forms and then never steps again (a wedge).

    python benchmarks/node_recovery.py --hosts netns --reps 3 --faults kill,cable,freeze
"""

from __future__ import annotations

import argparse
import statistics
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

from tests import netbed  # noqa: E402
from tests.etcd_server import EtcdServer, free_port  # noqa: E402
from tests.integration import harness, hosts  # noqa: E402

MODES = ("baseline", "restart", "live")
KILL_AFTER = 15  # steps at world 2 before the node is lost
STEPS_AT_ONE = 5  # steps at world 1 before a node joins
TIMEOUT = 120.0
FIGURES = ("kill -> first step at world 1", "steps redone", "survivor's pause on a join",
           "new node -> first step at world 2")
FAULTS = ("kill", "cable", "freeze")
HOLD = 20.0  # seconds a cable stays out / a host stays frozen (--hold)
C10D_PORT = 29400  # c10d's store in node-a's agent (a host of its own: the port is free)
JOIN = {"kill": "new node", "cable": "cable back", "freeze": "thawed"}
LOSS = {"kill": "kill", "cable": "cable pulled", "freeze": "frozen"}


def netns_figures(fault: str) -> tuple[str, ...]:
    """The rows of a fault's table across hosts."""
    return (f"{LOSS[fault]} -> first step at world 1", "steps redone",
            f"{JOIN[fault]} -> first step at world 2", "survivor's pause on a join",
            "steps redone on the join")


def _argv(run_dir: Path, backend: str, endpoint: str, mode: str, host: bool,
          local_addr: str | None = None) -> tuple[list[str], dict[str, str]]:
    """A node's command line and environment (``host``: it holds c10d's store)."""
    rdzv = [f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_dir.parent.name}"]
    if backend == "c10d":
        rdzv.append(f"--rdzv-conf=last_call_timeout=5,is_host={'true' if host else 'false'}")
    if local_addr:
        rdzv.append(f"--local-addr={local_addr}")
    common = ["--nnodes=1:3", "--nproc-per-node=1", "--max-restarts=3",
              "--monitor-interval=0.1", *rdzv]
    if mode == "baseline":
        argv = [sys.executable, "-m", "torch.distributed.run", *common, BASELINE,
                str(run_dir), "--preset", "small", "--steps", "100000", "--batch-size", "16",
                "--checkpoint-every", "10"]
        # As the README tells torchrun users across nodes: torch's shared store otherwise
        # hangs restarts (docs/stock-torch.md), seen here at the join (role_info wait timeout).
        return argv, harness.job_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    argv = [sys.executable, "-m", "elastic_train", "run", *common, "--run-dir", str(run_dir),
            "--preset", "small", "--steps", "100000", "--batch-size", "16",
            "--checkpoint-every", "10", "--log-every", "1000", "--warmup-steps", "0",
            "--recovery", mode, "--metrics-port", "0"]
    return argv, harness.job_env()


def _node(run_dir: Path, name: str, backend: str, endpoint: str, mode: str, host: bool
          ) -> harness.Job:
    argv, env = _argv(run_dir, backend, endpoint, mode, host)
    return harness.start(argv, run_dir, env, log_name=name)


def _host_node(run_dir: Path, host: netbed.Host, backend: str, endpoint: str, mode: str,
               store: bool) -> hosts.Node:
    """A node on a host of the bed, its output time-stamped in ``<name>.log``."""
    argv, env = _argv(run_dir, backend, endpoint, mode, store, local_addr=host.ip)
    log = run_dir.parent / f"{host.name}.log"
    proc = host.popen(argv, env={**env, "PYTHONUNBUFFERED": "1"}, log=log,
                      cwd=run_dir.parent, timestamps=True)
    return hosts.Node(proc, run_dir, log, host=host)


class _Failed(Exception):
    """A phase of the scenario did not happen within its timeout."""


def _wait(read: Callable[[], list[dict[str, Any]]], found: Callable[[list[dict[str, Any]]], Any],
          what: str, timeout: float | None = None) -> Any:
    timeout = TIMEOUT if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = found(read())
        if result:
            return result
        time.sleep(0.01)
    raise _Failed(f"{what} within {timeout:g} s")


def _steps(events: list[dict[str, Any]], world: int, after: float = 0.0
           ) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "step" and e.get("world_size") == world
            and e["time"] > after]


def one_run(run_dir: Path, backend: str, endpoint: str, mode: str,
            fault: str | None = None, hold: float = HOLD) -> dict[str, float]:
    """The scenario of the module doc for one job (across hosts when ``fault`` is given);
    its measurements (seconds, steps; a phase that failed is missing)."""
    measured: dict[str, float] = {}
    try:
        if fault is None:
            _scenario(run_dir, backend, endpoint, mode, measured)
        else:
            _netns_scenario(run_dir, backend, mode, fault, hold, measured)
    except _Failed as failed:
        print(f"  {run_dir.parent.name}: no {failed} (logs in {run_dir.parent})", flush=True)
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


def _redone(events: list[dict[str, Any]], after: float, last_done: int) -> float | None:
    """Steps redone by the re-formation that followed ``after``: the first recovery event's
    count (ours), else the steps done before it that the next incarnation did again."""
    for e in events:
        if e["event"] == "recovery" and e["time"] > after and e.get("steps_redone") is not None:
            return float(e["steps_redone"])
    for e in events:
        if e["event"] == "startup" and e["time"] > after:
            return float(max(0, last_done - e["resumed_step"]))
    return None


def _store_listens(host: netbed.Host, port: int, timeout: float) -> None:
    """Wait until c10d's store listens on ``host`` (node-a binds it before node-b starts)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            host.connect(host.ip, port, timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise _Failed(f"c10d store on {host.name} within {timeout:g} s") from None
            time.sleep(0.05)


def _netns_scenario(run_dir: Path, backend: str, mode: str, fault: str, hold: float,
                    measured: dict[str, float]) -> None:
    """Two nodes on hosts of their own, node-b's host lost by ``fault`` once the job
    trains; the module doc's figures (``netns_figures``) into ``measured``."""
    loss, redone_loss, join_step, pause, redone_join = netns_figures(fault)
    log = run_dir / ("baseline.jsonl" if mode == "baseline" else "events.jsonl")

    def read() -> list[dict[str, Any]]:
        return _events(log)

    with netbed.Netbed.create(["node-a", "node-b", "node-c"], etcd=backend == "etcd-v3",
                              workdir=run_dir.parent / "bed") as bed:
        a, b, c = bed.hosts[:3]
        endpoint = bed.etcd.endpoint if bed.etcd else f"{a.ip}:{C10D_PORT}"
        _host_node(run_dir, a, backend, endpoint, mode, store=True)
        if backend == "c10d":
            _store_listens(a, C10D_PORT, TIMEOUT)
        _host_node(run_dir, b, backend, endpoint, mode, store=False)
        _wait(read, lambda ev: [e for e in _steps(ev, 2) if e["step"] >= KILL_AFTER],
              "step at world 2")
        done = max(e["step"] for e in _steps(read(), 2))
        fault_at = {"kill": b.kill, "cable": b.cable_down, "freeze": b.freeze}[fault]()
        heal_by = fault_at + hold
        try:
            shrunk = _wait(read, lambda ev: _steps(ev, 1, fault_at)[:1], "step at world 1",
                           TIMEOUT if fault == "kill" else hold)[0]
        finally:
            if fault != "kill":  # a host frozen or cut off is never left so at teardown
                time.sleep(max(0.0, heal_by - time.time()))
        measured[loss] = shrunk["time"] - fault_at
        redone = _redone(read(), fault_at, done)
        if redone is not None:
            measured[redone_loss] = redone
        if fault == "kill":
            _wait(read, lambda ev: [e for e in _steps(ev, 1, fault_at)
                                    if e["step"] >= shrunk["step"] + STEPS_AT_ONE],
                  "steps at world 1")
            joined_at = time.time()
            _host_node(run_dir, c, backend, endpoint, mode, store=False)
        else:
            joined_at = b.cable_up() if fault == "cable" else b.thaw()
        grown = _wait(read, lambda ev: _steps(ev, 2, joined_at)[:1],
                      "step at world 2 after the join")[0]
        measured[join_step] = grown["time"] - joined_at
        alone = [e for e in _steps(read(), 1, fault_at) if e["time"] < grown["time"]]
        last_alone = max(alone, key=lambda e: e["time"])
        measured[pause] = grown["time"] - last_alone["time"]
        redone = _redone(read(), joined_at, last_alone["step"])
        if redone is not None:
            measured[redone_join] = redone
        causes = [e.get("cause") or e.get("kind") for e in read() if e["event"] == "recovery"]
        if causes:
            print(f"  {run_dir.parent.name}: recoveries {causes}", flush=True)


def main() -> int:
    global TIMEOUT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--backends", default="c10d,etcd-v3")
    parser.add_argument("--hosts", choices=("loopback", "netns"), default="loopback",
                        help="loopback: every node an agent on this host (the default); "
                             "netns: every node on a host of its own (tests/netbed.py)")
    parser.add_argument("--faults", default=None,
                        help=f"with --hosts netns: some of {','.join(FAULTS)} (default: all)")
    parser.add_argument("--hold", type=float, default=HOLD,
                        help="seconds a cable stays pulled / a host frozen (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT,
                        help="seconds a phase may take before it counts as failed "
                             "(default %(default)s)")
    ns = parser.parse_args()
    TIMEOUT = ns.timeout
    if ns.hosts == "loopback":
        if ns.faults not in (None, "kill"):
            parser.error("--faults cable/freeze need --hosts netns")
        return _loopback(ns)
    faults = (ns.faults or ",".join(FAULTS)).split(",")
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}: choose from {','.join(FAULTS)}")
    reason = netbed.unavailable_reason()
    if reason is not None:
        parser.error(f"--hosts netns: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="et-nodes-netns-"))
    print(f"# node loss and join across hosts ({time.strftime('%Y-%m-%d %H:%M')}, runs in "
          f"{tmp})")
    for backend in ns.backends.split(","):
        for fault in faults:
            figures = netns_figures(fault)
            results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
            for rep in range(ns.reps):
                for mode in MODES[rep % 3:] + MODES[:rep % 3]:
                    run_dir = tmp / f"{backend}-{fault}-{mode}-{rep}" / "run"
                    results[mode].append(one_run(run_dir, backend, "", mode, fault, ns.hold))
                    print(f"  {backend} {fault} {mode} {rep}: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in results[mode][-1].items()), flush=True)
            what = {"kill": "node-b's host killed, node-c added",
                    "cable": f"node-b's cable pulled for {ns.hold:g} s",
                    "freeze": f"node-b's host frozen for {ns.hold:g} s"}[fault]
            _table(f"{backend}, across hosts: 2 nodes, {what} (small preset, 1 worker per "
                   f"node, {ns.reps} repetition(s))", figures, results, ns.reps)
    return 0


def _table(title: str, figures: tuple[str, ...], results: dict[str, list[dict[str, float]]],
           reps: int) -> None:
    print(f"\n## {title}")
    print("| figure | baseline | ours, restart | ours, live | live / restart | "
          "live / baseline |")
    print("|---|---|---|---|---|---|")
    for key in figures:
        base, restart, live = ([r[key] for r in results[m] if key in r] for m in MODES)
        print(f"| {key} | {_summary(base)} | {_summary(restart)} | {_summary(live)} | "
              f"{_ratio_or_na(live, restart)} | {_ratio_or_na(live, base)} |")
    for mode in MODES:
        failed = sum(len(r) < len(figures) for r in results[mode])
        if failed:
            print(f"{mode}: {failed} of {reps} runs failed a phase (see above)")


def _ratio_or_na(num: list[float], den: list[float]) -> str:
    """``bench._ratio``, n/a where the denominator's median is 0 (no steps redone)."""
    return "n/a" if den and statistics.median(den) == 0 else _ratio(num, den)


def _loopback(ns: argparse.Namespace) -> int:
    """Every node an agent on this host (the module doc's first scenario)."""
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
            _table(f"{backend}: 2 nodes, one lost, one added (small preset, 1 worker per "
                   f"node, {ns.reps} repetition(s))", FIGURES, results, ns.reps)
    finally:
        if etcd is not None:
            etcd.stop()
    return 0

if __name__ == "__main__":
    sys.exit(main())
