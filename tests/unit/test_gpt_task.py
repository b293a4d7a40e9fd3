"""Unit tests of the built-in GPT task and its byte corpus (single process, CPU, ~5 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_train.errors import ConfigError
from elastic_train.tasks import gpt as gpt_module
from elastic_train.tasks.base import Task, TaskContext, collate
from elastic_train.tasks.corpus import (
    ByteWindowDataset,
    default_corpus_root,
    load_corpus_bytes,
)
from elastic_train.tasks.gpt import GPT, PRESETS, GPTTask, count_parameters, make_task


def _task(**options: object) -> GPTTask:
    return make_task(TaskContext(options=options))  # type: ignore[arg-type]


# --- presets and the model --------------------------------------------------------------

PARAM_RANGES = {
    "tiny": (100_000, 300_000),
    "small": (700_000, 1_300_000),
    "medium": (10_000_000, 12_000_000),
    "large": (45_000_000, 55_000_000),
}


@pytest.mark.parametrize("preset", sorted(PARAM_RANGES))
def test_preset_parameter_counts_lie_in_documented_ranges(preset: str) -> None:
    lo, hi = PARAM_RANGES[preset]
    with torch.device("meta"):
        model = GPT(PRESETS[preset])
    assert lo <= count_parameters(model) <= hi


def test_lm_head_is_tied_to_token_embedding() -> None:
    model = GPT(PRESETS["tiny"])
    assert model.lm_head.weight is model.tok_emb.weight


def test_model_is_deterministic_given_the_seed() -> None:
    task = _task(preset="tiny")
    torch.manual_seed(0)
    a = task.build_model().state_dict()
    torch.manual_seed(0)
    b = task.build_model().state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    torch.manual_seed(1)
    c = task.build_model().state_dict()
    assert not torch.equal(a["tok_emb.weight"], c["tok_emb.weight"])


def test_forward_gives_logits_and_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]).eval()
    idx = torch.randint(0, 256, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 256)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    # A later token must not change the logits of earlier positions.
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, PRESETS["tiny"].seq_len + 1, dtype=torch.long))


def test_optimizer_decays_only_matrices() -> None:
    task = _task(preset="tiny", weight_decay="0.05")
    model = task.build_model()
    opt = task.build_optimizer(model, 1e-3)
    assert isinstance(opt, torch.optim.AdamW)
    by_decay = {g["weight_decay"]: g["params"] for g in opt.param_groups}
    assert set(by_decay) == {0.05, 0.0}
    assert all(p.dim() >= 2 for p in by_decay[0.05])
    assert all(p.dim() < 2 for p in by_decay[0.0])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == count_parameters(model)
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)


# --- the corpus and the dataset ---------------------------------------------------------


def test_dataset_windows_are_shifted_non_overlapping_slices() -> None:
    data = bytes(range(256)) * 4
    seq_len = 7
    ds = ByteWindowDataset(data, seq_len)
    assert len(ds) == (len(data) - 1) // seq_len
    for i in (0, 1, 5, len(ds) - 1):
        item = ds[i]
        assert item.dtype == torch.int64
        assert item.shape == (seq_len + 1,)
        assert item.tolist() == list(data[i * seq_len : i * seq_len + seq_len + 1])
        # The target (item[1:]) is the input (item[:-1]) shifted by one byte.
        assert item[1:].tolist() == list(data[i * seq_len + 1 : i * seq_len + seq_len + 1])
    # Consecutive windows share exactly one byte: the next window's first input.
    assert ds[0][-1] == ds[1][0]
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_task_dataset_and_collate_split_into_inputs_and_targets() -> None:
    task = _task(preset="tiny", corpus_max_bytes=10_000)
    ds = task.build_dataset()
    batch = collate(task, [ds[0], ds[3]])
    assert batch.shape == (2, PRESETS["tiny"].seq_len + 1)
    assert torch.equal(batch[1], ds[3])
    assert task.loss(task.build_model(), batch).dim() == 0


def test_default_corpus_is_deterministic_and_non_empty() -> None:
    assert default_corpus_root().is_dir()
    a = load_corpus_bytes(None, 200_000)
    b = load_corpus_bytes(None, 200_000)
    assert a == b
    assert len(a) == 200_000


def test_user_directory_takes_text_files_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    files = {
        "b.txt": b"BBBB\n",
        "a.py": b"print('a')\n",
        "sub/c.md": b"# c\n",
        "sub.txt": b"sub dot txt\n",  # "sub.txt" < "sub/c.md": '.' sorts before '/'
        "image.png": b"\x89PNG not text",
        "noext": b"no suffix",
        ".hidden.txt": b"hidden",
        ".git/config.txt": b"git internals",
    }
    for rel, content in files.items():
        (tmp_path / rel).write_bytes(content)
    got = load_corpus_bytes(tmp_path, 1_000_000)
    assert got == files["a.py"] + files["b.txt"] + files["sub.txt"] + files["sub/c.md"]
    # Truncated to max_bytes, from the front.
    assert load_corpus_bytes(tmp_path, 5) == got[:5]


def test_corpus_is_read_once_per_task(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = gpt_module.load_corpus_bytes

    def counting(*args: object, **kwargs: object) -> bytes:
        calls.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gpt_module, "load_corpus_bytes", counting)
    task = _task(preset="tiny", corpus_max_bytes=10_000)
    assert calls == []  # the factory reads no corpus
    first = task.build_dataset()
    second = task.build_dataset()
    assert len(calls) == 1
    assert len(first) == len(second)
    assert torch.equal(first[2], second[2])


def test_missing_corpus_path_fails_in_the_factory(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such.txt"
    with pytest.raises(ConfigError) as info:
        _task(corpus=str(missing))
    assert str(missing) in str(info.value)
    assert "--task-opt corpus=" in str(info.value)
    with pytest.raises(ConfigError, match="--task-opt corpus="):
        load_corpus_bytes(missing, 1000)


def test_too_small_corpus_names_path_and_sizes(tmp_path: Path) -> None:
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 10)
    task = _task(preset="tiny", corpus=str(small))
    with pytest.raises(ConfigError) as info:
        task.build_dataset()
    message = str(info.value)
    assert str(small) in message
    assert "10 bytes" in message
    assert str(2 * PRESETS["tiny"].seq_len + 1) in message


# --- options ----------------------------------------------------------------------------


def test_options_from_the_command_line_are_converted() -> None:
    task = _task(
        preset="tiny", seq_len="32", n_layer="1", n_head="2", n_embd="32", dropout="0.1"
    )
    assert isinstance(task, Task)
    cfg = task.config
    assert (cfg.seq_len, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout) == (32, 1, 2, 32, 0.1)
    assert _task().config == PRESETS["small"]


def test_unknown_option_is_named_with_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        _task(n_layers="3")
    message = str(info.value)
    assert "n_layers" in message
    assert "n_layer" in message and "corpus_max_bytes" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"seq_len": "abc"}, "seq_len"),
        ({"seq_len": "12.5"}, "seq_len"),
        ({"n_layer": "0"}, "n_layer"),
        ({"n_head": -2}, "n_head"),
        ({"n_embd": True}, "n_embd"),
        ({"n_embd": "100", "n_head": "3"}, "n_embd"),
        ({"dropout": "1.0"}, "dropout"),
        ({"dropout": "-0.1"}, "dropout"),
        ({"dropout": "lots"}, "dropout"),
        ({"weight_decay": "-1"}, "weight_decay"),
        ({"weight_decay": "nan"}, "weight_decay"),
        ({"corpus_max_bytes": "0"}, "corpus_max_bytes"),
        ({"corpus_max_bytes": "100"}, "corpus_max_bytes"),  # < two windows of seq 128
        ({"preset": "huge"}, "preset"),
        ({"corpus": ""}, "corpus"),
    ],
)
def test_bad_option_values_name_the_option(options: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as info:
        _task(**options)
    message = str(info.value)
    assert named in message
    assert "\n" not in message
    if named == "preset":
        assert all(name in message for name in PRESETS)


# --- it learns --------------------------------------------------------------------------


def test_loss_goes_down_on_the_default_corpus() -> None:
    """60 AdamW steps of "tiny" (about 2 s on one thread) cut the loss by well over a nat."""
    task = _task(preset="tiny", corpus_max_bytes=300_000)
    torch.manual_seed(0)
    model = task.build_model()
    dataset = task.build_dataset()
    optimizer = task.build_optimizer(model, 3e-3)
    order = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        picks = torch.randint(len(dataset), (16,), generator=order).tolist()
        batch = task.collate([dataset[i] for i in picks])
        loss = task.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = losses[0], sum(losses[-10:]) / 10
    assert 4.5 < first < 6.0  # about ln(256) = 5.55 at init
    assert last <= first - 1.0, f"loss went from {first:.3f} to {last:.3f}"
