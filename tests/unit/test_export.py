"""Unit tests of exporting model weights: both file formats loaded back into a fresh model,
checkpoint choice, and files left whole (or untouched) when an export fails."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from elastic_train.checkpoint.export import ExportResult, export_checkpoint, write_weights
from elastic_train.checkpoint.storage import (
    PAYLOAD,
    CheckpointInfo,
    CheckpointStore,
    model_digest,
    tensor_shapes,
)
from elastic_train.errors import CheckpointCorruptError, CheckpointError, ConfigError

REPO = Path(__file__).resolve().parents[2]


# --- helpers ------------------------------------------------------------------------------


def _model(seed: int) -> torch.nn.Sequential:
    """A tiny language model whose output layer is tied to its embedding (as in a GPT)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.LayerNorm(6),
                                torch.nn.Linear(6, 11))
    model[2].weight = model[0].weight
    return model


def _write(store: CheckpointStore, step: int, model: torch.nn.Module) -> CheckpointInfo:
    state = model.state_dict()
    payload = {"model": state, "optimizer": {"state": {}, "param_groups": []},
               "trainer": {"step": step}}
    return store.write(step, payload, {"world_size": 2, "model_digest": model_digest(state),
                                       "model_shapes": tensor_shapes(state), "task": "unit"})


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    """Checkpoints 10 and 20 of the tied model, with different weights."""
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    _write(store, 10, _model(seed=1))
    _write(store, 20, _model(seed=2))
    return store


def _corrupt(info: CheckpointInfo) -> None:
    path = info.path / PAYLOAD
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


# --- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".pth", ".bin"])
def test_export_loads_into_a_fresh_model(store: CheckpointStore, tmp_path: Path,
                                         suffix: str) -> None:
    original = _model(seed=2).state_dict()
    out = tmp_path / "export" / f"model{suffix}"
    result = export_checkpoint(store, out)
    newest = store.list()[0]
    assert result == ExportResult(step=20, path=out, tensors=5, bytes=out.stat().st_size,
                                  model_digest=model_digest(original))
    assert result.model_digest == newest.model_digest  # what `checkpoints list` shows
    weights = load_file(out) if suffix == ".safetensors" else \
        torch.load(out, weights_only=True)
    assert type(weights) is dict
    assert sorted(weights) == sorted(original) == ["0.weight", "1.bias", "1.weight", "2.bias",
                                                   "2.weight"]
    assert all(t.device.type == "cpu" for t in weights.values())
    fresh = _model(seed=99)
    assert model_digest(fresh.state_dict()) != result.model_digest
    fresh.load_state_dict(weights, strict=True)
    assert model_digest(fresh.state_dict()) == result.model_digest
    assert fresh[2].weight is fresh[0].weight  # still tied
    assert sorted(os.listdir(out.parent)) == [out.name]  # no temp file left


def test_export_of_a_chosen_step(store: CheckpointStore, tmp_path: Path) -> None:
    result = export_checkpoint(store, tmp_path / "ten.pt", step=10)
    assert result.step == 10
    assert result.model_digest == model_digest(_model(seed=1).state_dict())
    assert model_digest(torch.load(tmp_path / "ten.pt", weights_only=True)) == \
        result.model_digest


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_write_weights_of_views_and_shared_storage(tmp_path: Path, suffix: str) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"base": base, "transposed": base.t(), "row": base[1], "same": base,
             "half": torch.ones(2, 2, dtype=torch.bfloat16), "count": torch.tensor(7),
             "empty": torch.zeros(0)}
    out = write_weights(state, tmp_path / f"w{suffix}")
    assert out == tmp_path / f"w{suffix}"
    loaded = load_file(out) if suffix == ".safetensors" else \
        torch.load(out, weights_only=True)
    assert sorted(loaded) == sorted(state)
    assert model_digest(loaded) == model_digest(state)
    assert model_digest(state) == model_digest({k: v.clone() for k, v in state.items()})


def test_files_get_the_same_mode_in_both_formats(tmp_path: Path) -> None:
    state = {"w": torch.ones(3)}
    pt = write_weights(state, tmp_path / "a.pt")
    st = write_weights(state, tmp_path / "a.safetensors")
    assert pt.stat().st_mode == st.stat().st_mode


def test_write_weights_replaces_an_existing_file(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    write_weights({"w": torch.zeros(4)}, out)
    write_weights({"w": torch.ones(4)}, out)
    assert torch.equal(load_file(out)["w"], torch.ones(4))
    assert os.listdir(tmp_path) == ["model.safetensors"]


# --- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "given"), [("model.ckpt", "suffix '.ckpt'"),
                                             ("model", "no suffix")])
def test_unknown_suffix_is_refused(tmp_path: Path, name: str, given: str) -> None:
    with pytest.raises(ConfigError) as caught:
        write_weights({"w": torch.ones(1)}, tmp_path / name)
    assert str(caught.value) == (f"cannot write model weights to {tmp_path / name}: it has "
                                 f"{given}; use one of .safetensors, .pt, .pth, .bin")
    assert os.listdir(tmp_path) == []


def test_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.pt").mkdir()
    with pytest.raises(ConfigError) as caught:
        write_weights({"w": torch.ones(1)}, tmp_path / "model.pt")
    assert str(caught.value) == (f"cannot write model weights to {tmp_path / 'model.pt'}: it "
                                 "is a directory; give a file name")


def test_a_step_that_is_not_there(store: CheckpointStore, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as caught:
        export_checkpoint(store, tmp_path / "model.pt", step=15)
    assert str(caught.value) == (f"no checkpoint of step 15 under {store.root}; the steps "
                                 "there are 20, 10")
    assert not (tmp_path / "model.pt").exists()


def test_no_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "run" / "checkpoints")
    with pytest.raises(CheckpointError) as caught:
        export_checkpoint(store, tmp_path / "model.pt")
    assert str(caught.value) == (f"no checkpoints under {store.root}: nothing to export; "
                                 "pass the run directory of a job that saved one")


def test_a_corrupt_newest_checkpoint_is_skipped_and_left_alone(store: CheckpointStore,
                                                               tmp_path: Path) -> None:
    _corrupt(store.list()[0])
    before = _tree(store.root)
    result = export_checkpoint(store, tmp_path / "model.safetensors")
    assert result.step == 10
    assert result.model_digest == model_digest(_model(seed=1).state_dict())
    assert model_digest(load_file(tmp_path / "model.safetensors")) == result.model_digest
    assert _tree(store.root) == before


def test_a_corrupt_chosen_step_leaves_the_out_file_as_it_was(store: CheckpointStore,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    export_checkpoint(store, out, step=10)
    good = out.read_bytes()
    newest = store.list()[0]
    _corrupt(newest)
    with pytest.raises(CheckpointCorruptError) as caught:
        export_checkpoint(store, out, step=20)
    assert str(caught.value) == (f"checkpoint {newest.path} is corrupt (state.pt fails its "
                                 "sha256 checksum): pass another --step, or none for the "
                                 "newest valid checkpoint")
    assert out.read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "run"]


def test_every_checkpoint_corrupt(store: CheckpointStore, tmp_path: Path) -> None:
    for info in store.list():
        _corrupt(info)
    with pytest.raises(CheckpointCorruptError) as caught:
        export_checkpoint(store, tmp_path / "model.pt")
    assert str(caught.value) == (
        f"none of the 2 checkpoints under {store.root} is valid (step-00000020: state.pt "
        "fails its sha256 checksum; step-00000010: state.pt fails its sha256 checksum); "
        "nothing was exported")


def test_a_payload_without_model(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    info = store.write(5, {"weights": {"w": torch.ones(2)}}, {"world_size": 1})
    out = tmp_path / "model.pt"
    out.write_bytes(b"a good file")
    with pytest.raises(CheckpointError) as caught:
        export_checkpoint(store, out)
    assert str(caught.value) == (f"checkpoint {info.path} holds no model weights (no 'model' "
                                 "entry): it was not written by an elastic_train job")
    assert out.read_bytes() == b"a good file"


def test_a_state_entry_that_is_not_a_tensor(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as caught:
        write_weights({"w": torch.ones(1), "extra": {"a": 1}}, tmp_path / "m.pt")
    assert str(caught.value) == ("model state entry 'extra' is a dict, not a tensor: only "
                                 "tensors can be exported")


def test_an_unwritable_place(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "file" / "model.pt"
    with pytest.raises(CheckpointError) as caught:
        write_weights({"w": torch.ones(1)}, out)
    assert str(caught.value) == (f"could not write model weights to {out} ([Errno 17] File "
                                 f"exists: '{tmp_path / 'file'}'): free space or fix "
                                 "permissions; no file was written or replaced")


# A real write failing half way: the file size limit (RLIMIT_FSIZE) is below the weights'
# size, so the write fails with EFBIG after the first bytes, as on a full disk.
FAILING_WRITE = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    import torch
    from elastic_train.checkpoint.export import write_weights
    from elastic_train.errors import CheckpointError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
    try:
        write_weights({"w": torch.ones(256, 1024)}, Path(sys.argv[1]))
    except CheckpointError as exc:
        print(exc)
""")


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_write_failing_half_way_leaves_the_old_file(tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"model{suffix}"
    write_weights({"w": torch.zeros(8)}, out)
    good = out.read_bytes()
    env: dict[str, Any] = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", FAILING_WRITE, str(out)], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith(f"could not write model weights to {out} ("), line
    assert "File too large" in line or "os error 27" in line, line
    assert line.endswith("): free space or fix permissions; no file was written or replaced")
    assert out.read_bytes() == good
    assert os.listdir(tmp_path) == [out.name]
