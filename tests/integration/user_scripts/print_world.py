"""A user's script that only says which world it runs in (as torchrun tells it): a line on
stdout, and the same line in ``world-RANK.txt`` in its working directory (two workers
printing at once may interleave their lines on a shared stdout)."""

import os

line = " ".join(["world", *(f"{k}={os.environ.get(k)}" for k in (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS"))])
print(line, flush=True)
with open(f"world-{os.environ.get('RANK')}.txt", "w") as f:
    f.write(line + "\n")
