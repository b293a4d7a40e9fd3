"""A user's script that only says which world it runs in (as torchrun tells it)."""

import os

print("world", *(f"{k}={os.environ.get(k)}" for k in (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS")), flush=True)
