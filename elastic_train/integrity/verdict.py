"""Replicas compared: the fingerprints (``fingerprint.state_fingerprint``) of the ranks that
must hold the same state, and who disagrees.

With three replicas or more, a strict majority holds the true state and the ranks outside
it are named; without a strict majority (two replicas, or a tie), every rank of the group
is a suspect: the evidence cannot tell which side is wrong, and the state of none can be
trusted (a checkpoint of that step is not certified).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    """``agree``: every replica's fingerprint is equal; ``named``: the ranks that hold a
    corrupt state, by majority (empty when there is none); ``suspects``: the ranks that
    may (every rank of the group when no majority names anyone)."""

    agree: bool
    named: tuple[int, ...] = ()
    suspects: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.agree:
            return "the replicas agree"
        if self.named:
            return (f"rank(s) {', '.join(map(str, self.named))} hold a state that differs from "
                    "the majority of their replicas (silent data corruption)")
        return (f"the replicas (ranks {', '.join(map(str, self.suspects))}) disagree and no "
                "majority tells which is right: all are suspects")


def compare(fingerprints: Mapping[int, Sequence[int]]) -> Verdict:
    """The verdict on one replica group: ``{rank: fingerprint words}``."""
    if len(fingerprints) < 2:
        return Verdict(True)
    votes = Counter(tuple(words) for words in fingerprints.values())
    if len(votes) == 1:
        return Verdict(True)
    top, count = votes.most_common(1)[0]
    ranks = tuple(sorted(fingerprints))
    if count * 2 > len(fingerprints):  # a strict majority
        named = tuple(r for r in ranks if tuple(fingerprints[r]) != top)
        return Verdict(False, named, named)
    return Verdict(False, (), ranks)


def compare_groups(fingerprints: Mapping[int, Sequence[int]],
                   groups: Sequence[Sequence[int]]) -> Verdict:
    """The verdict over several replica groups (DDP: one group of every rank; HSDP: the
    ranks that hold the same shard): the named and the suspects of every group."""
    named: list[int] = []
    suspects: list[int] = []
    for group in groups:
        verdict = compare({r: fingerprints[r] for r in group if r in fingerprints})
        named += verdict.named
        suspects += verdict.suspects
    if not suspects:
        return Verdict(True)
    return Verdict(False, tuple(sorted(named)), tuple(sorted(suspects)))
