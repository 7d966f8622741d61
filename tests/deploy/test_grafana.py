"""deploy/grafana: the dashboard's structure, offline (live metrics: test_observability.py)."""

from __future__ import annotations

import yaml
from dashboard_queries import exprs, load, selectors
from external_tools import DEPLOY


def test_panels_are_laid_out_on_the_grid_without_overlap():
    panels = load()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps at {(x, y)}"
                cells.add((x, y))


def test_every_query_uses_the_datasource_variable_and_selects_a_metric():
    dash = load()
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert selectors(t["expr"]), t["expr"]


def test_slipstream_metrics_are_selected_by_job():
    """A slipstream_* or vllm: selector names its job, so one Prometheus can scrape other things."""
    for expr in exprs():
        for name, labels in selectors(expr):
            if name.startswith(("slipstream_", "vllm:")):
                assert labels.get("job") in ("slipstream-learner", "slipstream-rollout", "slipstream-.*"), expr
            else:
                assert name in ("up", "process_resident_memory_bytes"), expr


def test_the_dashboard_covers_what_the_issue_asks_for():
    text = " ".join(exprs())
    for needed in ('name="ref_kl"', 'name="entropy"', 'name="pg_clip_fraction"', 'name="is_ess_ratio"',
                   'name="mismatch_kl"', "slipstream_server_policy_version", "slipstream_staleness_mean",
                   "slipstream_rollout_generated_tokens_total", "vllm:num_requests_running",
                   "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total"):
        assert needed in text, needed


def test_provisioning_points_at_the_dashboard_and_prometheus():
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    dash = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/slipstream.yml").read_text())
    assert dash["providers"][0]["type"] == "file"
