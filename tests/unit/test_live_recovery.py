"""Live recovery's pure parts: abortable waits, the per-worker process contexts' bookkeeping,
and how a recovery shows in the summary and the metrics. The real thing (real workers,
real SIGKILLs) is tests/integration/test_live_recovery.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from elastic_train.agent.live_agent import PerWorkerProcesses
from elastic_train.live.messages import store_prefix
from elastic_train.live.spare import DELAY as SPARE_DELAY
from elastic_train.live.spare import SPARE, place_key
from elastic_train.observe.metrics import WorkerMetrics
from elastic_train.observe.summary import summarize
from elastic_train.worker import aborts, data_parallel
from elastic_train.worker.aborts import CollectiveAborted
from elastic_train.worker.env import WorkerEnv


@pytest.fixture(autouse=True)
def not_aborted() -> Iterator[None]:
    aborts._aborted = None
    yield
    aborts._aborted = None


def test_an_abortable_wait_returns_the_collectives_result() -> None:
    inner: torch.futures.Future = torch.futures.Future()
    mine = aborts.abortable(inner)
    inner.set_result([torch.ones(2)])
    assert mine.wait()[0].tolist() == [1.0, 1.0]


def test_an_abort_ends_waits_now_and_fails_later_collectives_at_once() -> None:
    inner: torch.futures.Future = torch.futures.Future()
    mine = aborts.abortable(inner)
    aborts.abort_collectives("a worker was lost")
    with pytest.raises(CollectiveAborted, match="a worker was lost"):
        mine.wait()
    inner.set_result([torch.ones(1)])  # the stuck work ending later changes nothing
    later = aborts.abortable(torch.futures.Future())
    with pytest.raises(CollectiveAborted):
        later.wait()


def test_the_collectives_own_error_reaches_the_waiter() -> None:
    inner: torch.futures.Future = torch.futures.Future()
    mine = aborts.abortable(inner)
    inner.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        mine.wait()


def test_incarnations_have_their_own_store_prefix() -> None:
    assert store_prefix("job", 2) == "elastic_train/job/restart-2"


def test_only_a_failed_collective_asks_the_agents_to_re_form() -> None:
    lost = [CollectiveAborted("a peer was lost"),
            torch.distributed.DistBackendError("gloo: connection reset"),
            RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                         "closed by peer [127.0.0.1]:23456")]
    assert all(aborts.is_collective_failure(exc) for exc in lost)
    try:  # a collective's error wrapped by the code that waited on it
        try:
            raise lost[2]
        except RuntimeError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        assert aborts.is_collective_failure(outer)
    own = [ValueError("bad batch"), RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
           KeyError("tokens")]
    assert not any(aborts.is_collective_failure(exc) for exc in own)


def test_an_abort_seen_through_a_chained_future_is_a_collective_failure() -> None:
    """A callback chained on an aborted collective's future (DDP's comm hook's ``then``)
    fails with a RuntimeError that keeps only the abort's name and message: still the
    collective's failure, not the loop's own (the soak of 211e9c6: 27 steps said 'not a
    collective: waits 2 s')."""
    failed: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    chained = failed.then(lambda fut: fut.value() * 2)
    failed.set_exception(aborts.CollectiveAborted("the world re-forms as generation 3 "
                                                  "(node lost)"))
    with pytest.raises(RuntimeError) as caught:
        chained.wait()
    assert type(caught.value) is RuntimeError and caught.value.__cause__ is None
    assert "CollectiveAborted: the world re-forms" in str(caught.value)
    assert aborts.is_collective_failure(caught.value)
    own: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    own_chained = own.then(lambda fut: fut.value() * 2)
    own.set_exception(ValueError("bad batch"))
    with pytest.raises(RuntimeError) as caught_own:
        own_chained.wait()
    assert not aborts.is_collective_failure(caught_own.value)


# ---- the agent's per-worker contexts --------------------------------------------------------
@dataclass
class _Failure:
    local_rank: int = 0
    exitcode: int = -9


@dataclass
class _Result:
    failures: dict[int, Any] = field(default_factory=dict)
    return_values: dict[int, Any] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return bool(self.failures)


stops: list[tuple[str, int]] = []
"""What happened to the scripted contexts at a close, in order: ("waited", pid) for a wait
with a timeout (a spare's dismissal), ("closed", pid)."""


class _Context:
    """A worker's process context with a scripted outcome (None: still running)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.outcome: _Result | None = None
        self.closed = False

    def pids(self) -> dict[int, int]:
        return {0: self.pid}

    def wait(self, timeout: float = -1, period: float = 1) -> _Result | None:
        if timeout > 0:
            stops.append(("waited", self.pid))
        return self.outcome

    def close(self, death_sig: Any = None, timeout: int = 30) -> None:
        self.closed = True
        stops.append(("closed", self.pid))


def _workers(n: int, spare_store: Any = None) -> tuple[PerWorkerProcesses, list[_Context]]:
    started: list[_Context] = []

    def start_one(local_rank: int, env: dict[str, str]) -> Any:
        started.append(_Context(100 + len(started)))
        started[-1].env = env  # type: ignore[attr-defined]
        return started[-1]

    return PerWorkerProcesses(start_one, {lr: {"LOCAL_RANK": str(lr)} for lr in range(n)},
                              spare_store=spare_store), started


def _place(store: dist.Store, pid: int) -> dict[str, str]:
    return json.loads(store.get(place_key(pid)))


def test_a_failed_worker_s_place_goes_to_the_hot_spare_then_a_new_spare_is_due(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPARE_DELAY, "0")
    store = dist.HashStore()
    workers, started = _workers(2, store)
    assert workers.wants_spare()
    spare = workers.start_spare()
    assert spare == 102 and started[2].env == {"LOCAL_RANK": "0", SPARE: "1"}  # type: ignore[attr-defined]
    assert workers.pids() == {0: 100, 1: 101} and not workers.wants_spare()
    started[1].outcome = _Result(failures={0: _Failure()})
    workers.poll_failed()
    assert workers.restart(1, {"GEN": "1"}) == spare          # no new process forked
    assert len(started) == 3 and workers.pids() == {0: 100, 1: spare}
    assert _place(store, spare) == {"LOCAL_RANK": "1", "GEN": "1"}
    assert workers.wants_spare()  # the spare is a worker now: the next one is due
    workers.start_spare()
    stops.clear()
    workers.close()                                           # the idle spare is dismissed
    assert _place(store, 103) == {} and all(started[i].closed for i in (0, 2, 3))
    # the workers first (a SIGTERM reaches them at once; a second signal that cuts the
    # close short leaves no worker running), the spare last
    assert stops == [("closed", 100), ("closed", spare), ("waited", 103), ("closed", 103)]


def test_the_spare_is_closed_even_when_its_dismissal_or_a_workers_close_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No spare outlives its agent: one left behind exits only once the agent's store is
    gone, and says so after the agent's last line (a C++ trace of its store wait)."""
    monkeypatch.setenv(SPARE_DELAY, "0")

    class Gone(dist.HashStore):
        def set(self, key: str, value: Any) -> None:
            raise RuntimeError("the store is gone")

    workers, started = _workers(1, Gone())
    workers.start_spare()
    workers.close()
    assert started[1].closed                    # not dismissed (no store), closed all the same

    workers, started = _workers(1, dist.HashStore())
    workers.start_spare()

    def broken(death_sig: Any = None, timeout: int = 30) -> None:
        raise KeyboardInterrupt  # a second signal cutting the workers' close short

    started[0].close = broken  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        workers.close()
    assert started[1].closed


def test_without_a_live_spare_a_replacement_is_forked_and_spares_that_end_are_limited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPARE_DELAY, "0")
    store = dist.HashStore()
    workers, started = _workers(2, store)
    for ended in range(2):  # a spare that ends on its own is not given a place
        workers.start_spare()
        started[-1].outcome = _Result(failures={0: _Failure()})
        if ended == 0:
            assert workers.wants_spare()  # noticed; another is due
        else:
            started[1].outcome = _Result(failures={0: _Failure()})
            workers.poll_failed()
            assert workers.restart(1, {}) == 104  # forked: the spare had ended
            assert not store.check([place_key(103)])
    assert not workers.wants_spare()  # two spares ended: no more
    monkeypatch.setenv(SPARE_DELAY, "30")
    workers, _ = _workers(1, store)
    assert not workers.wants_spare()  # not before the delay
    assert not _workers(1)[0].wants_spare()  # no store: no spares


def test_one_failed_worker_is_reported_with_its_own_local_rank_and_started_again() -> None:
    workers, started = _workers(2)
    assert workers.pids() == {0: 100, 1: 101}
    assert workers.poll_failed() == ({}, 2)
    started[1].outcome = _Result(failures={0: _Failure()})
    failed, running = workers.poll_failed()
    assert list(failed) == [1] and failed[1].local_rank == 1 and running == 1
    assert workers.restart(1, {"GEN": "1"}) == 102
    assert started[2].env == {"LOCAL_RANK": "1", "GEN": "1"}  # type: ignore[attr-defined]
    assert workers.pids() == {0: 100, 1: 102}
    assert workers.wait(0) is None  # both running again


def test_the_torch_view_is_a_failure_while_unhandled_and_return_values_at_the_end() -> None:
    workers, started = _workers(2)
    started[0].outcome = _Result(failures={0: _Failure()})
    result = workers.wait(0)
    assert result is not None and list(result.failures) == [0]

    workers, started = _workers(2)
    started[0].outcome = _Result(return_values={0: "a"})
    assert workers.wait(0) is None  # one finished, one running
    assert workers.pids() == {0: 100, 1: 101}  # a finished worker keeps its pid
    started[1].outcome = _Result(return_values={0: "b"})
    result = workers.wait(0)
    assert result is not None and result.return_values == {0: "a", 1: "b"}
    workers.close()


def test_as_polled_hides_a_failure_until_live_recovery_polled_it() -> None:
    # torch's monitor calls wait(0) after the agent's own poll: a worker that died in
    # between must not reach torch's restart path before the agent's next look.
    workers, started = _workers(2)
    assert workers.poll_failed() == ({}, 2)
    started[1].outcome = _Result(failures={0: _Failure()})
    with workers.as_polled():
        assert workers.wait(0) is None
    assert workers.pids(running_only=True) == {0: 100, 1: 101}
    failed, running = workers.poll_failed()
    assert list(failed) == [1] and running == 1
    assert workers.pids(running_only=True) == {0: 100}


def test_workers_their_agent_ended_itself_are_neither_a_failure_nor_a_success() -> None:
    """The fault campaign, c10d seed 642: the agent ended its workers itself while the c10d
    store did not answer; their exits (SIGKILL) were then counted as a failure, which spent
    --max-restarts, and a second cut-off ended the job."""
    workers, started = _workers(2)
    workers.end_now()
    assert all(c.closed for c in started)
    for context in started:
        context.outcome = _Result(failures={0: _Failure()})  # their SIGKILLed exits
    assert workers.poll_failed() == ({}, 0)  # no failure: nothing spent on them
    assert workers.ended_here() == [0, 1]
    assert workers.wait(0) is None  # torch's view: neither failed nor succeeded
    assert workers.wait(0) is None
    workers.restart(1, {})
    assert workers.ended_here() == [0]
    # a worker that dies on its own after a restart is a failure again
    started[2].outcome = _Result(failures={0: _Failure()})
    failed, _ = workers.poll_failed()
    assert list(failed) == [1]


def test_a_worker_still_running_when_its_agent_ended_the_others_is_not_ended_here() -> None:
    workers, started = _workers(2)
    started[0].outcome = _Result(failures={0: _Failure()})  # died on its own, not polled
    workers.poll_failed()
    workers.end_now()  # ends the one still running
    started[1].outcome = _Result(failures={0: _Failure()})
    assert workers.poll_failed() == ({}, 0)
    assert workers.ended_here() == [1]
    result = workers.wait(0)  # the worker that failed on its own is still a failure
    assert result is not None and list(result.failures) == [0]


# ---- what a run shows -----------------------------------------------------------------------
LIVE = {"event": "recovery", "kind": "live", "restart": 0, "step": 15, "world_size": 2,
        "previous_world_size": 2, "failed_ranks": [1], "steps_redone": 1, "seconds": 0.25,
        "bytes": 1000, "time": 3.0}


def test_the_summary_counts_live_recoveries() -> None:
    events = [{"event": "start", "run_id": "r", "restart": 0, "world_size": 2,
               "total_steps": 2, "time": 1.0},
              {"event": "step", "step": 1, "loss": 1.0, "time": 2.0}, LIVE,
              {"event": "step", "step": 1, "loss": 1.0, "time": 4.0}]
    lines = summarize(events, "r").lines()
    assert "  live recoveries   1 (the world re-formed in place, state from a peer, 0.25 s at " \
           "most)" in lines


def test_the_summary_shows_every_world_a_run_had_also_those_re_formed_in_place() -> None:
    resize = {"event": "resize", "nodes": 1, "restart": 0, "since_last_step_seconds": None}
    events = [{"event": "start", "run_id": "r", "restart": 0, "world_size": 2,
               "total_steps": 3, "time": 1.0},
              {"event": "step", "step": 1, "loss": 1.0, "time": 2.0},
              {**LIVE, "world_size": 1, "cause": "node lost"},
              {**resize, "old_world_size": 2, "new_world_size": 1, "time": 3.1},
              {"event": "step", "step": 2, "loss": 1.0, "time": 4.0},
              {**resize, "old_world_size": 1, "new_world_size": 2, "time": 4.1},
              {"event": "step", "step": 3, "loss": 1.0, "time": 5.0}]
    assert summarize(events, "r").world_sizes == (2, 1, 2)


def test_the_metrics_count_recoveries_by_kind() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, WorkerEnv(world_size=2, run_id="r"), 64)
    metrics.observe(LIVE)
    metrics.observe({**LIVE, "kind": "restart", "steps_redone": 4, "bytes": None})

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"run_id": "r", "rank": "0",
                                                "node": metrics_node(registry), **labels})

    assert value("elastic_train_recoveries_total", kind="live") == 1
    assert value("elastic_train_recoveries_total", kind="restart") == 1
    assert value("elastic_train_recovery_steps_redone_total") == 5
    assert value("elastic_train_state_transfer_bytes_total") == 1000
    assert value("elastic_train_live_recovery_duration_seconds_count") == 1


def metrics_node(registry: CollectorRegistry) -> str:
    for family in registry.collect():
        for sample in family.samples:
            if "node" in sample.labels:
                return sample.labels["node"]
    raise AssertionError("no node label")


def test_live_workers_keep_their_process_on_an_nccl_error_unless_the_job_says_otherwise(
) -> None:
    from elastic_train.agent.live_agent import live_worker_env

    torch_env = {"RANK": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # what torch's agent sets
    env = live_worker_env(torch_env, "127.0.0.1:5000", agent_env={})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"   # abort the communicator only
    assert env["ELASTIC_TRAIN_LIVE_STORE"] == "127.0.0.1:5000" and env["RANK"] == "1"
    # The job set its own: torch's agent passed it on, and it stays.
    own = {"RANK": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    chosen = live_worker_env(own, "127.0.0.1:5000",
                             agent_env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert chosen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


class _Crossed(torch.nn.Module):
    """Parameters defined in one order and used in the other: DDP's buckets rebuilt in
    the first iteration (the order the gradients come) differ from a new DDP's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(x))


def _buckets(ddp: torch.nn.parallel.DistributedDataParallel) -> list[list[str]]:
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    return [[names[id(p)] for p in bucket.parameters()]
            for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def test_a_renewed_ddp_has_the_buckets_of_a_new_one_and_keeps_its_hook() -> None:
    """After a re-formation a survivor renews its DDP while a worker that joins builds one:
    both must reduce the same parameters in the same slots."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        failures = data_parallel.StepFailures()
        trained = torch.nn.parallel.DistributedDataParallel(_Crossed(), bucket_cap_mb=1e-6)
        trained.register_comm_hook(failures, data_parallel.forgiving_allreduce_hook)
        for _ in range(3):
            trained(torch.ones(2, 3)).sum().backward()
        new = torch.nn.parallel.DistributedDataParallel(_Crossed(), bucket_cap_mb=1e-6)
        assert _buckets(trained) != _buckets(new)        # rebuilt in the gradients' order
        data_parallel.renew_ddp(trained)
        assert _buckets(trained) == _buckets(new)
        assert trained._comm_hooks == [(data_parallel.forgiving_allreduce_hook, failures)]
        trained.module.zero_grad()
        trained(torch.ones(2, 3)).sum().backward()
        assert failures.take() is None
        assert trained.module.a.bias.grad is not None
    finally:
        dist.destroy_process_group()


def test_a_failed_gradient_all_reduce_is_recorded_and_backward_returns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ElasticSession's DDP hook: the loop's ``backward()`` returns; the session learns of
    the failure at ``step()`` (and its optimizer steps nothing meanwhile)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        failures = data_parallel.StepFailures()
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
        ddp.register_comm_hook(failures, data_parallel.forgiving_allreduce_hook)
        monkeypatch.setattr(aborts, "_aborted", None)
        aborts.abort_collectives("the world re-forms as generation 1 (worker lost)")
        ddp(torch.ones(2, 3)).sum().backward()
        error = failures.take()
        assert isinstance(error, CollectiveAborted)
        assert str(error) == "the world re-forms as generation 1 (worker lost)"
        assert failures.take() is None
    finally:
        dist.destroy_process_group()
