"""How long each rendezvous took, as torch's agent measures it, handed to the next workers.

torch's agent times every rendezvous itself: ``SimpleElasticAgent._rendezvous`` is wrapped
in ``torch.distributed.elastic.metrics.prof``, which publishes
``SimpleElasticAgent._rendezvous.duration.ms`` (joining the round, waiting for the other
nodes and the last call, then the rank assignment through the store) to the metric
handler of the ``torchelastic`` group, right before the agent spawns that round's workers.
``elastic-train run`` runs the agent in its own process and installs ``RendezvousTimer``
there (``metrics.configure`` is torch's public hook); the timer puts the duration in the
agent's environment, which the spawned workers inherit, and rank 0 writes it into the
event log's ``rendezvous`` event. Under a plain ``torchrun`` nobody installs it, and the
event says ``seconds: null``.
"""

from __future__ import annotations

from torch.distributed.elastic import metrics

from elastic_train.live.environment import set_rendezvous_seconds

METRIC = "SimpleElasticAgent._rendezvous.duration.ms"


class RendezvousTimer(metrics.MetricHandler):
    """Passes the agent's rendezvous durations on to the workers it spawns next."""

    def __init__(self, forward: metrics.MetricHandler | None = None) -> None:
        self.forward = forward
        self.last_seconds: float | None = None

    def emit(self, metric_data: metrics.MetricData) -> None:
        if metric_data.name == METRIC:
            self.last_seconds = float(metric_data.value) / 1000.0
            set_rendezvous_seconds(self.last_seconds)
        if self.forward is not None:
            self.forward.emit(metric_data)


def install() -> RendezvousTimer:
    """Receive the ``torchelastic`` metrics of the agent in this process."""
    timer = RendezvousTimer(metrics.getStream("torchelastic").handler)
    metrics.configure(timer, group="torchelastic")
    return timer
