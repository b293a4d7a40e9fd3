"""The built-in task: a small GPT-style byte-level language model (``--task gpt``).

Bytes are tokens (vocabulary 256), so there is no tokenizer to download or version, and
the default corpus is the Python standard library (see ``corpus.py``): the task runs
offline anywhere, and its loss falls from ln(256) ~ 5.55 nats quickly enough to show
training works. The model is nanoGPT-shaped: learned position embeddings, pre-LN blocks
with causal self-attention and a 4x GELU MLP, a final LayerNorm and an lm head tied to
the token embedding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elastic_train.errors import ConfigError
from elastic_train.tasks.base import OptionValue, TaskContext
from elastic_train.tasks.corpus import ByteWindowDataset, load_corpus_bytes


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model. ``seq_len`` is the context length the model is built for."""

    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


#: Named model sizes (``--task-opt preset=NAME``). Measured parameter counts (unique
#: parameters, the tied lm head counted once, position embeddings included):
#:
#: - ``tiny``:   2 layers,  64 wide,  4 heads, seq  64 ->    0.12M (120,576): for tests
#: - ``small``:  4 layers, 128 wide,  4 heads, seq 128 ->    0.84M (842,496): the default
#: - ``medium``: 6 layers, 384 wide,  6 heads, seq 256 ->   10.8M (10,844,160)
#: - ``large``: 10 layers, 640 wide, 10 heads, seq 512 ->   49.7M (49,728,000)
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(seq_len=64, n_layer=2, n_head=4, n_embd=64),
    "small": GPTConfig(seq_len=128, n_layer=4, n_head=4, n_embd=128),
    "medium": GPTConfig(seq_len=256, n_layer=6, n_head=6, n_embd=384),
    "large": GPTConfig(seq_len=512, n_layer=10, n_head=10, n_embd=640),
}

DEFAULT_PRESET = "small"
DEFAULT_CORPUS_MAX_BYTES = 4_000_000
DEFAULT_WEIGHT_DECAY = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    """The 4x-wide GELU feed-forward layer of a block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A byte-level GPT. ``forward(idx)`` maps (B, T) int64 tokens to (B, T, vocab) logits.

    Initialization draws only from torch's global generator, in module order, so two
    models built after the same ``torch.manual_seed`` are identical (exact resume relies
    on it).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2: scale the init of the projections that write into the residual stream by
        # 1/sqrt(2 * n_layer), so the residual's variance does not grow with depth.
        resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=resid_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        if t > self.config.seq_len:
            raise ValueError(
                f"sequence of length {t} is longer than the model's seq_len={self.config.seq_len}"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def count_parameters(model: nn.Module) -> int:
    """Number of unique parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


class GPTTask:
    """The Task (see ``base.py``): a ``GPT`` trained on a ``ByteWindowDataset`` with AdamW.

    The corpus is read on the first ``build_dataset`` call and cached on the instance, so
    later calls (a re-formed process group after a membership change) do not read it again.
    """

    def __init__(
        self,
        config: GPTConfig,
        corpus: Path | None = None,
        corpus_max_bytes: int = DEFAULT_CORPUS_MAX_BYTES,
        weight_decay: float = DEFAULT_WEIGHT_DECAY,
    ) -> None:
        self.config = config
        self.corpus = corpus
        self.corpus_max_bytes = corpus_max_bytes
        self.weight_decay = weight_decay
        self._dataset: ByteWindowDataset | None = None

    def build_model(self) -> nn.Module:
        """A freshly initialized ``GPT``; deterministic given torch's global seed."""
        return GPT(self.config)

    def build_dataset(self) -> ByteWindowDataset:
        """Windows of ``seq_len + 1`` bytes over the corpus, read once per task instance."""
        if self._dataset is None:
            seq_len = self.config.seq_len
            data = load_corpus_bytes(self.corpus, self.corpus_max_bytes, min_bytes=2 * seq_len + 1)
            self._dataset = ByteWindowDataset(data, seq_len)
        return self._dataset

    def build_optimizer(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """AdamW (betas 0.9, 0.95); weight decay on matrices and embeddings (>= 2-D) only.

        Biases and LayerNorm parameters (1-D) are not decayed, as in nanoGPT.
        """
        params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))

    def collate(self, samples: Sequence[torch.Tensor]) -> torch.Tensor:
        """Stack windows into a (B, seq_len + 1) int64 batch."""
        return torch.stack(list(samples))

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross entropy (nats per token) over every token of the batch."""
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


# --- the factory and its options -------------------------------------------------------

_INT_OPTIONS = ("seq_len", "n_layer", "n_head", "n_embd", "corpus_max_bytes")
KNOWN_OPTIONS: tuple[str, ...] = (
    "preset",
    "corpus",
    "corpus_max_bytes",
    "seq_len",
    "n_layer",
    "n_head",
    "n_embd",
    "dropout",
    "weight_decay",
)


def _bad(key: str, value: object, why: str, fix: str) -> ConfigError:
    return ConfigError(f"task option {key}={value!r} {why}: {fix}")


def _positive_int(key: str, value: OptionValue) -> int:
    fix = f"pass --task-opt {key}=N with N a positive integer"
    if isinstance(value, bool):
        raise _bad(key, value, "is not an integer", fix)
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        try:
            n = int(value.strip())
        except ValueError:
            raise _bad(key, value, "is not an integer", fix) from None
    else:
        raise _bad(key, value, "is not an integer", fix)
    if n <= 0:
        raise _bad(key, value, "must be positive", fix)
    return n


def _float(key: str, value: OptionValue, fix: str) -> float:
    if isinstance(value, bool):
        raise _bad(key, value, "is not a number", fix)
    try:
        x = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise _bad(key, value, "is not a number", fix) from None
    if not math.isfinite(x):
        raise _bad(key, value, "is not a finite number", fix)
    return x


def make_task(ctx: TaskContext) -> GPTTask:
    """Build the GPT task from ``ctx.options`` (see ``KNOWN_OPTIONS``).

    Cheap on purpose: it validates every option and checks that the corpus path exists (so
    a typo fails at once, before any process group forms), but reads no corpus bytes.
    """
    options: Mapping[str, OptionValue] = ctx.options
    for key in options:
        if key not in KNOWN_OPTIONS:
            raise ConfigError(
                f"unknown task option {key!r} for the gpt task: "
                f"use one of {', '.join(KNOWN_OPTIONS)}"
            )

    preset = str(options.get("preset", DEFAULT_PRESET)).strip()
    if preset not in PRESETS:
        raise _bad(
            "preset",
            options.get("preset"),
            "is not a known preset",
            f"pass --task-opt preset=NAME with NAME one of {', '.join(PRESETS)}",
        )
    cfg = PRESETS[preset]

    overrides: dict[str, Any] = {}
    ints = {key: _positive_int(key, options[key]) for key in _INT_OPTIONS if key in options}
    overrides.update({k: v for k, v in ints.items() if k != "corpus_max_bytes"})
    if "dropout" in options:
        fix = "pass --task-opt dropout=P with 0 <= P < 1"
        p = _float("dropout", options["dropout"], fix)
        if not 0.0 <= p < 1.0:
            raise _bad("dropout", options["dropout"], "is outside [0, 1)", fix)
        overrides["dropout"] = p
    cfg = replace(cfg, **overrides)
    if cfg.n_embd % cfg.n_head != 0:
        raise ConfigError(
            f"task option n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}: "
            "pass --task-opt n_embd and n_head so that n_embd is a multiple of n_head"
        )

    weight_decay = DEFAULT_WEIGHT_DECAY
    if "weight_decay" in options:
        fix = "pass --task-opt weight_decay=W with W >= 0"
        weight_decay = _float("weight_decay", options["weight_decay"], fix)
        if weight_decay < 0:
            raise _bad("weight_decay", options["weight_decay"], "is negative", fix)

    max_bytes = ints.get("corpus_max_bytes", DEFAULT_CORPUS_MAX_BYTES)
    need = 2 * cfg.seq_len + 1
    if max_bytes < need:
        raise ConfigError(
            f"task option corpus_max_bytes={max_bytes} is less than the {need} bytes two "
            f"samples of seq_len={cfg.seq_len} need: pass --task-opt corpus_max_bytes=N "
            f"with N >= {need}, or a smaller seq_len"
        )

    corpus: Path | None = None
    if "corpus" in options:
        raw = str(options["corpus"]).strip()
        if not raw:
            raise ConfigError(
                "task option corpus is empty: pass --task-opt corpus=PATH with a text file "
                "or a directory of text files, or leave it out to train on the stdlib"
            )
        corpus = Path(raw).expanduser().absolute()
        if not corpus.exists():
            raise ConfigError(
                f"corpus path {corpus} does not exist: "
                "pass --task-opt corpus=PATH with a text file or a directory of text files"
            )

    return GPTTask(cfg, corpus=corpus, corpus_max_bytes=max_bytes, weight_decay=weight_decay)
