"""When the c10d rendezvous store falls silent: torch's c10d handler waits without bound on
its store, in the agent's loop; a thread of the live agent asks the store itself, with a
bound, and ends this node's workers (then the agent, with one line) when it does not
answer."""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Callable

import torch.distributed as dist

from elastic_train.agent.worker_processes import PerWorkerProcesses
from elastic_train.agent.worker_start import stop_worker_server
from elastic_train.errors import RendezvousStoreLostError
from elastic_train.live.coordination import COMMITTED_KEY
from elastic_train.live.peers import bounded
from elastic_train.process_exit import exit_now

log = logging.getLogger(__name__)

STORE_ANSWER_SECONDS = 5.0
"""How long a coordinator waits for c10d's store to take its plan before it takes that
store's node for lost (a healthy one answers in milliseconds)."""


def store_lost(run_id: str, seconds: float) -> RendezvousStoreLostError:
    return RendezvousStoreLostError(
        f"the c10d rendezvous store of job {run_id} did not answer for {seconds:g} s "
        "(--rdzv-conf join_timeout): its node is lost or this node is cut off, and a c10d "
        "job cannot "
        "outlive its store's node; restart the job (it resumes from its newest checkpoint), "
        "or run it on --rdzv-backend etcd-v3, which survives the loss of any node")


def end_if_store_lost(store: dist.Store, loop_at: Callable[[], float],
                      workers: PerWorkerProcesses | None, seconds: float, run_id: str
                      ) -> None:
    """(A thread, when a peer fell silent on c10d.) torch's c10d handler waits without
    bound on its store, in this agent's loop: if the silent peer held the store, the
    loop does not come back until the store answers again. So the store is asked here,
    with a bound. No answer within ``STORE_ANSWER_SECONDS``: the store's node is lost,
    or this node is cut off; either way this node's workers hold a superseded state and
    are ended (their exits are no failure: ``PerWorkerProcesses.ended_here``). The agent
    then waits up to ``seconds`` for its loop to come back (a cable put back: the blocked
    call completes, and the loop joins the job again, none of --max-restarts spent); if it
    does not, it ends with one line."""
    suspected_at = time.monotonic()
    try:
        bounded(lambda: store.check([COMMITTED_KEY]), STORE_ANSWER_SECONDS)
        return
    except TimeoutError:
        pass
    except Exception:  # refused or reset: torch's handler raises on its own
        return
    if loop_at() > suspected_at:
        return  # the loop went on meanwhile: it handles the silent peer itself
    log.warning("the c10d rendezvous store does not answer: its node is lost, or this "
                "node is cut off; this node ends its workers and waits up to %g s for "
                "the store (--rdzv-conf join_timeout)", seconds)
    if workers is not None:
        workers.end_now()
    deadline = suspected_at + seconds
    while time.monotonic() < deadline:
        if loop_at() > suspected_at:
            return  # the store answered the loop: it rejoins the job
        time.sleep(0.1)
    if workers is not None:
        workers.close(signal.SIGKILL, 5)
    stop_worker_server()  # the spare's and the workers' server: nobody else will
    error = store_lost(run_id, seconds)
    print(f"elastic-train: error: {error}", file=sys.stderr, flush=True)
    exit_now(1)
