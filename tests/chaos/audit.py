"""What a fault campaign checks at its end, from the job's files and the hosts' processes:
each sample once per epoch (from the loop's own records of what its loader gave it), every
checkpoint verified by ``elastic-train checkpoints verify`` (no process left on a host:
tests/netbed.py's ``Host.leftovers``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from elastic_train.worker.sampler import epoch_order

SEED = 0
SESSION_SAMPLES, SESSION_BATCH = 256, 16
"""tests/integration/session_live_loop.py's data set and global batch."""


def verify_checkpoints(run_dir: Path) -> str:
    """"" when every checkpoint of ``run_dir`` verifies, else what the command said."""
    done = subprocess.run([sys.executable, "-m", "elastic_train", "checkpoints", "verify",
                           str(run_dir)], capture_output=True, text=True, timeout=300)
    return "" if done.returncode == 0 else (done.stdout + done.stderr)[-2000:]


def _newest_attempts(records: list[dict[str, Any]], starts: list[float]
                     ) -> dict[int, list[dict[str, Any]]]:
    """{step: the records of its newest attempt}: the newest incarnation (rank 0's start
    events split a worker's records) and, within it, the newest generation."""
    from bisect import bisect_right

    by_step: dict[int, dict[tuple[int, int], list[dict[str, Any]]]] = \
        defaultdict(lambda: defaultdict(list))
    for r in records:
        attempt = (bisect_right(starts, r["time"]) if "time" in r else 0,
                   int(r.get("generation", 0)))
        by_step[int(r["step"])][attempt].append(r)
    return {step: attempts[max(attempts)] for step, attempts in by_step.items()}


def _read(paths: list[Path]) -> list[dict[str, Any]]:
    records = []
    for path in paths:
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:  # a line torn by a kill in mid-write
                continue
    return records


def audit_samples(run_dir: Path, loop: str, samples: int = 0) -> list[str]:
    """Problems with the samples the loop was given: a step missing or with a partial
    world, a sample used twice in an epoch, an epoch's order skipped or reordered, an epoch
    ended early. ``loop``: ``builtin`` (RUN_DIR/samples/rank-*.jsonl, ``samples`` windows)
    or ``session`` (session_live_loop.py's RUN_DIR/samples-*.jsonl)."""
    problems: list[str] = []
    if loop == "session":
        records = _read(sorted(run_dir.glob("samples-*.jsonl")))
        starts: list[float] = []
        total = SESSION_SAMPLES
    else:
        records = _read(sorted((run_dir / "samples").glob("rank-*.jsonl")))
        events = _read([run_dir / "events.jsonl"]) if (run_dir / "events.jsonl").exists() \
            else []
        starts = sorted(e["time"] for e in events if e.get("event") == "start")
        total = samples
    if not records:
        return ["no sample records"]
    steps = _newest_attempts(records, starts)
    numbers = sorted(steps)
    missing = sorted(set(range(1, numbers[-1] + 1)) - set(numbers))
    if missing:
        problems.append(f"steps with no record: {missing[:20]}")
    used: dict[int, list[int]] = defaultdict(list)
    first_batch: dict[int, int] = {}
    for step in numbers:
        rs = sorted(steps[step], key=lambda r: r["rank"])
        world = rs[0]["world_size"]
        if [r["rank"] for r in rs] != list(range(world)):
            problems.append(f"step {step}: records of ranks {[r['rank'] for r in rs]} at "
                            f"world {world}")
            continue
        indices = [i for r in rs for i in r["indices"]]
        epoch = int(rs[0]["epoch"]) if "epoch" in rs[0] \
            else (step - 1) // (SESSION_SAMPLES // SESSION_BATCH)
        used[epoch].extend(indices)
        first_batch.setdefault(epoch, len(indices))
    for epoch, indices in sorted(used.items()):
        if len(indices) != len(set(indices)):
            problems.append(f"epoch {epoch} used {len(indices) - len(set(indices))} "
                            "sample(s) twice")
        order = epoch_order(total, SEED, epoch).tolist()
        if indices != order[:len(indices)]:
            problems.append(f"epoch {epoch} skipped or reordered samples")
        if epoch < max(used) and epoch + 1 in first_batch \
                and total - len(indices) >= first_batch[epoch + 1]:
            problems.append(f"epoch {epoch} ended with {total - len(indices)} samples unused")
    return problems
