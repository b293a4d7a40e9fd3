"""What we rely on in torch beyond its public API: declared by the one module per side that
uses it (agent/torch_seams.py, worker/torch_seams.py), checked by one unit test.

A torch upgrade that renames or reshapes one of these names then fails that test with one
line naming the torch version and the name, instead of somewhere deep in an integration
test (tests/unit/test_torch_seams.py).
"""

from __future__ import annotations

import dis
import importlib
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Private", "missing", "problems"]


@dataclass(frozen=True)
class Private:
    """One private name of torch: ``module``'s ``path`` (``Class.member`` or ``function``).

    ``params``: the parameter names we pass or wrap, in order (checked as a subsequence of
    the signature's, ``self`` excluded), or None where we do not call it. A member that is
    no class attribute (an instance's) must be assigned as ``self.member`` in the class's
    source. ``why``: what we use it for, for the failure's line.
    """

    module: str
    path: str
    why: str
    params: tuple[str, ...] | None = None


def _resolve(private: Private) -> tuple[object | None, str | None]:
    """(the object, None), or (None, why it is missing)."""
    try:
        obj: object = importlib.import_module(private.module)
    except ImportError as exc:
        return None, f"module {private.module} does not import ({exc})"
    parts = private.path.split(".")
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if i == len(parts) - 1 and inspect.isclass(obj) and _assigns(obj, part):
            return None, None  # an instance attribute: exists, nothing to inspect
        return None, f"{'.'.join(parts[:i + 1])} is gone"
    return obj, None


def _assigns(cls: type, member: str) -> bool:
    """Whether some class of ``cls``'s MRO assigns ``self.member``: in its methods'
    bytecode (microseconds), else in its source (tens of milliseconds a class: the
    check at start, torch_compat.py, takes this path only for a name it will refuse)."""
    return _stores(cls, member) or _assigns_in_source(cls, member)


def _stores(cls: type, member: str) -> bool:
    """Whether a function defined on some class of ``cls``'s MRO (or nested in one) stores
    ``self.member`` (``self``: the name its code loads right before ``STORE_ATTR``)."""
    codes = []
    for klass in inspect.getmro(cls):
        for value in vars(klass).values():
            if isinstance(value, staticmethod | classmethod):
                value = value.__func__
            functions = (value.fget, value.fset) if isinstance(value, property) else (value,)
            codes += [f.__code__ for f in functions if inspect.isfunction(f)]
    while codes:
        code = codes.pop()
        codes += [c for c in code.co_consts if inspect.iscode(c)]
        if member not in code.co_names:
            continue
        previous = None
        for instruction in dis.get_instructions(code):
            if instruction.opname == "STORE_ATTR" and instruction.argval == member \
                    and previous is not None and _loads_self(previous):
                return True
            if instruction.opname not in ("CACHE", "EXTENDED_ARG"):
                previous = instruction
    return False


def _loads_self(instruction: dis.Instruction) -> bool:
    """Whether ``instruction`` loads the name ``self`` (a local, or a closure's cell)."""
    values = instruction.argval if isinstance(instruction.argval, tuple) \
        else (instruction.argval,)
    return instruction.opname.startswith(("LOAD_FAST", "LOAD_DEREF")) and "self" in values


def _assigns_in_source(cls: type, member: str) -> bool:
    """Whether some class of ``cls``'s MRO assigns ``self.member`` in its source."""
    pattern = re.compile(rf"\bself\.{re.escape(member)}\s*(:[^=\n]*)?=(?!=)")
    for klass in inspect.getmro(cls):
        try:
            path = inspect.getsourcefile(klass)
            if path is None or not pattern.search(Path(path).read_text(errors="replace")):
                continue  # not in its module's file at all: no need to find the class in it
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if pattern.search(source):
            return True
    return False


def _signature_problem(obj: object, params: tuple[str, ...]) -> str | None:
    try:
        names = [p for p in inspect.signature(obj).parameters if p != "self"]  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None  # a C++ function without a signature: its existence is what we check
    position = 0
    for wanted in params:
        try:
            position = names.index(wanted, position) + 1
        except ValueError:
            return f"takes ({', '.join(names)}), we rely on ({', '.join(params)})"
    return None


def problems(required: Iterable[Private]) -> list[tuple[Private, str]]:
    """(name, what is wrong) for each private name this torch lacks or reshaped."""
    found = []
    for private in required:
        obj, problem = _resolve(private)
        if problem is None and obj is not None and private.params is not None:
            problem = _signature_problem(obj, private.params)
        if problem is not None:
            found.append((private, problem))
    return found


def missing(required: Iterable[Private]) -> list[str]:
    """One line per private name that this torch lacks or reshaped; [] when all hold."""
    import torch

    return [f"torch {torch.__version__}: {private.module}.{private.path}: {problem} "
            f"(elastic_train uses it {private.why})" for private, problem in problems(required)]
