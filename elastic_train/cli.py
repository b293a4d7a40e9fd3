"""The ``elastic-train`` command."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    raise NotImplementedError
