"""The queries of deploy/grafana/slipstream.json and the metric names they select (for the tests)."""

from __future__ import annotations

import json
import re

from external_tools import DEPLOY

DASHBOARD = DEPLOY / "grafana" / "slipstream.json"
SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)(\{[^}]*\}|\[)")
"""A metric name directly followed by its label matchers or a range: every query here has one."""


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs(dashboard: dict | None = None) -> list[str]:
    dashboard = dashboard or load()
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """``[(metric name, {label: value})]`` of one query (``=`` and ``=~`` matchers)."""
    out = []
    for name, rest in SELECTOR.findall(expr):
        labels = dict(re.findall(r'(\w+)=~?"([^"]*)"', rest)) if rest.startswith("{") else {}
        out.append((name, labels))
    return out
