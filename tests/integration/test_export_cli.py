"""``elastic-train checkpoints export`` as a user runs it, and every command ending quietly
when its reader closes stdout early (``| head``)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from elastic_train import cli
from elastic_train.checkpoint.storage import CheckpointStore, model_digest, tensor_shapes
from tests.integration import harness

BROKEN_PIPE_EXIT = 141  # what a shell reports for a writer killed by SIGPIPE


def elastic_train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastic_train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60, env=harness.job_env())


def user_env() -> dict[str, str]:
    """A user's environment: stdout block-buffered when it is a pipe (this one may not be)."""
    env = harness.job_env()
    env.pop("PYTHONUNBUFFERED", None)
    return env


def _write(store: CheckpointStore, step: int, state: dict[str, torch.Tensor]) -> None:
    store.write(step, {"model": state, "trainer": {"step": step}},
                {"world_size": 1, "model_digest": model_digest(state),
                 "model_shapes": tensor_shapes(state)})


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory with checkpoints 10 and 20 of a model with a tied output layer."""
    run_dir = tmp_path / "runs" / "job"
    store = CheckpointStore(run_dir / "checkpoints")
    for step in (10, 20):
        torch.manual_seed(step)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
        model[1].weight = model[0].weight
        _write(store, step, model.state_dict())
    return run_dir


def test_export_prints_one_line_and_writes_loadable_weights(run_dir: Path,
                                                            tmp_path: Path) -> None:
    (newest, _) = CheckpointStore(run_dir / "checkpoints").list()
    out = tmp_path / "weights" / "model.safetensors"
    done = elastic_train("checkpoints", "export", str(run_dir), str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    size = cli._human_bytes(out.stat().st_size)
    assert done.stdout == (f"exported step 20 of {run_dir} (3 tensors, {size}, model sha256 "
                           f"{newest.model_digest}) to {out}\n")
    assert model_digest(load_file(out)) == newest.model_digest

    done = elastic_train("checkpoints", "export", "runs/job", "model.pt", "--step", "10",
                         cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    digest = model_digest(weights)
    size = cli._human_bytes((tmp_path / "model.pt").stat().st_size)
    assert done.stdout == (f"exported step 10 of runs/job (3 tensors, {size}, model sha256 "
                           f"{digest}) to model.pt\n")


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--step", "15"], 1, "no checkpoint of step 15 under {ckpts}; the steps there are 20, 10"),
    ([], 2, "cannot write model weights to {out}: it has suffix '.ckpt'; use one of "
            ".safetensors, .pt, .pth, .bin"),
])
def test_export_errors_are_one_line(run_dir: Path, tmp_path: Path, args: list[str], code: int,
                                    message: str) -> None:
    out = tmp_path / ("model.pt" if args else "model.ckpt")
    done = elastic_train("checkpoints", "export", str(run_dir), str(out), *args, cwd=tmp_path)
    assert done.returncode == code
    assert done.stdout == ""
    expected = message.format(ckpts=run_dir / "checkpoints", out=out)
    assert done.stderr == f"elastic-train: error: {expected}\n"
    assert not out.exists()


def test_list_whose_reader_stops_after_one_line_ends_quietly(tmp_path: Path) -> None:
    # What `elastic-train checkpoints list RUN_DIR | head -1` does to it. The pipe holds one
    # page (4 KiB) and the listing is 30 KiB: `list` is still printing when the reader
    # closes, whatever the timing.
    run_dir = tmp_path / "run"
    store = CheckpointStore(run_dir / "checkpoints")
    for step in range(1, 281):
        _write(store, step, {"w": torch.tensor([float(step)])})
    reader, writer = os.pipe()
    fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen([sys.executable, "-m", "elastic_train", "checkpoints", "list",
                             str(run_dir)], stdout=writer, stderr=subprocess.PIPE,
                            env=user_env())
    os.close(writer)
    first = b""
    try:
        while not first.endswith(b"\n"):
            chunk = os.read(reader, 1)
            assert chunk, "the listing ended before its first line"
            first += chunk
    finally:
        os.close(reader)
    _, stderr = proc.communicate(timeout=60)
    assert first.decode().startswith("    STEP  WORLD  TIME (UTC)")
    assert stderr.decode() == ""
    assert proc.returncode == BROKEN_PIPE_EXIT


def test_output_to_a_closed_pipe_at_exit_ends_quietly(tmp_path: Path) -> None:
    # The reader is gone before anything is written: the buffered line fails only at the
    # final flush.
    reader, writer = os.pipe()
    os.close(reader)
    try:
        done = subprocess.run([sys.executable, "-m", "elastic_train", "--version"],
                              stdout=writer, stderr=subprocess.PIPE, text=True, timeout=60,
                              env=user_env())
    finally:
        os.close(writer)
    assert done.stderr == ""
    assert done.returncode == BROKEN_PIPE_EXIT
