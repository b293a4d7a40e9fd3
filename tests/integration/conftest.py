"""Fixtures shared by the integration modules."""

from __future__ import annotations

import pytest

from tests.integration import harness
from tests.integration.harness import TINY_DROPOUT, TINY_DROPOUT_STEPS


@pytest.fixture(scope="session")
def tiny_dropout_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """{step: model digest} of TINY_DROPOUT trained without interruption, a checkpoint every
    5 steps (all kept): what a disturbed run of it must end with, and pass through."""
    return harness.uninterrupted_digests(
        tmp_path_factory.mktemp("tiny-dropout-reference") / "run",
        [*TINY_DROPOUT, "--checkpoint-every", "5", "--keep-checkpoints",
         str(TINY_DROPOUT_STEPS), "--log-every", "20"])
