"""One home for the metric definitions of each process (issue 25, item 8), read from the source (AST).

Every Prometheus metric the learner exposes is defined in ``learner/metrics.py``
(:class:`learner.metrics.LearnerMetrics`), every one a rollout server exposes in
``rollout_server/metrics.py`` (:class:`rollout_server.metrics.RolloutMetrics`); the components take
that object and update its metrics. A definition is a call to ``Counter``, ``Gauge``,
``Histogram``, ``Summary``, ``Info`` or ``Enum`` from ``prometheus_client``, however imported:
``from prometheus_client import Counter [as C]`` (at any depth: inside functions too) or
``import prometheus_client [as p]`` and ``p.Counter(...)``. A ``collections.Counter`` is not one.
A planted violation shows the check bites.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOMES = {"learner": "learner/metrics.py", "rollout_server": "rollout_server/metrics.py"}
METRIC_TYPES = frozenset({"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"})
PROM_MODULES = ("prometheus_client", "prometheus_client.metrics")


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def metric_definitions(path: Path) -> list[tuple[int, str]]:
    """(line, what) of every call in ``path`` that defines a prometheus_client metric."""
    tree = ast.parse(path.read_text(), filename=str(path))
    classes: dict[str, str] = {}   # local name -> metric type, from `from prometheus_client import ...`
    modules: dict[str, str] = {}   # local name -> prometheus_client module, from `import ...`
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in PROM_MODULES:
            for a in node.names:
                if a.name in METRIC_TYPES:
                    classes[a.asname or a.name] = a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in PROM_MODULES:   # `import prometheus_client.metrics` binds `prometheus_client`
                    modules[a.asname or "prometheus_client"] = a.name if a.asname else "prometheus_client"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        if name in classes:
            found.append((node.lineno, f"prometheus_client.{classes[name]}"))
            continue
        head, _, rest = name.partition(".")
        if head in modules and rest:
            module, _, last = f"{modules[head]}.{rest}".rpartition(".")
            if module in PROM_MODULES and last in METRIC_TYPES:
                found.append((node.lineno, f"prometheus_client.{last}"))
    return sorted(found)


def violations(root: Path) -> list[str]:
    """``path:line: defines prometheus_client.X outside <home>`` for each package of HOMES under root."""
    out = []
    for package, home in HOMES.items():
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == home:
                continue
            out += [f"{rel}:{line}: defines {what} outside {home}" for line, what in metric_definitions(path)]
    return out


def test_every_metric_is_defined_in_its_process_metrics_module():
    assert violations(ROOT) == []


def test_the_homes_do_define_the_metrics():
    """The scan sees the real definitions (so an empty result above is not a blind scan)."""
    learner = metric_definitions(ROOT / HOMES["learner"])
    rollout = metric_definitions(ROOT / HOMES["rollout_server"])
    assert len(learner) >= 40 and len(rollout) >= 10
    from prometheus_client.metrics import MetricWrapperBase

    from learner.metrics import LearnerMetrics
    from rollout_server.metrics import RolloutMetrics

    def metrics_of(registry):   # the metrics of a registry (not the server's _Forward collector)
        return [c for c in set(registry._collector_to_names) if isinstance(c, MetricWrapperBase)]

    # one definition in the source per metric of the registry
    assert len(learner) == len(metrics_of(LearnerMetrics().registry))
    assert len(rollout) == len(metrics_of(RolloutMetrics().registry))


def test_the_check_catches_a_planted_violation(tmp_path):
    for home in HOMES.values():
        (tmp_path / home).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / home).write_text("from prometheus_client import Counter\nc = Counter('a', 'b')\n")
    state = tmp_path / "learner" / "state"
    state.mkdir()
    (state / "planted.py").write_text(
        "import collections\n"
        "from collections import Counter\n"
        "n = Counter('abc')                      # collections: fine\n"
        "m = collections.Counter()               # fine\n"
        "def make(r):\n"
        "    from prometheus_client import Counter as PromCounter, Histogram\n"
        "    PromCounter('slipstream_x', 'x', registry=r)\n"
        "    return Histogram('slipstream_y', 'y', registry=r)\n")
    (tmp_path / "rollout_server" / "planted.py").write_text(
        "import prometheus_client as pc\n"
        "import prometheus_client\n"
        "g = pc.Gauge('slipstream_z', 'z')\n"
        "s = prometheus_client.metrics.Summary('slipstream_w', 'w')\n"
        "i = prometheus_client.Info('slipstream_v', 'v')\n")
    assert violations(tmp_path) == [
        "learner/state/planted.py:7: defines prometheus_client.Counter outside learner/metrics.py",
        "learner/state/planted.py:8: defines prometheus_client.Histogram outside learner/metrics.py",
        "rollout_server/planted.py:3: defines prometheus_client.Gauge outside rollout_server/metrics.py",
        "rollout_server/planted.py:4: defines prometheus_client.Summary outside rollout_server/metrics.py",
        "rollout_server/planted.py:5: defines prometheus_client.Info outside rollout_server/metrics.py"]
