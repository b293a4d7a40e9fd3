"""Participants of an ``etcd-v3`` rendezvous in a process of their own (tests, benchmark).

    python tests/integration/rendezvous_participant.py ENDPOINT PREFIX RUN_ID MIN MAX COUNT [CONF]

Starts COUNT handlers (``design=leases`` unless CONF says otherwise), each joining in a
thread of its own; prints one JSON line per handler when it joined ({"node", "rank",
"world_size", "round", "seconds", "requests"}), or {"error": ...}; then keeps the handlers
(and their leases) alive until stdin closes, and shuts them down.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from elastic_train.rendezvous.handler import connect
from elastic_train.rendezvous.lease_handler import LeaseRendezvousHandler
from elastic_train.rendezvous.options import EtcdV3Options


def main() -> None:
    endpoint, prefix, run_id, low, high, count = sys.argv[1:7]
    conf = dict(item.split("=", 1) for item in (sys.argv[7].split(",") if len(sys.argv) > 7
                                                 and sys.argv[7] else []))
    options = EtcdV3Options.parse(endpoint, {"key_prefix": prefix, **conf})
    lock = threading.Lock()
    handlers = []

    def join(i: int) -> None:
        kv = connect(options)
        handler = LeaseRendezvousHandler(kv, options, run_id, int(low), int(high),
                                         local_addr=f"proc{i}")
        handlers.append(handler)
        began = time.monotonic()
        try:
            info = handler.next_rendezvous()
            assert handler.world is not None
            line = {"node": handler.node, "rank": info.rank, "world_size": info.world_size,
                    "round": handler.world.round, "seconds": time.monotonic() - began}
        except Exception as exc:  # reported to the test, which fails on it
            line = {"error": f"{type(exc).__name__}: {exc}"}
        with lock:
            print(json.dumps(line), flush=True)

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(int(count))]
    for thread in threads:
        thread.start()
    sys.stdin.read()  # until the test closes stdin (or kills this process)
    for handler in handlers:
        handler.leave()


if __name__ == "__main__":
    main()
