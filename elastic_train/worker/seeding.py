"""Randomness derived from names, not carried: seeds from (seed, purpose, step, rank, ...)."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from ``parts`` (same parts, same seed, on every machine)."""
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1
