"""The torch check at start (elastic_train/torch_compat.py) on the installed torch, with a
name made to disappear by monkeypatch where a refusal is wanted. The real commands:
tests/integration/test_torch_check.py."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from elastic_train import torch_compat, torch_private
from elastic_train.agent import environment as agent_env
from elastic_train.live.environment import WORKER_ENV_FILE
from elastic_train.torch_compat import (
    CACHE_DIR,
    CHECKED,
    SEAMS,
    TESTED,
    TorchUnsupportedError,
    Verdicts,
    check,
    check_at_launch,
    check_in_worker,
    declared,
    notice_line,
)

REPO = Path(__file__).resolve().parents[2]
TESTED_TEXT = "2.11.0, 2.12.1, 2.13.0, 2.14.1"
GONE = ("torch.nn.parallel.distributed.DistributedDataParallel._build_params_for_reducer "
        "(gone)")


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No check remembered from another test (in this process or on disk), no launcher's
    mark in the environment."""
    monkeypatch.setattr(torch_compat, "_checked_here", None)
    monkeypatch.setenv(CACHE_DIR, str(tmp_path / "verdicts"))
    monkeypatch.delenv(CHECKED, raising=False)
    monkeypatch.delenv(WORKER_ENV_FILE, raising=False)


def test_the_tested_versions_are_one_list_and_the_install_bound_is_its_first() -> None:
    assert ", ".join(TESTED) == TESTED_TEXT
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch_requirements = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    oldest = ".".join(TESTED[0].split(".")[:2])
    assert torch_requirements == [f"torch>={oldest}"]  # a lower bound only: never replaced


@pytest.mark.parametrize("seam", SEAMS)
def test_the_seams_declarations_read_from_source_are_what_importing_gives(seam: str) -> None:
    assert declared(seam) == importlib.import_module(seam).REQUIRED


def test_the_installed_torch_passes_with_its_notice_or_none() -> None:
    assert check() == notice_line(torch.__version__)


@pytest.mark.parametrize(("version", "line"), [
    ("2.13.0+cpu", None), ("2.14.0", None), ("2.11.0+cu130", None), ("2.12.1", None),
    ("2.15.0", "torch 2.15.0 is newer than the versions elastic_train was tested with "
               f"({TESTED_TEXT}); every private name of torch it relies on is there, so it runs"),
    ("2.16.0.dev20261201+cpu", "torch 2.16.0.dev20261201+cpu is newer than the versions "
     f"elastic_train was tested with ({TESTED_TEXT}); every private name of torch it relies "
     "on is there, so it runs"),
    ("2.10.0", "torch 2.10.0 is older than the versions elastic_train was tested with "
               f"({TESTED_TEXT}); every private name of torch it relies on is there, so it runs"),
])
def test_the_notice_is_for_releases_outside_the_tested_ones(version: str, line: str | None
                                                            ) -> None:
    assert notice_line(version) == line


def test_a_missing_and_a_reshaped_name_are_refused_in_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(DistributedDataParallel, "_build_params_for_reducer")
    monkeypatch.setattr(DistributedDataParallel, "_ddp_init_helper",
                        lambda self, params, expect_sparse_gradient: None)
    with pytest.raises(TorchUnsupportedError) as caught:
        check()
    assert caught.value.exit_code == 2
    assert str(caught.value) == (
        f"torch {torch.__version__} lacks what elastic_train relies on: {GONE}, "
        "torch.nn.parallel.distributed.DistributedDataParallel._ddp_init_helper (takes "
        "(params, expect_sparse_gradient), we rely on (parameters, expect_sparse_gradient, "
        "param_to_name_mapping, static_graph)); elastic_train was tested with torch "
        f"{TESTED_TEXT}: install one of those")


def test_a_worker_checks_its_seam_once_unless_its_launcher_did(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delattr(DistributedDataParallel, "_build_params_for_reducer")
    version = torch.__version__
    check_in_worker(0, {CHECKED: version})  # the launcher's mark: nothing checked
    marks = tmp_path / "worker-env.json"
    marks.write_text(json.dumps({CHECKED: version}))
    check_in_worker(0, {WORKER_ENV_FILE: str(marks)})  # a forked worker's mark: the file
    with pytest.raises(TorchUnsupportedError, match=re.escape(GONE)):
        check_in_worker(1, {CHECKED: "2.0.0"})  # a mark for another torch: checked
    with pytest.raises(TorchUnsupportedError, match=re.escape(GONE)):
        check_in_worker(1, {})


def test_a_worker_says_a_newer_torch_from_rank_0_only_and_once(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    check_in_worker(1, {})
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(torch_compat, "_checked_here", None)
    check_in_worker(0, {})
    check_in_worker(0, {})
    assert capsys.readouterr().err == f"elastic_train: {notice_line('2.99.0')}\n"


def test_the_launcher_says_a_newer_torch_and_marks_it_for_its_workers(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with agent_env.worker_env_file() as path:
        check_at_launch()
        assert json.loads(Path(path).read_text()) == {CHECKED: "2.99.0"}  # forked workers
        assert os.environ[CHECKED] == "2.99.0"  # subprocess workers
    assert capsys.readouterr().err == f"elastic-train: {notice_line('2.99.0')}\n"


def test_the_launcher_refuses_before_marking_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(DistributedDataParallel, "_build_params_for_reducer")
    with pytest.raises(TorchUnsupportedError, match=re.escape(GONE)):
        check_at_launch()
    assert CHECKED not in os.environ


def _no_second_check(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the checks that look at torch's names from now on."""
    looked: list[int] = []
    real = torch_compat.problems

    def counted(required: list[torch_private.Private]) -> list[tuple[torch_private.Private, str]]:
        looked.append(len(required))
        return real(required)

    monkeypatch.setattr(torch_compat, "problems", counted)
    return looked


def test_a_passed_check_is_remembered_until_torch_or_the_seams_change(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    verdicts = Verdicts(tmp_path / "verdicts")
    assert check(SEAMS, verdicts) == notice_line(torch.__version__)
    looked = _no_second_check(monkeypatch)
    assert check(SEAMS, verdicts) == notice_line(torch.__version__)
    assert looked == []                                  # remembered: nothing imported
    monkeypatch.setattr(torch, "__version__", "2.99.0")  # another torch: checked again
    assert check(SEAMS, verdicts) == notice_line("2.99.0") and looked
    looked.clear()
    assert check(SEAMS, verdicts) == notice_line("2.99.0") and looked == []  # its notice too
    monkeypatch.setattr(torch.version, "git_version", "another build")
    assert check(SEAMS, verdicts) is not None and looked


def test_the_key_follows_the_seams_source_and_torchs_install(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    package = tmp_path / "elastic_train"
    for part in ("agent/torch_seams.py", "rendezvous/torch_seams.py", "worker/torch_seams.py",
                 "checkpoint/torch_seams.py", "torch_private.py"):
        (package / part).parent.mkdir(parents=True, exist_ok=True)
        (package / part).write_bytes((REPO / "elastic_train" / part).read_bytes())
    monkeypatch.setattr(torch_compat, "_PACKAGE", package)
    before = Verdicts.key(SEAMS)
    assert Verdicts.key(SEAMS) == before and Verdicts.key(SEAMS[:1]) != before
    seam = package / "worker" / "torch_seams.py"
    seam.write_text(seam.read_text() + "\n# another name relied on\n")
    assert Verdicts.key(SEAMS) != before
    changed = Verdicts.key(SEAMS)
    real_stat = Path.stat

    def reinstalled(path: Path, *args: object, **kwargs: object) -> os.stat_result:
        result = real_stat(path, *args, **kwargs)  # type: ignore[arg-type]
        if path.name == "version.py":  # pip rewrote torch's version.py
            return os.stat_result((*result[:8], result.st_mtime + 1, result.st_ctime))
        return result

    monkeypatch.setattr(Path, "stat", reinstalled)
    assert Verdicts.key(SEAMS) != changed


def test_a_refusal_is_never_remembered(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    verdicts = Verdicts(tmp_path / "verdicts")
    with monkeypatch.context() as patch:
        patch.delattr(DistributedDataParallel, "_build_params_for_reducer")
        for _ in range(2):
            with pytest.raises(TorchUnsupportedError, match=re.escape(GONE)):
                check(SEAMS, verdicts)
    assert not list((tmp_path / "verdicts").glob("torch-check-*"))


@pytest.mark.parametrize("where", ["", "/proc/no-such-dir"])
def test_without_a_writable_cache_every_start_checks(monkeypatch: pytest.MonkeyPatch,
                                                     where: str) -> None:
    monkeypatch.setenv(CACHE_DIR, where)
    verdicts = Verdicts.from_environment()
    assert verdicts.directory == (Path(where) if where else None)
    assert check(SEAMS, verdicts) == notice_line(torch.__version__)
    looked = _no_second_check(monkeypatch)
    assert check(SEAMS, verdicts) == notice_line(torch.__version__) and looked


def test_the_cache_is_the_users_unless_configured() -> None:
    home = os.path.expanduser("~")
    assert Verdicts.from_environment({}).directory == Path(home, ".cache", "elastic_train")
    assert Verdicts.from_environment({"XDG_CACHE_HOME": "/x"}).directory == \
        Path("/x/elastic_train")
    assert Verdicts.from_environment({CACHE_DIR: "/y", "XDG_CACHE_HOME": "/x"}).directory == \
        Path("/y")


class Holder:
    """Instance attributes set the ways torch's classes set them."""

    def __init__(self, other: Holder | None = None) -> None:
        self.plain = 1
        self.annotated: int = 2
        if other is not None:
            other.elsewhere = 3  # another object's: not this class's attribute

        def later() -> None:
            self.in_closure = 4  # self from a cell (LOAD_DEREF)

        later()


@pytest.mark.parametrize(("member", "assigned"), [
    ("plain", True), ("annotated", True), ("in_closure", True), ("elsewhere", False),
    ("never", False)])
def test_instance_attributes_are_found_in_the_bytecode(member: str, assigned: bool) -> None:
    assert torch_private._stores(Holder, member) is assigned
    assert torch_private._assigns(Holder, member) is assigned  # the source agrees


def test_the_workers_check_costs_little_after_its_imports() -> None:
    """What a worker pays, measured in a fresh process that imported the worker's modules
    (as a worker has by then): the check of its seam (worker/torch_seams.py)."""
    code = ("import time, elastic_train.worker.train, elastic_train.worker.session\n"
            "from elastic_train.torch_compat import check_in_worker\n"
            "t = time.perf_counter(); check_in_worker(1, {})\n"
            "print(time.perf_counter() - t)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    seconds = float(done.stdout.strip().splitlines()[-1])
    assert seconds < 0.5, f"the worker's check took {seconds:.3f} s " \
                          f"(the process {time.monotonic() - started:.1f} s)"
