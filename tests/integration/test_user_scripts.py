"""Unmodified users' scripts under ``elastic-train run`` (issue 28): the shapes users bring
(user_scripts/: a pytorch/examples-style ``Trainer`` with its own snapshot, a module run
with ``-m``, a script that reads only LOCAL_RANK/RANK/WORLD_SIZE), each without faults and
with a SIGKILL of a worker, under both worker starts: every run ends, within a bound, with
the script's status (the default suite runs a subset that covers each shape, each start and
a kill under both; ``make test-extended`` every pairing). And a Kubeflow-style ``PET_*``-only
launch gets torchrun's world."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.integration import harness, script_jobs
from tests.integration.script_jobs import SCRIPTS

pytestmark = pytest.mark.slow
BOUND = 120.0  # seconds; a fault-free run takes ~5 s here, one with a kill ~9 s
FINISHED = {"tutorial": r"\[RANK{rank}\] done", "module": r"module rank {rank}: __main__",
            "plain": r"rank {rank} \(local \d\) of 2: loss"}


# The default suite: each shape and each start method at least once, a SIGKILL under both
# starts (a killed run also runs to its end); every other pairing: make test-extended.
DEFAULT_CASES = {("tutorial", "subprocess", 1), ("module", "forkserver", 1),
                 ("plain", "subprocess", None), ("plain", "forkserver", None)}
SCRIPT_CASES = [
    pytest.param(shape, start, kill, id=f"{shape}-{start}-{'sigkill' if kill else 'no-fault'}",
                 marks=[] if (shape, start, kill) in DEFAULT_CASES else [pytest.mark.extended])
    for shape in ("tutorial", "module", "plain") for start in ("forkserver", "subprocess")
    for kill in (None, 1)]


@pytest.mark.parametrize(("shape", "worker_start", "kill"), SCRIPT_CASES)
def test_an_unmodified_script_ends_with_its_status(tmp_path: Path, shape: str,
                                                   worker_start: str, kill: int | None) -> None:
    outcome = script_jobs.run(shape, tmp_path, worker_start=worker_start, kill_rank=kill,
                              timeout=BOUND)
    assert not outcome.hung, f"still running after {BOUND}s:\n{outcome.output[-3000:]}"
    assert not outcome.aborted, f"a worker aborted at exit:\n{outcome.output[-3000:]}"
    assert outcome.code == 0, outcome.output[-3000:]
    for rank in (0, 1):
        assert re.search(FINISHED[shape].format(rank=rank), outcome.output), rank
    assert "runs unmodified, as under torchrun: a failed worker restarts every worker" \
        in outcome.output
    if kill is not None:
        assert outcome.killed_pid is not None
        assert re.search(rf"failed \(exitcode: -9\) rank: 1 \(local_rank: \d, pid: "
                         rf"{outcome.killed_pid}\)", outcome.output), outcome.output[-3000:]
        if shape == "tutorial":  # restarted from the script's own snapshot
            assert "Resuming training from snapshot at Epoch" in outcome.output


@pytest.mark.parametrize("worker_start", [  # the status's path is the same under both
    pytest.param("forkserver", marks=pytest.mark.extended), "subprocess"])
def test_a_failing_scripts_status_reaches_the_job(tmp_path: Path, worker_start: str) -> None:
    outcome = script_jobs.run("plain", tmp_path, worker_start=worker_start, exit_code=3,
                              max_restarts=0, timeout=BOUND)
    assert outcome.code == 1, outcome.output[-3000:]
    assert re.search(r"elastic-train: job failed: rank \d failed: exit code 3 \(", outcome.output)


@pytest.mark.extended
@pytest.mark.parametrize("worker_start", ["forkserver", "subprocess"])
def test_the_tutorial_ends_every_time(tmp_path: Path, worker_start: str) -> None:
    """10 fault-free runs and 5 with a SIGKILL (scripts/script_exit_soak.py does more)."""
    bad = []
    for i, kill in enumerate([None] * 10 + [1] * 5):
        outcome = script_jobs.run("tutorial", tmp_path / str(i), worker_start=worker_start,
                                  kill_rank=kill, timeout=BOUND)
        if outcome.hung or outcome.aborted or outcome.code != 0:
            bad.append((i, kill, outcome.code, outcome.output[-800:]))
    assert bad == []


KUBEFLOW = {"PET_NNODES": "1", "PET_RDZV_BACKEND": "c10d", "PET_MAX_RESTARTS": "1"}


def world(launcher: list[str], env: dict[str, str], tmp_path: Path, name: str) -> list[str]:
    """The sorted ``world ...`` lines of print_world.py's workers under ``launcher`` (from
    the file each worker writes: their stdout lines may interleave)."""
    endpoint = {"PET_RDZV_ENDPOINT": f"127.0.0.1:{harness.free_ports()}"}
    cwd = tmp_path / name
    cwd.mkdir(parents=True)
    job = harness.start([*launcher, str(SCRIPTS / "print_world.py")], tmp_path / name,
                        harness.job_env({**KUBEFLOW, **endpoint, **env}), cwd=cwd,
                        log_name=name)
    assert job.wait(BOUND) == 0, job.report()
    return sorted(p.read_text().strip() for p in cwd.glob("world-*.txt"))


# Each variable alone: make test-extended (tests/unit/test_launch_options.py resolves them).
@pytest.mark.parametrize("env", [
    pytest.param({}, id="operator-defaults"),
    pytest.param({"PET_RDZV_ID": "kf-job"}, id="rdzv-id", marks=pytest.mark.extended),
    pytest.param({"PET_NPROC_PER_NODE": "2"}, id="nproc", marks=pytest.mark.extended),
    pytest.param({"PET_RDZV_ID": "kf-job", "PET_NPROC_PER_NODE": "2"}, id="rdzv-id+nproc",
                 marks=pytest.mark.extended)])
def test_a_pet_only_launch_gets_torchruns_world(tmp_path: Path, env: dict[str, str]) -> None:
    theirs = world([sys.executable, "-m", "torch.distributed.run"], env, tmp_path, "torchrun")
    ours = world([sys.executable, "-m", "elastic_train", "run"], env, tmp_path, "elastic")
    assert ours == theirs and theirs
    assert len(theirs) == int(env.get("PET_NPROC_PER_NODE", "1"))
    assert f"TORCHELASTIC_RUN_ID={env.get('PET_RDZV_ID', 'none')}" in theirs[0]


def test_a_non_elastic_pytorchjobs_two_nodes_meet_on_the_static_rendezvous(tmp_path: Path
                                                                           ) -> None:
    """Without elasticPolicy the operator gives torchrun PET_NNODES, PET_NODE_RANK,
    PET_MASTER_ADDR, PET_MASTER_PORT (and PET_NPROC_PER_NODE): torchrun's static
    rendezvous, torchrun's defaults (no restarts, id 'none')."""
    port = harness.free_ports()
    jobs = []
    for node in (0, 1):
        env = {"PET_NNODES": "2", "PET_NODE_RANK": str(node), "PET_MASTER_ADDR": "127.0.0.1",
               "PET_MASTER_PORT": str(port), "PET_NPROC_PER_NODE": "1"}
        jobs.append(harness.start([sys.executable, "-m", "elastic_train", "run",
                                   str(SCRIPTS / "print_world.py")], tmp_path / f"node{node}",
                                  harness.job_env(env), cwd=tmp_path, log_name=f"node{node}"))
    lines = []
    for job in jobs:
        assert job.wait(BOUND) == 0, job.report()
        lines += [line for line in job.output().splitlines() if line.startswith("world ")]
    assert sorted(lines) == [
        f"world RANK={rank} LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 GROUP_WORLD_SIZE=2 "
        "TORCHELASTIC_RUN_ID=none TORCHELASTIC_MAX_RESTARTS=0" for rank in (0, 1)]
