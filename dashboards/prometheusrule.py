"""Print alerts.yaml (a Prometheus rule file) as a Prometheus Operator ``PrometheusRule``.

    python dashboards/prometheusrule.py > dashboards/prometheusrule.yaml   (make does this)

The Operator reads rules only from PrometheusRule objects, whose ``spec`` is a rule file's
content (monitoring.coreos.com/v1, ``PrometheusRuleSpec.groups``); generating it keeps one
source for the rules. tests/e2e/test_deploy.py checks the committed file is up to date.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
HEADER = "# Generated from alerts.yaml by prometheusrule.py (make dashboards/prometheusrule.yaml): do not edit.\n"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL) as literal blocks, as in alerts.yaml."""


_Dumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def render(alerts: Path = HERE / "alerts.yaml") -> str:
    """The PrometheusRule manifest (YAML text) wrapping the rule groups of ``alerts``."""
    groups = yaml.safe_load(alerts.read_text())["groups"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "prefix-router"}, "spec": {"groups": groups}}
    return HEADER + yaml.dump(rule, Dumper=_Dumper, sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(render())
