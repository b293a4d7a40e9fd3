"""What we rely on in torch beyond its public API: declared by the one module per side that
uses it (agent/torch_seams.py, worker/torch_seams.py), checked by one unit test.

A torch upgrade that renames or reshapes one of these names then fails that test with one
line naming the torch version and the name, instead of somewhere deep in an integration
test (tests/unit/test_torch_seams.py).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Private", "missing"]


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
    """Whether some class of ``cls``'s MRO assigns ``self.member`` in its source."""
    pattern = re.compile(rf"\bself\.{re.escape(member)}\s*(:[^=\n]*)?=(?!=)")
    for klass in inspect.getmro(cls):
        try:
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


def missing(required: Iterable[Private]) -> list[str]:
    """One line per private name that this torch lacks or reshaped; [] when all hold."""
    import torch

    lines = []
    for private in required:
        obj, problem = _resolve(private)
        if problem is None and obj is not None and private.params is not None:
            problem = _signature_problem(obj, private.params)
        if problem is not None:
            lines.append(f"torch {torch.__version__}: {private.module}.{private.path}: "
                         f"{problem} (elastic_train uses it {private.why})")
    return lines
