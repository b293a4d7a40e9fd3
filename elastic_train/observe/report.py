"""``elastic-train report RUN_DIR``: a picture of a run and a short summary, from its event log.

The picture has loss and throughput over steps and over wall time, the step reached and the
world size over wall time; every failure (with the downtime until training resumed),
restart, live recovery, resize and checkpoint is marked. It needs matplotlib (``pip install
'elastic-train[report]'``); the summary does not.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_train.errors import ReportError
from elastic_train.events.log import read_events
from elastic_train.events.schema import Event
from elastic_train.observe.progress import format_eta
from elastic_train.observe.summary import launch_segment, summarize
from elastic_train.rundir import RunDir

THROUGHPUT_WINDOW = 10
"""Steps over which the drawn throughput is measured (wall time, pauses included)."""


@dataclass
class Incarnation:
    """One start of the workers: the first, or one after a restart."""

    restart: int
    started: float
    world_size: int | None
    resumed_step: int = 0
    steps: list[dict[str, Any]] = field(default_factory=list)

    def throughput(self) -> list[tuple[float, int, float]]:
        """(time, step, samples or steps per second) over the last THROUGHPUT_WINDOW steps."""
        out = []
        for i, record in enumerate(self.steps):
            if i == 0:
                continue
            first = self.steps[max(0, i - THROUGHPUT_WINDOW)]
            seconds = record["time"] - first["time"]
            if seconds <= 0:
                continue
            if record.get("samples") is not None and first.get("samples") is not None:
                amount = record["samples"] - first["samples"]
            else:
                amount = record["step"] - first["step"]
            out.append((record["time"], record["step"], amount / seconds))
        return out


@dataclass
class Downtime:
    """The end of an incarnation that did not finish, and how the next one resumed."""

    last_seen: float        # the failed incarnation's last logged event
    last_step: int | None   # its newest step
    resumed: float | None   # the first step after the restart ended (None: never)
    resumed_from: int       # the step the restart resumed from

    @property
    def downtime(self) -> float | None:
        return None if self.resumed is None else self.resumed - self.last_seen

    @property
    def lost_steps(self) -> int:
        return max(0, (self.last_step or 0) - self.resumed_from)


@dataclass
class Timeline:
    """A launch of a run, as drawn: its incarnations, checkpoints, failures and resizes."""

    run_id: str | None
    total_steps: int | None
    incarnations: list[Incarnation]
    checkpoints: list[tuple[float, int]]          # (time, step) of every save
    failures: list[Downtime]
    resizes: list[tuple[float, int, int]]         # (time, old, new world size)
    records: list[dict[str, Any]]
    live_recoveries: list[dict[str, Any]] = field(default_factory=list)
    """The ``recovery`` events of kind live: the world re-formed in place."""

    @property
    def began(self) -> float:
        return self.incarnations[0].started

    @property
    def ended(self) -> float:
        return self.records[-1]["time"]

    @property
    def samples_known(self) -> bool:
        return all(r.get("samples") is not None for i in self.incarnations for r in i.steps)


def timeline(events: Iterable[dict[str, Any]], run_id: str | None = None) -> Timeline:
    """Split the newest launch of ``run_id`` (default: the newest run) into incarnations."""
    run_id, records = launch_segment(events, run_id)
    if not records:
        raise ReportError("the event log has no run" + (f" {run_id!r}" if run_id else "")
                          + ": pass the --run-dir of a job that started")
    incarnations: list[Incarnation] = []
    checkpoints: list[tuple[float, int]] = []
    for record in records:
        kind = record["event"]
        if kind == Event.START:
            incarnations.append(Incarnation(record.get("restart", 0), record["time"],
                                            record.get("world_size")))
        elif kind == Event.CHECKPOINT_LOADED:
            incarnations[-1].resumed_step = record["step"]
        elif kind == Event.STEP:
            incarnations[-1].steps.append(record)
        elif kind == Event.CHECKPOINT_SAVED:
            checkpoints.append((record["time"], record["step"]))
    failures, resizes = [], []
    for before, after in itertools.pairwise(incarnations):
        seen = [r["time"] for r in records if before.started <= r["time"] < after.started]
        failures.append(Downtime(
            last_seen=max(seen, default=before.started),
            last_step=before.steps[-1]["step"] if before.steps else None,
            resumed=after.steps[0]["time"] if after.steps else None,
            resumed_from=after.resumed_step))
        if before.world_size != after.world_size and None not in (before.world_size,
                                                                  after.world_size):
            resizes.append((after.started, before.world_size, after.world_size))
    live = [r for r in records if r["event"] == Event.RECOVERY and r.get("kind") == "live"]
    return Timeline(run_id, records[0].get("total_steps"), incarnations, checkpoints,
                    failures, resizes, records, live)


def summary_lines(line: Timeline) -> list[str]:
    """The end-of-run summary plus wall time, throughput, and every failure's cost."""
    out = summarize(line.records, line.run_id).lines()
    wall = line.ended - line.began
    steps = [r for i in line.incarnations for r in i.steps]
    busy = sum(r.get("seconds") or 0.0 for r in steps)
    out.append(f"  wall time         {_duration(wall)} ({len(steps)} steps trained, "
               f"{_duration(busy)} of it in steps)")
    rates = [rate for i in line.incarnations for _, _, rate in i.throughput()]
    if rates:
        unit = "samples/s" if line.samples_known else "steps/s"
        out.append(f"  throughput        {sorted(rates)[len(rates) // 2]:.0f} {unit} "
                   f"(median over windows of {THROUGHPUT_WINDOW} steps)")
    if line.checkpoints:
        out.append(f"  checkpoints at    steps {_steps_list([s for _, s in line.checkpoints])}")
    for n, failure in enumerate(line.failures, 1):
        downtime = "never resumed" if failure.downtime is None else \
            f"training again {failure.downtime:.1f} s after the last sign of life"
        out.append(f"  failure {n}         after step {failure.last_step or 0}; resumed from "
                   f"step {failure.resumed_from} ({failure.lost_steps} steps redone); "
                   f"{downtime}")
    for n, rec in enumerate(line.live_recoveries, 1):
        source = ("the newest checkpoint, loaded in place" if rec.get("state_from") ==
                  "checkpoint" else f"{(rec.get('bytes') or 0) / 1e6:.1f} MB of state from "
                  f"rank {rec.get('source_rank', '?')}")
        out.append(f"  live recovery {n}   {_what_changed(rec)} at step {rec['step']} "
                   f"({rec.get('steps_redone') or 0} step redone, {source})"
                   f"{_recovery_seconds(rec)}")
    for rec in (r for r in line.records if r["event"] == Event.REPLICAS_DIVERGED):
        who = f"rank(s) {rec.get('named')} named by majority" if rec.get("named") else \
            f"no majority: ranks {rec.get('suspects')} suspect"
        out.append(f"  CORRUPTION        the replicas' state differed after step {rec['step']}: "
                   f"{who}, on {', '.join(sorted(set(rec.get('nodes') or []))) or '?'}")
    for when, old, new in line.resizes:
        out.append(f"  resize            world size {old} -> {new} after "
                   f"{_duration(when - line.began)}")
    return out


def _what_changed(rec: Mapping[str, Any]) -> str:
    """A live recovery's cause, in the report's words."""
    ranks = ", ".join(str(r) for r in rec.get("failed_ranks") or []) or "?"
    before, after = rec.get("previous_world_size"), rec.get("world_size")
    if rec.get("cause") == "node joined":
        return f"a node joined, world {before} -> {after},"
    if rec.get("lost_nodes"):
        return f"{rec['lost_nodes']} node(s) lost (rank {ranks}), world {before} -> {after},"
    return f"rank {ranks} replaced"


def _recovery_seconds(rec: Mapping[str, Any]) -> str:
    if rec.get("seconds") is None:
        return ""
    return f"; {rec['seconds']:.2f} s from detection to the state in place"


def _steps_list(steps: Sequence[int], limit: int = 12) -> str:
    shown = ", ".join(str(s) for s in steps[:limit])
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


def render(line: Timeline, path: Path) -> None:
    """Draw ``line`` into a PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("the report's picture needs matplotlib: pip install "
                          "'elastic-train[report]' (or pass --no-plot for the summary)") \
            from None
    wall = line.ended - line.began
    scale, unit = (1.0, "s") if wall < 300 else (60.0, "min") if wall < 5 * 3600 else \
        (3600.0, "h")

    def t(value: float) -> float:
        return (value - line.began) / scale

    fig, axes = plt.subplots(3, 2, figsize=(15, 10.5))
    (loss_s, loss_t), (rate_s, rate_t), (step_s, world_t) = axes
    rate_s.sharex(loss_s)
    for ax in (rate_t, step_s, world_t):
        ax.sharex(loss_t)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rate_unit = "samples/s" if line.samples_known else "steps/s"
    for n, inc in enumerate(line.incarnations):
        color = colors[n % len(colors)]
        label = "first start" if n == 0 else \
            f"restart {inc.restart} (from step {inc.resumed_step})"
        steps = [r["step"] for r in inc.steps]
        times = [t(r["time"]) for r in inc.steps]
        losses = [r.get("loss") for r in inc.steps]
        if any(v is not None for v in losses):
            loss_s.plot(steps, losses, color=color, lw=1, label=label)
            loss_t.plot(times, losses, color=color, lw=1, label=label)
        rates = inc.throughput()
        rate_s.plot([s for _, s, _ in rates], [v for _, _, v in rates], color=color, lw=1,
                    label=label)
        rate_t.plot([t(w) for w, _, _ in rates], [v for _, _, v in rates], color=color, lw=1,
                    label=label)
        step_s.plot(times, steps, color=color, lw=1.5, label=label)
    # World size over time: constant within an incarnation, gaps while down.
    for n, inc in enumerate(line.incarnations):
        end = line.failures[n].last_seen if n < len(line.failures) else line.ended
        if inc.world_size is not None:
            world_t.hlines(inc.world_size, t(inc.started), t(end), color="tab:blue", lw=2.5)
    sizes = [i.world_size for i in line.incarnations if i.world_size is not None]
    if sizes:
        world_t.set_ylim(0, max(sizes) + 1)
        world_t.yaxis.get_major_locator().set_params(integer=True)
    # Marks: checkpoints (green), failures and the downtime until training resumed (red),
    # resizes (purple).
    for when, step in line.checkpoints:
        for ax in (loss_s, rate_s):
            ax.axvline(step, color="tab:green", ls=":", lw=0.8, alpha=0.7)
        for ax in (loss_t, rate_t, world_t):
            ax.axvline(t(when), color="tab:green", ls=":", lw=0.8, alpha=0.7)
        step_s.plot([t(when)], [step], marker="v", color="tab:green", ms=5, ls="none")
    for failure in line.failures:
        resumed = failure.resumed if failure.resumed is not None else line.ended
        for ax in (loss_t, rate_t, step_s, world_t):
            ax.axvspan(t(failure.last_seen), t(resumed), color="tab:red", alpha=0.15, lw=0)
            ax.axvline(t(failure.last_seen), color="tab:red", ls="--", lw=1)
        for ax in (loss_s, rate_s):
            if failure.last_step is not None:
                ax.axvline(failure.last_step, color="tab:red", ls="--", lw=1)
            ax.axvspan(failure.resumed_from, failure.last_step or failure.resumed_from,
                       color="tab:red", alpha=0.15, lw=0)
    for rec in line.live_recoveries:
        for ax in (loss_t, rate_t, step_s, world_t):
            ax.axvline(t(rec["time"]), color="tab:orange", ls="--", lw=1)
        for ax in (loss_s, rate_s):
            ax.axvline(rec["step"], color="tab:orange", ls="--", lw=1)
    for when, old, new in line.resizes:
        for ax in (loss_t, rate_t, step_s, world_t):
            ax.axvline(t(when), color="tab:purple", ls="-.", lw=1.2)
        world_t.annotate(f"{old} -> {new}", (t(when), new), textcoords="offset points",
                         xytext=(4, 4), color="tab:purple")
    loss_s.set(title="Loss over steps", ylabel="loss")
    loss_t.set(title="Loss over wall time", ylabel="loss")
    rate_s.set(title=f"Throughput over steps (last {THROUGHPUT_WINDOW} steps)",
               ylabel=rate_unit)
    rate_t.set(title="Throughput over wall time", ylabel=rate_unit)
    step_s.set(title="Step reached over wall time (drops: steps redone after a failure)",
               xlabel=f"wall time ({unit})", ylabel="step")
    world_t.set(title="World size over wall time", xlabel=f"wall time ({unit})",
                ylabel="ranks")
    rate_s.set_xlabel("step")
    rate_t.set_xlabel(f"wall time ({unit})")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in (loss_s, step_s):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right" if ax is loss_s else "lower right", fontsize=8)
    legend = [plt.Line2D([], [], color="tab:green", ls=":", label="checkpoint"),
              plt.Line2D([], [], color="tab:red", ls="--", label="failure (shaded: down / "
                         "redone)"),
              plt.Line2D([], [], color="tab:orange", ls="--", label="live recovery (in "
                         "place)"),
              plt.Line2D([], [], color="tab:purple", ls="-.", label="resize")]
    world_t.legend(handles=legend, loc="lower right", fontsize=8)
    done = max((r["step"] for i in line.incarnations for r in i.steps), default=0)
    fig.suptitle(f"run {line.run_id}: {done}/{line.total_steps} steps, "
                 f"{_count(len(line.failures), 'restart')}, "
                 f"{len(line.live_recoveries)} live "
                 f"{'recovery' if len(line.live_recoveries) == 1 else 'recoveries'}, "
                 f"{_count(len(line.checkpoints), 'checkpoint')}, "
                 f"world size {' -> '.join(str(s) for s in _changes(sizes)) or 'n/a'}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else format_eta(seconds)


def _changes(values: Sequence[int]) -> list[int]:
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


@dataclass(frozen=True)
class Report:
    """What ``write_report`` wrote."""

    text: str
    summary_path: Path
    image_path: Path | None


def write_report(run_dir: Path | RunDir, output: Path | None = None, run_id: str | None = None,
                 plot: bool = True) -> Report:
    """Write ``report.png`` and ``report.txt`` (default: into ``run_dir``, or for an
    object store into this host's local directory of it)."""
    layout = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    log = layout.gathered_events()
    if not log.is_file():
        raise ReportError(f"{log} does not exist: pass the --run-dir of a job")
    if layout.remote and log.stat().st_size == 0:
        raise ReportError(f"{layout.location} has no event log: pass the --run-dir of a job")
    line = timeline(read_events(log), run_id)
    image = Path(output) if output is not None else layout.root / "report.png"
    if plot:
        render(line, image)
    text = "\n".join(summary_lines(line)) + "\n"
    summary = image.with_suffix(".txt")
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(text)
    return Report(text, summary, image if plot else None)
