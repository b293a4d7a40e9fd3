"""k8s/ proven offline: every overlay renders (our renderer and the real kustomize's kept
output agree), every object validates strictly (the PyTorchJob and PodMonitor against the
real CRDs vendored in tests/schemas/operators-v1, the built-in kinds against Kubernetes'
own schemas),
the worker command is one our parser accepts, and the PET_* variables the operator would
set make torchrun pick the intended backend, endpoint and node range. The object-store
overlay has no claim and no volume of one: its run_dir is a bucket."""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import re
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from elastic_train.agent.launch import launcher_parser, options_torchrun_knows, torchrun_argv
from elastic_train.agent.launch_options import resolve
from elastic_train.config_options import parse_job_args
from elastic_train.errors import ConfigError
from elastic_train.rendezvous.config import parse_rdzv_conf
from elastic_train.rendezvous.etcd_v3.options import EtcdV3Options
from tests import k8s_model, kustomize, tools

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
KUBERNETES_VERSION = "1.32"
CRDS = {"PyTorchJob": "kubeflow.org_pytorchjobs.yaml",
        "PodMonitor": "monitoring.coreos.com_podmonitors.yaml"}
# What each overlay is for: backend, node range, workers per pod, etcd members and image.
INTENDED = {
    "quickstart": ("etcd-v3", 1, 2, 1, 1, "v3.6"),
    "production": ("etcd-v3", 2, 8, 4, 3, "v3.6"),
    "stock-etcd": ("etcd", 1, 2, 1, 1, "v3.5"),
    "c10d": ("c10d", 1, 2, 1, 0, None),
    "object-store": ("etcd-v3", 1, 2, 1, 1, "v3.6"),
}
# Overlays whose checkpoints live in an object store: their run_dir (the job config's).
OBJECT_STORE = {"object-store": "s3://elastic-train/runs/elastic-train"}
# The [storage] keys the storage code reads (the job config's object-store table).
STORAGE_KEYS = {"endpoint_url", "region", "profile", "addressing_style", "local_dir"}
LOCAL_DIR = "/var/lib/elastic-train"
S3_SECRET = "elastic-train-s3"


def _config_knows_storage() -> bool:
    """Whether the job config accepts a [storage] table yet (the storage code adds it)."""
    with tempfile.TemporaryDirectory() as directory:
        probe = Path(directory) / "probe.toml"
        probe.write_text('[storage]\nendpoint_url = "http://probe.example:9000"\n')
        try:
            parse_job_args([f"--config={probe}"])
        except ConfigError:
            return False
    return True


# Until the job config knows [storage] and s3:// run dirs, the object-store overlay's
# job.toml cannot parse: those tests are expected to fail with a ConfigError. The mark
# lifts itself once the config accepts a [storage] table (then they must pass, run_dir
# kept as the s3:// URL included); strict: a pass while it still applies fails.
STORAGE_PENDING = pytest.mark.xfail(
    not _config_knows_storage(), raises=ConfigError, strict=True,
    reason="the job config does not know the [storage] table yet (the storage code adds it)")


def parsing_overlays() -> list[Any]:
    """OVERLAYS for the tests that parse the job config, object stores marked pending."""
    return [pytest.param(o, marks=STORAGE_PENDING) if o in OBJECT_STORE else o
            for o in OVERLAYS]


@functools.cache
def _rendered(overlay: str) -> dict[tuple[str, str], dict[str, Any]]:
    return kustomize.by_kind_and_name(kustomize.render(K8S / "overlays" / overlay))


def rendered(overlay: str) -> dict[tuple[str, str], dict[str, Any]]:
    """The overlay's objects by (kind, name); a copy each test may change."""
    return copy.deepcopy(_rendered(overlay))


@functools.cache
def crd_validator(kind: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(k8s_model.crd_schema(CRDS[kind]))


def one(objects: dict[tuple[str, str], dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for (k, _), doc in objects.items() if k == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def validate_strictly(doc: dict[str, Any]) -> None:
    """Raise jsonschema/kubernetes_validate errors for anything invalid or unknown."""
    if doc["kind"] in CRDS:
        crd_validator(doc["kind"]).validate(doc)
        assert set(doc["metadata"]) <= {"name", "namespace", "labels", "annotations"}
    elif doc["kind"] == "PrometheusRule":
        assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
        assert set(doc["spec"]) == {"groups"}
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_every_overlay_is_covered_here() -> None:
    assert set(OVERLAYS) == set(INTENDED)


def test_every_yaml_file_parses() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 12
    for path in files:
        assert kustomize.load_docs(path), path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_every_object_validates_strictly(overlay: str) -> None:
    objects = rendered(overlay)
    kinds = sorted(kind for kind, _ in objects)
    expected = ["ConfigMap", "PodMonitor", "PrometheusRule", "PyTorchJob"]
    if overlay not in OBJECT_STORE:
        expected.append("PersistentVolumeClaim")
    if INTENDED[overlay][4]:
        expected += ["Service", "Service", "StatefulSet"]
    assert kinds == sorted(expected)
    for doc in objects.values():
        try:
            validate_strictly(doc)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: "
                        f"{str(exc).splitlines()[0]}")


@pytest.mark.parametrize("name", sorted(kustomize.kustomizations()))
def test_our_renderer_agrees_with_the_real_kustomize(name: str) -> None:
    """The real tool's output is kept in the repo (tests/k8s_rendered: the README's install
    cannot provide kubectl or kustomize), made from k8s/ as it is now."""
    made_from, real = kustomize.rendered_file(name)
    assert made_from == kustomize.k8s_digest(), (
        "k8s/ changed since tests/k8s_rendered was made: run `make k8s-rendered` where "
        "kubectl or kustomize is installed, and commit what it writes")
    ours = kustomize.render(kustomize.kustomizations()[name])
    assert kustomize.by_kind_and_name(ours) == kustomize.by_kind_and_name(real)


def test_a_change_to_k8s_is_seen_by_the_digest_of_the_rendered_files(tmp_path: Path,
                                                                    monkeypatch: Any) -> None:
    """The check above cannot pass on stale files: any byte of k8s/ changes the digest."""
    copy_of = tmp_path / "k8s"
    subprocess.run(["cp", "-r", str(K8S), str(copy_of)], check=True)
    monkeypatch.setattr(kustomize, "K8S", copy_of)
    before = kustomize.k8s_digest()
    assert before == kustomize.rendered_file("overlays-c10d")[0]
    patch = copy_of / "overlays" / "c10d" / "kustomization.yaml"
    patch.write_text(patch.read_text() + "\n# a change\n")
    assert kustomize.k8s_digest() != before


@pytest.mark.parametrize(("patch", "error"), [
    ("$patch: delete\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: other}",
     "targets"),
    ("$patch: delete\napiVersion: v1\nkind: PersistentVolumeClaim\n"
     "metadata: {name: elastic-train-checkpoints}\nspec: {}", "names apiVersion"),
    ("apiVersion: v1\nkind: PersistentVolumeClaim\n"
     "metadata: {name: elastic-train-checkpoints}\nspec: {}", "only JSON 6902"),
])
def test_our_renderer_deletes_only_what_a_delete_patch_names(tmp_path: Path, patch: str,
                                                             error: str) -> None:
    target = {"kind": "PersistentVolumeClaim", "name": "elastic-train-checkpoints"}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(K8S / "base")], "patches": [{"target": target, "patch": patch}]}))
    with pytest.raises(kustomize.KustomizeError, match=error):
        kustomize.render(tmp_path)


@pytest.mark.parametrize(("kind", "path", "field"), [
    ("PyTorchJob", ["spec", "elasticPolicy"], "maxReplica"),
    ("PyTorchJob", ["spec", "pytorchReplicaSpecs", "Worker", "template", "spec"],
     "terminationGracePeriod"),
    ("PyTorchJob", ["spec", "pytorchReplicaSpecs", "Worker", "template", "spec",
                    "containers", 0], "imagePullPolcy"),
    ("PodMonitor", ["spec", "podMetricsEndpoints", 0], "intervall"),
    ("StatefulSet", ["spec", "template", "spec", "containers", 0], "envv"),
    ("PersistentVolumeClaim", ["spec"], "storageClass"),
])
def test_a_misspelt_field_fails_validation(kind: str, path: list[Any], field: str) -> None:
    doc = copy.deepcopy(one(rendered("production"), kind))
    node = doc
    for part in path:
        node = node[part]
    node[field] = 1
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError),
                       match=field):
        validate_strictly(doc)


def test_the_vendored_crds_are_the_files_their_readme_names() -> None:
    """The CRDs are in the repo (a clone needs nothing beside it), byte for byte as their
    README's table says where they come from."""
    readme = (k8s_model.SCHEMAS / "README.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \|.*\| ([0-9a-f]{64}) \|$", readme, flags=re.M)
    assert sorted(name for name, _ in rows) == sorted(CRDS.values())
    for name, digest in rows:
        assert hashlib.sha256((k8s_model.SCHEMAS / name).read_bytes()).hexdigest() == digest


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_operator_accepts_the_job(overlay: str) -> None:
    assert k8s_model.webhook_errors(one(rendered(overlay), "PyTorchJob")) == []


def job_toml(objects: dict[tuple[str, str], dict[str, Any]], tmp_path: Path,
             args: list[str]) -> list[str]:
    """``args`` with the ConfigMap's job.toml written where --config points in the pod."""
    config = one(objects, "ConfigMap")
    mounted = [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    assert mounted == ["/etc/elastic-train/job.toml"]
    local = tmp_path / "job.toml"
    local.write_text(config["data"]["job.toml"])
    return [f"--config={local}" if a.startswith("--config=") else a for a in args]


@pytest.mark.parametrize("overlay", parsing_overlays())
def test_the_worker_command_and_the_operators_settings_make_the_intended_launch(
        overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import run as torchrun

    backend, low, high, nproc, _, _ = INTENDED[overlay]
    objects = rendered(overlay)
    job = one(objects, "PyTorchJob")
    container = k8s_model.training_container(job)
    assert container["command"] == ["elastic-train", "run"]
    env = k8s_model.container_env(job)
    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    ns, job_args = launcher_parser().parse_known_args(container["args"])
    resolve(ns)
    config = parse_job_args(job_toml(objects, tmp_path, job_args), prog="elastic-train run")
    if overlay in OBJECT_STORE:
        assert str(config.run_dir) == OBJECT_STORE[overlay]
    else:
        assert str(config.run_dir).startswith("/checkpoints/")
    assert config.metrics.address == "0.0.0.0"
    # as the launcher does: without the options this torch's torchrun lacks (torch 2.11:
    # --shutdown-timeout), each said in one line
    cmd = options_torchrun_knows(torchrun_argv(ns, job_args), torchrun.get_args_parser())
    launch, _, _ = torchrun.config_from_args(torchrun.parse_args(cmd))

    policy = job["spec"]["elasticPolicy"]
    assert (launch.rdzv_backend, launch.min_nodes, launch.max_nodes) == (backend, low, high)
    assert launch.nproc_per_node == nproc == int(job["spec"]["nprocPerNode"])
    assert launch.max_restarts == policy["maxRestarts"]
    assert launch.run_id == policy["rdzvId"] == job["metadata"]["name"]
    if backend == "c10d":
        assert launch.rdzv_endpoint == "elastic-train-worker-0:29400"
    else:
        etcd = objects[("Service", "elastic-train-etcd")]
        service = f"{etcd['metadata']['name']}:{etcd['spec']['ports'][0]['port']}"
        assert launch.rdzv_endpoint == service
    conf = parse_rdzv_conf(env["PET_RDZV_CONF"])
    assert {k: launch.rdzv_configs[k] for k in conf} == conf
    if backend == "etcd-v3":
        options = EtcdV3Options.parse(launch.rdzv_endpoint, launch.rdzv_configs)
        assert options.key_prefix == "/elastic-train/rendezvous"
    # Restarts on several nodes need one rendezvous store per round (docs/stock-torch.md).
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_worker_has_a_scraped_metrics_port(overlay: str) -> None:
    objects = rendered(overlay)
    job, monitor = one(objects, "PyTorchJob"), one(objects, "PodMonitor")
    nproc = int(job["spec"]["nprocPerNode"])
    ports = {p["name"]: p["containerPort"]
             for p in k8s_model.training_container(job)["ports"] if p["name"].startswith("metrics")}
    assert ports == {f"metrics-{i}": 9450 + i for i in range(nproc)}
    assert sorted(e["port"] for e in monitor["spec"]["podMetricsEndpoints"]) == sorted(ports)
    labels = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("overlay", parsing_overlays())
def test_the_grace_period_covers_the_preemption_checkpoint(overlay: str, tmp_path: Path
                                                           ) -> None:
    objects = rendered(overlay)
    job = one(objects, "PyTorchJob")
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    ns, job_args = launcher_parser().parse_known_args(k8s_model.training_container(job)["args"])
    config = parse_job_args(job_toml(objects, tmp_path, job_args))
    budget = config.distributed.preemption_budget_seconds
    # SIGTERM: the workers stop and checkpoint within the budget, the agent waits
    # --shutdown-timeout for them; both end before the kubelet's SIGKILL.
    assert budget < ns.shutdown_timeout < pod["terminationGracePeriodSeconds"]
    assert pod["terminationGracePeriodSeconds"] - ns.shutdown_timeout >= 10


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o not in OBJECT_STORE])
def test_volumes_and_claims_fit_together(overlay: str) -> None:
    objects = rendered(overlay)
    job = one(objects, "PyTorchJob")
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in k8s_model.training_container(job)["volumeMounts"]}
    assert set(mounts) == set(volumes)
    claim = volumes["checkpoints"]["persistentVolumeClaim"]["claimName"]
    pvc = objects[("PersistentVolumeClaim", claim)]
    config_map = one(objects, "ConfigMap")["metadata"]["name"]
    assert volumes["job-config"]["configMap"]["name"] == config_map
    _ns, job_args = launcher_parser().parse_known_args(k8s_model.training_container(job)["args"])
    run_dir = next(a.split("=", 1)[1] for a in job_args if a.startswith("--run-dir="))
    assert run_dir.startswith(mounts["checkpoints"] + "/")
    # Pods on several nodes share checkpoints only through a ReadWriteMany volume.
    multi_node_storage = "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert multi_node_storage == (overlay == "production")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]


def pod_volumes(node: Any) -> list[dict[str, Any]]:
    """Every entry of every ``volumes`` list in an object (its pod templates')."""
    found: list[dict[str, Any]] = []
    if isinstance(node, list):
        for item in node:
            found += pod_volumes(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key == "volumes" and isinstance(value, list):
                found += [v for v in value if isinstance(v, dict)]
            else:
                found += pod_volumes(value)
    return found


@pytest.mark.parametrize("overlay", sorted(OBJECT_STORE))
def test_an_object_store_overlay_claims_no_volume_for_checkpoints(overlay: str) -> None:
    objects = rendered(overlay)
    assert [name for kind, name in objects if kind == "PersistentVolumeClaim"] == []
    claimed = [(kind, name, v["name"]) for (kind, name), doc in objects.items()
               for v in pod_volumes(doc) if "persistentVolumeClaim" in v]
    assert claimed == []
    # The only storage claimed is etcd's own data (its StatefulSet's claim template).
    templates = [key for key, doc in objects.items()
                 if doc.get("spec", {}).get("volumeClaimTemplates")]
    assert templates == [("StatefulSet", "elastic-train-etcd")]

    job = one(objects, "PyTorchJob")
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    container = k8s_model.training_container(job)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert set(mounts) == set(volumes) == {"job-config", "dshm", "local-files"}
    # Each pod's own files (event log, sample records) on its node's disk, not in memory.
    assert set(volumes["local-files"]) == {"name", "emptyDir"}
    assert "medium" not in volumes["local-files"]["emptyDir"]
    env = {e["name"]: e for e in container["env"]}
    assert env["ELASTIC_TRAIN_LOCAL_DIR"]["value"] == mounts["local-files"] == LOCAL_DIR
    # Credentials from the Secret, never a literal in the manifests.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[name] == {"name": name, "valueFrom": {
            "secretKeyRef": {"name": S3_SECRET, "key": name}}}
    assert [n for n, e in env.items() if n.startswith("AWS_") and "value" in e] == []
    # The run dir is the job config's bucket: no --run-dir on the command line.
    _ns, job_args = launcher_parser().parse_known_args(container["args"])
    assert [a for a in job_args if a.startswith("--run-dir")] == []
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert f"kubectl create secret generic {S3_SECRET}" in (K8S / "README.md").read_text()


@pytest.mark.parametrize("overlay", sorted(OBJECT_STORE))
def test_an_object_store_job_config_is_the_base_one_with_a_bucket_and_an_endpoint(
        overlay: str) -> None:
    config = tomllib.loads(one(rendered(overlay), "ConfigMap")["data"]["job.toml"])
    base_map = one(rendered("quickstart"), "ConfigMap")
    assert base_map == one(kustomize.by_kind_and_name(kustomize.render(K8S / "base")),
                           "ConfigMap")
    base = tomllib.loads(base_map["data"]["job.toml"])
    assert "run_dir" not in base and "storage" not in base
    assert config.pop("run_dir") == OBJECT_STORE[overlay]
    storage = config.pop("storage")
    assert set(storage) <= STORAGE_KEYS, sorted(set(storage) - STORAGE_KEYS)
    assert storage["endpoint_url"] == "http://object-store.example.svc:9000"
    assert storage["addressing_style"] == "path"
    # Everything else as in the base (which the other overlays' tests parse).
    assert config == base


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if INTENDED[o][4]])
def test_etcd_matches_the_backend(overlay: str) -> None:
    backend, *_, members, version = INTENDED[overlay]
    objects = rendered(overlay)
    etcd = objects[("StatefulSet", "elastic-train-etcd")]
    container = etcd["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert etcd["spec"]["replicas"] == members
    cluster = dict(item.split("=", 1) for item in env["ETCD_INITIAL_CLUSTER"].split(","))
    assert sorted(cluster) == [f"elastic-train-etcd-{i}" for i in range(members)]
    for name, url in cluster.items():
        assert url == f"http://{name}.{etcd['spec']['serviceName']}:2380"
    assert container["image"].rsplit(":", 1)[1].startswith(version)
    # torch's stock etcd backend speaks etcd's v2 API; ours needs only v3.
    assert (env.get("ETCD_ENABLE_V2") == "true") == (backend == "etcd")
    job = one(objects, "PyTorchJob")
    assert job["spec"]["elasticPolicy"]["rdzvHost"] == "elastic-train-etcd"
    assert objects[("Service", "elastic-train-etcd")]["spec"]["selector"] == \
        etcd["spec"]["selector"]["matchLabels"]
    peer = objects[("Service", "elastic-train-etcd-peer")]
    assert peer["spec"]["clusterIP"] == "None" and peer["spec"]["publishNotReadyAddresses"]


def test_the_prometheusrule_is_the_tested_alerts_file() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "render_prometheusrule", REPO / "scripts" / "render_prometheusrule.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    committed = yaml.safe_load((K8S / "base" / "prometheusrule.yaml").read_text())
    assert committed == module.prometheus_rule(), \
        "k8s/base/prometheusrule.yaml is stale: run python scripts/render_prometheusrule.py"


@pytest.mark.parametrize("overlay", parsing_overlays())
def test_the_job_config_file_is_valid_in_every_overlay(overlay: str, tmp_path: Path) -> None:
    text = one(rendered(overlay), "ConfigMap")["data"]["job.toml"]
    (tmp_path / "job.toml").write_text(text)
    parse_job_args([f"--config={tmp_path / 'job.toml'}"])


def test_the_k8s_readme_names_every_overlay_and_pet_variable() -> None:
    text = (K8S / "README.md").read_text()
    for overlay in OVERLAYS:
        assert f"overlays/{overlay}" in text
    for name in k8s_model.operator_env(one(rendered("quickstart"), "PyTorchJob")):
        assert name in text
    assert "Trainer v2" in text


def test_every_kubectl_apply_in_the_docs_names_an_overlay() -> None:
    for doc in (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), K8S / "README.md"):
        for target in re.findall(r"kubectl apply -k (\S+)", doc.read_text()):
            if target.startswith("k8s/"):
                assert (REPO / target / "kustomization.yaml").is_file(), (doc, target)


# --- deploy/Dockerfile ---------------------------------------------------------------

DOCKERFILE = REPO / "deploy" / "Dockerfile"


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = tools.installed_tool("hadolint")
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dockerfile_essentials() -> None:
    text = DOCKERFILE.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    # CPU base by default, CUDA by build argument.
    assert re.search(r"^ARG BASE_IMAGE=python:3\.\d+-slim", text, re.M)
    assert [ln for ln in lines if ln.startswith("FROM")] == ["FROM ${BASE_IMAGE} AS build",
                                                            "FROM ${BASE_IMAGE}"]
    torch_pin = re.search(r"^TORCH\s+\?=\s+torch==(\S+)", (REPO / "Makefile").read_text(), re.M)
    assert torch_pin and f"ARG TORCH_VERSION={torch_pin.group(1)}" in lines
    # Non-root, and the entrypoint the manifests use.
    users = [ln for ln in lines if ln.startswith("USER")]
    assert users and users[-1].split()[1].split(":")[0] not in ("root", "0")
    assert 'ENTRYPOINT ["elastic-train"]' in lines
    for overlay in OVERLAYS:
        job = one(rendered(overlay), "PyTorchJob")
        assert k8s_model.training_container(job)["command"][0] == "elastic-train"
    # Everything it copies from the build context exists and passes .dockerignore.
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    for line in lines:
        if line.startswith("COPY") and "--from=" not in line:
            sources = line.split()[1:-1]
            for source in sources:
                assert (REPO / source).exists(), source
                assert source.rstrip("/") in allowed, f"{source} is excluded by .dockerignore"


def test_launcher_options_come_from_pet_variables_unless_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NNODES", "2:5")
    monkeypatch.setenv("PET_MAX_RESTARTS", "9")
    monkeypatch.setenv("PET_RDZV_BACKEND", "etcd-v3")
    ns, job_args = launcher_parser().parse_known_args(["--max-restarts", "4", "--steps", "7"])
    assert (ns.nnodes, ns.max_restarts, ns.rdzv_backend) == ("2:5", 4, "etcd-v3")
    assert job_args == ["--steps", "7"]
    monkeypatch.delenv("PET_NNODES")
    assert launcher_parser().parse_known_args([])[0].nnodes == "1"
