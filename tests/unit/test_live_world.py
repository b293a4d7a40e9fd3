"""A worker's join of a re-formed world (worker/live_world.py), on real TCPStores: its
connect to a generation's store is left as soon as a newer generation is announced."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic_train.live.messages import (
    GENERATION_KEY,
    Announcement,
    announcement_key,
    store_prefix,
)
from elastic_train.live.plan import LIVE, Member, Plan
from elastic_train.worker import distributed, live_world
from elastic_train.worker.env import WorkerEnv
from tests.polling import wait_until

RUN = "t"
AGENT = "agent-a"


@pytest.fixture
def silent_server() -> Iterator[socket.socket]:
    """A host that takes connections but never answers (frozen, or cut off after the
    kernel accepted): torch's client connects, then waits for its validation's answer."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server
    server.close()


def _announce(agent_store: dist.Store, generation: int, group_store: str) -> None:
    store = dist.PrefixStore(store_prefix(RUN, 0), agent_store)
    plan = Plan(generation, LIVE, (Member(AGENT, 1),), group_store, "test")
    store.set(announcement_key(generation), Announcement("start", AGENT, plan).encode())
    store.add(GENERATION_KEY, generation - int(store.add(GENERATION_KEY, 0)))


def test_a_join_connecting_to_a_silent_generation_store_takes_the_newer_one_at_once(
        silent_server: socket.socket) -> None:
    """Seed 815 of the fault campaign: a worker inside torch's client constructor for the
    store of a host killed as the world grew waited out its 15 s (three times: 43 s),
    where the others re-formed without that host in 1.4 s; against a host that accepted
    and fell silent it waited without bound (this test hung on the code before). It now
    joins the newer generation within a second of its announcement."""
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    here = f"127.0.0.1:{agent_store.port}"
    silent = f"127.0.0.1:{silent_server.getsockname()[1]}"
    _announce(agent_store, 1, silent)
    live = live_world.LiveWorld(
        WorkerEnv(run_id=RUN, live_store=here, live_recovery=True, live_generation=1),
        "gloo", timeout_seconds=60)
    announced: list[float] = []

    def announce_when_connected() -> None:
        # the worker's client is connected (the kernel queued it) and waits for an answer
        readable, _, _ = select.select([silent_server], [], [], 10)
        assert readable, "the worker never connected to generation 1's store"
        announced.append(time.monotonic())
        _announce(agent_store, 2, here)

    thread = threading.Thread(target=announce_when_connected, daemon=True)
    thread.start()
    try:
        group = live.join()
        joined = time.monotonic()
        thread.join(timeout=10)
        assert announced, "generation 2 was never announced"
        assert live.generation == 2 and group.world_size == 1
        assert joined - announced[0] < 2.0, joined - announced[0]  # 15 s before
    finally:
        distributed.destroy_group()
        live.close()
    assert not dist.is_initialized()


def test_a_connect_that_is_not_superseded_still_fails_at_its_own_bound(
        silent_server: socket.socket, monkeypatch: pytest.MonkeyPatch) -> None:
    """No newer generation: the connect to a silent store ends at the client's own
    timeout with torch's error, as before (the worker's recovery then decides)."""
    monkeypatch.setattr(live_world, "JOIN_CONNECT_SECONDS", 1.0)
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    silent = f"127.0.0.1:{silent_server.getsockname()[1]}"
    _announce(agent_store, 1, silent)
    live = live_world.LiveWorld(
        WorkerEnv(run_id=RUN, live_store=f"127.0.0.1:{agent_store.port}",
                  live_recovery=True, live_generation=1), "gloo", timeout_seconds=60)
    started = time.monotonic()
    try:
        with pytest.raises(Exception) as raised:
            live._generation_store(live.plan)
        assert not isinstance(raised.value, live_world.Superseded)
        assert time.monotonic() - started < 1.0 + live_world.CONNECT_GRACE_SECONDS + 1.0
    finally:
        live.close()


_STORE_HOST = ("import sys, time\n"
               "import torch.distributed as dist\n"
               "store = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
               "print(store.port, flush=True)\n"
               "time.sleep(120)\n")


def _announce_plan(agent_store: dist.Store, plan: Plan, mode: str) -> None:
    store = dist.PrefixStore(store_prefix(RUN, 0), agent_store)
    store.set(announcement_key(plan.generation), Announcement(mode, AGENT, plan).encode())
    store.add(GENERATION_KEY, plan.generation - int(store.add(GENERATION_KEY, 0)))


def test_the_watcher_sees_a_newer_generation_while_a_pending_ones_store_host_is_frozen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed 1009 of the soak of 4eb25d8: a node frozen right after a boundary generation
    (its store on that node) was announced. The watcher, asking that store whether every
    worker was ready, waited in torch's client without bound, so that it never saw the
    generation the agents formed without the frozen node 1.4 s later: the survivors' loop
    sat in a collective with it until the thaw (12.4 s). The watcher now aborts the
    collectives within a moment of the newer announcement (this test failed before)."""
    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST], stdout=subprocess.PIPE,
                            text=True)
    aborted = threading.Event()
    monkeypatch.setattr(live_world.aborts, "abort_collectives",
                        lambda reason, generation=None: aborted.set())
    live = None
    try:
        assert host.stdout is not None
        frozen = f"127.0.0.1:{int(host.stdout.readline())}"
        agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        here = f"127.0.0.1:{agent_store.port}"
        _announce(agent_store, 1, here)
        live = live_world.LiveWorld(
            WorkerEnv(run_id=RUN, live_store=here, live_recovery=True, live_generation=1),
            "gloo", timeout_seconds=60).start()
        # generation 2 grows the world at a step boundary; its store is the frozen host's
        boundary = Plan(2, LIVE, (Member(AGENT, 1), Member("agent-b", 1)), frozen, "joined",
                        started=2)
        _announce_plan(agent_store, boundary, "boundary")
        asked = dist.TCPStore("127.0.0.1", int(frozen.rsplit(":", 1)[1]), is_master=False,
                              timeout=timedelta(seconds=10))
        ready_key = f"elastic_train/{RUN}/gen-2/ready"
        wait_until(lambda: asked.check([ready_key]), 10, "the watcher asking gen 2's store")
        os.kill(host.pid, signal.SIGSTOP)                 # the host freezes
        time.sleep(3 * live_world.WATCH_INTERVAL)          # its next question waits
        announced = time.monotonic()
        _announce_plan(agent_store, Plan(3, LIVE, (Member(AGENT, 1),), here, "lost"), "start")
        assert aborted.wait(5), "the watcher never saw generation 3"
        assert time.monotonic() - announced < 1.0
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()
        if live is not None:
            live.close()
