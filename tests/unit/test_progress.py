"""Unit tests of rank 0's console progress: plain lines off a terminal, one live line on a
real terminal (a pseudo-terminal), decided from the stream."""

from __future__ import annotations

import io
import os
import select
from collections.abc import Iterator
from typing import Any, TextIO

import pytest

from elastic_train.observe.progress import Progress, format_eta, is_terminal


def step(n: int, time: float, loss: float = 2.0, **extra: Any) -> dict[str, Any]:
    return {"event": "step", "time": time, "step": n, "loss": loss, "lr": 1e-3,
            "world_size": 2, "seconds": 0.1, **extra}


def start() -> dict[str, Any]:
    return {"event": "start", "time": 0.0, "total_steps": 100}


@pytest.fixture
def terminal() -> Iterator[tuple[TextIO, int]]:
    """A real terminal: the writing end of a pseudo-terminal, and the reading end's fd."""
    reader, writer = os.openpty()
    stream = os.fdopen(writer, "w")
    try:
        yield stream, reader
    finally:
        stream.close()
        os.close(reader)


def read_all(fd: int) -> str:
    chunks = []
    while True:
        ready, _, _ = select.select([fd], [], [], 0)
        if not ready:
            return b"".join(chunks).decode()
        chunks.append(os.read(fd, 65536))


def test_the_decision_comes_from_the_stream(terminal: tuple[TextIO, int],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "dumb")        # the environment is not asked
    assert is_terminal(terminal[0]) and Progress(terminal[0], 10, 8, 5).live
    assert not is_terminal(io.StringIO()) and not Progress(io.StringIO(), 10, 8, 5).live
    closed = io.StringIO()
    closed.close()
    assert not is_terminal(closed)


def test_plain_lines_every_log_every_steps() -> None:
    out = io.StringIO()
    progress = Progress(out, total_steps=100, batch_size=16, log_every=10)
    progress.observe(start())
    # 10 steps of 0.1 s back to back: 10 steps/s, 160 samples/s; 90 steps left: 9 s.
    for n in range(1, 21):
        progress.observe(step(n, 0.1 * n, loss=float(n)))
    progress.message("a message")
    assert out.getvalue().splitlines() == [
        "step 10/100  loss 5.5000 (mean)  lr 1.00e-03  world 2  160 samples/s  eta 0:09",
        "step 20/100  loss 15.5000 (mean)  lr 1.00e-03  world 2  160 samples/s  eta 0:08",
        "a message"]


def test_a_pause_between_steps_counts_in_the_throughput() -> None:
    out = io.StringIO()
    progress = Progress(out, total_steps=20, batch_size=10, log_every=10)
    progress.observe(start())
    times = [0.1 * n for n in range(1, 11)] + [1.0 + 1.0 + 0.1 * n for n in range(1, 11)]
    for n, t in enumerate(times, 1):   # a 1 s checkpoint pause after step 10
        progress.observe(step(n, t))
    second = out.getvalue().splitlines()[1]
    assert second.startswith("step 20/20") and "  50 samples/s  eta 0:00" in second


def test_the_live_line_redraws_in_place_and_stays_at_the_end(
        terminal: tuple[TextIO, int]) -> None:
    stream, reader = terminal
    progress = Progress(stream, total_steps=100, batch_size=16, log_every=10)
    assert progress.live
    progress.observe(start())
    tick = 1 / 16                           # steps 1/16 s apart: a redraw every 4th step
    for n in range(1, 51):
        progress.observe(step(n, tick * n))
    draws = read_all(reader).split("\r")[1:]
    assert [d.split("/")[0] for d in draws] == [f"step {n}" for n in range(1, 50, 4)]
    assert all(d.endswith("\x1b[K") for d in draws)
    assert draws[-1] == ("step 49/100  loss 2.0000 (mean)  lr 1.00e-03  world 2  "
                         "256 samples/s  eta 0:03\x1b[K")
    progress.message("resumed from somewhere")
    assert read_all(reader) == "\r\x1b[Kresumed from somewhere\r\n"   # the tty adds \r
    for n in range(51, 101):
        progress.observe(step(n, tick * n))
    assert read_all(reader).endswith("\rstep 100/100  loss 2.0000 (mean)  lr 1.00e-03  world 2"
                                     "  256 samples/s  eta 0:00\x1b[K\r\n")
    progress.close()                        # the last step already ended the line
    assert read_all(reader) == ""


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0:00"), (59.4, "0:59"), (61, "1:01"), (3600, "1:00:00"), (-3, "0:00")])
def test_format_eta(seconds: float, text: str) -> None:
    assert format_eta(seconds) == text
