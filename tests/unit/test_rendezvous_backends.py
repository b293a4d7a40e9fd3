"""rendezvous/backends.py: one table says what each rendezvous backend can do, and nothing
else in the package decides by comparing a backend's name (a new backend is one row)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from elastic_train.rendezvous.backends import (
    BACKENDS,
    UNKNOWN,
    Capabilities,
    capabilities,
    names_with,
)

PACKAGE = Path(__file__).resolve().parents[2] / "elastic_train"
TORCHRUNS_OWN = {"agent/launch_options.py"}
"""torchrun's resolution of its flags (``--standalone``, ``--master-port``: which backend a
launch gets), mirrored as torchrun does it: names, not capabilities."""


def comparisons_of_backend_names(source: str) -> list[int]:
    """Lines of ``source`` that compare something to the name of a backend of the table."""
    names = set(BACKENDS)
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            constants = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) \
                else [side]
            if any(isinstance(c, ast.Constant) and c.value in names for c in constants):
                lines.append(node.lineno)
                break
    return lines


def test_no_module_of_the_package_compares_a_backend_s_name() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "rendezvous/backends.py" or relative in TORCHRUNS_OWN:
            continue
        found += [f"{relative}:{line}" for line in
                  comparisons_of_backend_names(path.read_text())]
    assert found == [], "ask rendezvous.backends.capabilities(name) instead: " + str(found)


def test_the_rule_sees_a_comparison_in_every_shape() -> None:
    source = ('a = backend == "c10d"\nb = name in ("etcd", "etcd-v2")\n'
              'c = "etcd-v3" != x\nd = group.backend == "gloo"\n')
    assert comparisons_of_backend_names(source) == [1, 2, 3]


def test_what_each_backend_can_do() -> None:
    assert names_with("re_forms_across_nodes") == ("c10d", "etcd-v3")
    assert names_with("store_in_an_agent") == ("c10d",)
    assert names_with("heartbeats") == ("c10d", "etcd-v2")
    assert names_with("short_last_call") == ("c10d", "etcd-v2", "etcd")
    assert [capabilities(b).preflight for b in ("etcd", "etcd-v2", "etcd-v3", "c10d")] == \
        ["v2-api", "v2-api", "v3-api", None]


def test_a_plugin_s_backend_is_assumed_to_do_nothing_we_have_not_tested() -> None:
    assert capabilities("my-plugin") is UNKNOWN == Capabilities()
    with pytest.raises(ValueError, match="no rendezvous capability 'fast'"):
        names_with("fast")
