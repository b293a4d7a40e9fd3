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
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

SCHEMAS = Path(__file__).resolve().parents[1].parent / "shared" / "schemas"
DEFAULT_CONTAINER = "pytorch"
DEFAULT_PORT_NAME = "pytorchjob-port"
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def schemas_dir() -> Path:
    """../shared/schemas; skip when absent, except under CI=true, where it fails."""
    if not SCHEMAS.is_dir():
        message = (f"{SCHEMAS} is absent: the PyTorchJob and PodMonitor manifests were not "
                   "validated against their CRDs")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return SCHEMAS


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


def crd_schema(file_name: str) -> dict[str, Any]:
    """The strict openAPIV3Schema of the served version of a CRD in ../shared/schemas."""
    crd = yaml.safe_load((schemas_dir() / file_name).read_text())
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
