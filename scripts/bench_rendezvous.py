"""Benchmark the rendezvous backends (a measurement, not a test).

    python scripts/bench_rendezvous.py [--repeats 3] [--sizes 8,64,256,1000] [--processes 8]
        [--quadratic-up-to 64] [--failure-ttls 2,10] [--skip-launch]

1. Launch -> first training step of a 2-node job (two ``elastic-train run`` agents on this
   machine, ``--nnodes 2``, one worker each) with ``c10d``, torch's ``etcd`` and
   ``etcd-v2``, and our ``etcd-v3`` in both designs (``leases``, the default, and
   ``state-key``), in turns in the same run (so they share the machine's mood), against
   etcd 3.4 (v2 enabled for torch's backends, v3 only for ours). Also the rendezvous as
   torch's agent timed it (the ``rendezvous`` event). Medians of ``--repeats``.
2. Rendezvous of N participants: N handlers spread over P processes
   (tests/integration/rendezvous_participant.py, P = min(N, --processes), threads inside)
   join one round (min = max = N) against one etcd (v2 enabled, so that all designs use
   the same server): our ``etcd-v3`` with ``design=leases`` and ``design=state-key``, and
   torch's ``etcd-v2`` (torch's ``DynamicRendezvousHandler`` on the v2 API). Every process
   builds its handlers first (imports torch), then all start their joins at one wall-clock
   moment. Reported: seconds from that moment to the last handler's return; HTTP requests
   to etcd per participant up to its return (median and max; keep-alives included); and
   the requests per second per node afterwards while nobody joins (``--idle`` seconds:
   lease keep-alives, or torch's heartbeats). state-key and etcd-v2 are O(N^2) (every
   join and heartbeat rewrites one key by compare-and-swap): they run only at N <=
   ``--quadratic-up-to``. A run that takes longer than ``--timeout`` is reported as
   "timed out".
3. Failure detection (``design=leases``): ``--failure-nodes`` survivors in 2 processes and
   one victim process with 1 handler form a round; the victim is SIGKILLed; seconds from
   the kill to the first and to the last survivor whose ``num_nodes_waiting()`` (polled
   every 0.05 s) turns >= 1, for each ``lease_ttl`` of ``--failure-ttls``. Expected:
   at most lease_ttl + 1 s (etcd expires a lease lease_ttl after its last renewal, and
   checks every 0.5 s). The kill comes right after the round forms, less than lease_ttl / 4
   after the victim's lease was granted: close to the worst case.

Prints a markdown table of everything, and the command that made it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic_train.events.log import read_events
from elastic_train.rundir import RunDir
from tests.etcd_server import EtcdServer, etcd_binary, free_port
from tests.integration import harness

REPO = harness.REPO
JOB = ["--preset", "tiny", "--steps", "3", "--batch-size", "16", "--checkpoint-every", "off",
       "--log-every", "100"]
PARTICIPANT = REPO / "tests" / "integration" / "rendezvous_participant.py"
PREFIX = "/bench/rendezvous"

# (row name, --rdzv-backend, extra agent options)
LAUNCH = (("c10d", "c10d", ()), ("etcd (torch)", "etcd", ()), ("etcd-v2 (torch)", "etcd-v2", ()),
          ("etcd-v3 design=leases", "etcd-v3", ()),
          ("etcd-v3 design=state-key", "etcd-v3", ("--rdzv-conf", "design=state-key")))
DESIGNS = {"leases": "etcd-v3 design=leases", "state-key": "etcd-v3 design=state-key",
           "etcd-v2": "etcd-v2 (torch)"}
QUADRATIC = ("state-key", "etcd-v2")


# ---- 1. launch -> first step --------------------------------------------------------------
def launch_to_first_step(backend: str, extra: tuple[str, ...], endpoint: str
                         ) -> tuple[float, Any]:
    """Seconds from starting two agents to the job's first step; the rendezvous event."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{backend}-")) / "run"
    rdzv = ["--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
            "--rdzv-id", uuid.uuid4().hex[:8], *extra]
    started = time.time()
    nodes = [harness.node(run_dir, f"node-{i}", rdzv, JOB, "elastic-train", nnodes="2")
             for i in range(2)]
    try:
        first = nodes[0].wait_for_event(lambda e: e["event"] == "step", 180)
        for node in nodes:
            assert node.wait(180) == 0, node.report()
    finally:
        for node in nodes:
            node.stop()
    rendezvous = next(e for e in read_events(RunDir(run_dir).events)
                      if e["event"] == "rendezvous")
    return first["time"] - started, rendezvous


def bench_launch(repeats: int) -> list[list[str]]:
    """Rows: backend, launch -> first step, rendezvous (agent), the runs."""
    print(f"launch -> first step, 2 elastic-train run agents (--nnodes 2), {repeats} rounds "
          "of the backends in turn:", flush=True)
    servers = {"v2": EtcdServer.start(v2=True), "v3": EtcdServer.start(v2=False)}
    took: dict[str, list[float]] = {name: [] for name, _, _ in LAUNCH}
    rendezvous: dict[str, list[float]] = {name: [] for name, _, _ in LAUNCH}
    try:
        for _ in range(repeats):
            for name, backend, extra in LAUNCH:
                if backend == "c10d":
                    endpoint = f"127.0.0.1:{free_port()}"
                else:
                    endpoint = servers["v3" if backend == "etcd-v3" else "v2"].endpoint
                seconds, event = launch_to_first_step(backend, extra, endpoint)
                took[name].append(seconds)
                rendezvous[name].append(event["seconds"])
                print(f"  {name:25} {seconds:5.1f} s  rendezvous {event['seconds']:5.2f} s",
                      flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return [[f"`{name}`", f"{statistics.median(took[name]):.1f} s",
             f"{statistics.median(rendezvous[name]):.2f} s",
             ", ".join(f"{s:.1f}" for s in took[name])] for name, _, _ in LAUNCH]


# ---- participants in processes of their own --------------------------------------------
class BenchError(Exception):
    """A run that failed or timed out (its cell in the table says which)."""


@dataclass
class Process:
    """One rendezvous_participant.py: its lines arrive on the shared queue."""

    proc: subprocess.Popen[str]
    stderr: TextIO
    index: int

    def tail(self) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        lines = self.stderr.read().strip().splitlines()
        return "\n".join(lines[-15:])


@dataclass
class Group:
    """The participant processes of one run, and what they printed (stderr: a file each in
    ``logs``, kept with every thread's stack when the run fails)."""

    processes: list[Process] = field(default_factory=list)
    lines: queue.Queue[tuple[int, dict[str, Any]]] = field(default_factory=queue.Queue)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-rdzv-")))
    logs_kept: bool = False

    def start(self, server: EtcdServer, run_id: str, n: int, count: int, design: str,
              conf: str, *flags: str) -> Process:
        stderr = open(self.logs / f"process-{len(self.processes)}.stderr", "w+")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        argv = [sys.executable, str(PARTICIPANT), server.endpoint, PREFIX, run_id, str(n),
                str(n), str(count), conf, "--design", design, "--go-at", "stdin", *flags]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=stderr, text=True, env=env, start_new_session=True)
        process = Process(proc, stderr, len(self.processes))
        self.processes.append(process)
        threading.Thread(target=self._read, args=(process,), daemon=True).start()
        return process

    def _read(self, process: Process) -> None:
        assert process.proc.stdout is not None
        for raw in process.proc.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                continue  # not ours (a library printing)
            self.lines.put((process.index, line))
        self.lines.put((process.index, {"exited": process.proc.wait()}))

    def collect(self, key: str, count: int, deadline: float, what: str,
                expected_exit: int | None = None) -> list[tuple[int, dict[str, Any]]]:
        """``count`` lines that have ``key``; BenchError on an error line, the deadline or
        the exit of a process (but ``expected_exit``, a process index)."""
        found: list[tuple[int, dict[str, Any]]] = []
        while len(found) < count:
            try:
                index, line = self.lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                raise BenchError(f"timed out ({len(found)} of {count} {what})") from None
            if "error" in line:
                raise BenchError(f"failed: {line['error']}")
            if "exited" in line and index != expected_exit:
                raise BenchError(f"participant process exited ({line['exited']}) with "
                                 f"{len(found)} of {count} {what}:\n"
                                 f"{self.processes[index].tail()}")
            if key in line:
                found.append((index, line))
        return found

    def go(self, deadline: float) -> float:
        """Wait until every process built its handlers; tell them all one start moment."""
        self.collect("ready", len(self.processes), deadline, "processes ready")
        go_at = time.time() + 0.5
        for p in self.processes:
            assert p.proc.stdin is not None
            p.proc.stdin.write(f"{go_at!r}\n")
            p.proc.stdin.flush()
        return go_at

    def keep_logs(self) -> Path:
        """After a failure: every live participant's thread stacks into its stderr file."""
        for p in self.processes:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        self.logs_kept = True
        return self.logs

    def stop(self) -> None:
        """Close stdin (the handlers leave: leases revoked), then kill what is left."""
        for p in self.processes:
            try:
                assert p.proc.stdin is not None
                p.proc.stdin.close()
            except OSError:
                pass
        deadline = time.time() + 30
        for p in self.processes:
            try:
                p.proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait(10)
            p.stderr.close()
        if not self.logs_kept:
            shutil.rmtree(self.logs, ignore_errors=True)


def split(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


# ---- 2. N participants ------------------------------------------------------------------
@dataclass
class RunResult:
    last: float  # seconds from the common start to the last return
    first: float
    requests: list[int]  # per participant, up to its return
    idle_rate: list[float]  # requests per second per participant afterwards


def conf_of(timeout: float) -> str:
    # Whole seconds: torch reads etcd-v2's timeouts as integers.
    return f"last_call_timeout=1,join_timeout={max(1, int(timeout))}"


def rendezvous_run(server: EtcdServer, design: str, n: int, processes: int, idle: float,
                   timeout: float) -> RunResult:
    run_id = uuid.uuid4().hex
    group = Group()
    flags = ("--idle", f"{idle:g}") if idle > 0 else ()
    try:
        for count in split(n, min(n, processes)):
            group.start(server, run_id, n, count, design, conf_of(timeout), *flags)
        go_at = group.go(time.time() + max(120.0, timeout))
        joined = [line for _, line in group.collect("returned", n, go_at + timeout, "joined")]
        worlds = {(line["round"], line["world_size"]) for line in joined}
        ranks = sorted(line["rank"] for line in joined)
        if len(worlds) != 1 or next(iter(worlds))[1] != n or ranks != list(range(n)):
            raise BenchError(f"failed: not one world of {n}: (round, size) {sorted(worlds)}")
        rates: list[float] = []
        if idle > 0:
            lines = group.collect("idle_requests", n, time.time() + idle + 60, "idle counts")
            rates = [line["idle_requests"] / line["idle_seconds"] for _, line in lines]
        returned = [line["returned"] - go_at for line in joined]
        return RunResult(max(returned), min(returned), [line["requests"] for line in joined],
                         rates)
    except BenchError as exc:
        raise BenchError(f"{exc}\n    participants' stderr, stacks: {group.keep_logs()}"
                         ) from None
    finally:
        group.stop()


def bench_rendezvous(server: EtcdServer, sizes: list[int], designs: list[str], processes: int,
                     quadratic_up_to: int, idle: float, timeout: float, repeats: int
                     ) -> list[list[str]]:
    """Rows: design, N, processes, last return, requests per participant, idle rate."""
    print(f"rendezvous of N participants in min(N, {processes}) processes, min = max = N:",
          flush=True)
    rows = []
    for n in sizes:
        for design in designs:
            if design in QUADRATIC and n > quadratic_up_to:
                continue
            results: list[RunResult] = []
            failure = ""
            for _ in range(repeats):
                try:
                    results.append(rendezvous_run(server, design, n, processes, idle,
                                                  timeout))
                except BenchError as exc:
                    failure = str(exc)
                    print(f"  {design:9} N={n:<4} {failure}", flush=True)
                    break
                r = results[-1]
                print(f"  {design:9} N={n:<4} last return {r.last:7.2f} s (first "
                      f"{r.first:.2f} s)  requests median {statistics.median(r.requests):g}"
                      f" max {max(r.requests)}", flush=True)
            rows.append(table_row(design, n, min(n, processes), results, failure))
    return rows


def table_row(design: str, n: int, processes: int, results: list[RunResult], failure: str
              ) -> list[str]:
    name = f"`{DESIGNS[design]}`"
    if failure and not results:
        return [name, str(n), str(processes), failure.splitlines()[0], "", ""]
    lasts = sorted(r.last for r in results)
    last = f"{statistics.median(lasts):.2f} s"
    if len(lasts) > 1:
        last += f" ({lasts[0]:.2f}-{lasts[-1]:.2f})"
    if failure:
        last += f"; then {failure.splitlines()[0]}"
    requests = [x for r in results for x in r.requests]
    rates = [x for r in results for x in r.idle_rate]
    return [name, str(n), str(processes), last,
            f"{statistics.median(requests):g} (max {max(requests)})",
            f"{statistics.median(rates):.2f}" if rates else ""]


# ---- 3. failure detection ---------------------------------------------------------------
def failure_run(server: EtcdServer, survivors: int, ttl: int, timeout: float
                ) -> tuple[float, float, int]:
    """Seconds from SIGKILLing the victim to the first and the last survivor noticing; how
    many noticed before the kill (false alarms)."""
    run_id, n = uuid.uuid4().hex, survivors + 1
    conf = f"{conf_of(timeout)},lease_ttl={ttl}"
    group = Group()
    try:
        for count in split(survivors, min(2, survivors)):
            group.start(server, run_id, n, count, "leases", conf, "--watch-failures")
        victim = group.start(server, run_id, n, 1, "leases", conf)
        go_at = group.go(time.time() + max(120.0, timeout))
        group.collect("returned", n, go_at + timeout, "joined")
        killed = time.time()
        os.killpg(victim.proc.pid, signal.SIGKILL)
        noticed = [line["noticed"] - killed for _, line in
                   group.collect("noticed", survivors, killed + ttl + 30, "survivors noticed",
                                 expected_exit=victim.index)]
        return min(noticed), max(noticed), sum(1 for s in noticed if s < 0)
    except BenchError as exc:
        raise BenchError(f"{exc}\n    participants' stderr, stacks: {group.keep_logs()}"
                         ) from None
    finally:
        group.stop()


def bench_failures(server: EtcdServer, ttls: list[int], survivors: int, timeout: float
                   ) -> list[list[str]]:
    print(f"failure detection, design=leases: {survivors} survivors in 2 processes, 1 victim "
          "process SIGKILLed:", flush=True)
    rows = []
    for ttl in ttls:
        nodes = f"{survivors} + 1 killed"
        try:
            first, last, early = failure_run(server, survivors, ttl, timeout)
        except BenchError as exc:
            print(f"  lease_ttl {ttl}: {exc}", flush=True)
            rows.append([f"{ttl} s", nodes, str(exc).splitlines()[0], ""])
            continue
        print(f"  lease_ttl {ttl:3} s: kill -> first noticed {first:.2f} s, last {last:.2f} s"
              + (f" ({early} noticed BEFORE the kill)" if early else ""), flush=True)
        rows.append([f"{ttl} s", nodes, f"{first:.2f} s", f"{last:.2f} s"
                     + (f" ({early} before the kill)" if early else "")])
    return rows


# ---- the report ------------------------------------------------------------------------
def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def sizes_of(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3,
                        help="launches per backend (part 1)")
    parser.add_argument("--skip-launch", action="store_true", help="skip part 1")
    parser.add_argument("--sizes", default="8,64,256,1000",
                        help="N participants, comma-separated (part 2; '' skips it)")
    parser.add_argument("--participants", type=int, nargs="*", default=None,
                        help="the same as --sizes, space-separated (older spelling; no "
                             "value skips part 2)")
    parser.add_argument("--designs", default="leases,state-key,etcd-v2",
                        help=f"of {', '.join(DESIGNS)} (part 2)")
    parser.add_argument("--processes", type=int, default=8,
                        help="participant processes per run: min(N, this)")
    parser.add_argument("--quadratic-up-to", type=int, default=64,
                        help="largest N for the O(N^2) designs state-key and etcd-v2 (256: "
                             "minutes)")
    parser.add_argument("--rdzv-repeats", type=int, default=1,
                        help="runs per design and N (part 2; medians)")
    parser.add_argument("--idle", type=float, default=10.0,
                        help="seconds of requests counted per node after the round formed "
                             "(0: skip)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one run may take before it is reported as timed out")
    parser.add_argument("--failure-ttls", default="2,10",
                        help="lease_ttl values of part 3, comma-separated ('' skips it)")
    parser.add_argument("--failure-nodes", type=int, default=8,
                        help="survivors of part 3 (in 2 processes), besides the victim")
    ns = parser.parse_args()
    sizes = ns.participants if ns.participants is not None else sizes_of(ns.sizes)
    designs = [d for d in ns.designs.split(",") if d]
    unknown = [d for d in designs if d not in DESIGNS]
    if unknown:
        parser.error(f"--designs {','.join(unknown)}: use {', '.join(DESIGNS)}")
    ttls = sizes_of(ns.failure_ttls)
    command = shlex.join(["python", "scripts/bench_rendezvous.py", *sys.argv[1:]])

    # Many handlers: every socket etcd and the participants may open (they inherit it).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    load = os.getloadavg()[0]
    launch = [] if ns.skip_launch else bench_launch(ns.repeats)
    rendezvous: list[list[str]] = []
    failures: list[list[str]] = []
    if sizes or ttls:
        server = EtcdServer.start(v2=True)
        try:
            if sizes:
                rendezvous = bench_rendezvous(server, sizes, designs, ns.processes,
                                              ns.quadratic_up_to, ns.idle, ns.timeout,
                                              ns.rdzv_repeats)
            if ttls:
                failures = bench_failures(server, ttls, ns.failure_nodes, ns.timeout)
        finally:
            server.stop()

    print(f"\n```console\n$ {command}\n```\n")
    print(f"{os.cpu_count()} cores, load average {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end; {etcd_version()}, v2 API enabled; "
          f"open files limit {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}.\n")
    if launch:
        print(f"Launch -> first step, 2 agents, medians of {ns.repeats}:\n")
        print(markdown(["backend", "launch -> first step", "rendezvous (agent)", "runs"],
                       launch) + "\n")
    if rendezvous:
        print(f"N participants in min(N, {ns.processes}) processes, min = max = N "
              "(requests: HTTP requests to etcd per participant up to its return; idle: "
              f"requests per second per node over {ns.idle:g} s after the round formed):\n")
        print(markdown(["rendezvous", "N", "processes", "start -> last return",
                        "requests per participant (median)", "idle requests/s per node"],
                       rendezvous) + "\n")
    if failures:
        print("Failure detection, design=leases, survivors polling num_nodes_waiting() every "
              "0.05 s:\n")
        print(markdown(["lease_ttl", "nodes", "SIGKILL -> first noticed",
                        "SIGKILL -> last noticed"], failures) + "\n")
    return 0


def etcd_version() -> str:
    try:
        out = subprocess.run([etcd_binary(), "--version"], capture_output=True, text=True,
                             timeout=10).stdout
        return out.splitlines()[0].replace(" Version:", "").strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return "etcd"


if __name__ == "__main__":
    sys.exit(main())
