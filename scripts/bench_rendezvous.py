"""Benchmark the rendezvous backends (a measurement, not a test).

    python scripts/bench_rendezvous.py [--repeats 3] [--participants 8 32 64]

1. Launch -> first training step of a 2-node job (two ``elastic-train run`` agents on this
   machine, ``--nnodes 2``, one worker each) with ``c10d``, torch's ``etcd`` and
   ``etcd-v2``, and our ``etcd-v3``, in turns in the same run (so they share the machine's
   mood), against etcd 3.4 (v2 enabled for torch's backends, v3 only for ours). Also the
   rendezvous as torch's agent timed it (the ``rendezvous`` event). Medians.
2. Rendezvous completion for N simulated participants: N rendezvous handlers in threads of
   this process join one round (min = max = N) against one etcd, with our ``etcd-v3`` and
   with torch's ``etcd-v2`` (the same ``DynamicRendezvousHandler`` on the v2 API). Time from
   the first join to the last handler's return.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic_train.events import read_events
from elastic_train.rundir import RunDir
from tests.etcd_server import EtcdServer, free_port
from tests.integration import harness

JOB = ["--preset", "tiny", "--steps", "3", "--batch-size", "16", "--checkpoint-every", "off",
       "--log-every", "100"]


def launch_to_first_step(backend: str, endpoint: str) -> tuple[float, Any]:
    """Seconds from starting two agents to the job's first step; the rendezvous event."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{backend}-")) / "run"
    rdzv = ["--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
            "--rdzv-id", uuid.uuid4().hex[:8]]
    started = time.time()
    nodes = [harness.node(run_dir, f"node-{i}", rdzv, JOB, "elastic-train", nnodes="2")
             for i in range(2)]
    try:
        first = nodes[0].wait_for_event(lambda e: e["event"] == "step", 180)
        for node in nodes:
            assert node.wait(180) == 0, node.report()
    finally:
        for node in nodes:
            node.stop()
    rendezvous = next(e for e in read_events(RunDir(run_dir).events)
                      if e["event"] == "rendezvous")
    return first["time"] - started, rendezvous


def bench_launch(repeats: int) -> None:
    backends = ("c10d", "etcd", "etcd-v2", "etcd-v3")
    print(f"launch -> first step, 2 elastic-train run agents (--nnodes 2), {repeats} rounds "
          "of the backends in turn (medians):")
    servers = {"v2": EtcdServer.start(v2=True), "v3": EtcdServer.start(v2=False)}
    took: dict[str, list[float]] = {b: [] for b in backends}
    rendezvous: dict[str, list[float]] = {b: [] for b in backends}
    try:
        for _ in range(repeats):
            for backend in backends:
                if backend == "c10d":
                    endpoint = f"127.0.0.1:{free_port()}"
                else:
                    endpoint = servers["v3" if backend == "etcd-v3" else "v2"].endpoint
                seconds, event = launch_to_first_step(backend, endpoint)
                took[backend].append(seconds)
                rendezvous[backend].append(event["seconds"])
        for backend in backends:
            print(f"  {backend:8} launch -> first step {statistics.median(took[backend]):5.1f} s"
                  f"   rendezvous (agent) {statistics.median(rendezvous[backend]):5.2f} s   "
                  f"(runs: {', '.join(f'{s:.1f}' for s in took[backend])})", flush=True)
    finally:
        for server in servers.values():
            server.stop()


def etcd_v3_handler(server: EtcdServer, run_id: str, n: int, i: int) -> Any:
    from elastic_train.rendezvous.handler import build_handler, connect
    from elastic_train.rendezvous.options import EtcdV3Options

    options = EtcdV3Options.parse(server.endpoint, {"last_call_timeout": "1"})
    return build_handler(connect(options), options, run_id, n, n, local_addr=f"node{i}")


def etcd_v2_handler(server: EtcdServer, run_id: str, n: int, i: int) -> Any:
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend

    params = RendezvousParameters("etcd-v2", server.endpoint, run_id, n, n,
                                  local_addr=f"node{i}", last_call_timeout=1)
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def rendezvous_of(make: Callable[..., Any], server: EtcdServer, n: int) -> float:
    """Seconds for ``n`` handlers in threads to complete one round."""
    run_id, errors, done = uuid.uuid4().hex, [], []
    handlers = [make(server, run_id, n, i) for i in range(n)]
    barrier = threading.Barrier(n + 1)

    def join(handler: Any) -> None:
        barrier.wait()
        try:
            handler.next_rendezvous()
            done.append(time.monotonic())
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.monotonic()
    for t in threads:
        t.join(600)
    if errors or len(done) != n:
        raise RuntimeError(f"{len(done)} of {n} joined; first error: {errors[:1]}")
    for handler in handlers:
        handler._stop_heartbeats()
    return max(done) - started


def bench_participants(counts: list[int]) -> None:
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    print("rendezvous completion, N handlers in threads of one process, min = max = N:")
    server = EtcdServer.start(v2=True)
    try:
        for n in counts:
            v3 = rendezvous_of(etcd_v3_handler, server, n)
            v2 = rendezvous_of(etcd_v2_handler, server, n)
            print(f"  N={n:3}  etcd-v3 {v3:6.2f} s   etcd-v2 {v2:6.2f} s", flush=True)
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--participants", type=int, nargs="*", default=[8, 32, 64])
    parser.add_argument("--skip-launch", action="store_true")
    ns = parser.parse_args()
    if not ns.skip_launch:
        bench_launch(ns.repeats)
    if ns.participants:
        bench_participants(ns.participants)
    return 0


if __name__ == "__main__":
    sys.exit(main())
