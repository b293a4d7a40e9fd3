"""A node lost right after a rendezvous round closed, as a process of its own (tests).

    python tests/integration/lost_member.py ENDPOINT RUN_ID MAX_NODES LOCAL_ADDR [--after-ranks]

Joins the c10d rendezvous ``RUN_ID`` at ``ENDPOINT`` (whose store another node holds) with
torch's own handler, prints {"rank", "world_size", "round"} once the round closed with it,
and ends at once, as a host killed just then: no role, no ranks, no heartbeat, no goodbye.
``--after-ranks``: it first takes its worker ranks as elastic-train run's agent does
(agent/round_ranks.py, its role marked as ours), and ends before it says what it brings.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    endpoint, run_id, max_nodes, local_addr = sys.argv[1:5]
    after_ranks = "--after-ranks" in sys.argv[5:]
    handler = get_rendezvous_handler(RendezvousParameters(
        "c10d", endpoint, run_id, 1, int(max_nodes), local_addr=local_addr, is_host="false"))
    info = handler.next_rendezvous()
    print(json.dumps({"rank": info.rank, "world_size": info.world_size,
                      "round": handler._state_holder.state.round}), flush=True)  # type: ignore[attr-defined]
    if after_ranks:
        from elastic_train.agent.round_ranks import assign_round_ranks

        ranks = assign_round_ranks(info.store, info.rank, info.world_size, "default", 1)
        print(json.dumps({"first_rank": ranks.base_global_rank,
                          "ranks_of": ranks.global_world_size}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
