"""Fixtures shared by the integration modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration import harness
from tests.integration.harness import TINY_DROPOUT, TINY_DROPOUT_STEPS


@pytest.fixture(scope="session")
def tiny_dropout_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """{step: model digest} of TINY_DROPOUT trained without interruption, a checkpoint every
    5 steps (all kept): what a disturbed run of it must end with, and pass through."""
    run_dir: Path = tmp_path_factory.mktemp("tiny-dropout-reference") / "run"
    job = harness.elastic_run(run_dir, [*TINY_DROPOUT, "--checkpoint-every", "5",
                                        "--keep-checkpoints", str(TINY_DROPOUT_STEPS),
                                        "--log-every", "20", "--max-restarts", "0"])
    assert job.wait(300) == 0, job.report()
    return {r["step"]: r["model_digest"] for r in harness.checkpoint_listing(run_dir)}
