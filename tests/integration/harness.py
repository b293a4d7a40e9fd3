"""Real jobs for integration tests: start torchrun / elastic-train, watch events, kill workers.

Every wait has a deadline; a job left running by a failed test is killed with its whole
process group.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_train import cli
from elastic_train.events.log import read_events
from elastic_train.live.environment import RENDEZVOUS_SECONDS
from elastic_train.rundir import EVENTS_FILE
from elastic_train.torch_compat import CHECKED
from tests import procfs

REPO = Path(__file__).resolve().parents[2]


# The tiny GPT with dropout, 45 steps of 64 samples: the job of test_chaos and
# test_preemption, which share its uninterrupted reference (conftest.py); only options that
# do not change the weights may differ between them.
TINY_DROPOUT_STEPS = 45
TINY_DROPOUT = ["--preset", "tiny", "--batch-size", "64", "--steps", str(TINY_DROPOUT_STEPS),
                "--task-opt", "dropout=0.1"]


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env.pop(RENDEZVOUS_SECONDS, None)  # only an agent sets it, for its own workers
    # likewise the torch version its launcher checked: an in-process launch by an earlier
    # test sets it here, and a worker then skips its own check (the plain-torchrun refusal)
    env.pop(CHECKED, None)
    env.update(extra or {})
    return env


def free_ports(count: int = 1, host: str = "127.0.0.1") -> int:
    """A base port with ``count`` consecutive ports free on ``host``.

    Drawn below Linux's ephemeral range (32768+), so that outgoing connections made after
    the check cannot take them.
    """
    for _ in range(200):
        base = random.randrange(20000, 32000 - count)
        probes: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                probe = socket.socket()
                probes.append(probe)
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return base
    raise AssertionError(f"no {count} consecutive free ports on {host}")


def with_metrics_ports(args: Sequence[str], count: int = 4) -> list[str]:
    """``args`` plus a free loopback base port for the workers' /metrics endpoints, unless
    they choose one: jobs of suites that run side by side on one machine never collide."""
    if any(a.startswith("--metrics-port") for a in args):
        return list(args)
    return [*args, "--metrics-port", str(free_ports(count)), "--metrics-address", "127.0.0.1"]


@dataclass
class Job:
    """A launched job: the agent process (leader of its own process group) and its run dir."""

    proc: subprocess.Popen[bytes]
    run_dir: Path
    log_path: Path
    killed: list[tuple[int, int]] = field(default_factory=list)

    def events(self) -> list[dict[str, Any]]:
        return list(read_events(self.run_dir / EVENTS_FILE))

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def report(self) -> str:
        """The tail of the output for an assertion message, naming known crash kinds."""
        out = self.output()
        note = ""
        if "terminate called without an active exception" in out:
            note = ("NOTE: a worker aborted at exit (SIGABRT, 'terminate called without an "
                    "active exception'): a shutdown-order crash, not a training-logic failure\n")
        return note + out[-3000:]

    def wait_for_event(self, predicate: Callable[[dict[str, Any]], bool], timeout: float,
                       poll: float = 0.005) -> dict[str, Any]:
        """Return the first event matching ``predicate``; fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        path = self.run_dir / EVENTS_FILE
        offset = 0
        buffer = ""
        while time.monotonic() < deadline:
            if path.exists():
                with open(path) as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
                buffer += chunk
                *lines, buffer = buffer.split("\n")
                for line in lines:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if predicate(record):
                        return record
            if self.proc.poll() is not None:
                raise AssertionError(f"job exited ({self.proc.returncode}) before the awaited "
                                     f"event; output:\n{self.report()}")
            time.sleep(poll)
        raise AssertionError(f"no awaited event within {timeout}s; output:\n"
                             f"{self.report()}")

    def worker_pids(self, timeout: float = 30.0) -> dict[int, int]:
        """{rank: pid} of the agent's live worker processes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = workers_of(self.proc.pid)
            if found:
                return found
            time.sleep(0.01)
        raise AssertionError("no worker processes found")

    def kill_worker(self, rank: int, sig: int = signal.SIGKILL) -> int:
        pid = self.worker_pids()[rank]
        os.kill(pid, sig)
        self.killed.append((rank, pid))
        return pid

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"job did not finish within {timeout}s; output:\n"
                                 f"{self.report()}") from None

    def kill_node(self) -> float:
        """SIGKILL this agent and all its workers at once, as losing the machine would.

        torchrun starts each worker in its own session, so the agent's process group alone
        would leave them running. Returns the time of the kill (``time.time()``).
        """
        assert self.proc.poll() is None, f"the node already exited:\n{self.report()}"
        workers = workers_of(self.proc.pid)
        killed_at = time.time()
        for pid in workers.values():
            _kill_group(pid)
        _kill_group(self.proc.pid)
        self.proc.wait(timeout=30)
        self.killed.extend(workers.items())
        return killed_at

    def stop(self) -> None:
        """Kill the agent and its workers (torchrun starts each worker in its own session)."""
        if self.proc.poll() is None:
            for pid in descendants(self.proc.pid):
                _kill_group(pid)
            _kill_group(self.proc.pid)
            self.proc.wait(timeout=30)


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


descendants = procfs.descendants
process_name = procfs.name


def listening(pid: int) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket process ``pid`` listens on (from /proc)."""
    import ipaddress

    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            raw = bytes.fromhex(address)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


def workers_of(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of a torchrun agent's worker processes.

    Workers started as subprocesses carry RANK in their environment; workers forked from a
    forkserver (``elastic-train run``) name themselves ``et-rank-N``.
    """
    found = {}
    for pid in descendants(agent_pid):
        name = process_name(pid)
        if name.startswith("et-rank-"):
            found[int(name.removeprefix("et-rank-"))] = pid
            continue
        env = _environ(pid)
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env and "TORCHELASTIC_USE_AGENT_STORE" in env:
            found.setdefault(int(env["RANK"]), pid)
    return found


def _is_resource_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker: it ends on its own once its parent's end of its
    pipe closes, a moment after the parent, and says nothing."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def live_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (R, S, D, T, ...), None when it is gone or a
    zombie (dead, not yet reaped)."""
    return procfs.state(pid) if procfs.alive(pid) else None


def outliving(before: dict[int, str]) -> list[tuple[int, str]]:
    """Of an agent's descendants ``before`` ({pid: name}, taken while it ran), those still
    alive under the same name, and any orphaned worker or spare of ours (named ``et-``,
    parent 1: its agent and forkserver are gone). Workers forked from a forkserver carry
    no torch variable in /proc/PID/environ (set after the fork), so names it is."""
    left = [(pid, name) for pid, name in before.items()
            if live_state(pid) is not None and process_name(pid) == name
            and not _is_resource_tracker(pid)]
    for pid in procfs.pids():
        if pid not in before and procfs.parent(pid) == 1 and procfs.alive(pid) \
                and process_name(pid).startswith("et-"):
            left.append((pid, process_name(pid)))
    return left


def spare_of(agent_pid: int) -> int | None:
    """The pid of the agent's hot spare (a worker process named ``et-spare``), if one runs."""
    spares = [pid for pid in descendants(agent_pid) if process_name(pid) == "et-spare"]
    return spares[0] if spares else None


def wait_for_spare(job: Job, other_than: int | None = None, timeout: float = 60) -> int:
    """The pid of ``job``'s hot spare once one runs (and is not ``other_than``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = spare_of(job.proc.pid)
        if pid is not None and pid != other_than:
            return pid
        time.sleep(0.005)
    raise AssertionError(f"no hot spare within {timeout}s:\n{job.report()}")


def new_pid(job: Job, rank: int, old: int, timeout: float = 30) -> int:
    """The pid of ``rank`` once ``job``'s agent started it again (it was ``old``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = workers_of(job.proc.pid).get(rank)
        if pid is not None and pid != old:
            return pid
        time.sleep(0.005)
    raise AssertionError(f"rank {rank} was not started again within {timeout}s:\n"
                         f"{job.report()}")


@dataclass
class HungAndReplaced:
    """What a SIGSTOP of one worker under live recovery and ``--step-timeout`` led to."""

    pids: dict[int, int]  # the workers' pids before the stop
    hang: dict[str, Any]  # the watchdog's hang event
    recovery: dict[str, Any]  # the first recovery event after it
    seconds: float  # stop -> recovery event seen
    exit_code: int  # the job's, once it finished


def stop_until_replaced(job: Job, rank: int, timeout: float) -> HungAndReplaced:
    """SIGSTOP ``rank``; wait for the watchdog's ``hang`` event, the recovery, and the
    job's end (each bounded by ``timeout``)."""
    pids = job.worker_pids()
    stopped_at = time.monotonic()
    job.kill_worker(rank, signal.SIGSTOP)
    hang = job.wait_for_event(lambda e: e["event"] == "hang", timeout)
    recovery = job.wait_for_event(lambda e: e["event"] == "recovery", timeout)
    seconds = time.monotonic() - stopped_at
    return HungAndReplaced(pids, hang, recovery, seconds, job.wait(timeout))


def start(argv: Sequence[str], run_dir: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None, log_name: str | None = None) -> Job:
    """Start ``argv`` in its own process group, output to ``run_dir``/../<log_name>.log."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = run_dir.parent / f"{log_name or run_dir.name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                env=env or job_env(), cwd=cwd or run_dir.parent,
                                start_new_session=True)
    return Job(proc, run_dir, log_path)


def torchrun(run_dir: Path, job_args: Sequence[str], nproc: int = 2, max_restarts: int = 3,
             env: dict[str, str] | None = None, rdzv: Sequence[str] = ()) -> Job:
    """``torchrun`` (c10d on a free loopback port, unless ``rdzv`` says otherwise)."""
    rendezvous = list(rdzv) or ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1", *rendezvous,
            "-m", "elastic_train.train", "--run-dir", str(run_dir),
            *with_metrics_ports(job_args, nproc)]
    return start(argv, run_dir, env)


def node(run_dir: Path, name: str, rdzv: Sequence[str], job_args: Sequence[str],
         launcher: str = "torchrun", nnodes: str = "1:2", nproc: int = 1,
         max_restarts: int = 3) -> Job:
    """One "node" of a multi-node job on this machine: an agent with its own workers.

    ``launcher`` is ``torchrun`` (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the README
    tells multi-node torchrun users) or ``elastic-train`` (which sets it itself).
    """
    common = [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
              f"--max-restarts={max_restarts}", "--monitor-interval=0.1", *rdzv]
    job_args = with_metrics_ports(job_args, nproc)  # agents on one host: one port range each
    if launcher == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *common, "-m",
                "elastic_train.train", "--run-dir", str(run_dir), *job_args]
        env = job_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    else:
        argv = [sys.executable, "-m", "elastic_train", "run", *common, "--run-dir",
                str(run_dir), *job_args]
        env = job_env()
    return start(argv, run_dir, env, log_name=name)


def documentation() -> list[Path]:
    """The pages a user reads: the README, then docs/*.md."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def readme_commands() -> list[str]:
    """Every ``$ command`` line of the console blocks of the README and docs/*.md, in that
    order, each once (the README shows a few that a page repeats)."""
    found = [c for page in documentation()
             for c in re.findall(r"^\$ (.+)$", page.read_text(), flags=re.M)]
    return list(dict.fromkeys(found))


def readme_command(*needles: str) -> str:
    """The one documented command (README or docs/) that contains every needle."""
    found = [c for c in readme_commands() if all(n in c for n in needles)]
    assert len(found) == 1, f"documented commands with {needles}: {found}"
    return found[0]


def readme_argv(command: str, replace: dict[str, str] | None = None,
                launcher: Sequence[str] = (), job: Sequence[str] = ()
                ) -> tuple[list[str], dict[str, str]]:
    """A README command as argv for this Python, and the variables it sets before it.

    ``replace`` substitutes text (an endpoint); ``launcher`` options go where the launcher
    reads them (before ``-m`` for torchrun), overriding the README's; ``job`` options go
    last, overriding the README's job options.
    """
    for old, new in (replace or {}).items():
        assert old in command, f"{old!r} is not in {command!r}"
        command = command.replace(old, new)
    tokens = shlex.split(command)
    env: dict[str, str] = {}
    while "=" in tokens[0] and not tokens[0].startswith("-"):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    program, rest = tokens[0], tokens[1:]
    if program == "elastic-train":
        return [sys.executable, "-m", "elastic_train", *rest, *launcher, *job], env
    assert program == "torchrun", command
    module = rest.index("-m")
    return [sys.executable, "-m", "torch.distributed.run", *rest[:module], *launcher,
            *rest[module:], *job], env


def elastic_run(run_dir: Path, args: Sequence[str], env: dict[str, str] | None = None) -> Job:
    """``elastic-train run`` as a user types it."""
    argv = [sys.executable, "-m", "elastic_train", "run", "--run-dir", str(run_dir),
            *with_metrics_ports(args)]
    return start(argv, run_dir, env)


def uninterrupted_digests(run_dir: Path, job_args: Sequence[str],
                          timeout: float = 300) -> dict[int, str]:
    """{step: model digest} of every checkpoint of ``job_args`` trained by
    ``elastic-train run`` without interruption (keep them all to have every step)."""
    job = elastic_run(run_dir, [*job_args, "--max-restarts", "0"])
    assert job.wait(timeout) == 0, job.report()
    return {r["step"]: r["model_digest"] for r in checkpoint_listing(run_dir)}


def checkpoint_listing(run_dir: Path) -> list[dict[str, Any]]:
    """``elastic-train checkpoints list --json`` of a run, newest first.

    The command's main in this process: the same code and output, without the 2-3 s of an
    interpreter importing torch per call (the console command itself is tested on its own).
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["checkpoints", "list", str(run_dir), "--json"]) == 0
    return json.loads(out.getvalue())["checkpoints"]


def final_digest(run_dir: Path) -> str:
    """The model digest of the newest checkpoint (the final one of a finished run)."""
    rows = checkpoint_listing(run_dir)
    assert rows and rows[0]["valid"], rows
    return rows[0]["model_digest"]


def digest_at(run_dir: Path, step: int) -> str:
    """The model digest of the valid checkpoint of ``step``."""
    rows = [r for r in checkpoint_listing(run_dir) if r["step"] == step and r["valid"]]
    assert len(rows) == 1, checkpoint_listing(run_dir)
    return rows[0]["model_digest"]


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """Every sample of a /metrics endpoint: {(name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the one sample of ``name`` whose labels include ``labels`` (None: none)."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
    return found[0] if found else None
