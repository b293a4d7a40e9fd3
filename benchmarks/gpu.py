"""GPU benchmark: checkpoint stall, steady state, snapshot memory and recovery, in one run.

    python benchmarks/gpu.py                        # on a GPU: 1B and small GPT (minutes)
    python benchmarks/gpu.py --models small --saves 2 --skip-recovery   # a quick look
    python benchmarks/gpu.py --device cpu --models tiny --saves 2       # dry run, no GPU

Every figure is a ratio against a baseline measured in the same process, interleaved
(machines are shared and noisy). Per model (fp32 weights and AdamW state, bf16 autocast
compute on CUDA):

1. stall per checkpoint: how much longer the save's step took than a step without one
   (the save call plus the next step, minus the median plain step), for ours
   (``CheckpointManager.save``: pinned reused buffers, copy overlapped with the next
   forward/backward on a side stream, persist in the background), synchronous
   ``torch.save``, and ``torch.distributed.checkpoint.async_save`` (thread, and pinned-
   memory staging where the installed torch has ``DefaultStager``); against the floor, a
   pinned device-to-host copy of the same bytes into buffers allocated beforehand;
2. steady state: mean step time with ours every N steps / without checkpoints;
3. persist seconds, and host memory: the snapshot's buffers and the process' RSS after
   each save (reused buffers: flat after the first);
4. recovery on the GPU (``elastic-train run``): SIGKILL -> next completed step, the restart
   path (1 worker, NCCL) and live recovery (2 workers sharing the GPU on gloo).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic_train.checkpoint.manager import CheckpointManager
from elastic_train.checkpoint.storage import CheckpointStore
from elastic_train.config import CheckpointConfig
from elastic_train.events.log import EventLog, read_events
from elastic_train.tasks.gpt import GPT, PRESETS, GPTConfig
from elastic_train.worker.distributed import Group

MODELS: dict[str, tuple[GPTConfig, int]] = {
    # name: (shape, batch); 12 * n_layer * n_embd^2 parameters in the blocks
    "1b": (GPTConfig(seq_len=1024, n_layer=20, n_head=16, n_embd=2048), 8),   # 1.01B
    "small": (GPTConfig(seq_len=1024, n_layer=12, n_head=12, n_embd=768), 8),  # 85M (GPT-2 S)
    "tiny": (PRESETS["tiny"], 8),                                               # dry runs
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """One GPT, AdamW and a fixed random batch; ``step`` trains one step."""

    def __init__(self, cfg: GPTConfig, batch: int, device: torch.device) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = GPT(cfg).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), device=device)
        self.params = sum(p.numel() for p in self.model.parameters())

    def forward_backward(self) -> None:
        x, y = self.tokens[:, :-1], self.tokens[:, 1:]
        autocast = torch.autocast("cuda", torch.bfloat16) if self.device.type == "cuda" \
            else contextlib.nullcontext()
        with autocast:
            logits = self.model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()

    def step(self) -> None:
        self.forward_backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed_step(self) -> float:
        started = time.perf_counter()
        self.step()
        _sync(self.device)
        return time.perf_counter() - started

    def objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer}

    def state_bytes(self) -> int:
        tensors = list(self.model.state_dict().values())
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


class Ours:
    """``CheckpointManager.save`` as the trainer calls it (overlap with the next step)."""

    name = "ours (elastic_train)"

    def __init__(self, trainer: Trainer, root: Path) -> None:
        self.trainer = trainer
        self.events_path = root / "events.jsonl"
        self.manager = CheckpointManager(
            CheckpointStore(root / "ours"),
            Group(rank=0, world_size=1, backend="gloo", device=trainer.device),
            CheckpointConfig(every_steps=None, keep=1, asynchronous=True),
            EventLog(self.events_path))
        self.rss: list[int] = []

    def save(self, step: int) -> None:
        self.manager.save(step, self.trainer.objects(), overlap_with=self.trainer.optimizer)

    def settle(self) -> None:
        self.manager.finish()
        self.rss.append(_rss_bytes())

    def persist_seconds(self) -> list[float]:
        return [e["persist_seconds"] for e in read_events(self.events_path)
                if e["event"] == "checkpoint_saved"]

    def buffer_bytes(self) -> int:
        return self.manager._buffers.bytes_allocated


class TorchSave:
    name = "torch.save (synchronous)"

    def __init__(self, trainer: Trainer, root: Path) -> None:
        self.trainer = trainer
        self.path = root / "torch-save.pt"

    def save(self, step: int) -> None:
        torch.save({"model": self.trainer.model.state_dict(),
                    "optimizer": self.trainer.optimizer.state_dict(), "step": step}, self.path)

    def settle(self) -> None:
        self.path.unlink(missing_ok=True)  # a 1B model's state is 12 GiB a copy


class DcpAsync:
    """``torch.distributed.checkpoint.async_save``; the next ``optimizer.step`` waits for
    the staging (DCP's contract: the state must not change while it is copied)."""

    def __init__(self, trainer: Trainer, root: Path, pinned: bool) -> None:
        import inspect

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if pinned and "async_stager" not in inspect.signature(dcp.async_save).parameters:
            raise RuntimeError(f"torch {torch.__version__}'s async_save has no async_stager")

        self.dcp, self.get_state_dict = dcp, get_state_dict
        self.trainer = trainer
        self.root = root / ("dcp-pinned" if pinned else "dcp-thread")
        self.stager: Any = None
        self.name = "DCP async_save (thread)"
        if pinned:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = trainer.device.type == "cuda"

            options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                     use_async_staging=cuda, use_non_blocking_copy=cuda)
            self.make_stager = lambda: DefaultStager(options)
            self.stager = self.make_stager()
            self.name = "DCP async_save (pinned-memory staging, async)"
        self.remade = 0
        self.pending: Any = None
        self.hook = trainer.optimizer.register_step_pre_hook(self._before_step)
        self.persist: list[float] = []
        self._began = 0.0

    def _before_step(self, *_: Any) -> None:
        staging = getattr(self.pending, "staging_completion", None)
        if staging is not None:
            staging.result()

    def save(self, step: int) -> None:
        model_state, optim_state = self.get_state_dict(self.trainer.model,
                                                       self.trainer.optimizer)
        self._began = time.perf_counter()
        kwargs: dict[str, Any] = {"checkpoint_id": str(self.root / f"step-{step}")}
        if self.stager is not None:
            if self._stager_closed():
                self.stager = self.make_stager()
                self.remade += 1
            kwargs["async_stager"] = self.stager
        self.pending = self.dcp.async_save({"model": model_state, "optim": optim_state},
                                           **kwargs)

    def settle(self) -> None:
        pending, self.pending = self.pending, None
        upload = getattr(pending, "upload_completion", pending)
        if upload is not None:
            upload.result()
            self.persist.append(time.perf_counter() - self._began)
        shutil.rmtree(self.root, ignore_errors=True)  # a 1B model's state is 12 GiB a copy

    def _stager_closed(self) -> bool:
        """Whether torch closed the stager since the last save. torch 2.11 did (seen on the
        H100: the next stage failed with ``KeyError: <class 'type'>``, its copy table
        emptied); 2.13 closes only a stager that ``async_save`` made itself. A closed
        stager is made again, and its pinned buffers with it (counted in ``remade``)."""
        inner = getattr(self.stager, "_state_dict_stager", None)
        return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)

    def close(self) -> None:
        self.hook.remove()
        if self.stager is not None:
            self.stager.close()


def floor_seconds(trainer: Trainer, reps: int = 3) -> float:
    """A pinned device-to-host copy of the same tensors into buffers allocated beforehand
    (on the CPU: a plain copy). The least any snapshot that leaves the GPU must move."""
    sources = list(trainer.model.state_dict().values())
    for state in trainer.optimizer.state.values():
        sources += [v for v in state.values() if isinstance(v, torch.Tensor)]
    cuda = trainer.device.type == "cuda"
    buffers = [torch.empty(s.shape, dtype=s.dtype, pin_memory=cuda) for s in sources]
    times = []
    for _ in range(reps + 1):
        _sync(trainer.device)
        started = time.perf_counter()
        for src, dst in zip(sources, buffers, strict=True):
            dst.copy_(src, non_blocking=cuda)
        _sync(trainer.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{_median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def _rotations(items: list[Any], rounds: int) -> Iterator[list[Any]]:
    for r in range(rounds):
        k = r % len(items)
        yield items[k:] + items[:k]


def bench_model(name: str, device: torch.device, saves: int, between: int, root: Path,
                steady_steps: int, every: int, steady: bool) -> None:
    cfg, batch = MODELS[name]
    trainer = Trainer(cfg, batch, device)
    for _ in range(3):  # warm-up; creates the optimizer's state
        trainer.step()
    _sync(device)
    size = trainer.state_bytes()
    print(f"\n## {name}: {trainer.params / 1e6:.1f}M parameters, state {size / 2**30:.2f} GiB "
          f"(fp32 weights + AdamW moments), batch {batch} x {cfg.seq_len} tokens, {device}")

    if saves == 0:  # --saves 0: the steady state alone
        if steady:
            _steady_state(trainer, root, steady_steps, every, 3)
        return
    methods: list[Any] = [Ours(trainer, root), TorchSave(trainer, root)]
    for pinned in (False, True):
        try:
            methods.append(DcpAsync(trainer, root, pinned))
        except Exception as exc:  # an older torch: say which and go on
            print(f"DCP async_save ({'pinned' if pinned else 'thread'}) not run: {exc!r}")
    plain: list[float] = []
    stalls: dict[str, list[float]] = {m.name: [] for m in methods}
    blocked: dict[str, list[float]] = {m.name: [] for m in methods}
    step = 3
    for order in _rotations(methods, saves):
        for method in order:
            for _ in range(between):
                plain.append(trainer.timed_step())
                step += 1
            _sync(device)
            started = time.perf_counter()
            method.save(step)
            called = time.perf_counter() - started
            trainer.step()  # the next step: an overlapped copy or a staging wait lands here
            _sync(device)
            together = time.perf_counter() - started
            step += 1
            typical = _median(plain[-between:])
            stalls[method.name].append(max(0.0, together - typical))
            blocked[method.name].append(called)
            method.settle()
    floor = floor_seconds(trainer)
    base = _median(stalls["torch.save (synchronous)"])
    print(f"plain step: {_spread(plain)} s; floor (pinned D2H copy of the state): "
          f"{floor:.3f} s")
    print("\n| stall per save (s): median (min-max) | stall | / torch.save | / floor |"
          " save call only |")
    print("|---|---|---|---|---|")
    for method in methods:
        values = stalls[method.name]
        print(f"| {method.name} | {_spread(values)} | {_median(values) / base:.3f} | "
              f"{_median(values) / floor:.2f} | {_spread(blocked[method.name])} |")

    ours: Ours = methods[0]
    persists = ours.persist_seconds()
    print(f"\npersist (ours, background): {_spread(persists)} s for "
          f"{size / 2**30:.2f} GiB; DCP persists: "
          + "; ".join(f"{m.name}: {_spread(m.persist)} s" for m in methods
                      if isinstance(m, DcpAsync)))
    print(f"snapshot buffers (ours): {ours.buffer_bytes() / 2**30:.2f} GiB allocated once; "
          f"RSS after each of our saves (GiB): "
          f"{', '.join(f'{r / 2**30:.2f}' for r in ours.rss)}")
    for method in methods:
        if isinstance(method, DcpAsync):
            if method.remade:
                print(f"{method.name}: torch closed the stager after a save; it was made "
                      f"again (and its pinned buffers) {method.remade} of {saves} times")
            method.close()

    if steady:
        _steady_state(trainer, root, steady_steps, every, step)
    del trainer, methods
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _steady_state(trainer: Trainer, root: Path, steady_steps: int, every: int,
                  step: int) -> None:
    """Blocks without checkpoints and with ours every ``every`` steps, in turn."""
    device = trainer.device
    steady = Ours(trainer, root / "steady")
    step += 1
    steady.save(step)  # allocates the pinned buffers, as a job's first save does
    trainer.step()
    steady.settle()
    per_block: dict[str, list[float]] = {"off": [], "ours": []}
    for order in _rotations(["off", "ours"], 4):
        for mode in order:
            _sync(device)
            started = time.perf_counter()
            for i in range(steady_steps):
                trainer.step()
                step += 1
                if mode == "ours" and i % every == every // 2:  # its next steps in the block
                    steady.save(step)
            _sync(device)
            per_block[mode].append((time.perf_counter() - started) / steady_steps)
            print(f"steady block {mode}: {per_block[mode][-1]:.4f} s/step", flush=True)
            steady.settle()
    ratio = _median(per_block["ours"]) / _median(per_block["off"])
    print(f"\nsteady state, {steady_steps}-step blocks: mean step without checkpoints "
          f"{_spread(per_block['off'])} s, with ours every {every} steps "
          f"{_spread(per_block['ours'])} s: ratio {ratio:.3f} (target <= 1.01); RSS after "
          f"each save (GiB, ours alone in this part): "
          f"{', '.join(f'{r / 2**30:.2f}' for r in steady.rss)}")


def _recovery(tmp: Path) -> None:
    """SIGKILL -> the next completed step on the GPU, restart path and live path."""
    from tests.integration import harness

    preset = "medium" if torch.cuda.is_available() else "tiny"
    job = ["--task-opt", f"preset={preset}", "--batch-size", "32", "--steps", "400",
           "--checkpoint-every", "50", "--log-every", "100"]
    one = "nccl" if torch.cuda.is_available() else "gloo"
    restart = f"restart path (1 worker, {one})"
    cases: dict[str, tuple[list[str], int]] = {
        restart: (["--nproc-per-node", "1", "--recovery", "restart", "--backend", one], 0),
        "live recovery (2 workers, gloo)": (["--nproc-per-node", "2", "--backend", "gloo"], 1),
    }
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(3):
        for name, (extra, rank) in cases.items():
            run_dir = tmp / f"recovery-{rep}-{len(seconds[name])}-{rank}"
            run = harness.elastic_run(run_dir, [*job, *extra, "--max-restarts", "2"])
            try:
                run.wait_for_event(lambda e: e["event"] == "step" and e["step"] == 120, 300)
                killed_at = time.time()
                run.kill_worker(rank)
                seconds[name].append(_next_step_after_recovery(run, killed_at) - killed_at)
            finally:
                run.stop()
    print(f"\n## recovery: SIGKILL -> next completed step ({preset} GPT, 3 each, interleaved)")
    base = _median(seconds[restart])
    for name, values in seconds.items():
        print(f"| {name} | {_spread(values)} s | {_median(values) / base:.2f} |")


def _next_step_after_recovery(run: Any, killed_at: float, timeout: float = 300) -> float:
    """The time of the first step logged after the recovery that followed the kill (a
    ``recovery`` or ``checkpoint_loaded`` record), in the event log's order."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recovered = False
        for e in run.events():
            if e["event"] in ("recovery", "checkpoint_loaded") and e["time"] > killed_at:
                recovered = True
            elif recovered and e["event"] == "step":
                return float(e["time"])
        if run.proc.poll() is not None:
            break
        time.sleep(0.01)
    raise SystemExit(f"no step after the recovery:\n{run.report()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="1b,small")
    parser.add_argument("--saves", type=int, default=4, help="saves per method")
    parser.add_argument("--between", type=int, default=4, help="plain steps between saves")
    parser.add_argument("--steady-steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=30, help="steady state: save every N")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--steady", default="small,tiny",
                        help="models whose steady state is measured too (a 1B model's "
                             "persist takes longer than the steps between saves here)")
    parser.add_argument("--skip-recovery", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    root = Path(tempfile.mkdtemp(prefix="gpu-bench-", dir=args.dir))
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}")
    else:
        print(f"device: CPU (dry run), torch {torch.__version__}")
    # DCP's collectives: a group of one process.
    dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)
    try:
        for name in filter(None, args.models.split(",")):  # --models '': recovery only
            bench_model(name, device, args.saves, args.between, root / name,
                        args.steady_steps, args.every, name in args.steady.split(","))
        if not args.skip_recovery:
            _recovery(root)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
