"""Unit tests of the run report: incarnations, failures and resizes from an event log, the
summary's lines, and a picture drawn (matplotlib) for a run that failed and shrank."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from elastic_train import cli
from elastic_train.errors import ReportError
from elastic_train.observe.report import timeline, write_report


def records() -> list[dict[str, Any]]:
    """A 2-rank run killed after step 14, resumed from 10 on 1 rank, finished at 20."""
    out: list[dict[str, Any]] = [
        {"event": "start", "time": 100.0, "run_id": "r", "restart": 0, "world_size": 2,
         "total_steps": 20}]
    for n in range(1, 15):
        out.append({"event": "step", "time": 100.0 + n, "step": n, "loss": 5.0 - n / 10,
                    "lr": 0.001, "world_size": 2, "samples": 8 * n, "seconds": 0.5})
        if n == 10:
            out.append({"event": "checkpoint_saved", "time": 110.5, "step": 10})
    out += [{"event": "start", "time": 130.0, "run_id": "r", "restart": 1, "world_size": 1,
             "total_steps": 20},
            {"event": "checkpoint_loaded", "time": 131.0, "step": 10}]
    for n in range(11, 21):
        out.append({"event": "step", "time": 121.0 + 2 * n, "step": n, "loss": 4.0 - n / 20,
                    "lr": 0.001, "world_size": 1, "samples": 8 * n, "seconds": 1.0})
    out += [{"event": "checkpoint_saved", "time": 161.5, "step": 20},
            {"event": "end", "time": 162.0, "step": 20}]
    return out


def write(run_dir: Path, events: list[dict[str, Any]]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def test_timeline_finds_the_failure_the_resize_and_the_checkpoints() -> None:
    line = timeline(records())
    assert [(i.restart, i.world_size, i.resumed_step, len(i.steps))
            for i in line.incarnations] == [(0, 2, 0, 14), (1, 1, 10, 10)]
    assert line.checkpoints == [(110.5, 10), (161.5, 20)]
    (failure,) = line.failures
    assert (failure.last_seen, failure.last_step, failure.resumed, failure.resumed_from) == \
        (114.0, 14, 143.0, 10)
    assert failure.downtime == 29.0 and failure.lost_steps == 4
    assert line.resizes == [(130.0, 2, 1)]
    # Throughput: 8 samples per step; 1 step/s before, 1 step per 2 s after.
    assert {round(v) for _, _, v in line.incarnations[0].throughput()} == {8}
    assert {round(v) for _, _, v in line.incarnations[1].throughput()} == {4}


def test_summary_names_the_failure_and_the_resize(tmp_path: Path) -> None:
    report = write_report(write(tmp_path / "run", records()), plot=False)
    assert report.image_path is None
    assert report.summary_path == tmp_path / "run" / "report.txt"
    assert report.text == report.summary_path.read_text()
    lines = report.text.splitlines()
    assert lines[0] == "run r: 20/20 steps"
    assert "  restarts survived 1 (4 steps redone)" in lines
    assert "  world size        2 -> 1" in lines
    assert "  wall time         1:02 (24 steps trained, 17.0 s of it in steps)" in lines
    assert "  checkpoints at    steps 10, 20" in lines
    assert ("  failure 1         after step 14; resumed from step 10 (4 steps redone); "
            "training again 29.0 s after the last sign of life") in lines
    assert "  resize            world size 2 -> 1 after 30.0 s" in lines


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", header[16:24])


def test_the_command_draws_a_png_and_prints_the_summary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = write(tmp_path / "run", records())
    target = tmp_path / "out" / "picture.png"
    assert cli.main(["report", str(run_dir), "--output", str(target)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run r: 20/20 steps\n")
    assert out.endswith(f"wrote {target}, {target.with_suffix('.txt')}\n")
    assert png_size(target) == (1500, 1050) and target.stat().st_size > 40_000


def test_a_run_still_starting_and_a_session_log_without_samples(tmp_path: Path) -> None:
    just_started = [{"event": "start", "time": 1.0, "run_id": "s", "restart": 0,
                     "world_size": 2, "total_steps": None}]
    assert write_report(write(tmp_path / "a", just_started), plot=False).text.startswith(
        "run s: 0/None steps")
    session = [*just_started, *[{"event": "step", "time": 1.0 + n, "step": n, "loss": None,
                                 "world_size": 2, "restart": 0} for n in range(1, 6)]]
    report = write_report(write(tmp_path / "b", session))
    assert "throughput        1 steps/s" in report.text
    assert png_size(tmp_path / "b" / "report.png") == (1500, 1050)


def test_nothing_to_report_is_one_line(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ReportError, match=r"events\.jsonl does not exist: pass the --run-dir"):
        write_report(tmp_path)
    write(tmp_path / "empty", [])
    with pytest.raises(ReportError, match="the event log has no run: pass the --run-dir"):
        write_report(tmp_path / "empty")
    assert cli.main(["report", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err == (f"elastic-train: error: run directory {tmp_path / 'nope'}"
                                       " does not exist: pass the --run-dir of a job\n")


def test_a_live_recovery_is_a_line_of_the_summary_and_a_mark_of_the_picture(
        tmp_path: Path) -> None:
    events = records()
    at = next(i for i, e in enumerate(events) if e.get("step") == 6)
    events.insert(at + 1, {"event": "recovery", "time": 106.5, "kind": "live", "restart": 0,
                           "step": 6, "world_size": 2, "previous_world_size": 2,
                           "failed_ranks": [1], "steps_redone": 1, "seconds": 0.43,
                           "bytes": 10_170_335, "generation": 1, "source_rank": 0})
    line = timeline(events)
    assert [r["step"] for r in line.live_recoveries] == [6]
    report = write_report(write(tmp_path / "run", events))
    assert "  live recovery 1   rank 1 replaced at step 6 (1 step redone, 10.2 MB of state " \
           "from rank 0); 0.43 s from detection to the state in place" in report.text
    assert "  live recoveries   1 (" in report.text
    assert report.image_path is not None and report.image_path.stat().st_size > 10_000


def test_a_lost_and_a_joining_node_say_so_with_the_worlds(tmp_path: Path) -> None:
    events = records()
    at = next(i for i, e in enumerate(events) if e.get("step") == 6)
    common = {"event": "recovery", "kind": "live", "restart": 0, "generation": 1,
              "source_rank": 0}
    events[at + 1:at + 1] = [
        {**common, "time": 106.5, "step": 6, "world_size": 1, "previous_world_size": 2,
         "failed_ranks": [1], "steps_redone": 1, "seconds": 0.2, "bytes": 0,
         "cause": "node lost", "lost_nodes": 1},
        {**common, "time": 106.7, "step": 6, "world_size": 2, "previous_world_size": 1,
         "failed_ranks": [], "steps_redone": 0, "seconds": None, "bytes": 10_170_335,
         "cause": "node joined"}]
    text = write_report(write(tmp_path / "run", events), plot=False).text
    assert "  live recovery 1   1 node(s) lost (rank 1), world 2 -> 1, at step 6 (1 step " \
           "redone, 0.0 MB of state from rank 0); 0.20 s from detection" in text
    assert "  live recovery 2   a node joined, world 1 -> 2, at step 6 (0 step redone, 10.2 MB"\
           " of state from rank 0)\n" in text


def test_a_sharded_recovery_through_the_checkpoint_says_so(tmp_path: Path) -> None:
    events = records()
    at = next(i for i, e in enumerate(events) if e.get("step") == 6)
    events.insert(at + 1, {"event": "recovery", "time": 106.5, "kind": "live", "restart": 0,
                           "step": 5, "world_size": 2, "previous_world_size": 2,
                           "failed_ranks": [1], "steps_redone": 2, "seconds": 0.25,
                           "bytes": 0, "generation": 1, "source_rank": -1,
                           "state_from": "checkpoint"})
    text = write_report(write(tmp_path / "run", events), plot=False).text
    assert "  live recovery 1   rank 1 replaced at step 5 (2 step redone, the newest " \
           "checkpoint, loaded in place); 0.25 s from detection to the state in place" in text
