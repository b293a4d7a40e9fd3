"""Check a rendezvous service before a launch, so that a wrong one fails with one clear line.

torch's ``etcd`` and ``etcd-v2`` backends talk to etcd's v2 API through ``python-etcd``;
an etcd that does not serve v2 (3.6 removed it; 3.4 and 3.5 need ``--enable-v2``) makes
them fail with ``etcd.EtcdException: Bad response : 404 page not found``. Here the same
server gets a sentence that says so and names the backend that works: ``etcd-v3``.
``etcd-v3`` is checked with its own client: options, reachability (retried for
``connect_timeout`` seconds while etcd does not answer), TLS and credentials.
"""

from __future__ import annotations

import importlib.util
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from elastic_train.errors import RendezvousUnavailableError
from elastic_train.rendezvous.backends import capabilities
from elastic_train.rendezvous.etcd_v3.kv import EtcdUnreachableError
from elastic_train.rendezvous.etcd_v3.options import SETTINGS, EtcdV3Options, parse_endpoint
from elastic_train.rendezvous.etcd_v3.outage import retry_unreachable


def check_rendezvous(backend: str, endpoint: str, config: Mapping[str, Any],
                     timeout: float = 5.0) -> None:
    """Raise ``RendezvousUnavailableError`` (or a config error) if ``backend`` cannot work."""
    check = capabilities(backend).preflight
    if check == "v2-api":
        check_v2(backend, endpoint, config, timeout)
    elif check == "v3-api":
        check_v3(endpoint, config)


def _v2_url(backend: str, endpoint: str, config: Mapping[str, Any]) -> str:
    protocol = str(config.get("protocol", "")).lower() or None
    return parse_endpoint(endpoint, protocol, backend).url


def _tls_context(config: Mapping[str, Any]) -> ssl.SSLContext:
    # etcd-v2 spells them ca_cert / ssl_cert / ssl_cert_key, etcd: cacert / cert / key.
    ca = config.get("ca_cert") or config.get("cacert")
    cert = config.get("ssl_cert") or config.get("cert")
    key = config.get("ssl_cert_key") or config.get("key")
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    return context


def check_v2(backend: str, endpoint: str, config: Mapping[str, Any],
             timeout: float = 5.0) -> None:
    """torch's v2 backends: python-etcd installed, and the server answers on ``/v2/keys``."""
    if importlib.util.find_spec("etcd") is None:
        raise RendezvousUnavailableError(
            f"--rdzv-backend {backend} needs the python-etcd client, which is not installed: "
            "pip install 'elastic-train[etcd]', or use --rdzv-backend etcd-v3")
    url = _v2_url(backend, endpoint, config)
    context = _tls_context(config) if url.startswith("https") else None

    def check() -> None:
        try:
            with urllib.request.urlopen(f"{url}/v2/keys/", timeout=timeout,
                                        context=context) as response:
                json.loads(response.read() or b"{}")
        except urllib.error.HTTPError:
            raise
        except OSError as exc:  # no answer at all: etcd may still be starting
            raise EtcdUnreachableError(url, str(getattr(exc, "reason", exc))) from None

    try:
        # An etcd that is still starting gets connect_timeout, as for etcd-v3.
        retry_unreachable(check, float(config.get("connect_timeout",
                                                  SETTINGS["connect_timeout"][0])))
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise RendezvousUnavailableError(
                f"etcd at {url} does not serve the v2 API that --rdzv-backend {backend} "
                "needs (etcd 3.6 removed it; 3.4 and 3.5 serve it only with --enable-v2): "
                "use --rdzv-backend etcd-v3, which needs only the v3 API") from None
        raise RendezvousUnavailableError(
            f"etcd at {url} answered HTTP {exc.code} on /v2/keys/: check --rdzv-endpoint "
            "and the TLS options in --rdzv-conf") from None
    except EtcdUnreachableError as exc:
        raise RendezvousUnavailableError(str(exc)) from None
    except ValueError as exc:
        raise RendezvousUnavailableError(
            f"etcd at {url} answered /v2/keys/ with something that is not JSON ({exc}): "
            "check that --rdzv-endpoint is etcd's client URL") from None


def check_v3(endpoint: str, config: Mapping[str, Any]) -> None:
    """``etcd-v3``: its options parse, and etcd answers — with these TLS files and user."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from elastic_train.rendezvous.etcd_v3.create import connect

    options = EtcdV3Options.parse(endpoint, config)
    kv = connect(options)

    def check() -> None:
        kv.version()
        kv.count_prefix(options.key_prefix + "/")  # a v3 call: API, credentials, permissions

    try:
        # An etcd that does not answer yet (starting: also its gateway's "transport is
        # closing") gets connect_timeout.
        retry_unreachable(check, options.connect_timeout)
    except RendezvousConnectionError as exc:
        raise RendezvousUnavailableError(str(exc)) from None
