"""k8s/trainer-v2 proven offline: each variant (etcd-v3, c10d) renders; the TrainJob, the
ClusterTrainingRuntime and the JobSet Trainer v2 makes of them validate strictly against the
real CRDs (tests/schemas/trainer-v2, Trainer v2.3.0 and JobSet v0.12.0), the built-in kinds
against Kubernetes' own schemas; Trainer v2's rules accept the pair; and the command each
node's pod runs, with the PET_* variables Trainer v2's Torch plugin gives it, makes the
intended launch, as torchrun would settle the same command."""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from elastic_train.agent.launch import launcher_parser, options_torchrun_knows, torchrun_argv
from elastic_train.agent.launch_options import resolve
from elastic_train.config_options import parse_job_args
from elastic_train.rendezvous.config import parse_rdzv_conf
from elastic_train.rendezvous.etcd_v3.options import EtcdV3Options
from tests import k8s_model, kustomize

REPO = Path(__file__).resolve().parents[2]
V2 = REPO / "k8s" / "trainer-v2"
SCHEMAS = k8s_model.TRAINER_V2_SCHEMAS
KUBERNETES_VERSION = "1.32"
VARIANTS = {  # backend, its endpoint in the pods, nodes (min, max), workers per node
    "etcd-v3": ("etcd-v3", "elastic-train-etcd:2379", 1, 2, 1),
    "c10d": ("c10d", "elastic-train-node-0-0.elastic-train:29500", 1, 2, 1),
}
CRDS = {"TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
        "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml",
        "JobSet": "jobset.x-k8s.io_jobsets.yaml"}


@functools.cache
def _rendered(variant: str) -> dict[tuple[str, str], dict[str, Any]]:
    return kustomize.by_kind_and_name(kustomize.render(V2 / variant))


def rendered(variant: str) -> dict[tuple[str, str], dict[str, Any]]:
    return copy.deepcopy(_rendered(variant))


def one(objects: dict[tuple[str, str], dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for (k, _), doc in objects.items() if k == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


@functools.cache
def validator(kind: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(k8s_model.crd_schema(CRDS[kind], SCHEMAS))


def jobset_of(train_job: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    """The JobSet Trainer v2 makes of the pair (what its JobSet and Torch plugins set in the
    node Job: its parallelism and completions, the container's command, args, env,
    resources and the trainer port; node 0's PET_NODE_RANK from the completion index)."""
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    job = next(j for j in spec["replicatedJobs"] if j["name"] == k8s_model.TRAINER_V2_NODE)
    trainer = train_job["spec"]["trainer"]
    job["template"]["spec"]["parallelism"] = job["template"]["spec"]["completions"] = \
        trainer["numNodes"]
    pod = job["template"]["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == k8s_model.TRAINER_V2_NODE)
    container["command"], container["args"] = trainer["command"], trainer["args"]
    container["resources"] = trainer["resourcesPerNode"]
    env = k8s_model.trainer_v2_env(train_job, runtime, 0)
    env.pop("PET_NODE_RANK")
    container["env"] = [*container.get("env", []),
                        *({"name": k, "value": v} for k, v in env.items()),
                        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
                            "fieldPath": "metadata.annotations['batch.kubernetes.io/"
                                         "job-completion-index']"}}}]
    container["ports"] = [*container.get("ports", []),
                          {"containerPort": k8s_model.TRAINER_V2_PORT, "protocol": "TCP"}]
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": train_job["metadata"]["name"]}, "spec": spec}


def validate_strictly(doc: dict[str, Any]) -> None:
    """Raise jsonschema/kubernetes_validate errors for anything invalid or unknown."""
    if doc["kind"] in CRDS:
        validator(doc["kind"]).validate(doc)
        assert set(doc["metadata"]) <= {"name", "namespace", "labels", "annotations"}
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def node_job(jobset: dict[str, Any]) -> dict[str, Any]:
    """The JobSet's node Job as a batch/v1 Job, for Kubernetes' own strict schema."""
    job = next(j for j in jobset["spec"]["replicatedJobs"]
               if j["name"] == k8s_model.TRAINER_V2_NODE)
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{jobset['metadata']['name']}-node-0"},
            "spec": copy.deepcopy(job["template"]["spec"])}


def test_the_vendored_crds_are_the_ones_their_readme_names() -> None:
    readme = (SCHEMAS / "README.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \|.*\| ([0-9a-f]{64}) \|$", readme, flags=re.M)
    assert sorted(name for name, _ in rows) == sorted(CRDS.values())
    for name, digest in rows:
        assert hashlib.sha256((SCHEMAS / name).read_bytes()).hexdigest() == digest, name


def test_every_variant_is_covered_here() -> None:
    assert {p.name for p in V2.iterdir() if (p / "kustomization.yaml").is_file()} == \
        {*VARIANTS, "base"}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_object_and_the_jobset_validate_strictly(variant: str) -> None:
    objects = rendered(variant)
    expected = ["ClusterTrainingRuntime", "ConfigMap", "PersistentVolumeClaim", "TrainJob"]
    if variant == "etcd-v3":
        expected += ["Service", "Service", "StatefulSet"]
    assert sorted(kind for kind, _ in objects) == sorted(expected)
    train_job, runtime = one(objects, "TrainJob"), one(objects, "ClusterTrainingRuntime")
    jobset = jobset_of(train_job, runtime)
    for doc in [*objects.values(), jobset, node_job(jobset)]:
        try:
            validate_strictly(doc)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{variant}: {doc['kind']}/{doc['metadata']['name']}: "
                        f"{str(exc).splitlines()[0]}")
    assert k8s_model.trainer_v2_errors(train_job, runtime) == []


@pytest.mark.parametrize(("kind", "path", "field"), [
    ("TrainJob", ["spec", "trainer"], "numNode"),
    ("TrainJob", ["spec", "runtimeRef"], "namespace"),
    ("ClusterTrainingRuntime", ["spec", "mlPolicy", "torch"], "numProcPerNode"),  # v2.0's
    ("ClusterTrainingRuntime", ["spec", "template", "spec", "failurePolicy"], "maxRestart"),
    ("ClusterTrainingRuntime", ["spec", "template", "spec", "replicatedJobs", 0, "template",
                                "spec", "template", "spec"], "terminationGracePeriod"),
    ("JobSet", ["spec", "replicatedJobs", 0, "template", "spec", "template", "spec",
                "containers", 0], "imagePullPolcy"),
    ("Job", ["spec", "podFailurePolicy", "rules", 0], "onExitCode"),
])
def test_a_misspelt_field_fails_validation(kind: str, path: list[Any], field: str) -> None:
    objects = rendered("etcd-v3")
    jobset = jobset_of(one(objects, "TrainJob"), one(objects, "ClusterTrainingRuntime"))
    doc = {"JobSet": jobset, "Job": node_job(jobset)}.get(kind) or one(objects, kind)
    node = doc
    for part in path:
        node = node[part]
    node[field] = 1
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError),
                       match=field):
        validate_strictly(doc)


def test_trainer_v2s_rules_refuse_what_its_webhook_refuses() -> None:
    objects = rendered("c10d")
    train_job, runtime = one(objects, "TrainJob"), one(objects, "ClusterTrainingRuntime")
    train_job["spec"]["trainer"]["env"] = [{"name": "PET_NNODES", "value": "2:4"}]
    runtime["spec"]["mlPolicy"]["mpi"] = {}
    train_job["metadata"]["name"] = "Elastic_Train"
    assert k8s_model.trainer_v2_errors(train_job, runtime) == [
        "TrainJob metadata.name must be a DNS-1035 label of at most 63 characters",
        "mlPolicy must set exactly one of torch, mpi, jax, xgboost, flux",
        "trainer.env must not have reserved envs: ['PET_NNODES']"]


@pytest.mark.parametrize(("text", "env", "expanded"), [
    ("--nnodes=1:$(PET_NNODES)", {"PET_NNODES": "3"}, "--nnodes=1:3"),
    ("$(A):$(B)", {"A": "h", "B": "1"}, "h:1"),
    ("$(UNSET)-$$(A)", {"A": "h"}, "$(UNSET)-$(A)"),
])
def test_kubernetes_expands_variables_in_args(text: str, env: dict[str, str],
                                              expanded: str) -> None:
    assert k8s_model.expand(text, env) == expanded


def node_launch(variant: str, node_rank: int, tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, list[str], dict[str, str]]:
    """(our settled options, torch's launch config, the job args, the pod's environment)
    for node ``node_rank``'s pod, its PET_* variables in this process's environment."""
    from torch.distributed import run as torchrun

    objects = rendered(variant)
    argv, env = k8s_model.trainer_v2_pod(one(objects, "TrainJob"),
                                         one(objects, "ClusterTrainingRuntime"), node_rank)
    assert argv[:2] == ["elastic-train", "run"]
    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ns, job_args = launcher_parser().parse_known_args(argv[2:])
    resolve(ns)
    config = one(objects, "ConfigMap")
    local = tmp_path / "job.toml"
    local.write_text(config["data"]["job.toml"])
    job_args = [f"--config={local}" if a == "--config=/etc/elastic-train/job.toml" else a
                for a in job_args]
    cmd = options_torchrun_knows(torchrun_argv(ns, job_args), torchrun.get_args_parser())
    launch, _, _ = torchrun.config_from_args(torchrun.parse_args(cmd))
    return ns, launch, job_args, env


@pytest.mark.parametrize("node_rank", [0, 1])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_nodes_pod_makes_the_intended_launch_as_torchrun_would(
        variant: str, node_rank: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import run as torchrun

    backend, endpoint, low, high, nproc = VARIANTS[variant]
    ns, launch, job_args, env = node_launch(variant, node_rank, tmp_path, monkeypatch)
    assert env["PET_NODE_RANK"] == str(node_rank)
    assert (launch.rdzv_backend, launch.rdzv_endpoint) == (backend, endpoint)
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (low, high, nproc)
    assert (launch.run_id, launch.max_restarts) == ("elastic-train", 100)
    assert ns.shutdown_timeout == 40
    config = parse_job_args(job_args, prog="elastic-train run")
    assert str(config.run_dir) == "/checkpoints/elastic-train"
    assert config.metrics.address == "0.0.0.0"
    conf = parse_rdzv_conf(ns.rdzv_conf)
    assert {k: launch.rdzv_configs[k] for k in conf} == conf
    if backend == "etcd-v3":
        assert EtcdV3Options.parse(launch.rdzv_endpoint, launch.rdzv_configs).key_prefix == \
            "/elastic-train/rendezvous"
    # torchrun given the same command and environment settles the same world
    argv, _ = k8s_model.trainer_v2_pod(one(rendered(variant), "TrainJob"),
                                       one(rendered(variant), "ClusterTrainingRuntime"),
                                       node_rank)
    theirs = torchrun.parse_args([*[a for a in argv[2:] if a.startswith(
        ("--rdzv", "--nnodes", "--max-restarts"))], "train.py"])
    assert (theirs.rdzv_backend, theirs.rdzv_endpoint, theirs.nnodes, theirs.rdzv_id) == (
        ns.rdzv_backend, ns.rdzv_endpoint, ns.nnodes, ns.rdzv_id)
    assert (theirs.nproc_per_node, theirs.node_rank) == (ns.nproc_per_node, ns.node_rank)


@pytest.mark.parametrize(("trainer", "nproc"), [
    ({"numProcPerNode": 4}, "4"),
    ({"resourcesPerNode": {"requests": {"cpu": "3"}}}, "3"),
    ({"resourcesPerNode": {"requests": {"cpu": "500m"}}}, "1"),
    ({"resourcesPerNode": {"limits": {"nvidia.com/gpu": 8}}}, "auto"),
])
def test_the_workers_per_node_are_the_torch_plugins(trainer: dict[str, Any], nproc: str
                                                    ) -> None:
    objects = rendered("c10d")
    train_job, runtime = one(objects, "TrainJob"), one(objects, "ClusterTrainingRuntime")
    for key in ("numProcPerNode", "resourcesPerNode"):
        train_job["spec"]["trainer"].pop(key)
    train_job["spec"]["trainer"].update(trainer)
    assert k8s_model.trainer_v2_nproc(train_job, runtime) == nproc


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_pods_fit_the_job(variant: str, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Metrics ports, the grace period, volumes and the job config, as the PyTorchJob's."""
    objects = rendered(variant)
    runtime = one(objects, "ClusterTrainingRuntime")
    ns, _, job_args, env = node_launch(variant, 0, tmp_path, monkeypatch)
    container = k8s_model.trainer_v2_container(runtime)
    nproc = int(env["PET_NPROC_PER_NODE"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {f"metrics-{i}": 9450 + i for i in range(nproc)}
    job = k8s_model.trainer_v2_node_job(runtime)["template"]["spec"]
    pod = job["template"]["spec"]
    config = parse_job_args(job_args)
    budget = config.distributed.preemption_budget_seconds
    assert budget < ns.shutdown_timeout < pod["terminationGracePeriodSeconds"]
    assert {e["name"]: e["value"] for e in container["env"]} == {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} == set(volumes)
    claim = volumes["checkpoints"]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in objects
    assert volumes["job-config"]["configMap"]["name"] == one(objects, "ConfigMap")["metadata"][
        "name"]
    # bad input (exit 2 or 3) fails the Job, and that fails the JobSet for good
    rules = job["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [2, 3]
    fail = runtime["spec"]["template"]["spec"]["failurePolicy"]["rules"][0]
    assert (fail["action"], fail["onJobFailureReasons"]) == ("FailJobSet", ["PodFailurePolicy"])


def test_the_job_config_is_the_pytorchjobs() -> None:
    base = kustomize.by_kind_and_name(kustomize.render(REPO / "k8s" / "base"))
    assert one(rendered("c10d"), "ConfigMap")["data"] == one(base, "ConfigMap")["data"]


def test_the_etcd_of_the_etcd_v3_variant_is_the_one_its_endpoint_names() -> None:
    objects = rendered("etcd-v3")
    service = objects[("Service", "elastic-train-etcd")]
    host, port = VARIANTS["etcd-v3"][1].split(":")
    assert (service["metadata"]["name"], service["spec"]["ports"][0]["port"]) == (host,
                                                                                  int(port))


def test_the_docs_name_the_variables_trainer_v2_sets() -> None:
    text = (REPO / "docs" / "kubernetes.md").read_text()
    for name in k8s_model.TORCHRUN_RESERVED:
        assert name in text
    for variant in VARIANTS:
        assert f"kubectl apply -k k8s/trainer-v2/{variant}" in text
    assert yaml.safe_load((V2 / "base" / "clustertrainingruntime.yaml").read_text())["kind"] == \
        "ClusterTrainingRuntime"
