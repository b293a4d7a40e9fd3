"""Participants of a rendezvous in a process of their own (tests, benchmark).

    python tests/integration/rendezvous_participant.py ENDPOINT PREFIX RUN_ID MIN MAX COUNT [CONF]
        [--design leases|state-key|etcd-v2] [--go-at EPOCH_SECONDS|stdin]
        [--watch-failures] [--idle SECONDS]

Starts COUNT handlers, each joining in a thread of its own: our ``etcd-v3`` with
``design=leases`` (the default; CONF is ``--rdzv-conf``'s KEY=VALUE,...), our ``etcd-v3``
with ``design=state-key``, or torch's ``etcd-v2`` (its dynamic rendezvous on the v2 API;
PREFIX is not used, CONF goes to torch as the rendezvous parameters). Prints one JSON line
per handler when it joined ({"node", "rank", "world_size", "round", "seconds", "began",
"returned", "requests"}: ``began`` and ``returned`` are wall-clock times, ``requests`` the
HTTP requests the handler sent to etcd up to its return, keep-alives included), or
{"error": ...}; then keeps the handlers (and their leases, heartbeats) alive until stdin
closes, and shuts them down.

- ``--go-at EPOCH_SECONDS``: every handler starts its join at that wall-clock moment (so
  that several processes start together). ``--go-at stdin``: print {"ready": COUNT, "pid"}
  once the handlers are built (torch imported), then read the moment from stdin's first
  line.
- ``--watch-failures``: after joining, each handler polls ``num_nodes_waiting()`` every
  0.05 s and prints {"node", "noticed": WALL_TIME} when it first turns >= 1.
- ``--idle SECONDS``: once all of this process's handlers joined, wait SECONDS and print
  per handler {"node", "idle_requests", "idle_seconds"}: the requests it sent meanwhile
  (keep-alives, heartbeats).

``kill -USR1 PID`` prints every thread's stack on stderr (a join that hangs).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic_train.rendezvous.etcd_v3.create import connect
from elastic_train.rendezvous.etcd_v3.leases import LeaseRendezvousHandler
from elastic_train.rendezvous.etcd_v3.options import EtcdV3Options
from elastic_train.rendezvous.etcd_v3.state_key import build_handler

DESIGNS = ("leases", "state-key", "etcd-v2")
_print_lock = threading.Lock()


def emit(line: dict[str, Any]) -> None:
    with _print_lock:
        print(json.dumps(line), flush=True)


def raise_limits() -> None:
    """Many handlers in one process: every socket it may open, small thread stacks."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    threading.stack_size(512 * 1024)


def count_python_etcd_requests() -> None:
    """Count python-etcd's requests per ``etcd.Client`` (``bench_requests``): torch's
    etcd-v2 backend sends every one through ``api_execute`` or ``api_execute_json``."""
    import etcd

    lock = threading.Lock()
    for name in ("api_execute", "api_execute_json"):
        original = getattr(etcd.Client, name)

        def counted(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with lock:
                self.bench_requests = getattr(self, "bench_requests", 0) + 1
            return _original(self, *args, **kwargs)

        setattr(etcd.Client, name, counted)


class Participant:
    """One handler, how to read its request count, its node name and round."""

    def __init__(self, design: str, endpoint: str, prefix: str, run_id: str, low: int,
                 high: int, conf: dict[str, str], i: int) -> None:
        self.handler: Any
        self.requests: Callable[[], int]
        if design == "etcd-v2":
            from torch.distributed.elastic.rendezvous.api import RendezvousParameters
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
            from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import (
                create_backend,
            )

            params = RendezvousParameters("etcd-v2", endpoint, run_id, low, high,
                                          local_addr=f"proc{i}", **conf)
            backend, store = create_backend(params)
            self.handler = create_handler(store, backend, params)
            client = backend._client
            self.requests = lambda: int(getattr(client, "bench_requests", 0))
            return
        options = EtcdV3Options.parse(endpoint, {"key_prefix": prefix, **conf,
                                                 "design": design})
        kv = connect(options)
        self.requests = lambda: kv.requests
        if design == "leases":
            self.handler = LeaseRendezvousHandler(kv, options, run_id, low, high,
                                                  local_addr=f"proc{i}")
        else:
            self.handler = build_handler(kv, options, run_id, low, high,
                                         local_addr=f"proc{i}")

    @property
    def node(self) -> str:
        if isinstance(self.handler, LeaseRendezvousHandler):
            return self.handler.node
        return str(self.handler._this_node)

    @property
    def round(self) -> int:
        if isinstance(self.handler, LeaseRendezvousHandler):
            assert self.handler.world is not None
            return self.handler.world.round
        return int(self.handler._state_holder.state.round)

    def close(self) -> None:
        if isinstance(self.handler, LeaseRendezvousHandler):
            self.handler.leave()
        else:
            self.handler._stop_heartbeats()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("endpoint", "prefix", "run_id"):
        parser.add_argument(name)
    for name in ("min", "max", "count"):
        parser.add_argument(name, type=int)
    parser.add_argument("conf", nargs="?", default="")
    parser.add_argument("--design", choices=DESIGNS, default=None,
                        help="default: CONF's design=, else leases")
    parser.add_argument("--go-at", default=None, help="EPOCH_SECONDS or stdin")
    parser.add_argument("--watch-failures", action="store_true")
    parser.add_argument("--idle", type=float, default=0.0)
    return parser.parse_args(argv)


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # kill -USR1: every thread's stack on stderr
    ns = parse_args(sys.argv[1:])
    conf = dict(item.split("=", 1) for item in ns.conf.split(",") if item)
    design = ns.design or conf.pop("design", "leases")
    conf.pop("design", None)
    if design not in DESIGNS:
        raise SystemExit(f"design {design}: use one of {', '.join(DESIGNS)}")
    raise_limits()
    if design != "leases":
        # torch's dynamic rendezvous: no TCPStore server per rank 0 (one machine, many).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if design == "etcd-v2":
        count_python_etcd_requests()
    participants = [Participant(design, ns.endpoint, ns.prefix, ns.run_id, ns.min, ns.max,
                                conf, i) for i in range(ns.count)]
    go_at: float | None = None
    if ns.go_at == "stdin":
        emit({"ready": ns.count, "pid": os.getpid()})
        go_at = float(sys.stdin.readline())
    elif ns.go_at is not None:
        go_at = float(ns.go_at)
    joined = threading.Barrier(ns.count + 1) if ns.idle > 0 else None

    def join(p: Participant) -> None:
        if go_at is not None:
            time.sleep(max(0.0, go_at - time.time()))
        began, ok = time.time(), False
        try:
            info = p.handler.next_rendezvous()
            returned = time.time()
            line = {"node": p.node, "rank": info.rank, "world_size": info.world_size,
                    "round": p.round, "seconds": returned - began, "began": began,
                    "returned": returned, "requests": p.requests()}
            ok = True
        except Exception as exc:  # reported to the test or benchmark, which fails on it
            line = {"error": f"{type(exc).__name__}: {exc}"}
        emit(line)
        if joined is not None:
            joined.wait()
        if ok and ns.watch_failures:
            while p.handler.num_nodes_waiting() < 1:
                time.sleep(0.05)
            emit({"node": p.node, "noticed": time.time()})

    threads = [threading.Thread(target=join, args=(p,), daemon=True) for p in participants]
    for thread in threads:
        thread.start()
    if joined is not None:
        joined.wait()
        before = [p.requests() for p in participants]
        time.sleep(ns.idle)
        for p, count in zip(participants, before, strict=True):
            emit({"node": p.node, "idle_requests": p.requests() - count,
                  "idle_seconds": ns.idle})
    sys.stdin.read()  # until the test closes stdin (or kills this process)
    for p in participants:
        p.close()


if __name__ == "__main__":
    main()
