"""Write k8s/base/prometheusrule.yaml from deploy/prometheus/alerts.yml.

The alert rules have one source, deploy/prometheus/alerts.yml (tested with promtool); the
PrometheusRule for the Prometheus Operator wraps the same groups. Run this after changing
the alerts; tests/unit/test_k8s.py fails while the two differ.

    python scripts/render_prometheusrule.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
TARGET = REPO / "k8s" / "base" / "prometheusrule.yaml"

HEADER = """\
# Generated from deploy/prometheus/alerts.yml by scripts/render_prometheusrule.py: edit
# those rules, then rerun the script. The Prometheus Operator loads this PrometheusRule
# into every Prometheus whose ruleSelector matches its labels.
"""


class _BlockStyle(yaml.SafeDumper):
    """Multi-line strings (the PromQL) as YAML block scalars, as in alerts.yml."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockStyle.add_representer(str, _str)


def prometheus_rule() -> dict[str, Any]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "elastic-train",
                     "labels": {"app.kubernetes.io/name": "elastic-train"}},
        "spec": {"groups": groups},
    }


def render() -> str:
    return HEADER + yaml.dump(prometheus_rule(), Dumper=_BlockStyle, sort_keys=False, width=100)


def main() -> int:
    TARGET.write_text(render())
    print(f"wrote {TARGET.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
