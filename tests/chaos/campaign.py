"""A fault campaign: a job across the hosts of a test bed, faults of a schedule in sequence,
and what a user relies on checked from outside the framework.

``Campaign(bed, setup, workdir)`` starts ``elastic-train run`` on every node host
(tests/netbed.py: each its own network namespace, name and address; etcd on a host of its
own), waits for the full world, then ``run(schedule)`` applies the faults one after the
other: each held for its hold, healed, then (for some) the full world awaited, then the gap.
What it observes comes from outside: the agents' processes and exit codes, the hosts'
process lists, the shared event log's step times, the loop's own records of the samples it
was given, the checkpoints as ``elastic-train checkpoints verify`` reads them. ``finish()``
SIGTERMs every agent, waits, and audits. Violations are collected, not raised, so that a
soak (benchmarks/chaos.py) goes on and counts them; a test asserts there are none.

Measured per fault (``FaultRecord``):
- ``next_step``: fault -> the end of the first step that *started* after the fault (steps
  run back to back: the one whose predecessor ended after the fault), the cost a user
  meets; a fault that costs nothing reads about one or two step times;
- ``full_world``: heal -> the first step at the full world that started after the heal
  (an agent's start included, for a host killed).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import netbed as nb
from tests.chaos.audit import audit_samples, verify_checkpoints
from tests.chaos.disk import fill
from tests.chaos.schedule import KINDS, Fault, Schedule
from tests.integration import harness, hosts
from tests.integration.hosts import EventLog

NEXT_STEP_BOUND = 60.0
"""A fault after which no step starts within this many seconds wedged the job."""
HEAL_BOUND = 90.0
"""A heal after which the world is not full again within this many seconds is a failure."""
START_BOUND = 180.0
"""The job's first step at the full world, from the agents' start."""
FINAL_BOUND = 60.0
"""Seconds from the final SIGTERM to every agent's exit (the preemption budget, 25 s by
default, and the agent's own shutdown)."""
RENDEZVOUS_CLOSED = "a job with this --rdzv-id already finished"
"""An agent's last line when the job's rendezvous is closed (the job ended)."""
STOCK_ROUND = "an agent of this rendezvous round is not elastic-train run's"
"""An agent's line when its round started every worker the torch way (live recovery off
until the next round): in a campaign every agent is ours, so it is a member lost and taken
for plain torchrun (c10d seed 642's replay: a cable pulled next cost 13.5 s)."""
JOB_DEATH_WINDOW = 10.0
"""Every node's agent ending by itself within this many seconds (each one started again as
it ends) is the whole job ending."""
SESSION_LOOP = Path(__file__).resolve().parents[1] / "integration" / "session_live_loop.py"
BUILTIN_SAMPLES = 800
"""The built-in job's corpus, in 64-byte windows (``corpus_max_bytes``)."""


LIVE_RESTARTS_SPENT = "the world cannot re-form in place (the live restarts of " \
    "--max-restarts are spent)"
"""An agent's line when a worker of its node fails with its live restarts spent: the node
takes torch's restart path (the world goes on without it until it is back)."""


@dataclass(frozen=True)
class Setup:
    """The job a campaign runs."""

    backend: str = "etcd-v3"
    """``etcd-v3`` (etcd on a host of its own) or ``c10d`` (the store in node host 0's
    agent; faults that would lose that node are left out: its loss has a scenario of its own)."""
    loop: str = "builtin"
    """``builtin`` (the built-in GPT job) or ``session`` (a hand-written ElasticSession loop
    that records the indices its loader gave it)."""
    parallelism: str = "ddp"
    hosts: int = 3
    nproc: int = 1
    steps: int = 100_000
    rdzv_conf: str | None = None
    extra: tuple[str, ...] = ()
    """More job options (built-in job) or script arguments (session loop)."""
    launcher: tuple[str, ...] = ()
    """More launcher options (e.g. ``--peer-timeout``), before the job's."""
    env: tuple[tuple[str, str], ...] = ()
    """More environment for the agents (e.g. LOGLEVEL=INFO to see their decisions)."""

    @property
    def names(self) -> list[str]:
        return [f"node-{chr(ord('a') + i)}" for i in range(self.hosts)]

    @property
    def full_world(self) -> int:
        return self.hosts * self.nproc


@dataclass
class Agent:
    """One ``elastic-train run`` started on a host, and how it ended."""

    host: str
    node: hosts.Node
    started_at: float
    expected: str | None = None
    """Why the campaign expects it to end (``killed``, ``sigterm``, ``final``); None: it
    must run on."""
    ended_at: float | None = None
    code: int | None = None
    baseline: tuple[int, int] | None = None
    """(threads, descriptors) of the agent process once the job trained with it."""

    @property
    def pid(self) -> int:
        return self.node.proc.pid


@dataclass
class FaultRecord:
    index: int
    fault: Fault
    at: float
    healed_at: float | None = None
    next_step: float | None = None
    full_world: float | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Violation:
    what: str
    fault: int | None
    """The index of the fault in flight or last applied (None: before any, or at the end)."""
    detail: str = ""

    def __str__(self) -> str:
        where = f"after fault {self.fault}" if self.fault is not None else "outside faults"
        return f"{self.what} ({where}){': ' + self.detail if self.detail else ''}"


class Campaign:
    """See the module. ``bed``: a Netbed with ``setup.names`` as hosts (and ``etcd`` for
    etcd-v3); ``workdir``: the run dir's parent (node logs go there)."""

    def __init__(self, bed: nb.Netbed, setup: Setup, workdir: Path,
                 schedule: Schedule | None = None) -> None:
        self.bed = bed
        self.setup = setup
        self.workdir = workdir
        self.run_dir = workdir / "run"
        self.schedule = schedule
        self.log = EventLog(self.run_dir)
        self.agents: dict[str, Agent] = {}
        self.lives: list[Agent] = []
        self.records: list[FaultRecord] = []
        self.violations: list[Violation] = []
        self.rdzv_id = f"chaos{os.getpid()}"
        self._ended = False
        self._netem: bool | None = None
        self.job_died = False

    # ---- the job ---------------------------------------------------------------------------
    def _launcher(self, host: nb.Host) -> list[str]:
        s = self.setup
        nnodes = f"1:{s.hosts}"
        if s.backend == "etcd-v3":
            return hosts.etcd_v3(self.bed, host, self.rdzv_id, nnodes=nnodes, nproc=s.nproc,
                                 conf=s.rdzv_conf)
        if s.backend == "c10d":
            return hosts.c10d(self.bed.host(s.names[0]), host, self.rdzv_id, nnodes=nnodes,
                              nproc=s.nproc, conf=s.rdzv_conf)
        raise ValueError(f"unknown backend {s.backend}")

    def _job(self) -> tuple[list[str], bool]:
        s = self.setup
        if s.loop == "session":
            extra = ["fsdp"] if s.parallelism == "fsdp" else []
            return [str(SESSION_LOOP), str(self.run_dir), str(s.steps), "0.02", *extra,
                    *s.extra], True
        return ["--preset", "tiny", "--steps", str(s.steps), "--checkpoint-every", "20",
                "--record-samples", "true", "--log-every", "100", "--metrics-port", "0",
                "--seed", "0",
                "--task-opt", f"corpus_max_bytes={BUILTIN_SAMPLES * 64 + 1}",
                *(["--parallelism", s.parallelism] if s.parallelism != "ddp" else []),
                *s.extra], False

    def start_agent(self, name: str) -> Agent:
        host = self.bed.host(name)
        job, script = self._job()
        lives = sum(1 for a in self.lives if a.host == name)
        node = hosts.start_node(host, self.run_dir,
                                [*self._launcher(host), *self.setup.launcher, *job],
                                name=f"{name}.{lives}", script=script,
                                env={"ELASTIC_TRAIN_LOG_LEVEL": "INFO", **dict(self.setup.env)})
        agent = Agent(name, node, time.time())
        self.agents[name] = agent
        self.lives.append(agent)
        return agent

    def start(self) -> None:
        """Every node's agent; returns once the job trained a step at the full world."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for name in self.setup.names:
            self.start_agent(name)
        at = time.time()
        if not self._wait(lambda: self._step_at_world(self.setup.full_world, at),
                          START_BOUND):
            raise AssertionError("the job never trained at the full world:\n"
                                 + self.report_nodes())
        for agent in self.lives:
            agent.baseline = self._agent_footprint(agent.pid)

    # ---- observing ---------------------------------------------------------------------------
    def _steps(self) -> list[dict[str, Any]]:
        return [e for e in self.log.read() if e["event"] == "step"]

    def _step_started_after(self, at: float, world: int | None = None
                            ) -> dict[str, Any] | None:
        """The first step that started after ``at`` (at ``world``): steps run back to back,
        so a step started when the one before it ended (its event's time)."""
        steps = self._steps()
        for before, e in itertools.pairwise(steps):
            if before["time"] >= at and (world is None or e["world_size"] == world):
                return e
        return None

    def _step_at_world(self, world: int, after: float) -> bool:
        return self._step_started_after(after, world) is not None

    def _check_agents(self, fault: int | None) -> None:
        """Record every agent that ended without the campaign asking; a node whose agent
        ended is started again (the campaign goes on), unless the whole job ended."""
        ended_now, closed_now = False, ""
        for agent in list(self.agents.values()):
            code = agent.node.proc.poll()
            if code is None or agent.ended_at is not None:
                continue
            agent.ended_at, agent.code = time.time(), code
            if agent.expected is None:
                ended_now = True
                tail = agent.node.output().strip().splitlines()[-1:] or [""]
                if RENDEZVOUS_CLOSED in tail[0]:
                    closed_now = f"{agent.node.log_path.name}: {tail[0][:200]}"
                what = "an agent exited 0 before the job was done (a silent exit)" \
                    if code == 0 else f"an agent ended by itself with exit code {code}"
                self.violations.append(Violation(what, fault,
                                                 f"{agent.node.log_path.name}: {tail[0][:200]}"))
        alive = [a for a in self.agents.values() if a.node.proc.poll() is None]
        if not alive and not self._ended:
            self.job_died = True
            self.violations.append(Violation("the whole job ended by itself", fault,
                                             self._job_end_reason()))
            return
        if not self._ended and closed_now:
            # the job's rendezvous closed under it: no node can join again (etcd-v3 seed
            # 512, before the fix: every agent started after that was refused at once)
            self.job_died = True
            self.violations.append(Violation(
                "the whole job ended by itself (its rendezvous was closed)", fault,
                closed_now))
            return
        if not self._ended and ended_now and self._every_node_down(time.time()):
            # each agent is started again as it ends: a job that died reads as nodes ending
            # one after the other, within seconds (c10d seed 403: all three within 1.2 s)
            self.job_died = True
            self.violations.append(Violation(
                f"the whole job ended by itself (every node's agent within "
                f"{JOB_DEATH_WINDOW:g} s)", fault, self._job_end_reason()))
            return
        for name, agent in list(self.agents.items()):
            if agent.ended_at is not None and agent.expected is None:
                self.start_agent(name)  # an unexpected exit: its node comes back

    def _every_node_down(self, now: float) -> bool:
        """Whether no node carries the job: each one's agent is down now (killed by a fault,
        or ended), or ended by itself within the last ``JOB_DEATH_WINDOW`` seconds (a new
        one started since carries nothing of the job's running state)."""
        down = {name for name, a in self.agents.items() if a.node.proc.poll() is not None}
        down |= {a.host for a in self.lives if a.expected is None and a.ended_at is not None
                 and now - a.ended_at <= JOB_DEATH_WINDOW}
        return down >= set(self.setup.names)

    def _job_end_reason(self) -> str:
        for e in reversed(self.log.read()):
            if e["event"] in ("preempted", "stopped", "end"):
                return f"last event {e['event']}: {e}"
        return "no end event"

    def _wait(self, done: Callable[[], bool], timeout: float, fault: int | None = None
              ) -> bool:
        """Poll ``done`` (and the agents) until it holds or ``timeout``; whether it held."""
        deadline = time.monotonic() + timeout
        while True:
            if done():
                return True
            self._check_agents(fault)
            if self.job_died or time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def _pause(self, seconds: float, fault: int | None) -> None:
        self._wait(lambda: False, seconds, fault)

    # ---- faults ------------------------------------------------------------------------------
    def _end_expected(self, name: str, why: str) -> Agent:
        agent = self.agents[name]
        agent.expected = why
        return agent

    def _worker_pid(self, name: str, local_rank: int) -> int | None:
        agent = self.agents[name]
        workers = harness.workers_of(agent.pid)
        if not workers:
            return None
        ranks = sorted(workers)
        return workers[ranks[min(local_rank, len(ranks) - 1)]]

    def apply(self, index: int, fault: Fault) -> FaultRecord:
        """Apply ``fault``, hold it, heal it; the record (its times filled in later)."""
        name, host = fault.host, self.bed.host(fault.host)
        kind = fault.kind
        record = FaultRecord(index, fault, time.time())
        self.records.append(record)
        if kind == "host_kill":
            self._end_expected(name, "killed")
            record.at = host.kill()
            self._pause(fault.hold, index)
            self.start_agent(name)
        elif kind == "kill_while_joining":
            self._end_expected(name, "killed")
            record.at = host.kill()
            self._pause(fault.hold, index)
            joining = self.start_agent(name)
            self._pause(float(fault.detail.get("join_kill_after", 1.0)), index)
            joining.expected = "killed"
            host.kill()
            self.start_agent(name)
        elif kind == "cable":
            record.at = host.cable_down()
            self._pause(fault.hold, index)
            host.cable_up()
        elif kind == "freeze":
            record.at = host.freeze()
            self._pause(fault.hold, index)
            host.thaw()
        elif kind == "worker_kill":
            full_before = self._world_at(time.time()) == self.setup.full_world
            spent_before = self.agents[name].node.output().count(LIVE_RESTARTS_SPENT)
            pid = self._worker_pid(name, int(fault.detail.get("local_rank", 0)))
            if pid is None:
                record.notes.append("no worker to kill")
            else:
                record.at = time.time()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        elif kind == "agent_freeze":
            pid = self.agents[name].pid
            record.at = time.time()
            os.kill(pid, signal.SIGSTOP)
            self._pause(fault.hold, index)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        elif kind == "one_way":
            incoming = fault.detail.get("direction", "incoming") == "incoming"
            record.at = host.drop_incoming() if incoming else host.drop_outgoing()
            self._pause(fault.hold, index)
            host.restore()
        elif kind == "slow_link":
            record.at = time.time()
            if self._netem is None:
                self._netem = self.bed.supports("netem")
            if self._netem:
                host.slow_link(delay_ms=float(fault.detail.get("delay_ms", 50)))
            else:  # a kernel without sch_netem: a slow rate instead of a delay
                host.slow_link(rate=str(fault.detail.get("rate", "20mbit")))
            self._pause(fault.hold, index)
            host.fast_link()
        elif kind == "etcd_kill":
            assert self.bed.etcd is not None
            record.at = host.kill()
            self._pause(fault.hold, index)
            self.bed.etcd = nb.NetEtcd.start(host)
        elif kind == "etcd_cable":
            record.at = host.cable_down()
            self._pause(fault.hold, index)
            host.cable_up()
        elif kind == "node_sigterm":
            agent = self._end_expected(name, "sigterm")
            record.at = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.pid, signal.SIGTERM)
            self._pause(fault.hold, index)
            self._leave_checked(agent, index)
            self.start_agent(name)
        elif kind == "disk_full":
            record.at = time.time()
            ballast = fill(self.run_dir)  # a small disk of its own (chaos/disk.py)
            self._pause(fault.hold, index)
            ballast.unlink(missing_ok=True)
        else:
            raise ValueError(f"unknown fault kind {kind}")
        record.healed_at = time.time()
        if fault.wait_heal and not self._wait(
                lambda: self._step_at_world(self.setup.full_world, record.healed_at or 0),
                HEAL_BOUND, index) and not self.job_died:
            # Counted: until 2026-12-02 this wait ran out silently, and the next fault went
            # on (the soaks of 211e9c6 and d1a8ad9, c10d's of 9c51e2c: five such heals)
            self.violations.append(Violation(
                f"the world was not full again within {HEAL_BOUND:g} s of the heal",
                index, fault.describe()))
            self._dump_stacks()
        self._pause(fault.gap, index)
        self._measure(record)
        if kind == "worker_kill" and full_before:
            shrunk = [e["world_size"] for e in self._steps() if e["time"] > record.at
                      and e["world_size"] < self.setup.full_world]
            # with its live restarts spent the node takes torch's restart path, as
            # documented: the others go on without it until it is back (never fewer)
            spent = self.agents[name].node.output().count(LIVE_RESTARTS_SPENT) > spent_before
            if spent:
                record.notes.append("the node's live restarts were spent: torch's restart "
                                    f"path (steps at world {sorted(set(shrunk))} meanwhile)")
            without_node = self.setup.full_world - self.setup.nproc
            if shrunk and (not spent or min(shrunk) < without_node):
                self.violations.append(Violation(
                    "a worker kill shrank the world", index,
                    f"steps at world {sorted(set(shrunk))} after it"))
        return record

    def _world_at(self, at: float) -> int | None:
        """The world size of the last step before ``at``."""
        before = [e for e in self._steps() if e["time"] <= at]
        return before[-1]["world_size"] if before else None

    def run_to_end(self, timeout: float) -> list[int | None]:
        """A campaign of a job with an end (``setup.steps``): wait for every agent to end by
        itself; each must exit 0 (then the same audits as ``finish``)."""
        deadline = time.monotonic() + timeout
        self._ended = True
        codes = []
        for agent in self.agents.values():
            try:
                agent.code = agent.node.proc.wait(
                    timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.violations.append(Violation(f"the job did not end within {timeout:g} s",
                                                 None, agent.node.log_path.name))
                agent.node.stop()
            codes.append(agent.code)
            if agent.code != 0:
                self.violations.append(Violation("an agent did not end with 0 at the job's "
                                                 "end", None, f"{agent.node.log_path.name}: "
                                                 f"exit {agent.code}"))
        self._audit()
        return codes

    def _leave_checked(self, agent: Agent, index: int) -> None:
        """A node SIGTERMed alone leaves: its agent ends, non-zero, within the budget."""
        try:
            code = agent.node.proc.wait(timeout=FINAL_BOUND)
        except subprocess.TimeoutExpired:
            self.violations.append(Violation("a node SIGTERMed alone did not leave", index,
                                             f"{agent.node.log_path.name} still runs after "
                                             f"{FINAL_BOUND:g} s"))
            agent.node.stop()
            code = agent.node.proc.poll()
        agent.ended_at, agent.code = time.time(), code
        if code == 0:
            self.violations.append(Violation("a node SIGTERMed alone exited 0", index,
                                             agent.node.log_path.name))

    def _measure(self, record: FaultRecord, until: float = float("inf")) -> None:
        """The record's two figures, from steps that came before ``until`` (the next fault:
        what comes after it is that fault's, and the figure stays unmeasured)."""
        step = self._step_started_after(record.at)
        record.next_step = step["time"] - record.at \
            if step is not None and step["time"] < until else None
        if record.healed_at is not None:
            full = self._step_started_after(record.healed_at, self.setup.full_world)
            record.full_world = full["time"] - record.healed_at \
                if full is not None and full["time"] < until else None

    # ---- the whole campaign ----------------------------------------------------------------
    def run(self, schedule: Schedule, stop_on_violation: bool = False) -> None:
        self.schedule = schedule
        for index, fault in enumerate(schedule.faults):
            if self.job_died:
                break
            if KINDS[fault.kind].needs_etcd and self.bed.etcd is None:
                continue
            self.apply(index, fault)
            print(f"[chaos] fault {index} at {self.records[-1].at:.3f}: {fault.describe()}: "
                  "next step "
                  f"{_s(self.records[-1].next_step)}, full world "
                  f"{_s(self.records[-1].full_world)}", flush=True)
            if stop_on_violation and self.violations:
                break
        self._bound_checks()

    def _bound_checks(self) -> None:
        """The last heal was followed by the full world within HEAL_BOUND, and every fault
        by a step within NEXT_STEP_BOUND; then each record's figures, from the steps before
        the next fault."""
        if self.records and not self.job_died and not self.records[-1].fault.wait_heal:
            last = self.records[-1]  # (a heal waited for in apply() was checked there)
            healed = last.healed_at or last.at
            if not self._wait(lambda: self._step_at_world(self.setup.full_world, healed),
                              max(0.0, healed + HEAL_BOUND - time.time()), last.index):
                self.violations.append(Violation(
                    f"the world was not full again within {HEAL_BOUND:g} s of the last heal",
                    last.index, last.fault.describe()))
                self._dump_stacks()
        for record, after in itertools.zip_longest(self.records, self.records[1:]):
            step = self._step_started_after(record.at)  # whatever came in between
            if step is None or step["time"] - record.at > NEXT_STEP_BOUND:
                self.violations.append(Violation(
                    f"no step started within {NEXT_STEP_BOUND:g} s of the fault (a wedge)",
                    record.index, record.fault.describe()))
            self._measure(record, after.at if after is not None else float("inf"))

    def _dump_stacks(self) -> None:
        """Where every live agent and its workers are, as the violation is found (before
        the final SIGTERM moves them): py-spy's dump of each process (every thread's
        Python stack), appended to ``stacks.txt`` beside the node logs."""
        spy = Path(sys.executable).with_name("py-spy")
        if not spy.exists():
            return
        with open(self.workdir / "stacks.txt", "a") as out:
            for name, agent in self.agents.items():
                if agent.node.proc.poll() is not None:
                    continue
                for pid in [agent.pid, *harness.workers_of(agent.pid).values()]:
                    out.write(f"==== {name}: pid {pid} at {time.time():.3f}\n")
                    out.flush()
                    subprocess.run([str(spy), "dump", "--pid", str(pid)], stdout=out,
                                   stderr=subprocess.STDOUT, timeout=30, check=False)

    def finish(self) -> dict[int, int | None]:
        """SIGTERM every agent at once (the job deleted); their exit codes. Each must end
        with 143 within FINAL_BOUND; then no process may be left on any node host, every
        checkpoint verifies and every epoch used each sample once."""
        self._ended = True
        self._check_agents(None)
        for agent in self.agents.values():
            if agent.node.proc.poll() is None and agent.baseline is not None:
                grown = self._footprint_growth(agent)
                if grown:
                    self.violations.append(Violation("an agent grew", None, grown))
        running = [a for a in self.agents.values() if a.node.proc.poll() is None]
        for agent in running:
            agent.expected = "final"
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.pid, signal.SIGTERM)
        deadline = time.monotonic() + FINAL_BOUND
        codes: dict[int, int | None] = {}
        for agent in running:
            try:
                agent.code = agent.node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.violations.append(Violation(
                    f"an agent did not end within {FINAL_BOUND:g} s of the final SIGTERM",
                    None, agent.node.log_path.name))
                agent.node.stop()
            codes[agent.pid] = agent.code
            if agent.code is not None and agent.code != 143:
                self.violations.append(Violation(
                    "an agent did not end with 143 on the final SIGTERM", None,
                    f"{agent.node.log_path.name}: exit {agent.code}"))
        self._audit()
        return codes

    def _audit(self) -> None:
        """No process left on a node host, every checkpoint verifies, each sample once."""
        for name in self.setup.names:
            left = self.bed.host(name).leftovers(within=15.0)
            if left:
                self.violations.append(Violation("processes left behind", None,
                                                 f"{name}: {left}"))
        bad = verify_checkpoints(self.run_dir)
        if bad:
            self.violations.append(Violation("a checkpoint does not verify", None, bad))
        for problem in audit_samples(self.run_dir, self.setup.loop, BUILTIN_SAMPLES):
            self.violations.append(Violation("sample audit", None, problem))
        self._stock_rounds()

    def _stock_rounds(self) -> None:
        """A round of our agents only never starts the torch way (one violation per fault
        it followed: every agent of the round says it)."""
        seen: set[int | None] = set()
        for agent in self.lives:
            for line in agent.node.output().splitlines():
                if STOCK_ROUND not in line:
                    continue
                fault = self._fault_before(_stamp(line))
                if fault not in seen:
                    seen.add(fault)
                    self.violations.append(Violation(
                        "a round of elastic-train agents only started every worker the torch "
                        "way (live recovery off until the next round)", fault,
                        f"{agent.node.log_path.name}: {line[:200]}"))

    def _fault_before(self, at: float | None) -> int | None:
        """The index of the last fault applied at or before ``at``."""
        if at is None:
            return None
        before = [r.index for r in self.records if r.at is not None and r.at <= at]
        return before[-1] if before else None

    # ---- footprints and reports --------------------------------------------------------------
    @staticmethod
    def _agent_footprint(pid: int) -> tuple[int, int] | None:
        try:
            return (len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd")))
        except OSError:
            return None

    def _footprint_growth(self, agent: Agent) -> str:
        now = self._agent_footprint(agent.pid)
        if now is None or agent.baseline is None:
            return ""
        (t0, f0), (t1, f1) = agent.baseline, now
        if t1 > t0 + 16 or f1 > f0 + 64:
            return (f"{agent.node.log_path.name}: threads {t0} -> {t1}, descriptors "
                    f"{f0} -> {f1}")
        return ""

    def report_nodes(self) -> str:
        return hosts.report([a.node for a in self.lives[-2 * self.setup.hosts:]])


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _stamp(line: str) -> float | None:
    """The time a node log's line was written (its first field, tests/integration/hosts.py)."""
    try:
        return float(line.split(" ", 1)[0])
    except ValueError:
        return None
