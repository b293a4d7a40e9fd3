"""The vote at the end of every step: what every rank agrees on, from one all-reduce.

Each rank puts its loss and its reasons to leave the loop (a SIGTERM, its agent's own stop,
rank 0's failed checkpoint write under ``--on-save-failure stop``, a node ready to join,
rank 0's checkpoint interval) in one small tensor (the slots below); the sum over every
rank, read by ``decide``, is the same on every rank, so every rank leaves the loop, saves
or re-forms at the same step (worker/runtime.py makes the all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["GO_ON", "LEAVE_GRACE", "Vote", "decide", "make_tally"]

LEAVE_GRACE = 1.0
"""Seconds a SIGTERM on some nodes waits for the others before those nodes leave alone: a
job deleted or preempted as a whole signals every node within a moment and stops with a
checkpoint; a node signalled alone (a spot node reclaimed, a node drained) leaves at a
step boundary while the others re-form without it."""


@dataclass(frozen=True)
class Vote:
    """What every rank agreed at the end of one step."""

    loss_sum: float
    """The step's losses summed over the ranks (0.0 when the loop gave none)."""
    stop: bool
    """A SIGTERM reached some rank: checkpoint this step and leave the loop."""
    save_failed: bool
    """Rank 0 could not write a checkpoint and ``--on-save-failure`` is stop."""
    stopped_nodes: tuple[int, ...] = ()
    """The nodes (group ranks) whose workers got the signal."""
    reform: bool = False
    """A node is ready to join, or some leave (live recovery): every rank that stays
    re-forms the world after this step, which is committed."""
    restart: bool = False
    """An agent stops its workers itself (torch's restart path): every rank stops with a
    checkpoint of this step, and the agents start them again from it. Not the job's end."""
    leave: bool = False
    """This rank's node was signalled alone: it leaves the job at this step, without a
    checkpoint (the ranks that stay hold the state and go on)."""
    leaving: tuple[int, ...] = ()
    """The nodes (group ranks) that leave while the others go on."""
    save_due: bool | None = field(default=None, compare=False)
    """Rank 0's clock says ``--checkpoint-interval`` has passed: every rank saves this step
    (a sharded save needs all of them at the same step). None: not voted on."""

    @property
    def ends_loop(self) -> bool:
        return self.stop or self.save_failed or self.leave


GO_ON = Vote(loss_sum=0.0, stop=False, save_failed=False)
"""The vote of a loop that ran out of steps (or ran none)."""

# The vote's one all-reduce, slot by slot: the loss sum, how many ranks were preempted, the
# save-failure stop, how many ranks see a node ready to join, whether rank 0's checkpoint
# interval has passed, how many ranks their agent stops itself, how many were preempted
# LEAVE_GRACE ago or more, then one slot per node (its ranks that were preempted).
(TALLY_LOSS, TALLY_STOPS, TALLY_SAVE_FAILED, TALLY_REFORMS, TALLY_SAVE_DUE,
 TALLY_AGENT_STOPS, TALLY_RIPE, TALLY_NODES) = range(8)


def make_tally(nodes: int, extra: int, device: torch.device, *,
               loss_sum: torch.Tensor | float | None, preempted: bool, ripe: bool,
               by_agent: bool, save_failed: bool, reform: bool, node: int, save_due: bool
               ) -> torch.Tensor:
    """This rank's tally (a world of ``nodes`` nodes; ``node``: this rank's), slot by slot
    as above, and ``extra`` zero slots after the nodes' (worker/straggler_check.py)."""
    tally = torch.zeros(TALLY_NODES + nodes + extra, dtype=torch.float64, device=device)
    if loss_sum is not None:
        tally[TALLY_LOSS] = loss_sum
    if preempted:
        tally[TALLY_STOPS] = tally[TALLY_NODES + node] = 1.0
        if ripe:
            tally[TALLY_RIPE] = 1.0
    for slot, flag in ((TALLY_AGENT_STOPS, by_agent), (TALLY_SAVE_FAILED, save_failed),
                       (TALLY_REFORMS, reform), (TALLY_SAVE_DUE, save_due)):
        if flag:
            tally[slot] = 1.0
    return tally


def decide(summed: torch.Tensor | list[float], group_rank: int, nodes_in_world: int, *, live: bool
           ) -> Vote:
    """What the vote's tally of every rank (``summed``) says, the same on every rank
    (``group_rank``: this rank's node; ``live``: the world re-forms in place).

    An agent's own stop of its workers stops every rank with a checkpoint (a restart, not
    the job's end). A SIGTERM on every node stops the job with a checkpoint. A SIGTERM on
    some nodes waits ``LEAVE_GRACE`` for the rest; then those nodes leave and the others
    re-form without them (without live recovery every rank stops with them, as torch's
    restart path needs)."""
    values = summed.tolist() if isinstance(summed, torch.Tensor) else list(summed)
    nodes = tuple(node for node, v in enumerate(values[TALLY_NODES:]) if v > 0)
    common: dict[str, Any] = {"loss_sum": values[TALLY_LOSS],
                              "save_failed": values[TALLY_SAVE_FAILED] > 0,
                              "reform": values[TALLY_REFORMS] > 0,
                              "save_due": values[TALLY_SAVE_DUE] > 0}
    if values[TALLY_AGENT_STOPS] > 0:
        return Vote(stop=True, stopped_nodes=nodes, restart=True, **common)
    ripe = values[TALLY_RIPE] > 0
    if nodes and (len(nodes) == nodes_in_world or (ripe and not live)):
        return Vote(stop=True, stopped_nodes=nodes, **common)
    if nodes and ripe:
        leave = group_rank in nodes
        return Vote(stop=False, leave=leave, leaving=nodes, **{**common, "reform": not leave})
    return Vote(stop=False, **common)


