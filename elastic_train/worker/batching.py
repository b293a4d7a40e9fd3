"""The global batch policy: what happens to the batch and the learning rate on a resize.

``constant`` (the default): the global batch is ``--batch-size`` at every world size; each
rank's share is global / world (split as evenly as it goes), and ``--micro-batch-size``
bounds one forward pass, accumulating gradients when a share is larger. The optimisation
is the same whatever the world size: a resize changes speed, not the result.

``scale-lr``: each rank keeps the batch it had at the job's first start (its *reference*
world size W0, kept in the checkpoint), so the global batch follows the world size,
``batch_size * W // W0``, and the learning rate is scaled by the same factor (the linear
scaling rule). Throughput per rank stays constant; the optimisation changes with W.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_train.errors import ConfigError


@dataclass(frozen=True)
class WorldBatch:
    """The batch of one incarnation: samples per optimizer step and the LR multiplier."""

    policy: str
    global_batch: int
    lr_scale: float
    world_size: int
    reference_world_size: int


def plan_batch(policy: str, batch_size: int, world_size: int,
               reference_world_size: int) -> WorldBatch:
    """The plan for ``world_size`` ranks; ``reference_world_size`` is W0 (see module)."""
    if policy == "constant":
        global_batch, lr_scale = batch_size, 1.0
    elif policy == "scale-lr":
        global_batch = batch_size * world_size // reference_world_size
        lr_scale = global_batch / batch_size
    else:
        raise ConfigError(f"--batch-policy {policy} is invalid: it must be 'constant' or "
                          "'scale-lr'")
    if global_batch < world_size:
        raise ConfigError(f"the global batch of {global_batch} samples is smaller than the "
                          f"world size {world_size}: every rank needs at least one sample; "
                          "raise --batch-size")
    return WorldBatch(policy, global_batch, lr_scale, world_size, reference_world_size)


def global_batch(batch_size: int | None, global_batch_size: int | None,
                 world_size: int) -> int:
    """The samples of one step over all ranks, from a per-rank or a global size (one of
    them), for hand-written loops (worker/session.py)."""
    if (batch_size is None) == (global_batch_size is None):
        raise ConfigError("give batch_size (per rank) or global_batch_size (over all ranks), "
                          "one of them")
    name, value = (("batch_size", batch_size) if batch_size is not None
                   else ("global_batch_size", global_batch_size))
    assert value is not None
    if value <= 0:
        raise ConfigError(f"{name} {value} is invalid: it must be a positive number of samples")
    if batch_size is not None:
        return batch_size * world_size
    if value < world_size:
        raise ConfigError(f"global_batch_size {value} is smaller than the world size "
                          f"{world_size}: every rank needs at least one sample")
    return value
