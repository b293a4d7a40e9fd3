"""A Kubeflow Trainer v2 job's nodes, on this machine: each runs the command of
k8s/trainer-v2/c10d's TrainJob with the environment Trainer v2's Torch plugin gives its pod
(tests/k8s_model.py trainer_v2_pod: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR, PET_MASTER_PORT; the master's address and port made loopback's), and the
two train one world together to the end."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests import k8s_model, kustomize
from tests.integration import harness

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
JOB = ["--preset", "tiny", "--batch-size", "16", "--steps", "6", "--checkpoint-every", "3",
       "--log-every", "3"]


def test_a_trainer_v2_jobs_two_nodes_train_on_the_environment_it_gives(tmp_path: Path
                                                                      ) -> None:
    objects = kustomize.by_kind_and_name(kustomize.render(REPO / "k8s" / "trainer-v2" / "c10d"))
    train_job = next(d for (k, _), d in objects.items() if k == "TrainJob")
    runtime = next(d for (k, _), d in objects.items() if k == "ClusterTrainingRuntime")
    config = tmp_path / "job.toml"
    config.write_text(next(d for (k, _), d in objects.items() if k == "ConfigMap")["data"][
        "job.toml"])
    run_dir = tmp_path / "run"
    port = harness.free_ports()
    jobs = []
    trainer = train_job["spec"]["trainer"]
    for rank in (0, 1):
        _, env = k8s_model.trainer_v2_pod(train_job, runtime, rank)
        # the pod's names, made this machine's: the master's address, the run dir, the config
        env.update({"PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)})
        argv = [k8s_model.expand(a, env).replace("/etc/elastic-train/job.toml", str(config))
                .replace("/checkpoints/elastic-train", str(run_dir))
                for a in [*trainer["command"], *trainer["args"]]]
        assert argv[:2] == ["elastic-train", "run"]
        assert f"--rdzv-endpoint=127.0.0.1:{port}" in argv and "--nnodes=1:2" in argv
        command = [sys.executable, "-m", "elastic_train", *argv[1:],
                   *harness.with_metrics_ports(JOB, 1)]
        jobs.append(harness.start(command, tmp_path / f"node{rank}", harness.job_env(env),
                                  log_name=f"node{rank}"))
    for job in jobs:
        assert job.wait(240) == 0, job.report()
    listing = harness.checkpoint_listing(run_dir)
    assert max(r["step"] for r in listing) == 6
    assert {r["world_size"] for r in listing} == {2}
    output = "".join(job.output() for job in jobs)
    assert re.search(r"world 2", output), output[-3000:]
