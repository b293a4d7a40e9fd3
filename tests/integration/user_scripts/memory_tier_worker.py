"""A worker that uses the memory tier as the checkpoint manager will: in the first
incarnation rank 0 offers a snapshot and the rank on the other node reads it back through
its own agent; then every worker exits 1 (every worker dies, the agents live on); in the
next incarnation every rank finds the snapshot in the agents' memory. Results go to
``OUT/<what>-<rank>.json`` (``OUT``: the first argument)."""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from elastic_train.worker.memory_tier import MemoryTierClient

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
payload = hashlib.sha256(b"state").digest() * 40_000  # 1.28 MB of "state"
manifest = {"writer_epoch": 1, "step": 7, "sha256": hashlib.sha256(payload).hexdigest(),
            "bytes": len(payload)}


def write(name: str, value: object) -> None:
    tmp = out / f".{name}-{rank}.tmp"
    tmp.write_text(json.dumps(value))
    tmp.rename(out / f"{name}-{rank}.json")


def wait_for(pattern: str) -> None:
    deadline = time.monotonic() + 60
    while not list(out.glob(pattern)) and time.monotonic() < deadline:
        time.sleep(0.05)


client = MemoryTierClient.from_env()
if client is None:
    write("none", {"restart": restart})
    sys.exit(0)
if restart == 0:
    if rank == 0:
        copies = client.offer(manifest, payload)
        write("offer", {"copies": copies, "held_by": client.held_by,
                        "url": client.endpoint.url})
        wait_for("read-*.json")
    else:
        wait_for("offer-*.json")
        newest = client.newest()
        write("read", {"newest": newest, "same": client.fetch(newest) == payload
                       if newest else False, "url": client.endpoint.url})
    sys.exit(1)  # every worker dies; the agents and their holders stay
newest = client.newest()
write("restored", {"newest": newest, "same": client.fetch(newest) == payload
                   if newest else False})
