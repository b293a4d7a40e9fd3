"""A byte-level text corpus and the map-style dataset the built-in GPT task trains on.

The default corpus is the Python standard library's own source code: it ships with every
Python installation, so the built-in task trains offline on any machine with no download.
A user corpus is a text file or a directory of text files (``--task-opt corpus=PATH``).
"""

from __future__ import annotations

import operator
import os
import sysconfig
from pathlib import Path

import torch

from elastic_train.errors import ConfigError

#: Directory names skipped when the corpus is the standard library: installed third-party
#: packages, the (huge, repetitive) test suites and the IDLE GUI.
STDLIB_SKIP_DIRS: frozenset[str] = frozenset({"site-packages", "test", "tests", "idlelib"})

#: File suffixes taken from a user directory: plain text, docs, source and config files.
#: Anything else (binaries, images, archives, files with no suffix) is left out.
TEXT_SUFFIXES: frozenset[str] = frozenset(
    {".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".yaml", ".yml", ".html", ".js"}
)


def default_corpus_root() -> Path:
    """The standard library source directory: text that is present offline everywhere."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_default_root(root: Path) -> bool:
    try:
        return root.resolve() == default_corpus_root().resolve()
    except OSError:
        return False


def _list_files(root: Path, *, stdlib: bool) -> list[Path]:
    """Regular files under ``root`` that belong in the corpus, in sorted relative-path order.

    For the standard library: ``*.py`` outside ``STDLIB_SKIP_DIRS``. For a user directory:
    files with a ``TEXT_SUFFIXES`` suffix, skipping hidden files and directories (``.git``,
    ``.venv``, ...) and ``__pycache__``. Symlinked directories are not followed.
    """
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        if stdlib:
            dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS and d != "__pycache__"]
        else:
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            suffix = os.path.splitext(name)[1].lower()
            if stdlib:
                if suffix != ".py":
                    continue
            elif name.startswith(".") or suffix not in TEXT_SUFFIXES:
                continue
            rel = name if rel_dir == "." else os.path.join(rel_dir, name)
            found.append(Path(rel).as_posix())
    found.sort()
    return [root / rel for rel in found]


def load_corpus_bytes(path: Path | None, max_bytes: int, *, min_bytes: int = 1) -> bytes:
    """The corpus at ``path`` (default: the standard library) as bytes, at most ``max_bytes``.

    A file gives its own bytes. A directory gives its text files (see ``_list_files``)
    concatenated in sorted relative-path order, so the corpus is the same on every call on a
    given machine. Unreadable files are skipped quietly. Fewer than ``min_bytes`` bytes (a
    caller passes what two samples need) is a ``ConfigError``.
    """
    if max_bytes <= 0:
        raise ConfigError(
            f"corpus_max_bytes must be a positive integer, got {max_bytes}: "
            "pass --task-opt corpus_max_bytes=N with N > 0"
        )
    root = default_corpus_root() if path is None else Path(path).expanduser()
    if not root.exists():
        raise ConfigError(
            f"corpus path {root} does not exist: "
            "pass --task-opt corpus=PATH with a text file or a directory of text files"
        )
    if root.is_dir():
        parts: list[bytes] = []
        total = 0
        for file in _list_files(root, stdlib=_is_default_root(root)):
            if total >= max_bytes:
                break
            try:
                if not file.is_file():
                    continue
                with open(file, "rb") as f:
                    chunk = f.read(max_bytes - total)
            except OSError:
                continue
            parts.append(chunk)
            total += len(chunk)
        data = b"".join(parts)
    else:
        try:
            with open(root, "rb") as f:
                data = f.read(max_bytes)
        except OSError as e:
            raise ConfigError(
                f"corpus file {root} cannot be read ({e.strerror or e}): "
                "pass --task-opt corpus=PATH with a readable text file or directory"
            ) from e
    if len(data) < min_bytes:
        raise ConfigError(
            f"corpus {root} has {len(data)} bytes of text (within corpus_max_bytes={max_bytes}) "
            f"but at least {min_bytes} are needed for two samples: "
            "pass --task-opt corpus=PATH with more text, raise corpus_max_bytes or lower seq_len"
        )
    return data


class ByteWindowDataset:
    """Non-overlapping windows of ``seq_len + 1`` bytes: an input and its next-byte target.

    Item ``i`` is ``data[i*seq_len : i*seq_len + seq_len + 1]`` as int64, so consecutive
    windows share one byte (the last target of one is the first input of the next) and every
    byte of the corpus is predicted once. Item ``i`` never changes, as the Task protocol
    requires for exact resume; the trainer's sampler decides the order.
    """

    def __init__(self, data: torch.Tensor | bytes | bytearray, seq_len: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if isinstance(data, (bytes, bytearray)):
            # A private copy: frombuffer shares memory with the buffer it is given.
            buf = bytearray(data)
            data = (
                torch.frombuffer(buf, dtype=torch.uint8)
                if buf
                else torch.empty(0, dtype=torch.uint8)
            )
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError(
                f"data must be a 1-D torch.uint8 tensor, got {data.dtype} {tuple(data.shape)}"
            )
        self.data = data
        self.seq_len = seq_len
        self._len = max(0, (data.numel() - 1) // seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> torch.Tensor:
        i = operator.index(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {index} out of range for a dataset of {self._len} windows")
        start = i * self.seq_len
        return self.data[start : start + self.seq_len + 1].to(torch.int64)
