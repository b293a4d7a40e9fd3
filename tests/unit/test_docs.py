"""The docs cannot rot: every test they name exists, and every bad-input row names one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md"))
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def functions_in(path: Path) -> set[str]:
    """Names of the module-level test functions of a test file."""
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_test_named_in_the_docs_exists(doc: Path) -> None:
    refs = TEST_REF.findall(doc.read_text())
    missing = [f"{file}::{name}" for file, name in refs
               if not (REPO / file).is_file() or name not in functions_in(REPO / file)]
    assert not missing, f"{doc.name} names tests that do not exist: {missing}"


def test_every_bad_input_row_names_a_test() -> None:
    lines = (REPO / "docs" / "bad-input.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| input")]
    assert len(rows) >= 13
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert len(cells) == 5, row
        assert TEST_REF.search(cells[-1]), f"no test for: {cells[0]}"


def test_the_readme_links_the_docs() -> None:
    readme = (REPO / "README.md").read_text()
    for doc in DOCS:
        assert f"(docs/{doc.name})" in readme, doc.name
