"""deploy/prometheus: the scrape config and alert rules pass promtool, and every alert fires in the
rules' unit tests (alerts_test.yml), which fail when a threshold is wrong."""

from __future__ import annotations

import re
import shutil

import yaml
from external_tools import DEPLOY, require, run_tool

PROM = DEPLOY / "prometheus"
JOBS = {"slipstream-learner", "slipstream-rollout"}


def _alerts() -> dict[str, dict]:
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def test_alert_rules_pass_promtool_check():
    r = run_tool([require("promtool"), "check", "rules", str(PROM / "alerts.yml")])
    assert r.returncode == 0, r.stdout
    assert f"SUCCESS: {len(_alerts())} rules found" in r.stdout


def test_scrape_config_passes_promtool_check_and_names_the_jobs_the_rules_use():
    r = run_tool([require("promtool"), "check", "config", str(PROM / "prometheus.yml")])
    assert r.returncode == 0, r.stdout
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert {j["job_name"] for j in cfg["scrape_configs"]} == JOBS
    assert cfg["rule_files"] == ["alerts.yml"]
    used = {job for rule in _alerts().values() for job in re.findall(r'job="([^"]+)"', rule["expr"])}
    assert used and used <= JOBS


def test_every_alert_fires_in_the_unit_tests():
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]}
    quiet = {case["alertname"] for t in tests for case in t["alert_rule_test"] if not case["exp_alerts"]}
    assert fired == set(_alerts()), set(_alerts()) ^ fired
    assert quiet == set(_alerts())          # and each is shown not firing too (before `for:`, healthy)
    r = run_tool([require("promtool"), "test", "rules", str(PROM / "alerts_test.yml")])
    assert r.returncode == 0, r.stdout
    assert "SUCCESS" in r.stdout


def test_the_unit_tests_catch_a_wrong_threshold(tmp_path):
    """The clip-fraction rule at 0.5 instead of the seeds' 0.3: promtool's unit tests fail."""
    shutil.copy(PROM / "alerts_test.yml", tmp_path)
    rules = (PROM / "alerts.yml").read_text()
    wrong = rules.replace('name="pg_clip_fraction"} > 0.3', 'name="pg_clip_fraction"} > 0.5')
    assert wrong != rules
    (tmp_path / "alerts.yml").write_text(wrong)
    r = run_tool([require("promtool"), "test", "rules", str(tmp_path / "alerts_test.yml")])
    assert r.returncode != 0 and "SlipstreamClipFractionHigh" in r.stdout, r.stdout


def test_thresholds_are_the_seeds():
    """The numbers the rules compare against (see the header of alerts.yml for where each is from)."""
    expected = {"SlipstreamKLHigh": "> 0.15", "SlipstreamKLExplosion": "> 1",
                "SlipstreamUpdateKLHigh": "> 0.1", "SlipstreamRewardStdCollapse": "< 0.05",
                "SlipstreamClipFractionHigh": "> 0.3", "SlipstreamEntropyCollapse": "< 0.5 *",
                "SlipstreamImportanceESSLow": "< 0.5", "SlipstreamMismatchKLHigh": "> 0.1"}
    alerts = _alerts()
    for name, cmp in expected.items():
        assert cmp in alerts[name]["expr"], (name, alerts[name]["expr"])
