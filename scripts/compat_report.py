"""The results file of one compatibility run (scripts/test-compat.sh): version x proof, date,
commit, pass/fail counts and wall times, from pytest's JUnit XML; markdown on stdout."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Outcome:
    """One test's result: passed, failed, error or skipped; its seconds; its message."""

    test_id: str
    result: str
    seconds: float
    message: str = ""


def outcomes(junit: Path) -> list[Outcome]:
    """Every test case of a JUnit XML file, as pytest ids (path::name[params])."""
    if not junit.is_file():
        return []
    found = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname = case.get("classname", "")
        parts = classname.split(".")
        # pytest writes tests.unit.test_x (a module) or tests.unit.test_x.Class
        module = next((i for i in range(len(parts), 0, -1)
                       if Path(*parts[:i]).with_suffix(".py").is_file()), len(parts))
        test_id = "/".join(parts[:module]) + ".py::" + "::".join([*parts[module:],
                                                                  case.get("name", "")])
        result, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                result = {"failure": "failed"}.get(kind, kind)
                message = (node.get("message") or "").strip().splitlines()[0:1]
                message = message[0][:200] if message else ""
                break
        found.append(Outcome(test_id, result, float(case.get("time", 0)), message))
    return found


def counts(cases: list[Outcome]) -> str:
    """'N passed, N failed' (', N skipped', ', N errors' where any)."""
    tally = {kind: sum(c.result == kind for c in cases)
             for kind in ("passed", "failed", "skipped", "error")}
    text = f"{tally['passed']} passed, {tally['failed']} failed"
    if tally["skipped"]:
        text += f", {tally['skipped']} skipped"
    if tally["error"]:
        text += f", {tally['error']} errors"
    return text


def ended(code: int, junit: Path) -> str:
    """What to add when pytest did not end by itself (killed at the script's limit)."""
    if code in (124, 137) or (code and not junit.is_file()):
        return (f"; pytest did not finish (exit {code}: killed at the time limit, a hang; "
                "the counts are of the tests it had reported)")
    return ""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True,
                          check=False).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--spec", required=True)
    p.add_argument("--torch", required=True)
    p.add_argument("--unit", type=Path, required=True)
    p.add_argument("--unit-seconds", type=int, required=True)
    p.add_argument("--proofs", type=Path, required=True)
    p.add_argument("--proof-list", type=Path, required=True)
    p.add_argument("--proof-seconds", type=int, required=True)
    p.add_argument("--evidence", type=Path, required=True)
    p.add_argument("--unit-code", type=int, default=0)
    p.add_argument("--proof-code", type=int, default=0)
    p.add_argument("--unit-log", type=Path)
    p.add_argument("--proof-log", type=Path)
    args = p.parse_args(argv)

    unit = outcomes(args.unit)
    proofs = outcomes(args.proofs)
    listed = [line.split("|", 1) for line in args.proof_list.read_text().splitlines() if line]
    changed = [line for line in git("status", "--porcelain", "--untracked-files=no")
               .splitlines() if line.strip()]
    commit = git("rev-parse", "--short=7", "HEAD")
    tree = "clean tree" if not changed else f"{len(changed)} tracked files changed"
    out = [f"# Compatibility run: torch {args.torch}", "",
           f"- command: `make test-compat TORCH={args.spec}` (scripts/test-compat.sh)",
           f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
           f"- commit: {commit} ({tree})",
           f"- machine: {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, "
           f"Python {platform.python_version()}, no GPU used (gloo on CPU)",
           f"- unit suite (tests/unit, not extended): {counts(unit)} in {args.unit_seconds} s"
           f"{ended(args.unit_code, args.unit)}",
           f"- proofs: {counts(proofs)} in {args.proof_seconds} s"
           f"{ended(args.proof_code, args.proofs)}", "",
           "| proof | test | result | seconds |", "|---|---|---|---|"]
    for proof, test_id in listed:
        matched = [c for c in proofs if c.test_id == test_id
                   or c.test_id.startswith(test_id + "::")]
        if not matched:
            out.append(f"| {proof} | `{test_id}` | not run | |")
        for case in matched:
            shown = case.result + (f": {case.message}" if case.message
                                   and case.result != "passed" else "")
            out.append(f"| {proof} | `{case.test_id}` | {shown.replace('|', '/')} | "
                       f"{case.seconds:.1f} |")
    skipped: dict[str, int] = {}
    for case in (c for c in [*unit, *proofs] if c.result == "skipped"):
        skipped[case.message] = skipped.get(case.message, 0) + 1
    if skipped:
        out += ["", "Skipped, and why:", ""]
        out += [f"- {n} x {reason.replace('|', '/')}" for reason, n in sorted(skipped.items())]
    failed = [c for c in unit if c.result in ("failed", "error")]
    if failed:
        out += ["", "Unit tests that failed:", ""]
        out += [f"- `{c.test_id}`: {c.message.replace('|', '/')}" for c in failed]
    out += ["", "pip's evidence that the project's install left this torch in place:", "",
            "```text", args.evidence.read_text().rstrip() if args.evidence.is_file()
            else "(no evidence file)", "```"]
    for name, log in (("unit suite", args.unit_log), ("proofs", args.proof_log)):
        if log is not None and log.is_file():
            tail = log.read_text(errors="replace").rstrip().splitlines()[-1:]
            out += ["", f"pytest's last line ({name}): `{tail[0] if tail else ''}`"]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
