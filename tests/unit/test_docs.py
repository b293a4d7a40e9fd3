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


# --- links, commands and the README's length --------------------------------------------

PAGES = [REPO / "README.md", *DOCS]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"^\$ (.+)$", re.M)


def prose(page: Path) -> str:
    """A page without its fenced code blocks (a link or a heading there is not one)."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but ``-`` and ``_``
    dropped, spaces as ``-``, a repeated heading numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *$", prose(page), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):          # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no such heading in {linked.name})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, f"{page.name} links to what does not exist: {broken}"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading, here\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a-heading-here) [ok](#mine) [web](https://x.y)\n"
                    "## Mine\n[gone](missing.md) [gone](there.md#nowhere) [gone](#nothing)\n"
                    "```\n[code](not-a-link.md)\n```\n")
    assert broken_links(page) == ["missing.md (no such file)",
                                  "there.md#nowhere (no such heading in there.md)",
                                  "#nothing (no such heading in page.md)"]


def commands() -> list[tuple[str, str]]:
    return [(page.name, c) for page in PAGES for c in COMMAND.findall(page.read_text())]


def option_names(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--")]


def wrong_in(command: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """What a documented command names that does not exist: an ``elastic-train``
    subcommand, an option of ``elastic-train run`` (torchrun's, ours, the job's), a job
    option after ``-m elastic_train.train``, a ``python X.py`` or ``bash scripts/X``."""
    from elastic_train import cli
    from elastic_train.agent.launch import launcher_parser
    from elastic_train.config_options import job_parser

    launcher = set(launcher_parser()._option_string_actions)
    job = set(job_parser()._option_string_actions)
    wrong: list[str] = []
    for part in re.split(r"&&|\|", command):
        tokens = part.split("#", 1)[0].split()
        while tokens and re.match(r"^[A-Z_]+=", tokens[0]):
            tokens.pop(0)                            # VAR=value before the program
        if not tokens:
            continue
        program, args = tokens[0], tokens[1:]
        if program == "elastic-train" and args:
            sub = [a for a in args[:2] if not a.startswith("-")]
            if args[0] == "checkpoints":
                sub = args[:2]
            try:
                code = cli.main([*sub, "--help"])
            except SystemExit as exc:
                code = exc.code
            capsys.readouterr()
            if code != 0:
                wrong.append(f"elastic-train {' '.join(sub)}")
            if args[0] == "run":
                script = next((i for i, a in enumerate(args) if a == "-m"
                               or a.endswith(".py")), len(args))
                wrong += [o for o in option_names(args[1:script]) if o not in launcher | job]
        if "elastic_train.train" in args:
            after = args[args.index("elastic_train.train") + 1:]
            wrong += [o for o in option_names(after) if o not in job]
        if program in ("python", "bash"):
            wrong += [a for a in args[:1] if not (REPO / a).is_file()]
    return wrong


def test_every_documented_command_names_what_exists(capsys: pytest.CaptureFixture[str]) -> None:
    found = commands()
    assert len(found) > 30
    wrong = {f"{page}: {c}": w for page, c in found if (w := wrong_in(c, capsys))}
    assert not wrong, wrong


@pytest.mark.parametrize("command", [
    "elastic-train runn --steps 3",
    "elastic-train checkpoints lst runs/x",
    "elastic-train run --nproc-per-node 2 --no-such-option 3",
    "torchrun --nproc-per-node 2 -m elastic_train.train --stepz 3",
    "python benchmarks/no_such_bench.py --reps 3",
    "bash scripts/no-such.sh env && bash scripts/gpu-check.sh tests",
])
def test_a_wrong_command_is_found(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert wrong_in(command, capsys)


def test_the_options_of_a_script_are_the_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    # After the script (or -m MODULE) the options are the script's, not ours.
    assert not wrong_in("elastic-train run --nproc-per-node 2 train.py --its-own 1", capsys)


def test_the_readme_is_short() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
