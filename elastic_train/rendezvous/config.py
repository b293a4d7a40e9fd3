"""The rendezvous of a launch: ``--rdzv-*`` defaults per backend, ``--rdzv-conf`` parsed and
checked.

``elastic-train run`` completes what the user gives here before torchrun sees it: the
endpoint and job id a single node does without, and ``--rdzv-conf`` defaults for jobs that
must not sit in torch's 30 s last call (``RDZV_DEFAULTS``); what the user gives wins. The
``etcd-v3`` backend's own options and their checks are in etcd_v3/options.py, which takes its
last-call default from here.

Free of torch imports: the launcher imports this before it imports torch (agent/worker_start.py).
"""

from __future__ import annotations

import uuid

from elastic_train.errors import ConfigError
from elastic_train.rendezvous.backends import capabilities, names_with
from elastic_train.rendezvous.heartbeat import check_keep_alive_conf

DEFAULT_BACKEND = "c10d"

# torch waits 30 s after the minimum number of nodes joined for more (last call): a node
# started a few seconds after the others joins the next round anyway (a restart that costs
# seconds, not a failure), so 5 s, for every backend (etcd-v3: options.SETTINGS).
LAST_CALL_TIMEOUT = 5.0

# --rdzv-conf defaults per backend of torch's (backends.py: ``short_last_call``); what the
# user gives wins. etcd-v3 has its defaults built in (etcd_v3/options.py). Heartbeats keep
# torch's 5 s x 3 (heartbeat.py).
RDZV_DEFAULTS: dict[str, dict[str, str]] = {
    backend: {"last_call_timeout": f"{LAST_CALL_TIMEOUT:g}"}
    for backend in names_with("short_last_call")
}

# One node needs no shared endpoint or job id: a free port on this host, a random id.
SINGLE_NODE_ENDPOINT = "127.0.0.1:0"


def single_node(nnodes: str) -> bool:
    """``--nnodes`` names exactly one node."""
    return nnodes in ("1", "1:1")


def rendezvous_endpoint(nnodes: str, endpoint: str) -> str:
    """The ``--rdzv-endpoint`` to launch with: the user's, else a free port for one node."""
    endpoint = endpoint or (SINGLE_NODE_ENDPOINT if single_node(nnodes) else "")
    if not endpoint:
        raise ConfigError("--rdzv-endpoint is required with more than one node: give the "
                          "HOST:PORT every node can reach")
    return endpoint


def rendezvous_id(nnodes: str, run_id: str) -> str:
    """The ``--rdzv-id`` to launch with: the user's, else a random one for one node."""
    if not run_id and not single_node(nnodes):
        raise ConfigError("--rdzv-id is required with more than one node: give every node the "
                          "same job id")
    return run_id or uuid.uuid4().hex[:12]


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``KEY=VALUE,...`` as torchrun reads it."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"--rdzv-conf item {item!r} is invalid: write KEY=VALUE,...")
        conf[key.strip()] = value.strip()
    return conf


def rdzv_conf_with_defaults(backend: str, text: str) -> str:
    """The --rdzv-conf to launch with: the user's, completed with ``RDZV_DEFAULTS``.

    For torch's backends with heartbeats (c10d, etcd-v2) the heartbeat settings are checked
    like etcd-v3's (etcd_v3/options.py), which torch does not do.
    """
    conf = {**RDZV_DEFAULTS.get(backend, {}), **parse_rdzv_conf(text)}
    if capabilities(backend).heartbeats:
        check_keep_alive_conf(backend, conf)
    return ",".join(f"{key}={value}" for key, value in conf.items())
