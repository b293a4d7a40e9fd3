"""The ``--rdzv-conf`` options of the ``etcd-v3`` backend, parsed and checked in one place."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_train.errors import RendezvousConfigError
from elastic_train.rendezvous.config import LAST_CALL_TIMEOUT
from elastic_train.rendezvous.etcd_v3.client import Credentials, Endpoint
from elastic_train.rendezvous.heartbeat import (
    KEEP_ALIVE_INTERVAL,
    KEEP_ALIVE_MAX_ATTEMPT,
    check_keep_alive,
)

DEFAULT_PORT = 2379

# name: (default, meaning) — the README's table is drawn from the same words.
SETTINGS: dict[str, tuple[Any, str]] = {
    "key_prefix": ("/elastic_train/rendezvous", "etcd key prefix; a job's keys are "
                   "PREFIX/RUN_ID/state and PREFIX/RUN_ID/store/..."),
    "protocol": (None, "http or https (default: https when ca_cert is given)"),
    "ca_cert": (None, "CA certificate file that signed etcd's server certificate"),
    "ssl_cert": (None, "client certificate file (etcd --client-cert-auth)"),
    "ssl_cert_key": (None, "private key file of ssl_cert"),
    "user": (None, "etcd user (etcd auth enabled)"),
    "password": (None, "password of user (visible in the process list: prefer "
                 "password_file)"),
    "password_file": (None, "file holding the password of user"),
    "design": ("leases", "leases: one key per node on its own lease, watches, one "
               "transaction per round (scales to 1,000 nodes); state-key: torch's dynamic "
               "rendezvous in one key (the previous design, O(N^2) writes)"),
    "lease_ttl": (10, "design=leases: seconds after which a node whose agent stopped "
                  "renewing its lease (dead, cut off) is gone from the rendezvous"),
    "join_timeout": (600.0, "seconds a node waits for a rendezvous round to complete"),
    "last_call_timeout": (LAST_CALL_TIMEOUT, "seconds a round stays open for more nodes "
                          "once it has the minimum"),
    "close_timeout": (30.0, "seconds to mark the rendezvous closed at the end"),
    "heartbeat_timeout": (5.0, "design=state-key: seconds one keep-alive heartbeat may "
                          "take"),
    "keep_alive_interval": (KEEP_ALIVE_INTERVAL, "design=state-key: seconds between a "
                            "node's heartbeats"),
    "keep_alive_max_attempt": (KEEP_ALIVE_MAX_ATTEMPT, "design=state-key: heartbeat "
                               "intervals after which a silent node counts as dead (at "
                               "least 2 + 3 s / keep_alive_interval)"),
    "read_timeout": (60.0, "seconds a store read waits for another agent's key"),
    "request_timeout": (10.0, "seconds one request to etcd may take"),
    "connect_timeout": (30.0, "seconds to keep retrying an etcd that does not answer, at "
                        "start and when a rendezvous is due, before the agent fails"),
    "state_ttl": (7200, "seconds the keys outlive their last write (0: forever)"),
}

DESIGNS = ("leases", "state-key")
# Heartbeats of torch's dynamic rendezvous: design=state-key only.
HEARTBEAT_SETTINGS = ("keep_alive_interval", "keep_alive_max_attempt", "heartbeat_timeout")

# Set by torchrun for every backend (``timeout`` is always there): accepted, not used.
_GENERIC = {"timeout", "rank", "is_host", "store_type", "local_addr"}


def _number(config: Mapping[str, Any], name: str, kind: type) -> Any:
    raw = config.get(name, SETTINGS[name][0])
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise RendezvousConfigError(
            f"--rdzv-conf {name}={raw} is invalid: expected "
            f"{'a number of seconds' if kind is float else 'a whole number'}") from None
    if value < 0 or (value == 0 and name != "state_ttl"):
        raise RendezvousConfigError(f"--rdzv-conf {name}={raw} is invalid: it must be "
                                    f"{'>= 0' if name == 'state_ttl' else 'positive'}")
    return value


def parse_endpoint(text: str, protocol: str | None, backend: str = "etcd-v3") -> Endpoint:
    """``HOST[:PORT]`` or ``http(s)://HOST[:PORT]``; the port defaults to 2379."""
    text = (text or "").strip()
    if not text:
        raise RendezvousConfigError(f"--rdzv-backend {backend} needs --rdzv-endpoint "
                                    "HOST:PORT of an etcd server")
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    rest = rest.rstrip("/")
    if "," in rest:
        raise RendezvousConfigError(f"--rdzv-endpoint {text} is invalid: give one etcd "
                                    "member as HOST:PORT")
    host, port = rest, DEFAULT_PORT
    if rest.startswith("["):  # [IPv6]:port
        host, _, tail = rest[1:].partition("]")
        if tail.startswith(":"):
            port = _port(tail[1:], text)
    elif rest.count(":") == 1:
        host, port_text = rest.split(":")
        port = _port(port_text, text)
    chosen = scheme or protocol or "http"
    if chosen not in ("http", "https"):
        raise RendezvousConfigError(f"protocol {chosen!r} is invalid: use http or https")
    if not host:
        raise RendezvousConfigError(f"--rdzv-endpoint {text} has no host: write HOST:PORT")
    return Endpoint(host, port, chosen)


def _port(text: str, endpoint: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise RendezvousConfigError(f"--rdzv-endpoint {endpoint} has an invalid port "
                                    f"{text!r}: write HOST:PORT")
    return int(text)


@dataclass(frozen=True)
class EtcdV3Options:
    """Everything the etcd-v3 backend is configured with."""

    endpoint: Endpoint
    credentials: Credentials = field(default_factory=Credentials)
    key_prefix: str = SETTINGS["key_prefix"][0]
    design: str = SETTINGS["design"][0]
    lease_ttl: int = SETTINGS["lease_ttl"][0]
    join_timeout: float = SETTINGS["join_timeout"][0]
    last_call_timeout: float = SETTINGS["last_call_timeout"][0]
    close_timeout: float = SETTINGS["close_timeout"][0]
    heartbeat_timeout: float = SETTINGS["heartbeat_timeout"][0]
    keep_alive_interval: float = SETTINGS["keep_alive_interval"][0]
    keep_alive_max_attempt: int = SETTINGS["keep_alive_max_attempt"][0]
    read_timeout: float = SETTINGS["read_timeout"][0]
    request_timeout: float = SETTINGS["request_timeout"][0]
    connect_timeout: float = SETTINGS["connect_timeout"][0]
    state_ttl: int = SETTINGS["state_ttl"][0]

    @classmethod
    def parse(cls, endpoint: str, config: Mapping[str, Any]) -> EtcdV3Options:
        """Options from ``--rdzv-endpoint`` and the ``--rdzv-conf`` mapping."""
        for key in config:
            if key not in SETTINGS and key not in _GENERIC:
                close = difflib.get_close_matches(key, list(SETTINGS), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise RendezvousConfigError(
                    f"unknown --rdzv-conf key {key!r} for etcd-v3{hint}; known: "
                    f"{', '.join(SETTINGS)}")
        text = {k: str(v) for k, v in config.items() if v is not None}
        protocol = text.get("protocol") or ("https" if text.get("ca_cert") else None)
        password = text.get("password")
        if "password_file" in text:
            try:
                password = Path(text["password_file"]).read_text().rstrip("\r\n")
            except OSError as exc:
                raise RendezvousConfigError(
                    f"--rdzv-conf password_file={text['password_file']} cannot be read "
                    f"({exc.strerror}): give a readable file") from None
        if password is not None and not text.get("user"):
            raise RendezvousConfigError("--rdzv-conf has a password but no user: add "
                                        "user=NAME")
        if bool(text.get("ssl_cert")) != bool(text.get("ssl_cert_key")):
            raise RendezvousConfigError("--rdzv-conf needs both ssl_cert and ssl_cert_key "
                                        "for a client certificate")
        for name in ("ca_cert", "ssl_cert", "ssl_cert_key"):
            if name in text and not Path(text[name]).is_file():
                raise RendezvousConfigError(f"--rdzv-conf {name}={text[name]}: no such file")
        prefix = text.get("key_prefix", SETTINGS["key_prefix"][0])
        if not prefix.startswith("/") or prefix.rstrip("/") == "":
            raise RendezvousConfigError(f"--rdzv-conf key_prefix={prefix} is invalid: use an "
                                        "absolute key like /jobs/rendezvous")
        design = text.get("design", SETTINGS["design"][0])
        if design not in DESIGNS:
            raise RendezvousConfigError(f"--rdzv-conf design={design} is invalid: use "
                                        f"{' or '.join(DESIGNS)}")
        interval = _number(text, "keep_alive_interval", float)
        attempts = _number(text, "keep_alive_max_attempt", int)
        lease_ttl = _number(text, "lease_ttl", int)
        if design == "leases":
            given = [name for name in HEARTBEAT_SETTINGS if name in text]
            if given:
                raise RendezvousConfigError(
                    f"--rdzv-conf {given[0]} does not apply to the etcd-v3 rendezvous, which "
                    "notices a dead node when its lease expires: set lease_ttl=SECONDS "
                    f"(default {SETTINGS['lease_ttl'][0]}) instead, or design=state-key for "
                    "the previous, heartbeat-based design")
            if lease_ttl < 2:
                raise RendezvousConfigError(f"--rdzv-conf lease_ttl={lease_ttl} is invalid: "
                                            "use at least 2 seconds")
        else:
            check_keep_alive(interval, attempts)
        return cls(
            endpoint=parse_endpoint(endpoint, protocol),
            credentials=Credentials(ca_cert=text.get("ca_cert"), cert=text.get("ssl_cert"),
                                    key=text.get("ssl_cert_key"), user=text.get("user"),
                                    password=password),
            key_prefix=prefix.rstrip("/"),
            design=design,
            lease_ttl=lease_ttl,
            join_timeout=_number(text, "join_timeout", float),
            last_call_timeout=_number(text, "last_call_timeout", float),
            close_timeout=_number(text, "close_timeout", float),
            heartbeat_timeout=_number(text, "heartbeat_timeout", float),
            keep_alive_interval=interval,
            keep_alive_max_attempt=attempts,
            read_timeout=_number(text, "read_timeout", float),
            request_timeout=_number(text, "request_timeout", float),
            connect_timeout=_number(text, "connect_timeout", float),
            state_ttl=_number(text, "state_ttl", int),
        )
