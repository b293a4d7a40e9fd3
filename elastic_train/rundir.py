"""The run directory: created and checked for writability before anything is trained."""

from __future__ import annotations

import os
from pathlib import Path

from elastic_train.errors import ConfigError


def prepare_run_dir(run_dir: Path) -> Path:
    """Create ``run_dir/checkpoints`` and prove the directory is writable."""
    run_dir = Path(run_dir)
    probe = run_dir / f".write-probe-{os.getpid()}"
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"run directory {run_dir} is not writable ({exc.strerror or exc}): "
                          "choose another --run-dir or fix its permissions") from None
    return run_dir
