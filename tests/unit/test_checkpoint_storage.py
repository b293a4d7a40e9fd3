"""Unit tests of on-disk checkpoints: format, integrity checks, crash safety and retention.

Single process except the crash simulations, which fork one short-lived child each.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.checkpoint.storage import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PAYLOAD,
    CheckpointInfo,
    CheckpointStore,
    check_compatible,
    model_digest,
    step_dirname,
    tensor_shapes,
)
from elastic_train.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
)
from tests.state_equality import assert_same_state

STAGES = ("tmp-created", "payload-written", "payload-synced", "manifest-synced", "renamed")


# --- helpers ------------------------------------------------------------------------------


def _model(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "layer.weight": torch.linspace(-1, 1, 12).reshape(3, 4) * scale,
        "layer.bias": torch.tensor([0.5, -0.25, 1e-8]) * scale,
        "emb": (torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale).to(torch.bfloat16),
        "steps": torch.tensor([1, 2, 3], dtype=torch.int64),
    }


def _payload(scale: float = 1.0) -> dict[str, Any]:
    return {
        "model": _model(scale),
        "optimizer": {"state": {0: {"exp_avg": torch.full((3, 4), 0.125 * scale),
                                    "step": torch.tensor(7.0)}},
                      "param_groups": [{"lr": 0.01, "params": [0, 1], "name": "all"}]},
        "trainer": {"step": 7, "samples_seen": 112},
        "note": "hello",
    }


def _meta(payload: dict[str, Any], world_size: int = 4) -> dict[str, Any]:
    model = payload["model"]
    return {"world_size": world_size, "model_digest": model_digest(model),
            "model_shapes": tensor_shapes(model), "task": "unit"}


def _write(store: CheckpointStore, step: int, scale: float = 1.0, **kwargs: Any
           ) -> CheckpointInfo:
    payload = _payload(scale)
    return store.write(step, payload, _meta(payload), **kwargs)


def _info(store: CheckpointStore, step: int) -> CheckpointInfo:
    (info,) = [i for i in store.list() if i.step == step]
    return info


def _problem(store: CheckpointStore, step: int) -> str:
    """Verify checkpoint ``step`` expecting it invalid; return the problem."""
    infos = store.list()                      # listing still works
    assert step in [i.step for i in infos]
    verdict = store.verify(_info(store, step))
    assert not verdict.valid
    assert verdict.problem
    return verdict.problem


def _newest_valid(store: CheckpointStore) -> int | None:
    for info in store.list():
        if store.verify(info).valid:
            return info.step
    return None


def _reseal(path: Path, **changes: Any) -> None:
    """Edit a manifest and fix its checksum (what a newer writer would produce)."""
    manifest = json.loads((path / MANIFEST).read_text())
    manifest.update(changes)
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    manifest["manifest_sha256"] = hashlib.sha256(
        json.dumps(body, sort_keys=True).encode()).hexdigest()
    (path / MANIFEST).write_text(json.dumps(manifest))


# --- round trip and manifest --------------------------------------------------------------


def test_write_list_verify_load_round_trip_bitwise(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    assert store.list() == []
    payload = _payload()
    before = time.time()
    written = store.write(5, payload, _meta(payload))
    after = time.time()
    assert written.path == tmp_path / "checkpoints" / "step-00000005"
    (info,) = store.list()
    assert (info.step, info.path, info.problem) == (5, written.path, None)
    assert info.manifest == written.manifest
    assert before <= info.time <= after
    verdict = store.verify(info)
    assert verdict.valid and verdict.problem is None
    assert verdict.checked_bytes == (info.path / PAYLOAD).stat().st_size == info.size_bytes
    loaded = store.load(info)
    assert_same_state(loaded, payload)
    assert model_digest(loaded["model"]) == info.model_digest == model_digest(payload["model"])
    assert sorted(os.listdir(info.path)) == [MANIFEST, PAYLOAD]
    assert store.leftovers() == []


def test_manifest_fields(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    payload = _payload()
    info = store.write(12, payload, _meta(payload, world_size=3))
    manifest = json.loads((info.path / MANIFEST).read_text())
    assert manifest["format"] == FORMAT == "elastic_train.checkpoint"
    assert manifest["format_version"] == FORMAT_VERSION == 1
    assert manifest["step"] == 12
    assert isinstance(manifest["time"], float)
    assert manifest["world_size"] == 3
    assert info.world_size == 3
    assert manifest["task"] == "unit"
    data = (info.path / PAYLOAD).read_bytes()
    assert manifest["files"] == {PAYLOAD: {"bytes": len(data),
                                           "sha256": hashlib.sha256(data).hexdigest()}}
    assert manifest["model_digest"] == model_digest(payload["model"])
    assert manifest["model_shapes"] == {
        "layer.weight": ["torch.float32", [3, 4]], "layer.bias": ["torch.float32", [3]],
        "emb": ["torch.bfloat16", [2, 3]], "steps": ["torch.int64", [3]]}
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    assert manifest["manifest_sha256"] == hashlib.sha256(
        json.dumps(body, sort_keys=True).encode()).hexdigest()


def test_list_is_newest_first_and_ignores_other_names(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in (3, 100, 20):
        _write(store, step)
    (tmp_path / "step-12").mkdir()                       # too few digits: not ours
    (tmp_path / "step-00000077").write_text("a file")    # not a directory
    (tmp_path / "notes").mkdir()
    assert [i.step for i in store.list()] == [100, 20, 3]
    assert CheckpointStore(tmp_path / "absent").list() == []


# --- model_digest -------------------------------------------------------------------------


def test_model_digest_equal_weights_equal_digest() -> None:
    a, b = _model(), _model()
    assert model_digest(a) == model_digest(b)
    assert model_digest(a) == model_digest(dict(reversed(list(a.items()))))  # order-free
    # Non-contiguous or gradient-tracking tensors digest by value.
    c = dict(a)
    c["layer.weight"] = a["layer.weight"].t().contiguous().t().requires_grad_()
    assert model_digest(c) == model_digest(a)


@pytest.mark.parametrize("name", ["layer.weight", "layer.bias", "emb", "steps"])
def test_model_digest_sees_a_one_ulp_change(name: str) -> None:
    base = _model()
    changed = {k: v.clone() for k, v in base.items()}
    flat = changed[name].view(-1)
    if flat.dtype.is_floating_point:
        flat[1] = torch.nextafter(flat[1], torch.tensor(float("inf"), dtype=flat.dtype))
    else:
        flat[1] += 1
    assert not torch.equal(changed[name], base[name])
    assert model_digest(changed) != model_digest(base)


def test_model_digest_sees_names_dtypes_and_shapes() -> None:
    base = {"w": torch.zeros(2, 3)}
    assert model_digest(base) != model_digest({"v": torch.zeros(2, 3)})
    assert model_digest(base) != model_digest({"w": torch.zeros(3, 2)})
    assert model_digest(base) != model_digest({"w": torch.zeros(2, 3, dtype=torch.int32)})
    assert model_digest(base) != model_digest({"w": torch.zeros(2, 3), "x": torch.zeros(0)})
    bf = {"w": torch.ones(4, dtype=torch.bfloat16)}
    assert model_digest(bf) != model_digest({"w": torch.ones(4, dtype=torch.float16)})
    assert model_digest({"w": torch.tensor(0.0)}) != model_digest({"w": torch.tensor(-0.0)})


# --- corruption ---------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    store = CheckpointStore(tmp_path / "checkpoints")
    _write(store, 1)
    _write(store, 2, scale=2.0)
    return store


def test_a_flipped_byte_in_the_payload(store: CheckpointStore) -> None:
    path = _info(store, 2).path / PAYLOAD
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert _problem(store, 2) == "state.pt fails its sha256 checksum"
    assert _newest_valid(store) == 1


def test_a_truncated_payload(store: CheckpointStore) -> None:
    path = _info(store, 2).path / PAYLOAD
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    assert _problem(store, 2) == \
        f"state.pt has {size - 100} bytes, the manifest says {size}"
    assert _newest_valid(store) == 1


def test_a_deleted_payload(store: CheckpointStore) -> None:
    (_info(store, 2).path / PAYLOAD).unlink()
    assert _problem(store, 2) == "state.pt is missing"
    assert _newest_valid(store) == 1


def test_a_deleted_manifest(store: CheckpointStore) -> None:
    (_info(store, 2).path / MANIFEST).unlink()
    info = _info(store, 2)
    assert info.manifest is None
    assert info.world_size is None and info.model_digest is None
    assert info.size_bytes == (info.path / PAYLOAD).stat().st_size
    assert _problem(store, 2) == "manifest.json is missing"
    assert _newest_valid(store) == 1


def test_an_unreadable_manifest(store: CheckpointStore) -> None:
    (_info(store, 2).path / MANIFEST).write_text('{"format": "elastic_tr')
    assert _problem(store, 2).startswith("manifest.json is unreadable (")


@pytest.mark.parametrize(("key", "value"), [("step", 3), ("world_size", 8),
                                            ("model_digest", "0" * 64)])
def test_an_edited_manifest(store: CheckpointStore, key: str, value: Any) -> None:
    path = _info(store, 2).path / MANIFEST
    manifest = json.loads(path.read_text())
    manifest[key] = value
    path.write_text(json.dumps(manifest))
    assert _problem(store, 2) == "manifest.json was edited (its checksum does not match)"
    assert _newest_valid(store) == 1


def test_a_manifest_of_another_format(store: CheckpointStore) -> None:
    _reseal(_info(store, 2).path, format="somebody.else")
    assert _problem(store, 2) == "manifest.json is not an elastic_train manifest"
    (_info(store, 2).path / MANIFEST).write_text("[1, 2, 3]")
    assert _problem(store, 2) == "manifest.json is not an elastic_train manifest"


def test_a_future_format_version(store: CheckpointStore) -> None:
    _reseal(_info(store, 2).path, format_version=FORMAT_VERSION + 1)
    info = _info(store, 2)
    assert info.manifest is not None                   # readable, but not for us
    assert _problem(store, 2) == (f"format version {FORMAT_VERSION + 1} is not "
                                  f"{FORMAT_VERSION} (written by another elastic_train version)")
    assert _newest_valid(store) == 1


def test_a_directory_whose_manifest_names_another_step(store: CheckpointStore) -> None:
    shutil.copytree(_info(store, 2).path, store.root / step_dirname(9))
    assert _problem(store, 9) == "manifest.json says step 2, the directory says 9"
    assert _newest_valid(store) == 2


# --- safe loading -------------------------------------------------------------------------


def _make_marker(path: str) -> None:
    Path(path).write_text("code ran")


class Exploit:
    """Unpickling this runs ``_make_marker`` — unless the loader refuses."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_make_marker, (self.marker,))


class PlainObject:
    def __init__(self) -> None:
        self.value = 3


def test_loading_pickled_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    marker = tmp_path / "marker"
    payload = {**_payload(), "extra": Exploit(marker)}
    info = store.write(3, payload, _meta(payload))
    assert not marker.exists()                    # saving does not run it
    assert store.verify(info).valid               # the manifest matches: only load can catch it
    refused = r"holds a pickled tests.unit.test_checkpoint_storage._make_marker that safe "
    with pytest.raises(UnsafeCheckpointError,
                       match=refused + r"loading refuses to run; it was not loaded"):
        store.load(info)
    assert not marker.exists()
    # The payload really is an exploit: an unsafe load would have run it.
    torch.load(info.path / PAYLOAD, weights_only=False)
    assert marker.read_text() == "code ran"


def test_loading_a_pickled_user_object_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    payload = {**_payload(), "obj": PlainObject()}
    info = store.write(4, payload, _meta(payload))
    assert store.verify(info).valid
    with pytest.raises(UnsafeCheckpointError) as caught:
        store.load(info)
    assert str(info.path) in str(caught.value)
    assert "\n" not in str(caught.value)


def test_load_of_a_truncated_payload_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    info = _write(store, 1)
    path = info.path / PAYLOAD
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    with pytest.raises(CheckpointCorruptError, match=f"checkpoint {info.path} cannot be read"):
        store.load(info)


def test_load_of_a_missing_payload_names_shared_storage(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    info = _write(store, 1)
    (info.path / PAYLOAD).unlink()
    with pytest.raises(CheckpointError, match="not readable on this host: put the run "
                       "directory on storage that every node mounts"):
        store.load(info)


def test_load_of_a_garbage_payload_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    info = _write(store, 1)
    (info.path / PAYLOAD).write_bytes(b"x" * 100)
    with pytest.raises(CheckpointCorruptError):
        store.load(info)


# --- crash safety -------------------------------------------------------------------------


def _write_and_die(root: Path, stage: str) -> None:
    def hook(current: str) -> None:
        if current == stage:
            os._exit(1)

    _write(CheckpointStore(root), 2, scale=2.0, fault_hook=hook)
    os._exit(0)                                   # the hook never fired


@pytest.mark.parametrize("stage", STAGES)
def test_a_crash_at_any_stage_leaves_the_old_checkpoint_or_the_complete_new_one(
        tmp_path: Path, stage: str) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    _write(store, 1)
    child = multiprocessing.get_context("fork").Process(target=_write_and_die,
                                                       args=(store.root, stage))
    child.start()
    child.join(60)
    assert child.exitcode == 1, "the child did not crash where it was told to"

    leftovers = store.leftovers()
    if stage == "renamed":
        assert _newest_valid(store) == 2
        assert [i.step for i in store.list()] == [2, 1]
        assert leftovers == []
        assert_same_state(store.load(_info(store, 2)), _payload(2.0))
    else:
        assert [i.step for i in store.list()] == [1]
        assert _newest_valid(store) == 1
        assert len(leftovers) == 1
        assert leftovers[0].name.startswith(".tmp-step-00000002-")
    assert_same_state(store.load(_info(store, 1)), _payload())

    # Someone else's files and a set-aside checkpoint are not leftovers.
    (store.root / "README").write_text("mine")
    (store.root / "step-00000001.corrupt-1-ab").mkdir()
    assert store.remove_leftovers() == leftovers
    assert store.leftovers() == []
    assert sorted(p.name for p in store.root.iterdir()) == sorted(
        ["README", "step-00000001.corrupt-1-ab", "step-00000001"]
        + (["step-00000002"] if stage == "renamed" else []))
    assert _newest_valid(store) == (2 if stage == "renamed" else 1)


def test_remove_leftovers_deletes_temp_and_trash_dirs_only(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _write(store, 1)
    tmp = tmp_path / ".tmp-step-00000002-1-abcd"
    trash = tmp_path / ".trash-step-00000000-ef01"
    for path in (tmp, trash):
        path.mkdir()
        (path / PAYLOAD).write_bytes(b"x")
    assert sorted(store.leftovers()) == sorted([tmp, trash])
    assert sorted(store.remove_leftovers()) == sorted([tmp, trash])
    assert not tmp.exists() and not trash.exists()
    assert _newest_valid(store) == 1
    assert CheckpointStore(tmp_path / "absent").leftovers() == []


class Boom(Exception):
    pass


@pytest.mark.parametrize("stage", STAGES)
def test_a_failing_write_removes_its_temp_dir_and_keeps_older_checkpoints(
        tmp_path: Path, stage: str) -> None:
    store = CheckpointStore(tmp_path)
    _write(store, 1)

    def hook(current: str) -> None:
        if current == stage:
            raise Boom(stage)

    with pytest.raises(Boom):
        _write(store, 2, scale=2.0, fault_hook=hook)
    assert store.leftovers() == []
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    assert store.verify(_info(store, 1)).valid
    assert_same_state(store.load(_info(store, 1)), _payload())
    steps = [i.step for i in store.list()]
    assert steps == ([2, 1] if stage == "renamed" else [1])


def test_writing_over_a_corrupt_checkpoint_sets_it_aside(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _write(store, 1)
    old = _write(store, 2)
    data = bytearray((old.path / PAYLOAD).read_bytes())
    data[100] ^= 0xFF
    (old.path / PAYLOAD).write_bytes(bytes(data))
    old_manifest = (old.path / MANIFEST).read_bytes()
    assert not store.verify(_info(store, 2)).valid

    new = _write(store, 2, scale=3.0)
    assert store.verify(_info(store, 2)).valid
    assert_same_state(store.load(new), _payload(3.0))
    assert [i.step for i in store.list()] == [2, 1]
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("step-00000002.corrupt-")]
    assert (aside / PAYLOAD).read_bytes() == bytes(data)      # the old bytes are kept
    assert (aside / MANIFEST).read_bytes() == old_manifest
    assert store.leftovers() == []                            # and not taken for debris
    store.remove_leftovers()
    assert aside.exists()


def test_writing_over_a_directory_without_manifest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    (tmp_path / step_dirname(4)).mkdir()
    (tmp_path / step_dirname(4) / PAYLOAD).write_bytes(b"half")
    _write(store, 4)
    assert _newest_valid(store) == 4
    (aside,) = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert (aside / PAYLOAD).read_bytes() == b"half"


# --- retention ----------------------------------------------------------------------------


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in range(1, 7):
        _write(store, step)
    deleted = store.apply_retention(3, newest=6)
    assert sorted(deleted) == sorted(tmp_path / step_dirname(s) for s in (1, 2, 3))
    assert [i.step for i in store.list()] == [6, 5, 4]
    assert store.leftovers() == []                 # the trash was emptied
    assert store.apply_retention(3, newest=6) == []
    assert store.apply_retention(1, newest=6) == [tmp_path / step_dirname(s) for s in (5, 4)]
    assert [i.step for i in store.list()] == [6]
    assert _newest_valid(store) == 6


def test_retention_does_not_count_or_delete_broken_manifests(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in range(1, 6):
        _write(store, step)
    (tmp_path / step_dirname(5) / MANIFEST).write_text("garbage")
    (tmp_path / step_dirname(3) / MANIFEST).unlink()
    deleted = store.apply_retention(2, newest=5)
    assert deleted == [tmp_path / step_dirname(1)]
    assert [i.step for i in store.list()] == [5, 4, 3, 2]
    assert _newest_valid(store) == 4


def test_retention_never_deletes_the_newest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for step in (10, 20):
        _write(store, step)
    (tmp_path / step_dirname(30)).mkdir()          # a broken newer one
    store.apply_retention(1, newest=20)
    assert [i.step for i in store.list()] == [30, 20]
    assert _newest_valid(store) == 20


@pytest.mark.parametrize("keep", [0, -1])
def test_retention_refuses_to_keep_nothing(tmp_path: Path, keep: int) -> None:
    store = CheckpointStore(tmp_path)
    _write(store, 1)
    with pytest.raises(ValueError, match="keep must be at least 1"):
        store.apply_retention(keep, newest=1)
    assert [i.step for i in store.list()] == [1]


def test_retention_keeps_the_newest_checkpoint_that_verifies(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    # Step 9's payload rotted on disk; restore skipped it and resumed from an older
    # checkpoint, and the run has just saved step 7 (say under --checkpoint-interval).
    _write(store, 9)
    _write(store, 7)
    path = tmp_path / step_dirname(9) / PAYLOAD
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert _newest_valid(store) == 7
    store.apply_retention(1, newest=7)
    assert _newest_valid(store) == 7


# --- compatibility ------------------------------------------------------------------------


def test_check_compatible_passes_for_equal_shapes(tmp_path: Path) -> None:
    info = _write(CheckpointStore(tmp_path), 1)
    assert check_compatible(info, tensor_shapes(_model())) is None
    # Values do not matter, only names, dtypes and shapes.
    assert check_compatible(info, tensor_shapes(_model(5.0))) is None


def _mismatch(tmp_path: Path, ours: dict[str, torch.Tensor]) -> str:
    info = _write(CheckpointStore(tmp_path), 1)
    with pytest.raises(CheckpointMismatchError) as caught:
        check_compatible(info, tensor_shapes(ours))
    message = str(caught.value)
    assert message.startswith(f"checkpoint {info.path} is for another model: ")
    assert "the checkpoint was left untouched" in message
    assert "\n" not in message
    return message


def test_check_compatible_names_a_shape_mismatch(tmp_path: Path) -> None:
    ours = {**_model(), "layer.weight": torch.zeros(4, 4)}
    assert "tensor 'layer.weight' is torch.float32[3, 4] there and torch.float32[4, 4] here" \
        in _mismatch(tmp_path, ours)


def test_check_compatible_names_a_dtype_mismatch(tmp_path: Path) -> None:
    ours = {**_model(), "emb": torch.zeros(2, 3)}
    assert "tensor 'emb' is torch.bfloat16[2, 3] there and torch.float32[2, 3] here" \
        in _mismatch(tmp_path, ours)


def test_check_compatible_names_a_missing_tensor(tmp_path: Path) -> None:
    ours = {**_model(), "head.weight": torch.zeros(2)}
    assert "it has no tensor 'head.weight'" in _mismatch(tmp_path, ours)


def test_check_compatible_names_an_extra_tensor(tmp_path: Path) -> None:
    ours = {k: v for k, v in _model().items() if k != "layer.bias"}
    assert "it has tensor 'layer.bias' that this model lacks" in _mismatch(tmp_path, ours)
