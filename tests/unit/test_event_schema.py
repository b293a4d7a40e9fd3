"""Unit tests of the event log's schema (events/schema.py), of the package keeping to it (a
source check: events are emitted as typed records and recognised by ``Event``, never by a
spelled-out name) and of the run directory's layout (rundir.py). Single process, no torch.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

import elastic_train
from elastic_train.errors import ConfigError
from elastic_train.events import schema as event_schema
from elastic_train.events.log import EventLog, read_events
from elastic_train.events.schema import (
    CheckpointSaved,
    Event,
    EventRecord,
    Hang,
    Start,
    Startup,
    Step,
)
from elastic_train.rundir import (
    CHECKPOINTS_DIR,
    EVENTS_FILE,
    SAMPLES_DIR,
    RunDir,
    prepare_run_dir,
)

PACKAGE = Path(elastic_train.__file__).resolve().parent
EVENT_NAMES = frozenset(e.value for e in Event)


def _record_classes() -> list[type[EventRecord]]:
    """Every subclass of EventRecord, at any depth."""
    found: list[type[EventRecord]] = []
    todo = list(EventRecord.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


# --- one record class per event -----------------------------------------------------------


def test_every_event_has_exactly_one_record_class_and_every_class_an_event() -> None:
    classes = [c for c in _record_classes() if c.__module__ == event_schema.__name__]
    assert classes, "no record classes found"
    by_event: dict[Event, list[str]] = {}
    for cls in classes:
        event = cls.__dict__.get("event")
        assert isinstance(event, Event), f"{cls.__name__} declares no Event of its own"
        by_event.setdefault(event, []).append(cls.__name__)
    assert {e: names for e, names in by_event.items() if len(names) != 1} == {}
    assert set(by_event) == set(Event)
    # No record class lives elsewhere (a second definition of an event would be missed).
    assert [c.__qualname__ for c in _record_classes() if c not in classes
            and c.__module__.startswith("elastic_train")] == []


def test_event_names_are_unique_and_compare_as_the_strings_read_back() -> None:
    assert len(EVENT_NAMES) == len(Event)
    for event in Event:
        assert event == event.value and str(event) == event.value
        assert json.loads(json.dumps({"event": event}))["event"] == event
        assert {event.value: 1}.get(event) == 1 and {event: 1}.get(event.value) == 1


@pytest.mark.parametrize("cls", sorted((c for c in _record_classes()
                                        if c.__module__ == event_schema.__name__),
                                       key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_record_classes_are_frozen_keyword_only_and_their_markers_name_fields(
        cls: type[EventRecord]) -> None:
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    assert params.frozen
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert all(f.kw_only for f in fields.values())
    assert "event" not in fields and "time" not in fields   # the log writes those itself
    hints = typing.get_type_hints(cls)
    for name in cls.omitted_when_none:
        assert name in fields, f"{cls.__name__}.omitted_when_none names no field {name!r}"
        assert fields[name].default is None, f"{cls.__name__}.{name} must default to None"
    for name in cls.flattened:
        assert name in fields, f"{cls.__name__}.flattened names no field {name!r}"
        assert typing.get_origin(hints[name]) is Mapping, f"{cls.__name__}.{name}"
    assert not cls.omitted_when_none & cls.flattened


# --- fields() -----------------------------------------------------------------------------


def test_fields_keep_declared_order_and_omit_only_the_optional_parts_that_are_none() -> None:
    bare = Step(step=3, loss=None, world_size=2, restart=1)
    assert list(bare.fields().items()) == [("step", 3), ("loss", None), ("world_size", 2),
                                           ("restart", 1)]      # loss None is kept
    full = Step(restart=1, seconds=0.5, global_batch=32, samples=96, world_size=2, epoch=0,
                lr=0.001, loss=2.5, step=3)
    assert list(full.fields()) == ["step", "loss", "lr", "epoch", "world_size", "samples",
                                   "global_batch", "seconds", "restart"]
    some = Step(step=3, loss=1.0, epoch=0, world_size=2, restart=0)
    assert list(some.fields()) == ["step", "loss", "epoch", "world_size", "restart"]


def test_fields_keep_none_of_fields_that_are_not_optional_parts() -> None:
    start = Start(run_id="r", restart=0, world_size=2, total_steps=None, backend="gloo")
    assert start.fields() == {"run_id": "r", "restart": 0, "world_size": 2,
                              "total_steps": None, "backend": "gloo"}
    assert list(start.fields()) == ["run_id", "restart", "world_size", "total_steps",
                                    "backend"]
    with_all = Start(run_id="r", restart=0, world_size=2, total_steps=10, backend="gloo",
                     threads=4, config={"lr": 0.1})
    assert list(with_all.fields()) == ["run_id", "restart", "world_size", "total_steps",
                                       "backend", "threads", "config"]
    assert with_all.fields()["config"] == {"lr": 0.1}


def test_checkpoint_saved_has_its_copy_fields_only_when_the_copy_overlapped() -> None:
    common = dict(step=5, path="/run/checkpoints/step-00000005", reason="periodic", bytes=10,
                  model_digest=None, snapshot_at=1.5, snapshot_seconds=0.1,
                  persist_seconds=0.2, persist_cpu_seconds=0.15, waited_seconds=0.0)
    plain = CheckpointSaved(**common)  # type: ignore[arg-type]
    assert list(plain.fields()) == ["step", "path", "reason", "bytes", "model_digest",
                                    "snapshot_at", "snapshot_seconds", "persist_seconds",
                                    "persist_cpu_seconds", "waited_seconds"]
    assert plain.fields()["model_digest"] is None            # not an optional part: kept
    overlapped = CheckpointSaved(**common, copy_seconds=0.0,  # type: ignore[arg-type]
                                 copy_wait_seconds=0.25)
    assert list(overlapped.fields()) == ["step", "path", "reason", "bytes", "model_digest",
                                         "snapshot_at", "snapshot_seconds", "copy_seconds",
                                         "copy_wait_seconds", "persist_seconds",
                                         "persist_cpu_seconds", "waited_seconds"]
    assert overlapped.fields()["copy_seconds"] == 0.0         # zero is not None


def test_flattened_mappings_become_fields_of_their_own() -> None:
    marks = {"process_start": 1.0, "group_began": 2.0, "group_ready": 3.0}
    startup = Startup(restart=1, resumed_step=20, first_step_done=4.0, marks=marks)
    assert list(startup.fields().items()) == [("restart", 1), ("resumed_step", 20),
                                              ("first_step_done", 4.0),
                                              ("process_start", 1.0), ("group_began", 2.0),
                                              ("group_ready", 3.0)]
    assert "marks" not in Startup(restart=0, resumed_step=0, first_step_done=1.0).fields()
    hang = Hang(restart=2, finding={"detected_by": 1, "step": 7, "where": "backward"})
    assert hang.fields() == {"restart": 2, "detected_by": 1, "step": 7, "where": "backward"}
    assert list(hang.fields()) == ["restart", "detected_by", "step", "where"]
    assert Hang(restart=0).fields() == {"restart": 0}


def test_a_flattened_key_that_repeats_a_declared_field_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Hang.finding repeats \['restart'\]"):
        Hang(restart=1, finding={"restart": 5, "step": 3}).fields()


def test_a_typed_record_is_written_as_one_line_in_its_fields_order(tmp_path: Path) -> None:
    seen: list[Mapping[str, object]] = []
    log = EventLog(tmp_path / "events.jsonl", observers=[seen.append])
    log.emit(Step(step=1, loss=2.0, world_size=2, restart=0))
    log.emit(Hang(restart=0, finding={"where": "forward"}))
    log.close()
    records = list(read_events(tmp_path / "events.jsonl"))
    assert [list(r) for r in records] == [["time", "event", "step", "loss", "world_size",
                                           "restart"],
                                          ["time", "event", "restart", "where"]]
    assert [r["event"] for r in records] == [Event.STEP, Event.HANG]
    assert [dict(r) for r in seen] == records
    assert type(records[0]["event"]) is str


# --- the package keeps to the schema (a source check) -------------------------------------


def _package_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


_SCOPES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``scope``, not descending into the scopes nested in it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, _SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def _reads_event_key(node: ast.AST, names: frozenset[str] = frozenset()) -> bool:
    """``x["event"]``, ``x.get("event"[, default])``, or a name bound to one of them."""
    if isinstance(node, ast.NamedExpr):
        return _reads_event_key(node.value)
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and key.value == "event"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "get" and node.args:
        key = node.args[0]
        return isinstance(key, ast.Constant) and key.value == "event"
    return isinstance(node, ast.Name) and node.id in names


def _event_read_names(scope: ast.AST) -> frozenset[str]:
    """Names that ``scope`` binds to an event-key read (``kind = record["event"]``)."""
    names: set[str] = set()
    for node in _own_nodes(scope):
        if isinstance(node, ast.Assign) and _reads_event_key(node.value):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None \
                and _reads_event_key(node.value) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return frozenset(names)


def _event_name_constants(node: ast.AST) -> list[str]:
    """String constants naming an event: the node itself, or the items of a literal
    tuple, list or set (``kind in ("start", "step")``)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items
            if isinstance(i, ast.Constant) and isinstance(i.value, str)
            and i.value in EVENT_NAMES]


def _spelled_event_names(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Comparisons (``==``, ``!=``, ``in``, ``not in``, ``match``) of an event-key read
    with an event name spelled as a string."""
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, _SCOPES))]
    for scope in scopes:
        names = _event_read_names(scope)
        for node in _own_nodes(scope):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                for op, left, right in zip(node.ops, operands[:-1], operands[1:], strict=True):
                    if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                        continue
                    for a, b in ((left, right), (right, left)):
                        if _reads_event_key(a, names):
                            for name in _event_name_constants(b):
                                yield node.lineno, f"compares the event with {name!r}"
            elif isinstance(node, ast.Match) and _reads_event_key(node.subject, names):
                for case in node.cases:
                    for pattern in ast.walk(case.pattern):
                        if isinstance(pattern, ast.MatchValue):
                            for name in _event_name_constants(pattern.value):
                                yield pattern.lineno, f"matches the event with {name!r}"


def _violations(source: str, relative: str) -> list[str]:
    """What breaks the schema's rules in the package file ``relative`` (to the package)."""
    tree = ast.parse(source, filename=relative)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "emit" and node.args \
                and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            found.append((node.lineno, f"emit({node.args[0].value!r}, ...): emit a record "
                                       "of events/schema.py"))
        if isinstance(node, ast.Attribute) and node.attr == "emit_raw":
            found.append((node.lineno, "emit_raw is for replays and tests, not the package"))
        if isinstance(node, ast.Name) and node.id == "emit_raw":
            found.append((node.lineno, "emit_raw is for replays and tests, not the package"))
    if relative != "events/schema.py":
        found.extend(_spelled_event_names(tree))
    if relative == "observe/metrics.py":
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                for key in node.keys:
                    if key is not None:
                        found.extend((key.lineno, f"dict key {name!r}: use Event")
                                     for name in _event_name_constants(key))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "dict":
                found.extend((node.lineno, f"dict key {k.arg!r}: use Event")
                             for k in node.keywords if k.arg in EVENT_NAMES)
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "_handlers":
                found.extend((node.lineno, f"handler key {name!r}: use Event")
                             for name in _event_name_constants(node.slice))
    return [f"{relative}:{line}: {what}" for line, what in sorted(set(found))]


@pytest.mark.parametrize("path", _package_files(),
                         ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_the_package_emits_typed_records_and_names_events_by_event(path: Path) -> None:
    assert _violations(path.read_text(), path.relative_to(PACKAGE).as_posix()) == []


def test_the_source_check_finds_what_it_looks_for() -> None:
    """The check itself: each forbidden form is found, the allowed ones are not."""
    source = '''
def bad(log, record, records):
    log.emit("step", step=1)
    log.emit_raw("step", step=1)
    if record["event"] == "start":
        pass
    if "end" != record.get("event"):
        pass
    kind = record["event"]
    if kind in ("checkpoint_saved", "step", "not_an_event"):
        pass
    if (other := record.get("event")) == "hang":
        pass
    match record["event"]:
        case "resize":
            pass
    return sum(r["event"] == "checkpoint_skipped" for r in records)

def good(log, record, info, kind):
    log.emit(Step(step=1, loss=None, world_size=1, restart=0))
    if record["event"] == Event.START:
        pass
    if record["step"] == "step" or info["reason"] == "checkpoint_failed":
        pass
    if kind == "start":      # not bound to an event read in this function
        pass
    return {"step": 1, "restart": 0}
'''
    tree = ast.parse(source)
    spelled = sorted(line for line, _ in _spelled_event_names(tree))
    lines = source.splitlines()
    assert [lines[n - 1].strip() for n in spelled] == [
        'if record["event"] == "start":',
        'if "end" != record.get("event"):',
        'if kind in ("checkpoint_saved", "step", "not_an_event"):',
        'if kind in ("checkpoint_saved", "step", "not_an_event"):',
        'if (other := record.get("event")) == "hang":',
        'case "resize":',
        'return sum(r["event"] == "checkpoint_skipped" for r in records)',
    ]
    found = _violations(source, "anywhere.py")
    assert [v for v in found if "emit" in v] == [
        "anywhere.py:3: emit('step', ...): emit a record of events/schema.py",
        "anywhere.py:4: emit_raw is for replays and tests, not the package"]
    assert len(found) == 2 + len(spelled)
    assert _violations(source, "events/schema.py") == [         # where the names live
        v.replace("anywhere.py", "events/schema.py") for v in found[:2]]
    handlers = """
class M:
    def __init__(self):
        self._handlers = {"start": self.a, Event.STEP: self.b, "seconds": self.c}
        self._fields = dict(hang=1, lr=2)
    def observe(self, record):
        return self._handlers["checkpoint_saved"]
"""
    assert _violations(handlers, "observe/metrics.py") == [
        "observe/metrics.py:4: dict key 'start': use Event",
        "observe/metrics.py:5: dict key 'hang': use Event",
        "observe/metrics.py:7: handler key 'checkpoint_saved': use Event"]
    assert _violations(handlers, "observe/summary.py") == []         # field maps elsewhere are fine


def test_metrics_handles_events_by_event() -> None:
    source = (PACKAGE / "observe/metrics.py").read_text()
    tree = ast.parse(source)
    handlers = [n for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Attribute) and n.target.attr == "_handlers"]
    assert len(handlers) == 1 and isinstance(handlers[0].value, ast.Dict)
    keys = handlers[0].value.keys
    assert keys and all(isinstance(k, ast.Attribute) and isinstance(k.value, ast.Name)
                        and k.value.id == "Event" and k.attr in Event.__members__
                        for k in keys)


# --- RunDir -------------------------------------------------------------------------------


def test_run_dir_paths(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path / "run"))
    assert run.root == tmp_path / "run" and isinstance(run.root, Path)
    assert run.checkpoints == tmp_path / "run" / CHECKPOINTS_DIR == tmp_path / "run" / "checkpoints"
    assert run.events == tmp_path / "run" / EVENTS_FILE == tmp_path / "run" / "events.jsonl"
    assert run.samples == tmp_path / "run" / SAMPLES_DIR == tmp_path / "run" / "samples"
    assert run.samples_of(0) == tmp_path / "run" / "samples" / "rank-0.jsonl"
    assert run.samples_of(12) == tmp_path / "run" / "samples" / "rank-12.jsonl"
    assert RunDir(tmp_path / "run") == run                       # a value: str or Path alike
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.root = tmp_path  # type: ignore[misc]
    assert not (tmp_path / "run").exists()                       # nothing made until prepare


def test_run_dir_prepare_creates_the_checkpoint_store_only(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "a" / "b")
    assert run.prepare() is run
    assert sorted(p.name for p in run.root.iterdir()) == ["checkpoints"]   # no probe left
    assert run.checkpoints.is_dir()
    assert run.prepare() is run                                  # idempotent
    assert prepare_run_dir(run.root) == run.root


def test_run_dir_prepare_under_a_regular_file_says_so_in_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    run = RunDir(blocker / "run")
    with pytest.raises(ConfigError) as caught:
        run.prepare()
    message = str(caught.value)
    assert message == (f"run directory {run.root} is not writable (Not a directory): choose "
                       "another --run-dir or fix its permissions")
    assert "\n" not in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert blocker.read_text() == "not a directory"
