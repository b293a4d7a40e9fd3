"""Bad input: one clear line, a non-zero exit, and existing checkpoints left intact."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from multiprocessing import forkserver, resource_tracker
from pathlib import Path

import pytest

from elastic_train import cli
from tests.integration import harness

pytestmark = pytest.mark.slow

TINY = ["--preset", "tiny", "--batch-size", "32", "--log-every", "10"]


def elastic_train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elastic_train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=harness.job_env())


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("elastic-train: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize(("args", "code", "expected"), [
    (["--stepz", "3"], 2, "unrecognized arguments: --stepz 3"),
    (["--step", "3"], 2, "unrecognized arguments: --step 3"),
    (["--steps", "0"], 2, "--steps 0 is invalid: it must be a positive number of steps"),
    (["--steps", "-5"], 2, "--steps -5 is invalid"),
    (["--checkpoint-every", "0"], 2, "--checkpoint-every 0 is invalid: it must be a positive"),
    (["--checkpoint-interval", "-1"], 2, "--checkpoint-interval -1.0 is invalid"),
    (["--corpus", "/nonexistent/corpus"], 2, "corpus path /nonexistent/corpus does not exist: "
     "pass --task-opt corpus=PATH"),
    (["--task", "no_such_module:make"], 2, "--task 'no_such_module:make' cannot be imported"),
    (["--task-opt", "n_layerz=3"], 2, "unknown task option 'n_layerz'"),
    (["--on-save-failure", "halt"], 2, "--on-save-failure halt is invalid: it must be "
     "'continue' or 'stop'"),
    (["--metrics-port", "70000"], 2, "--metrics-port 70000 is invalid: it must be a TCP port"),
    (["--parallelism", "zero3"], 2, "--parallelism zero3 is invalid: it must be 'ddp', 'fsdp' "
     "or 'hsdp'"),
    (["--parallelism", "hsdp", "--replica-group-size", "2", "--nproc-per-node", "3"], 2,
     "--replica-group-size 2 does not divide the world size 3: hsdp shards within groups of "
     "that many ranks; choose a size that divides every world size the job may have"),
])
def test_bad_job_option_fails_fast_with_one_line(args: list[str], code: int, expected: str,
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's main in this process (the same code, without an interpreter start per
    case); the console command itself is run by the cases below. A case that fails in the
    pre-flight has started the workers' forkserver by then: it must be gone too."""
    monkeypatch.chdir(tmp_path)
    for key in ("OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):  # set by the launch
        monkeypatch.delenv(key, raising=False)
    children = child_pids()
    try:
        returned = cli.main(["run", "--run-dir", str(tmp_path / "run"), *args])
    except SystemExit as exc:
        returned = exc.code
    result = subprocess.CompletedProcess(args, returned, "", capsys.readouterr().err)
    assert result.returncode == code
    assert expected in one_error_line(result)
    # multiprocessing's resource tracker, started with the forkserver, stays until exit
    tracker = {resource_tracker._resource_tracker._pid}
    assert child_pids() - tracker == children - tracker
    assert forkserver._forkserver._forkserver_pid is None


def child_pids() -> set[int]:
    """This process's live children (zombies included: a reaped child is gone)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found


def test_the_console_command_gives_the_same_line(tmp_path: Path) -> None:
    result = elastic_train("run", "--run-dir", str(tmp_path / "run"), "--stepz", "3",
                           cwd=tmp_path)
    assert result.returncode == 2
    assert "unrecognized arguments: --stepz 3" in one_error_line(result)


def test_unknown_config_file_key(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text("[train]\nstpes = 10\n")
    result = elastic_train("run", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown config key in [train] 'stpes' (did you mean 'steps'?)" in \
        one_error_line(result)


def test_unwritable_run_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = elastic_train("run", "--run-dir", str(blocker / "run"), *TINY, cwd=tmp_path)
    assert result.returncode == 2
    line = one_error_line(result)
    assert f"run directory {blocker / 'run'} is not writable" in line
    assert "choose another --run-dir" in line


def test_metrics_port_in_use_fails_fast_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = elastic_train("run", "--run-dir", str(tmp_path / "run"), *TINY,
                               "--metrics-address", "127.0.0.1", "--metrics-port", str(port - 1),
                               cwd=tmp_path)
    assert result.returncode == 2
    assert one_error_line(result) == (
        f"elastic-train: error: metrics port 127.0.0.1:{port} is in use (Address already in "
        "use): pass --metrics-port with a free base port (each worker serves PORT + its local "
        "rank), or --metrics-port 0 to run without metrics")
    assert not list((tmp_path / "run").rglob("events.jsonl"))  # no worker started


def test_worker_rejects_bad_option_under_torchrun(tmp_path: Path) -> None:
    job = harness.torchrun(tmp_path / "run", ["--steps", "0"], max_restarts=0)
    assert job.wait(120) != 0
    assert "elastic_train: error: --steps 0 is invalid" in job.output()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 2-worker run with checkpoints at 10, 20, 30."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    job = harness.torchrun(run_dir, [*TINY, "--steps", "30", "--checkpoint-every", "10"],
                           max_restarts=0)
    assert job.wait(180) == 0, job.report()
    return run_dir


def test_checkpoint_of_another_model_is_refused_and_kept(finished_run: Path,
                                                         tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = tree_digest(run_dir / "checkpoints")
    # The launcher's pre-flight refuses in a second, naming the tensor.
    result = elastic_train("run", "--run-dir", str(run_dir), "--preset", "small",
                           "--steps", "40", cwd=tmp_path)
    assert result.returncode == 3
    line = one_error_line(result)
    assert "step-00000030 is for another model: tensor 'tok_emb.weight' is " \
           "torch.float32[256, 64] there and torch.float32[256, 128] here" in line
    assert "left untouched" in line
    # The worker refuses too (plain torchrun, no pre-flight), and every rank exits.
    job = harness.torchrun(run_dir, ["--preset", "small", "--steps", "40"], max_restarts=0)
    assert job.wait(180) != 0
    assert "is for another model: tensor 'tok_emb.weight'" in job.output()
    assert tree_digest(run_dir / "checkpoints") == before


def test_corrupt_and_torn_checkpoints_are_skipped(finished_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    ckpts = run_dir / "checkpoints"
    final_digest = harness.final_digest(run_dir)
    # Bit rot in the newest checkpoint: same size, one byte flipped.
    payload = ckpts / "step-00000030" / "state.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x40
    payload.write_bytes(bytes(data))
    # Leftovers of saves torn by a crash: a temp dir, and a step dir with no manifest.
    shutil.copytree(ckpts / "step-00000020", ckpts / ".tmp-step-00000040-999-dead")
    (ckpts / ".tmp-step-00000040-999-dead" / "manifest.json").unlink()
    shutil.copytree(ckpts / "step-00000020", ckpts / "step-00000035")
    (ckpts / "step-00000035" / "manifest.json").unlink()
    verify = elastic_train("checkpoints", "verify", str(run_dir), cwd=tmp_path)
    assert verify.returncode == 1
    assert "step-00000030: CORRUPT: state.pt fails its sha256 checksum" in verify.stdout
    assert "step-00000035: CORRUPT: manifest.json is missing" in verify.stdout

    job = harness.torchrun(run_dir, [*TINY, "--steps", "30", "--checkpoint-every", "10"],
                           max_restarts=0)
    assert job.wait(180) == 0, job.report()
    out = job.output()
    assert "skipping corrupt checkpoint" in out and "step-00000035" in out
    assert "step-00000030: state.pt fails its sha256 checksum" in out
    events = job.events()
    skipped = [e["step"] for e in events if e["event"] == "checkpoint_skipped"]
    assert skipped == [35, 30]
    assert [e["step"] for e in events if e["event"] == "checkpoint_loaded"] == [20]
    assert not (ckpts / ".tmp-step-00000040-999-dead").exists()
    # Redone from step 20, the run ends exactly where the uncorrupted one did.
    assert harness.digest_at(run_dir, 30) == final_digest
    # The corrupt bytes were set aside, not deleted.
    assert list(ckpts.glob("step-00000030.corrupt-*"))


def test_all_checkpoints_corrupt_stops_instead_of_starting_over(finished_run: Path,
                                                                tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    for payload in (run_dir / "checkpoints").glob("step-*/state.pt"):
        payload.write_bytes(payload.read_bytes()[:-10])
    before = tree_digest(run_dir / "checkpoints")
    job = harness.torchrun(run_dir, [*TINY, "--steps", "30"], max_restarts=0)
    assert job.wait(180) != 0
    assert "none of the 3 checkpoints under" in job.output()
    assert "nothing was deleted" in job.output()
    assert tree_digest(run_dir / "checkpoints") == before


def test_missing_and_edited_manifests_are_skipped_and_set_aside(finished_run: Path,
                                                                tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    ckpts = run_dir / "checkpoints"
    final_digest = harness.final_digest(run_dir)
    edited = ckpts / "step-00000030" / "manifest.json"
    manifest = json.loads(edited.read_text())
    manifest["world_size"] = 1  # a hand edit; its checksum no longer matches
    edited.write_text(json.dumps(manifest))
    (ckpts / "step-00000020" / "manifest.json").unlink()
    verify = elastic_train("checkpoints", "verify", str(run_dir), cwd=tmp_path)
    assert verify.returncode == 1
    assert f"{ckpts}/step-00000030: CORRUPT: manifest.json was edited (its checksum does not " \
           "match)" in verify.stdout.splitlines()
    assert f"{ckpts}/step-00000020: CORRUPT: manifest.json is missing" in \
        verify.stdout.splitlines()

    job = harness.torchrun(run_dir, [*TINY, "--steps", "30", "--checkpoint-every", "10"],
                           max_restarts=0)
    assert job.wait(180) == 0, job.report()
    out = job.output()
    assert f"skipping corrupt checkpoint {ckpts}/step-00000030: manifest.json was edited " \
           "(its checksum does not match)" in out
    assert f"skipping corrupt checkpoint {ckpts}/step-00000020: manifest.json is missing" in out
    events = job.events()
    assert [e["step"] for e in events if e["event"] == "checkpoint_loaded"] == [10]
    assert harness.digest_at(run_dir, 30) == final_digest
    assert len(list(ckpts.glob("step-00000030.corrupt-*"))) == 1   # kept, out of the way
    assert len(list(ckpts.glob("step-00000020.corrupt-*"))) == 1


def _make_marker(path: str) -> None:
    Path(path).write_text("code ran")


class Exploit:
    """Unpickling this runs ``_make_marker``: what a planted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (_make_marker, (self.marker,))


def test_a_planted_pickle_is_refused_and_never_runs(finished_run: Path, tmp_path: Path) -> None:
    """A checkpoint with a valid manifest whose payload would run code when unpickled."""
    import torch

    from elastic_train.checkpoint.storage import CheckpointStore

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    store = CheckpointStore(run_dir / "checkpoints")
    (good,) = [i for i in store.list() if i.step == 30]
    marker = tmp_path / "marker"
    payload = {**store.load(good), "extra": Exploit(marker)}
    meta = {k: v for k, v in good.manifest.items()
            if k in ("world_size", "model_digest", "model_shapes", "task", "task_options")}
    store.write(40, payload, meta)
    before = tree_digest(run_dir / "checkpoints")
    job = harness.torchrun(run_dir, [*TINY, "--steps", "50"], max_restarts=0)
    assert job.wait(180) != 0
    assert (f"elastic_train: error: checkpoint {store.root}/step-00000040 holds a pickled "
            "tests.integration.test_bad_input._make_marker that safe loading refuses to run; "
            "it was not loaded — delete it if you did not write it") in job.output()
    assert not marker.exists()                                   # the code never ran
    assert tree_digest(run_dir / "checkpoints") == before        # nothing deleted or moved
    torch.load(store.root / "step-00000040" / "state.pt", weights_only=False)
    assert marker.read_text() == "code ran"                      # it really was an exploit
