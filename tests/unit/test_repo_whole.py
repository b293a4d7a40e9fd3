"""A clone of the repository needs nothing beside it: no code, doc, manifest or test names a
path outside it (a folder next to the checkout, a machine's own paths) or a file it does not
hold (the development machine's field notes: their facts are in docs/stock-torch.md)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(r"\.\./shared|FIELD-NOTES|/work/(?:main|shared|soak|tools)\b")
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".cfg", ".ini", ".txt", ".json", ""}
SKIPPED = {".git", ".venv", ".venv-compat", "__pycache__", "runs", ".pytest_cache", ".hypothesis",
           ".ruff_cache", "gpu-results", ".whl"}
OUTPUTS = REPO / "benchmarks" / "results"
"""Results files hold the logs of the runs as they were (paths of the machine included)."""


def named_outside(root: Path) -> list[str]:
    """``file:line: text`` of every line under ``root`` that names what is outside it."""
    found = []
    for path in sorted(root.rglob("*")):
        parts = set(path.relative_to(root).parts)
        if not path.is_file() or parts & SKIPPED or path.suffix not in TEXT \
                or path.is_relative_to(OUTPUTS) or path.resolve() == Path(__file__).resolve():
            continue
        try:
            lines = path.read_text().splitlines()
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(root)}:{n}: {line.strip()}"
                  for n, line in enumerate(lines, 1) if OUTSIDE.search(line)]
    return found


def test_nothing_in_the_repo_names_a_path_outside_it() -> None:
    assert named_outside(REPO) == []


def test_a_file_that_names_a_path_outside_the_repo_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("fine\nsee ../shared/schemas for the CRDs\n")
    (tmp_path / "code.py").write_text("# measured (FIELD-NOTES)\n")
    (tmp_path / "ok.py").write_text("x = 1\n")
    assert named_outside(tmp_path) == ["code.py:1: # measured (FIELD-NOTES)",
                                       "docs/page.md:2: see ../shared/schemas for the CRDs"]
