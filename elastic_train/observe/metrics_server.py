"""One HTTP endpoint per worker: ``GET /metrics`` from a registry, answered by daemon threads.

Workers serve on ``base port + local rank``: a restarted worker binds the same port again
(the old process is gone by then, and the socket allows address reuse), so Prometheus
keeps scraping the same targets across restarts.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from elastic_train.config import JobConfig
from elastic_train.errors import MetricsError
from elastic_train.observe.metrics import (
    ObservedProcess,
    WorkerMetrics,
    check_single_process_mode,
)

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"


def _host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def bind_error(address: str, port: int, exc: OSError) -> MetricsError:
    """The one-line error for a metrics endpoint that cannot bind."""
    where = _host_port(address, port)
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        return MetricsError(f"metrics port {where} is in use ({reason}): pass --metrics-port "
                            "with a free base port (each worker serves PORT + its local rank), "
                            "or --metrics-port 0 to run without metrics")
    return MetricsError(f"cannot serve metrics on {where} ({reason}): pass --metrics-address "
                        "with an address of this machine (0.0.0.0: every interface)")


def _family(address: str, port: int) -> tuple[socket.AddressFamily, str]:
    info = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = info[0]
    return family, sockaddr[0]


def check_ports_free(address: str, base_port: int, count: int) -> None:
    """Raise the bind error of the first of ``count`` ports from ``base_port`` in use now."""
    if base_port + count - 1 > 65535:
        raise MetricsError(f"--metrics-port {base_port} + local ranks up to {count - 1} go "
                           "above 65535: pass a lower --metrics-port")
    for port in range(base_port, base_port + count):
        try:
            family, host = _family(address, port)
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        except OSError as exc:
            raise bind_error(address, port, exc) from None


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never keeps the worker alive


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Body:
    """A WSGI response whose ``close`` (called once it has been sent) reports the scrape."""

    def __init__(self, chunks: Iterable[bytes], on_sent: Callable[[], None]) -> None:
        self._chunks = chunks
        self._on_sent = on_sent

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._chunks)

    def close(self) -> None:
        self._on_sent()


class MetricsServer:
    """Serves ``registry`` at ``http://address:port/metrics`` until ``close``.

    Port 0 picks a free port (tests); ``port`` tells which one was bound.
    """

    def __init__(self, registry: CollectorRegistry, address: str, port: int) -> None:
        self._metrics_app = make_wsgi_app(registry)
        self._changed = threading.Condition()
        self._begun = 0           # /metrics requests, numbered as they begin
        self._newest_sent = 0     # the highest number whose response was sent
        self._sent_count = 0
        try:
            family, host = _family(address, port)
            server_class = type("_Server", (_ThreadingServer,), {"address_family": family})
            self._httpd = make_server(host, port, self._app, server_class,
                                      handler_class=_QuietHandler)
        except OSError as exc:
            raise bind_error(address, port, exc) from None
        self.address = address
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.1},  # close() within 0.1 s
                                        name=f"metrics-{self.port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """Where to scrape it from this machine."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.address, self.address)
        return f"http://{_host_port(host, self.port)}{METRICS_PATH}"

    @property
    def scrapes(self) -> int:
        """How many /metrics responses were sent so far."""
        return self._sent_count

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [f"elastic_train metrics are at {METRICS_PATH}\n".encode()]
        with self._changed:
            self._begun += 1
            number = self._begun
        # The values are read after the request got its number.
        return _Body(self._metrics_app(environ, start_response), lambda: self._sent(number))

    def _sent(self, number: int) -> None:
        with self._changed:
            self._sent_count += 1
            self._newest_sent = max(self._newest_sent, number)
            self._changed.notify_all()

    def wait_for_scrape(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds until a /metrics response that began after this
        call has been sent (so it carries the values of now); True if one was."""
        with self._changed:
            mark = self._begun
            return self._changed.wait_for(lambda: self._newest_sent > mark, timeout=timeout)

    def close(self) -> None:
        """Stop serving and free the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


@dataclass
class WorkerEndpoint:
    """A worker's metrics and the server that exposes them."""

    metrics: WorkerMetrics
    server: MetricsServer

    def close(self, linger_seconds: float = 0.0) -> None:
        """Wait up to ``linger_seconds`` for one more scrape (the final values), then stop."""
        if linger_seconds > 0 and not self.server.wait_for_scrape(linger_seconds):
            log.info("no scrape of %s within --metrics-linger %gs", self.server.url,
                     linger_seconds)
        self.server.close()


def serve_worker_metrics(config: JobConfig, env: ObservedProcess) -> WorkerEndpoint | None:
    """Build this worker's metrics and serve them on ``port + local rank``; None if off."""
    settings = config.metrics
    if not settings.port:
        return None
    check_single_process_mode(env)
    port = settings.port + env.local_rank
    if port > 65535:
        raise MetricsError(f"--metrics-port {settings.port} + local rank {env.local_rank} is "
                           "above 65535: pass a lower --metrics-port")
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, env, config.train.batch_size,
                            min_world_size=settings.min_world_size)
    server = MetricsServer(registry, settings.address, port)
    log.info("serving metrics at %s", server.url)
    return WorkerEndpoint(metrics, server)
