"""A user's script as a worker (worker/script_worker.py): its exit status, module mode, how the
process ends, and the groups it destroys kept until then (worker/distributed.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch.distributed as dist

from elastic_train.worker import aborts
from elastic_train.worker.script_worker import main


def test_destroyed_groups_are_kept_while_a_script_runs(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # the private name this relies on (behind worker/distributed.py's seam), in the installed torch
    assert isinstance(dist.distributed_c10d._world.pg_map, Mapping)
    monkeypatch.setattr(aborts, "_retained", [])
    original = dist.destroy_process_group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    world = dist.group.WORLD
    with aborts.groups_kept_until_exit():
        from torch.distributed import destroy_process_group  # as a user's script does

        assert destroy_process_group is not original
        destroy_process_group()
        assert not dist.is_initialized()
    assert aborts._retained == [world] and aborts.retained_groups() == 1
    assert dist.destroy_process_group is original
    assert dist.distributed_c10d.destroy_process_group is original


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "user_script.py"
    path.write_text(body)
    return path


@pytest.mark.parametrize(("body", "code"), [
    ("import sys\nsys.exit(3)\n", 3), ("pass\n", 0), ("raise SystemExit('bye')\n", 1),
    ("raise ValueError('boom')\n", 1),
])
def test_the_status_is_the_scripts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   body: str, code: int) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main([str(script(tmp_path, body))]) == code


def test_a_subprocess_worker_ends_as_python_would(tmp_path: Path) -> None:
    """argv, the script's directory on sys.path, atexit handlers run, output flushed,
    the script's status (``python -m elastic_train.worker.script_worker`` ends with os._exit)."""
    path = script(tmp_path, "import atexit, sys\n"
                            "atexit.register(lambda: print('atexit ran'))\n"
                            f"print(sys.argv, sys.path[0] == {str(tmp_path)!r}, end=' ')\n"
                            "sys.exit(7)\n")
    done = subprocess.run([sys.executable, "-m", "elastic_train.worker.script_worker", str(path),
                           "--lr", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 7, done.stderr
    assert done.stdout == f"[{str(path)!r}, '--lr', '1'] True atexit ran\n"


def test_a_module_runs_as_main(tmp_path: Path) -> None:
    (tmp_path / "user_pkg").mkdir()
    (tmp_path / "user_pkg" / "__init__.py").write_text("")
    (tmp_path / "user_pkg" / "train.py").write_text(
        "import sys\nprint(__name__, sys.argv[1:])\nsys.exit(4)\n")
    done = subprocess.run([sys.executable, "-m", "elastic_train.worker.script_worker", "-m",
                           "user_pkg.train", "x"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (4, "__main__ ['x']\n"), done.stderr
