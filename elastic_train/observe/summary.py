"""The end-of-run summary, drawn from the event log."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from elastic_train.events.schema import Event

LOSS_WINDOW = 10


@dataclass(frozen=True)
class RunSummary:
    """What one launch of a run did, across all its restarts."""

    run_id: str | None
    steps_done: int
    total_steps: int | None
    final_loss: float | None
    first_loss: float | None
    checkpoints_written: int
    checkpoints_skipped: int
    restarts: int
    steps_redone: int
    world_sizes: tuple[int, ...]
    loss_window: int = 10
    live_recoveries: tuple[float | None, ...] = ()
    """Seconds of each live recovery (detection to state in place; None: not known)."""

    def lines(self) -> list[str]:
        loss = "n/a" if self.final_loss is None else f"{self.final_loss:.4f}"
        first = "" if self.first_loss is None else f"; first step {self.first_loss:.4f}"
        sizes = " -> ".join(str(w) for w in self.world_sizes) or "n/a"
        return [
            f"run {self.run_id}: {self.steps_done}/{self.total_steps} steps",
            f"  final loss        {loss} (mean of the last {self.loss_window} steps{first})",
            f"  checkpoints       {self.checkpoints_written} written, "
            f"{self.checkpoints_skipped} skipped as corrupt",
            f"  restarts survived {self.restarts} ({self.steps_redone} steps redone)",
            *self._live_lines(),
            f"  world size        {sizes}",
        ]

    def _live_lines(self) -> list[str]:
        if not self.live_recoveries:
            return []
        known = [s for s in self.live_recoveries if s is not None]
        timing = f", {max(known):.2f} s at most" if known else ""
        return [f"  live recoveries   {len(self.live_recoveries)} (the world re-formed in place, "
                f"state from a peer{timing})"]


def _newest_launch(records: list[dict[str, Any]], run_id: str | None) -> tuple[int, int]:
    """[begin, end) of the newest launch of ``run_id`` in the log.

    A launch begins at a ``start`` of the run that follows the run's ``end`` (or another
    run's start, or nothing); every other start of the run continues it — a restart after
    a failure, or a resize: in a multi-node job, rank 0 may live on an agent that just
    joined and has restarted nothing, so a restart count of 0 alone does not mean a new
    launch. It ends at the next start of another run.
    """
    begin, closed = -1, True
    for i, e in enumerate(records):
        if e["event"] == Event.END:
            closed = True
        elif e["event"] == Event.START:
            if e.get("run_id") != run_id:
                closed = True
            elif closed:
                begin, closed = i, False
    end = next((i for i in range(begin + 1, len(records)) if records[i]["event"] == Event.START
                and records[i].get("run_id") != run_id), len(records))
    return begin, end


def launch_segment(events: Iterable[dict[str, Any]], run_id: str | None = None
                   ) -> tuple[str | None, list[dict[str, Any]]]:
    """The records of the newest launch of ``run_id`` (or of the newest run in the log):
    from its first start up to the next launch, restarts and resizes included."""
    records = list(events)
    starts = [i for i, e in enumerate(records) if e["event"] == Event.START
              and (run_id is None or e.get("run_id") == run_id)]
    if not starts:
        return run_id, []
    run_id = records[starts[-1]].get("run_id")
    begin, end = _newest_launch(records, run_id)
    return run_id, records[begin:end]


def summarize(events: Iterable[dict[str, Any]], run_id: str | None = None) -> RunSummary:
    """Summarise the newest launch of ``run_id`` (or of the newest run in the log)."""
    run_id, segment = launch_segment(events, run_id)
    if not segment:
        return RunSummary(run_id, 0, None, None, None, 0, 0, 0, 0, ())
    steps = [e for e in segment if e["event"] == Event.STEP]
    seen: set[int] = set()
    redone = 0
    effective: dict[int, float] = {}
    for e in steps:
        if e["step"] in seen:
            redone += 1
        seen.add(e["step"])
        effective[e["step"]] = e["loss"]
    losses = [effective[s] for s in sorted(effective) if effective[s] is not None]
    tail = losses[-LOSS_WINDOW:]
    sizes: list[int] = []
    for e in segment:  # every world: each start's, and each one re-formed in place
        world = e.get("new_world_size") if e["event"] == Event.RESIZE else \
            e.get("world_size") if e["event"] == Event.START else None
        if world is not None and (not sizes or sizes[-1] != world):
            sizes.append(world)
    restarts = max((e.get("restart", 0) for e in segment if e["event"] == Event.START), default=0)
    return RunSummary(
        run_id=run_id,
        steps_done=max(seen, default=0),
        total_steps=segment[0].get("total_steps"),
        final_loss=sum(tail) / len(tail) if tail else None,
        first_loss=steps[0]["loss"] if steps and steps[0]["step"] == 1 else None,
        checkpoints_written=sum(e["event"] == Event.CHECKPOINT_SAVED for e in segment),
        checkpoints_skipped=sum(e["event"] == Event.CHECKPOINT_SKIPPED for e in segment),
        restarts=restarts,
        steps_redone=redone,
        world_sizes=tuple(sizes),
        loss_window=len(tail) or LOSS_WINDOW,
        live_recoveries=tuple(e.get("seconds") for e in segment
                              if e["event"] == Event.RECOVERY and e.get("kind") == "live"),
    )

