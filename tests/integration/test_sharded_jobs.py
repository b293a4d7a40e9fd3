"""Sharded models (``--parallelism fsdp|hsdp``: FSDP2 on gloo, CPU) in real torchrun and
``elastic-train run`` jobs, with sharded checkpoints (checkpoint/sharded.py).

- fsdp: SIGKILLs of a worker mid-interval, right after a checkpoint, and of rank 0: every
  restart resumes from the newest sharded checkpoint and the job ends with the weights of a
  run never killed, bit for bit, every checkpoint on the way too; each sample once;
- hsdp (2 replica groups of 2): a worker SIGKILLed, the same weights as a run never
  killed; only the first replica group writes shards;
- a resize 2 -> 3 -> 2 (SIGTERM, then a relaunch at the new size): each restore reshards to
  the new mesh, and the recorded sample ids show each sample once per epoch;
- a corrupt shard: the checkpoint fails verification, the restore skips it and the rerun
  ends with the uninterrupted weights; the export gathers a plain state dict that a fresh,
  unsharded model loads, with the checkpoint's digest.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from elastic_train import cli
from elastic_train.checkpoint.storage import model_digest
from elastic_train.tasks.base import TaskContext
from elastic_train.tasks.gpt import make_task
from tests.integration import harness
from tests.integration.test_multinode import effective_steps

pytestmark = pytest.mark.slow

SAMPLES = 700  # windows of 64 bytes: 10 global batches of 64 per epoch, a tail dropped
STEPS = 40
TASK = ["--preset", "tiny", "--task-opt", "dropout=0.1",
        "--task-opt", f"corpus_max_bytes={SAMPLES * 64 + 1}"]
JOB = [*TASK, "--steps", str(STEPS), "--batch-size", "64", "--checkpoint-every", "5",
       "--keep-checkpoints", "10", "--log-every", "10", "--record-samples", "true"]
FSDP = [*JOB, "--parallelism", "fsdp"]
HSDP = [*JOB, "--parallelism", "hsdp", "--replica-group-size", "2"]
TIMEOUT = 240


def digests(run_dir: Path) -> dict[int, str]:
    return {r["step"]: r["model_digest"] for r in harness.checkpoint_listing(run_dir)
            if r["valid"]}


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], Path]:
    run_dir = tmp_path_factory.mktemp("fsdp-reference") / "run"
    job = harness.torchrun(run_dir, FSDP, max_restarts=0)
    assert job.wait(TIMEOUT) == 0, job.report()
    return digests(run_dir), run_dir


def assert_each_sample_once(run_dir: Path) -> dict[int, dict[str, Any]]:
    steps = effective_steps(run_dir)  # the newest attempt of each step
    assert sorted(steps) == list(range(1, STEPS + 1))
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for step in sorted(steps):
        by_epoch[steps[step]["epoch"]].extend(steps[step]["indices"])
    for epoch, seen in by_epoch.items():
        assert len(seen) == len(set(seen)), f"epoch {epoch} repeats samples"
        assert all(0 <= i < SAMPLES for i in seen)
        if epoch < max(by_epoch):
            assert len(seen) == (SAMPLES // 64) * 64, f"epoch {epoch} skipped samples"
    return steps


def loaded(job: harness.Job) -> list[tuple[int, int | None, int]]:
    return [(e["step"], e["saved_world_size"], e["world_size"]) for e in job.events()
            if e["event"] == "checkpoint_loaded"]


def recoveries(job: harness.Job) -> list[dict[str, Any]]:
    return [e for e in job.events() if e["event"] == "recovery"]


def saved(step: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "checkpoint_saved" and e["step"] == step


def stepped(step: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "step" and e["step"] == step


def kill_and_watch(job: harness.Job, kills: list[tuple[int, Callable[[dict[str, Any]], bool]]]
                   ) -> list[bool]:
    """For each (rank, when) in turn: SIGKILL that rank at the first event ``when`` takes,
    and wait for the world to re-form; whether every other worker kept its process."""
    kept = []
    for count, (rank, when) in enumerate(kills):
        job.wait_for_event(when, TIMEOUT)
        pids = job.worker_pids()
        job.kill_worker(rank)
        job.wait_for_event(lambda e, count=count: e["event"] == "recovery"
                           and len(recoveries(job)) > count, timeout=TIMEOUT)
        kept.append({r: p for r, p in job.worker_pids().items() if r != rank}
                    == {r: p for r, p in pids.items() if r != rank})
    return kept


def test_fsdp_sigkills_recover_in_place_from_the_checkpoint_bitwise(
        fsdp_reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    """Four SIGKILLs in one ``elastic-train run`` (live recovery, the default): mid-interval
    (rank 1), right after a checkpoint (rank 1), as a checkpoint is written (rank 1), and
    rank 0, the committer, mid-interval.
    FSDP has no replica of a lost rank's shards: the survivor keeps its process, and every
    rank goes back to the newest checkpoint, resharded on the new mesh, as a restart would,
    from the agents' memory tier."""
    reference, _ = fsdp_reference
    kills = [(1, stepped(12)), (1, saved(20)), (1, stepped(25)), (0, stepped(33))]
    run_dir = tmp_path / "run"
    job = harness.elastic_run(run_dir, [*FSDP, "--max-restarts", "4"])
    try:
        kept = kill_and_watch(job, kills)
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    assert kept == [True] * len(kills), job.report()  # the survivor kept its process
    found = recoveries(job)
    assert [(r["kind"], r["state_from"], r["failed_ranks"]) for r in found] == [
        ("live", "checkpoint", [rank]) for rank, _ in kills], found
    # The third kill comes as checkpoint 25 is written: rank 1 either offered its part to
    # the memory tier first (25 is whole there, and is the one loaded), or never did, and
    # 20 is loaded (rank 0 gave the durable save of 25 up, unless rank 1 wrote it first:
    # it waited for rank 1's shard, or the new world's restore swept its temp directory
    # away while rank 0 still wrote its own shard, which is no disk failure).
    given_up = "WARNING elastic_train.checkpoint.manager: checkpoint 25 was given up: the " \
        "world re-formed "
    assert "checkpoint 25 was not written" not in job.output(), job.report()
    resumed = [r["step"] for r in found]
    assert resumed in ([10, 20, 20, 30], [10, 20, 25, 30]), resumed
    assert resumed[2] == 25 or given_up in job.output(), job.report()
    # A save loaded from memory whose durable write was given up (25 above; or any save
    # whose temp directory the new world's restore swept away while rank 0 still wrote it,
    # seen once for 10 on 2 busy cores) is written again by the new world: the run
    # directory ends with every checkpoint the policy asked for (digests, below).
    given_up_steps = {int(n) for n in re.findall(
        r"checkpoint (\d+) was given up: the world re-formed", job.output())}
    rewritten = [e["step"] for e in job.events()
                 if e["event"] == "checkpoint_saved" and e["reason"] == "from_memory"]
    assert rewritten == sorted(given_up_steps & set(resumed)), (rewritten, given_up_steps)
    assert not [e for e in job.events() if e["event"] == "restart"]
    # Each rank offered its part to its agent's memory tier before writing it: every
    # recovery read the parts from there, never the run directory.
    assert [e["source"] for e in job.events() if e["event"] == "checkpoint_loaded"] == \
        ["memory"] * len(kills)
    assert digests(run_dir) == reference  # every checkpoint, the final one included
    assert_each_sample_once(run_dir)
    final = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    assert sorted(p.name for p in final.iterdir()) == [
        "common.pt", "manifest.json", "shard-00000.safetensors", "shard-00001.safetensors"]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_a_checkpoint_interval_is_rank_0s_clock_and_every_rank_saves_that_step(
        fsdp_reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    """``--checkpoint-interval`` with fsdp: rank 0's clock decides, the step's vote carries
    it, and every rank writes its shards at that step: each save commits (no rank waited
    for a shard of a step another rank did not save), and the run ends with the weights of
    the reference run (the same steps, checkpointed every 5)."""
    reference, _ = fsdp_reference
    run_dir = tmp_path / "run"
    paced = ["--task", "tests.integration.paced_task:make_task", "--task-opt", "pace=0.05"]
    job = harness.elastic_run(run_dir, [*FSDP, *paced, "--checkpoint-every", "off",
                                        "--checkpoint-interval", "0.4", "--max-restarts", "0"])
    assert job.wait(TIMEOUT) == 0, job.report()
    saved = [e["step"] for e in job.events() if e["event"] == "checkpoint_saved"]
    assert len(saved) >= 3 and saved[-1] == STEPS, saved  # 40 steps of at least 0.05 s
    assert saved == sorted(set(saved)), saved  # each save once, in order
    listed = harness.checkpoint_listing(run_dir)
    assert sorted(r["step"] for r in listed) == sorted(saved)[-10:]  # kept: 10
    assert all(r["valid"] for r in listed), listed
    assert "wrote no shard" not in job.output()
    assert digests(run_dir)[STEPS] == reference[STEPS]


# Extended (make test-extended); the default suite proves it with
# test_hsdp_a_lost_node_is_a_lost_replica_group_and_a_new_one_is_filled_by_the_peers.
@pytest.mark.extended
def test_hsdp_killed_workers_take_their_shards_from_their_replica_group_bitwise(
        tmp_path: Path) -> None:
    """4 workers, 2 replica groups of 2, under ``elastic-train run``: a worker SIGKILLed
    mid-interval (rank 3), then rank 0, the committer: each time the new worker receives
    its shards from its peer in the other replica group, nothing goes back to a checkpoint,
    and the run ends with the weights of a run never killed (torchrun's, with no kill);
    only the first replica group wrote shards."""
    reference = tmp_path / "reference"
    job = harness.torchrun(reference, HSDP, nproc=4, max_restarts=0)
    assert job.wait(TIMEOUT) == 0, job.report()
    run_dir = tmp_path / "run"
    job = harness.elastic_run(run_dir, [*HSDP, "--nproc-per-node", "4"])
    kills = [(3, 17), (0, 28)]
    try:
        kept = kill_and_watch(job, [(rank, stepped(step)) for rank, step in kills])
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    assert kept == [True] * len(kills), job.report()
    found = recoveries(job)
    assert [(r["kind"], r["state_from"], r["failed_ranks"]) for r in found] == [
        ("live", "peers", [rank]) for rank, _ in kills], found
    for recovery, (_, step) in zip(found, kills, strict=True):
        assert step <= recovery["step"] <= step + 1 and recovery["steps_redone"] <= 1
        assert recovery["bytes"] > 0
    assert [e["step"] for e in job.events() if e["event"] == "checkpoint_loaded"] == []
    assert digests(run_dir) == digests(reference)
    final = run_dir / "checkpoints" / f"step-{STEPS:08d}"
    assert sorted(p.name for p in final.glob("shard-*")) == [
        "shard-00000.safetensors", "shard-00001.safetensors"]
    assert json.loads((final / "manifest.json").read_text())["world_size"] == 4


def _preempted_at(run_dir: Path, nproc: int, step: int) -> harness.Job:
    """A launch at ``nproc`` workers, SIGTERMed once it passed ``step`` (every rank
    checkpoints at one agreed step and exits)."""
    job = harness.torchrun(run_dir, FSDP, nproc=nproc, max_restarts=0)
    try:
        job.wait_for_event(lambda e: e["event"] == "step" and e["step"] >= step, TIMEOUT)
        job.proc.send_signal(signal.SIGTERM)
        job.wait(TIMEOUT)
    finally:
        job.stop()
    return job


# Extended (make test-extended); the default suite proves it with
# test_fsdp_two_nodes_one_lost_then_one_joining_reshard_in_place.
@pytest.mark.extended
def test_a_resize_2_3_2_reshards_and_uses_each_sample_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _preempted_at(run_dir, 2, 12)
    job = _preempted_at(run_dir, 3, 26)
    assert loaded(job)[-1][1:] == (2, 3), loaded(job)
    job = harness.torchrun(run_dir, FSDP, nproc=2, max_restarts=0)
    assert job.wait(TIMEOUT) == 0, job.report()
    assert loaded(job)[-1][1:] == (3, 2), loaded(job)
    steps = assert_each_sample_once(run_dir)
    assert {s["world_size"] for s in steps.values()} == {2, 3}
    assert harness.checkpoint_listing(run_dir)[0]["step"] == STEPS


def test_a_corrupt_shard_is_skipped_and_the_export_loads_unsharded(
        fsdp_reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    reference, reference_dir = fsdp_reference
    run_dir = tmp_path / "run"
    shutil.copytree(reference_dir, run_dir)
    shard = run_dir / "checkpoints" / f"step-{STEPS:08d}" / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cli.main(["checkpoints", "verify", str(run_dir)]) == 1
    job = harness.torchrun(run_dir, FSDP, max_restarts=0)
    assert job.wait(TIMEOUT) == 0, job.report()
    assert loaded(job) == [(STEPS - 5, 2, 2)]
    assert digests(run_dir)[STEPS] == reference[STEPS]
    assert [p for p in (run_dir / "checkpoints").iterdir() if ".corrupt-" in p.name]

    out = tmp_path / "weights.safetensors"
    assert cli.main(["checkpoints", "export", str(run_dir), str(out)]) == 0
    model = make_task(TaskContext({"preset": "tiny", "dropout": 0.1})).build_model()
    model.load_state_dict(load_file(out))  # strict: every tensor, whole
    assert model_digest(model.state_dict()) == reference[STEPS]
    assert torch.equal(model.lm_head.weight, model.tok_emb.weight)


SESSION_LOOP = Path(__file__).resolve().parents[2] / "examples" / "fsdp_session.py"


def _session_loop(run_dir: Path, max_restarts: int, launcher: str = "torchrun",
                  nproc: int = 2, args: tuple[str, ...] = ()) -> harness.Job:
    if launcher == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
                "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.1"]
    else:
        argv = [sys.executable, "-m", "elastic_train", "run"]
    return harness.start([*argv, f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                          str(SESSION_LOOP), str(run_dir), *args], run_dir)


@pytest.fixture(scope="module")
def session_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reference = tmp_path_factory.mktemp("fsdp-session-reference") / "run"
    job = _session_loop(reference, 0)
    assert job.wait(TIMEOUT) == 0, job.report()
    return reference


def assert_same_final_weights(run_dir: Path, reference: Path) -> None:
    """The exported weights equal the reference's bit for bit and load, strictly, into the
    unsharded model."""
    ours, theirs = load_file(run_dir / "final.safetensors"), \
        load_file(reference / "final.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from examples.fsdp_session import Model

    Model().load_state_dict(ours)  # strict: the whole, unsharded model


# Extended (make test-extended); the default suite proves it with
# test_a_hand_written_fsdp_loop_recovers_in_place_with_the_weights_of_one_never_killed.
@pytest.mark.extended
def test_a_hand_written_fsdp_loop_killed_under_torchrun_resumes_with_unchanged_weights(
        session_reference: Path, tmp_path: Path) -> None:
    """examples/fsdp_session.py (``session.wrap(model, parallelism="fsdp")``) under plain
    torchrun: a worker SIGKILLed mid-epoch; the restart resumes from the sharded checkpoint
    and the exported final weights equal the uninterrupted run's, bit for bit, and load
    into the unsharded model."""
    run_dir = tmp_path / "run"
    job = _session_loop(run_dir, 2)
    try:
        job.wait_for_event(lambda e: e["event"] == "checkpoint_saved" and e["step"] == 20,
                           TIMEOUT)
        job.kill_worker(1)
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    assert [step for step, _, _ in loaded(job)] in ([20], [30]), loaded(job)
    assert_same_final_weights(run_dir, session_reference)


def test_a_hand_written_fsdp_loop_recovers_in_place_with_the_weights_of_one_never_killed(
        session_reference: Path, tmp_path: Path) -> None:
    """The same loop under ``elastic-train run``: rank 1 SIGKILLed after checkpoint 10,
    then rank 0 (the committer) after checkpoint 20. Each time the survivor keeps its
    process (and the loop its model and optimizer objects: the model is sharded again in
    place on the new mesh), the lost shards come from the newest checkpoint, which the
    agents' memory tier holds, and the job ends with the uninterrupted run's weights, bit
    for bit; the session says nothing about a restart."""
    run_dir = tmp_path / "run"
    job = _session_loop(run_dir, 2, "elastic-train run")
    try:
        kept = kill_and_watch(job, [(1, saved(10)), (0, saved(20))])
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    assert kept == [True, True], job.report()
    found = recoveries(job)
    assert [(r["kind"], r["state_from"], r["failed_ranks"]) for r in found] == [
        ("live", "checkpoint", [1]), ("live", "checkpoint", [0])], found
    assert [step for step, _, _ in loaded(job)] == [10, 20], loaded(job)
    assert {e["source"] for e in job.events() if e["event"] == "checkpoint_loaded"} == \
        {"memory"}
    assert "not recovered in place" not in job.output()
    assert_same_final_weights(run_dir, session_reference)


@pytest.mark.extended  # the built-in job's hsdp test proves the peers' path by default
def test_a_hand_written_hsdp_loop_takes_a_lost_ranks_shards_from_its_replica_group(
        tmp_path: Path) -> None:
    """The loop with ``parallelism="hsdp"``, 4 workers in 2 replica groups of 2, under
    ``elastic-train run``: rank 3 SIGKILLed after checkpoint 10; its new worker receives
    its shards from its peer in the other replica group (no checkpoint read) and the
    job ends with the weights of a run never killed, bit for bit."""
    reference = tmp_path / "reference"
    job = _session_loop(reference, 0, nproc=4, args=("hsdp", "2"))
    assert job.wait(TIMEOUT) == 0, job.report()
    run_dir = tmp_path / "run"
    job = _session_loop(run_dir, 2, "elastic-train run", nproc=4, args=("hsdp", "2"))
    try:
        kept = kill_and_watch(job, [(3, saved(10))])
        assert job.wait(TIMEOUT) == 0, job.report()
    finally:
        job.stop()
    assert kept == [True], job.report()
    found = recoveries(job)
    assert [(r["kind"], r["state_from"], r["failed_ranks"]) for r in found] == [
        ("live", "peers", [3])], found
    assert found[0]["bytes"] > 0 and loaded(job) == []
    assert_same_final_weights(run_dir, reference)


def test_a_checkpoint_of_the_other_kind_is_refused_with_one_line_and_kept(
        fsdp_reference: tuple[dict[int, str], Path], tmp_path: Path) -> None:
    """A sharded run resumed with --parallelism ddp: the launcher refuses the checkpoint with
    one line before any worker starts (exit 3); nothing in the run directory changes."""
    _, reference_dir = fsdp_reference
    run_dir = tmp_path / "run"
    shutil.copytree(reference_dir, run_dir)
    before = {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    job = harness.elastic_run(run_dir, [*JOB, "--steps", str(STEPS + 5), "--max-restarts", "0"])
    assert job.wait(TIMEOUT) == 3, job.report()
    assert job.output().strip().splitlines()[-1] == (
        f"elastic-train: error: checkpoint {run_dir}/checkpoints/step-{STEPS:08d} is sharded "
        "(--parallelism fsdp or hsdp) and this job is unsharded (--parallelism ddp): resume "
        "it with the --parallelism that wrote it, or start a new --run-dir from its weights "
        "(elastic-train checkpoints export)"), job.output()[-2000:]
    assert "[rank 0]" not in job.output()  # no worker started
    after = {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    assert after == before


def test_fsdp_two_nodes_one_lost_then_one_joining_reshard_in_place(tmp_path: Path) -> None:
    """Two nodes (c10d, one worker each) under ``--parallelism fsdp``: node b is killed,
    then node c joins. The shrink goes through the checkpoint (no member holds node b's
    shards): the survivor keeps its process and loads the newest checkpoint onto a mesh of
    1, node b's part from the copy node a's agent holds of it (the memory tier); the grow
    reshards in place (the survivor holds every shard: it sends the new worker its half of
    the new mesh, no checkpoint is read). The survivor's process lives
    through both; the batch policy applies at each size; each sample is used once, in
    order, per epoch."""
    from tests.etcd_server import free_port
    from tests.integration.test_multinode import (
        JOB as NODE_JOB,
    )
    from tests.integration.test_multinode import (
        SLOW_EXPIRY,
        assert_each_sample_once_in_order,
        c10d_node,
        check_the_log,
        first_recovery,
        lose_a_node_and_add_one,
    )

    run_dir = tmp_path / "run"
    measured = lose_a_node_and_add_one(
        run_dir, c10d_node(tmp_path, free_port(), [*NODE_JOB, "--parallelism", "fsdp"],
                           SLOW_EXPIRY), victim="store-client")
    events = check_the_log(run_dir)
    assert_each_sample_once_in_order(run_dir)
    shrink, grow = first_recovery(events, "node lost"), first_recovery(events, "node joined")
    assert (shrink["kind"], shrink["state_from"], shrink["world_size"]) == \
        ("live", "checkpoint", 1), shrink
    assert (grow["kind"], grow["state_from"], grow["steps_redone"], grow["world_size"]) == \
        ("live", "peers", 0, 2), grow
    assert grow["bytes"] > 0
    loads = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [(e["step"], e["saved_world_size"], e["world_size"], e["source"])
            for e in loads] == [(shrink["step"], 2, 1, "memory")], loads  # b's part: a copy
    assert measured.survivor_pids[0] == measured.survivor_pids[1] == measured.survivor_pids[2]


def test_hsdp_a_lost_node_is_a_lost_replica_group_and_a_new_one_is_filled_by_the_peers(
        tmp_path: Path) -> None:
    """Two c10d nodes of two workers under ``--parallelism hsdp`` (one replica group per
    node, the default): node b is killed, then node c joins. Every shard of node b has a
    replica on node a, so the world of 2 goes on from its peers (no checkpoint is read),
    and node c's workers receive their shards from node a's; node a's processes live
    through both; each sample is used once, in order, per epoch."""
    from tests.etcd_server import free_port
    from tests.integration.test_multinode import JOB as NODE_JOB
    from tests.integration.test_multinode import (
        SLOW_EXPIRY,
        assert_each_sample_once_in_order,
        c10d_node,
        first_recovery,
        step_at,
        worlds_of,
    )

    run_dir = tmp_path / "run"
    start = c10d_node(tmp_path, free_port(), [
        *NODE_JOB, "--parallelism", "hsdp", "--nproc-per-node", "2",
        "--task-opt", "pace_world_2=0.4"], SLOW_EXPIRY)
    nodes = [start("node-a"), start("node-b")]
    try:
        nodes[0].wait_for_event(step_at(4, min_step=12), TIMEOUT)
        survivors = set(harness.workers_of(nodes[0].proc.pid).values())
        killed_at = nodes[1].kill_node()
        nodes[0].wait_for_event(step_at(2, after=killed_at), TIMEOUT)
        joined_at = time.time()
        nodes.append(start("node-c"))
        nodes[0].wait_for_event(step_at(4, after=joined_at), TIMEOUT)
        assert set(harness.workers_of(nodes[0].proc.pid).values()) == survivors
        for node in (nodes[0], nodes[2]):
            assert node.wait(TIMEOUT) == 0, node.report()
    finally:
        for node in nodes:
            node.stop()
    events = nodes[0].events()
    assert worlds_of(events)[-3:] == [4, 2, 4], worlds_of(events)
    shrink, grow = first_recovery(events, "node lost"), first_recovery(events, "node joined")
    assert (shrink["kind"], shrink["state_from"], shrink["world_size"]) == \
        ("live", "peers", 2), shrink
    assert shrink["steps_redone"] <= 1
    assert (grow["kind"], grow["state_from"], grow["steps_redone"], grow["world_size"]) == \
        ("live", "peers", 0, 4), grow
    assert grow["bytes"] > 0
    assert [e for e in events if e["event"] == "checkpoint_loaded"] == []
    assert_each_sample_once_in_order(run_dir)
