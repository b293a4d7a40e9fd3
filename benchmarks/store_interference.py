"""Benchmark: what moving one checkpoint's bytes costs a training step on this machine,
when another process moves them: a file write (fsync) vs an upload to moto's S3 server on
loopback (the store benchmarks/object_store.py and the tests use).

    python benchmarks/store_interference.py            # medium preset, 12 writes each
    python benchmarks/store_interference.py --reps 20 --preset small

One training process (the built-in GPT task, 1 thread, as a worker of a 2-worker node)
times its steps; a second process (``SCHED_IDLE``, as the agent's upload and the local
writer run) writes a payload of the checkpoint's size once per third step, and the step
that overlaps the write is compared with the two before it. The store's server runs at
``SCHED_IDLE`` too. Neither the training process nor its GIL takes part in the write:
the excess is what the machine's shared cores, caches and memory bandwidth give up to
the bytes moving, and it says how much of an ``s3://`` run's stall on this machine comes
from the object store's server sharing it (a remote endpoint's would not).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from elastic_train.tasks.base import TaskContext, collate
from elastic_train.tasks.gpt import make_task
from tests.s3_server import S3Server

WRITER = """
import os, sys, time
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
from elastic_train.checkpoint.object_store import ObjectLocation, ObjectStore
from elastic_train.config import StorageConfig
mode, target, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
data = bytearray(os.urandom(size))
store = None
if mode == "s3":
    store = ObjectStore(ObjectLocation("bench", ""), StorageConfig(endpoint_url=target))
    store.check_bucket()
print("ready", flush=True)
for i, _ in enumerate(sys.stdin):
    began = time.monotonic()
    if store is not None:
        store.upload(f"run/checkpoints/step-{i:08d}/state-{i:012x}.pt", data)
    else:
        with open(target, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    print(round(time.monotonic() - began, 3), flush=True)
"""


def _idle(pid: int) -> None:
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setscheduler(int(task), os.SCHED_IDLE, os.sched_param(0))


def measure(mode: str, preset: str, reps: int, tmp: Path) -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    task = make_task(TaskContext({"preset": preset}))
    model = task.build_model()
    dataset = task.build_dataset()
    optimizer = task.build_optimizer(model, 1e-3)
    batch = collate(task, [dataset[i] for i in range(8)])
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3

    def step() -> float:
        began = time.monotonic()
        task.loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.monotonic() - began

    server = S3Server.start() if mode == "s3" else None
    try:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        if server is not None:
            server.make_bucket("bench")
            _idle(server.proc.pid)
            env.update(server.env())
        target = server.endpoint if server is not None else str(tmp / "payload.bin")
        writer = subprocess.Popen([sys.executable, "-c", WRITER, mode, target, str(size)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env=env)
        assert writer.stdin is not None and writer.stdout is not None
        assert writer.stdout.readline().strip() == "ready"
        for _ in range(3):
            step()
        plain, during, writes = [], [], []
        for _ in range(reps):
            plain += [step(), step()]
            writer.stdin.write("go\n")
            writer.stdin.flush()
            during.append(step())
            writes.append(float(writer.stdout.readline()))
        writer.stdin.close()
        writer.wait(60)
    finally:
        if server is not None:
            server.stop()
    return {"bytes": size, "plain": statistics.median(plain),
            "during": statistics.median(during), "write": statistics.median(writes)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--reps", type=int, default=12)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="et-interference-") as tmp:
        print(f"`python benchmarks/store_interference.py --preset {ns.preset} --reps "
              f"{ns.reps}` ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)")
        print("| writer (another process, SCHED_IDLE) | payload MiB | step alone s | step "
              "during the write s | excess s | the write's wall s |")
        print("|---|---|---|---|---|---|")
        for mode, label in (("file", "file write + fsync"),
                            ("s3", "upload to moto on loopback (moto SCHED_IDLE)")):
            r = measure(mode, ns.preset, ns.reps, Path(tmp))
            print(f"| {label} | {r['bytes'] / 2**20:.1f} | {r['plain']:.3f} | "
                  f"{r['during']:.3f} | {r['during'] - r['plain']:+.3f} | {r['write']:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
