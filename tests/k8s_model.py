"""What the cluster would do with k8s/'s objects, offline: the CRDs' schemas made strict,
and the Kubeflow Training Operator's (v1.9) translation of a PyTorchJob into the PET_*
variables torchrun reads.

The operator part follows pkg/controller.v1/pytorch/{elastic,envvar}.go of
kubeflow/training-operator release-1.9, reimplemented: for an elastic job (elasticPolicy
set, no Master replica) it sets PET_RDZV_ENDPOINT, PET_RDZV_BACKEND, PET_NNODES, and, when
the policy has them, PET_MAX_RESTARTS, PET_NPROC_PER_NODE (from the deprecated
elasticPolicy.nProcPerNode only), PET_RDZV_ID, PET_RDZV_CONF and PET_STANDALONE. The
validating webhook's rules for PyTorchJob are in ``webhook_errors``.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

SCHEMAS = Path(__file__).resolve().parent / "schemas" / "operators-v1"
"""The PyTorchJob (Training Operator 1.9) and PodMonitor CRDs, vendored (their README)."""
DEFAULT_CONTAINER = "pytorch"
DEFAULT_PORT_NAME = "pytorchjob-port"
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever it lists properties and allows
    nothing else, so that an unknown or misspelt field fails (CRDs do not say it)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()
           if key not in ("description",)}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_schema(file_name: str, directory: Path | None = None) -> dict[str, Any]:
    """The strict openAPIV3Schema of the served version of a CRD in ``directory`` (default:
    the PyTorchJob and PodMonitor CRDs' folder)."""
    # up to 1 MB each: libyaml's safe loader where there is one
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(((directory or SCHEMAS) / file_name).read_text(), Loader=loader)
    version = next(v for v in crd["spec"]["versions"] if v.get("served", True))
    return strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]


def training_container(job: dict[str, Any]) -> dict[str, Any]:
    containers = _worker(job)["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == DEFAULT_CONTAINER)


def operator_env(job: dict[str, Any]) -> dict[str, str]:
    """The PET_* variables the operator adds to the training container of an elastic job."""
    policy = job["spec"]["elasticPolicy"]
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    port = policy.get("rdzvPort")
    if port is None:
        ports = training_container(job).get("ports", [])
        port = next((p["containerPort"] for p in ports if p.get("name") == DEFAULT_PORT_NAME),
                    None)
        if port is None:
            raise ValueError("port not found: set elasticPolicy.rdzvPort or a container port "
                             f"named {DEFAULT_PORT_NAME}")
    env = {"PET_RDZV_ENDPOINT": f"{host}:{port}",
           "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d")}
    if "minReplicas" in policy or "maxReplicas" in policy:
        env["PET_NNODES"] = f"{policy.get('minReplicas')}:{policy.get('maxReplicas')}"
    else:
        env["PET_NNODES"] = str(_worker(job)["replicas"])
    if "maxRestarts" in policy:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if "nProcPerNode" in policy:
        env["PET_NPROC_PER_NODE"] = str(policy["nProcPerNode"])
    if "rdzvId" in policy:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    if policy.get("rdzvConf") is not None:
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    if policy.get("standalone"):
        env["PET_STANDALONE"] = ""
    return env


def container_env(job: dict[str, Any]) -> dict[str, str]:
    """The training container's environment in the pod: its own entries, then the
    operator's (Kubernetes lets a later entry of the same name win)."""
    env = {e["name"]: e["value"] for e in training_container(job).get("env", [])
           if "value" in e}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(operator_env(job))
    return env


def webhook_errors(job: dict[str, Any]) -> list[str]:
    """What the operator's validating webhook refuses in a PyTorchJob."""
    errors = []
    spec = job["spec"]
    if not DNS_1035.match(job["metadata"]["name"]) or len(job["metadata"]["name"]) > 63:
        errors.append("metadata.name must be a DNS-1035 label")
    replicas = spec.get("pytorchReplicaSpecs", {})
    if spec.get("elasticPolicy") is not None:
        if "Worker" not in replicas:
            errors.append("Worker must be configured if elastic policy is used")
        if "nProcPerNode" in spec["elasticPolicy"] and "nprocPerNode" in spec:
            errors.append("elasticPolicy.nProcPerNode must not be used with nprocPerNode")
    for kind, replica in replicas.items():
        if kind not in ("Master", "Worker"):
            errors.append(f"replica type {kind} is not Master or Worker")
        containers = replica["template"]["spec"].get("containers", [])
        if not any(c.get("name") == DEFAULT_CONTAINER for c in containers):
            errors.append(f"{kind}: no container named {DEFAULT_CONTAINER}")
        if any(not c.get("image") for c in containers):
            errors.append(f"{kind}: a container without an image")
        if kind == "Master" and replica.get("replicas") != 1:
            errors.append("Master replicas must be 1")
        if kind == "Worker" and replica.get("replicas", 1) < 1:
            errors.append("Worker replicas must be at least 1")
    return errors


# --- Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1) ----------------------------------
# Reimplemented from kubeflow/trainer v2.3.0 (commit 658725bd): the Torch plugin
# (pkg/runtime/framework/plugins/torch/torch.go, EnforceMLPolicy and Validate), its constants
# (pkg/constants/constants.go), and the CEL rules of the CRDs that jsonschema cannot evaluate
# and that our manifests touch. The CRDs themselves: tests/schemas/trainer-v2/ (README.md).

TRAINER_V2_SCHEMAS = Path(__file__).resolve().parent / "schemas" / "trainer-v2"
TRAINER_V2_NODE = "node"  # the replicatedJob and the container the Torch plugin configures
TRAINER_V2_ANCESTOR = ("trainer.kubeflow.org/trainjob-ancestor-step", "trainer")
TRAINER_V2_PORT = 29500  # constants.ContainerTrainerPort
TORCHRUN_RESERVED = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                     "PET_MASTER_PORT")
ML_POLICIES = ("torch", "mpi", "jax", "xgboost", "flux")


def trainer_v2_node_job(runtime: dict[str, Any]) -> dict[str, Any]:
    """The runtime's replicatedJob of the nodes (named ``node``)."""
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return next(j for j in jobs if j["name"] == TRAINER_V2_NODE)


def trainer_v2_container(runtime: dict[str, Any]) -> dict[str, Any]:
    """The runtime's container ``node`` of the node pods."""
    pod = trainer_v2_node_job(runtime)["template"]["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == TRAINER_V2_NODE)


def _quantity_ceil(value: Any) -> int:
    """resource.Quantity.Value() of a CPU or GPU count: rounded up ("500m" -> 1)."""
    text = str(value)
    if text.endswith("m"):
        return -(-int(text[:-1]) // 1000)
    return int(-(-float(text) // 1))


def trainer_v2_nproc(train_job: dict[str, Any], runtime: dict[str, Any]) -> str:
    """PET_NPROC_PER_NODE as the Torch plugin sets it: trainer.numProcPerNode, else "auto",
    which becomes the CPU count per node where the node has no GPU."""
    trainer = train_job["spec"].get("trainer") or {}
    if trainer.get("numProcPerNode") is not None:
        return str(trainer["numProcPerNode"])
    resources = trainer.get("resourcesPerNode") or trainer_v2_container(runtime).get(
        "resources") or {}
    gpus = [v for part in ("requests", "limits") for k, v in (resources.get(part) or {}).items()
            if "gpu" in k.lower()]
    if gpus:
        return "auto"
    cpu = (resources.get("requests") or {}).get("cpu") or (resources.get("limits") or {}).get(
        "cpu")
    return str(max(1, _quantity_ceil(cpu) if cpu is not None else 0))


def trainer_v2_env(train_job: dict[str, Any], runtime: dict[str, Any],
                   node_rank: int) -> dict[str, str]:
    """The PET_* variables the Torch plugin puts into container ``node`` of node
    ``node_rank``'s pod (PET_NODE_RANK comes from the pod's Job completion index)."""
    name = train_job["metadata"]["name"]
    trainer = train_job["spec"].get("trainer") or {}
    nodes = trainer.get("numNodes", runtime["spec"]["mlPolicy"].get("numNodes", 1))
    return {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": trainer_v2_nproc(train_job, runtime),
            "PET_NODE_RANK": str(node_rank),
            "PET_MASTER_ADDR": f"{name}-{TRAINER_V2_NODE}-0-0.{name}",
            "PET_MASTER_PORT": str(TRAINER_V2_PORT)}


def trainer_v2_pod(train_job: dict[str, Any], runtime: dict[str, Any], node_rank: int
                   ) -> tuple[list[str], dict[str, str]]:
    """(the container's command and args, Kubernetes' $(VAR) expanded; its environment of
    plain values) in node ``node_rank``'s pod: the runtime's container, the TrainJob's
    trainer fields over it (command, args, env), then the plugin's PET_* variables."""
    container = trainer_v2_container(runtime)
    trainer = train_job["spec"].get("trainer") or {}
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    env.update({e["name"]: e["value"] for e in trainer.get("env", []) if "value" in e})
    env.update(trainer_v2_env(train_job, runtime, node_rank))
    argv = [*trainer.get("command", container.get("command", [])),
            *trainer.get("args", container.get("args", []))]
    return [expand(arg, env) for arg in argv], env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a command or argument: $(NAME) by the container's variable
    NAME where defined (else left as it is), $$ for a literal $."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and ")" in text[i:]:
            end = text.index(")", i)
            name = text[i + 2:end]
            out.append(env.get(name, text[i:end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def trainer_v2_errors(train_job: dict[str, Any], runtime: dict[str, Any]) -> list[str]:
    """What Trainer v2 (its webhooks and the CRDs' CEL rules) refuses in this pair."""
    errors = []
    name = train_job["metadata"]["name"]
    if not DNS_1035.match(name) or len(name) > 63:
        errors.append("TrainJob metadata.name must be a DNS-1035 label of at most 63 characters")
    ref = train_job["spec"]["runtimeRef"]
    if (ref.get("kind", "ClusterTrainingRuntime"), ref["name"]) != (runtime["kind"],
                                                                   runtime["metadata"]["name"]):
        errors.append(f"runtimeRef {ref} does not name the runtime")
    policy = runtime["spec"].get("mlPolicy") or {}
    if sum(key in policy for key in ML_POLICIES) != 1:
        errors.append("mlPolicy must set exactly one of " + ", ".join(ML_POLICIES))
    trainer = train_job["spec"].get("trainer") or {}
    if trainer.get("numNodes", 1) < 1 or policy.get("numNodes", 1) < 1:
        errors.append("numNodes must be at least 1")
    reserved = sorted({e["name"] for e in trainer.get("env", [])} & set(TORCHRUN_RESERVED))
    if reserved:
        errors.append(f"trainer.env must not have reserved envs: {reserved}")
    try:
        job = trainer_v2_node_job(runtime)
        trainer_v2_container(runtime)
    except StopIteration:
        errors.append("the runtime has no replicatedJob and container named node")
    else:
        key, value = TRAINER_V2_ANCESTOR
        if job["template"].get("metadata", {}).get("labels", {}).get(key) != value:
            errors.append(f"replicatedJob node lacks the label {key}: {value}")
    return errors
