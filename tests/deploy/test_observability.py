"""What an operator points at a run, checked on one real short run shared by the module.

The run is started the way a cluster starts it: deploy/slurm/slipstream.sbatch on this host
(no Slurm: one node; the HF engine, the tiny model, free ports, a KL term so ``ref_kl`` exists):
a learner and one rollout server train (with no step limit that the test could reach) while a real
Prometheus server on loopback scrapes both processes with the shipped config and rules; its HTTP
API must show the learner's version and each server's; ``promtool check metrics`` must pass on
live scrapes; every metric the Grafana dashboard queries must exist in them. Then ``ctl stop``
ends the run, the script stops the server and writes the report. (``slipstream run`` writes its
report too: tests/integration/test_demo.py.)
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import dashboard_queries
import pytest
import yaml
from config_kit import nested, rollout_nested
from external_tools import DEPLOY, REPO, require, run_tool

pytestmark = pytest.mark.slow

MANY_STEPS = 100_000
"""total_steps: the run trains until ``ctl stop`` (a finished learner lets its servers go)."""
CLI = [sys.executable, "-m", "deploy.cli"]
SBATCH = DEPLOY / "slurm" / "slipstream.sbatch"
SCRAPE_INTERVAL = "1s"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float = 10) -> bytes:
    return urllib.request.urlopen(url, timeout=timeout_s).read()


@dataclass
class Live:
    run: object                  # conftest.Watched: the sbatch script
    run_dir: Path
    env: dict
    learner: dict                # the learner's ready event (endpoints)
    server: dict                 # rollout-0's ready event
    prometheus_url: str = ""

    def query(self, promql: str) -> list[dict]:
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        body = json.loads(_get(url))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_query(self, promql: str, timeout_s: float, n: int = 1) -> list[dict]:
        """Poll the query (each scrape is 1 s apart) until it returns >= n series, bounded."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(promql)
            if len(result) >= n:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{promql!r}: {result} after {timeout_s}s")
            time.sleep(0.25)


def _start_prometheus(groups, live: Live, tmp: Path, env: dict) -> str:
    """A real Prometheus on loopback with the shipped config and rules, retargeted at this run."""
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"] = {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL}
    targets = {"slipstream-learner": live.learner["metrics"], "slipstream-rollout": live.server["metrics"]}
    for job in cfg["scrape_configs"]:
        job.pop("file_sd_configs", None)
        job["static_configs"] = [{"targets": [urllib.parse.urlsplit(targets[job["job_name"]]).netloc]}]
    (tmp / "alerts.yml").write_text((DEPLOY / "prometheus" / "alerts.yml").read_text())
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = _free_port()
    prom = groups.watch([require("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                         f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                        env=env, cwd=tmp)
    prom.wait_for_line("Server is ready to receive web requests", 60)
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model_dir, builtin_cache, module_process_groups) -> Live:
    require("prometheus")
    tmp = tmp_path_factory.mktemp("observability")
    run_dir = tmp / "run"
    cfg = {
        "model": tiny_model_dir,
        "learner": nested({"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                    "total_steps": MANY_STEPS, "batch_prompts": 2, "group_size": 4,
                    "max_new_tokens": 4, "kl_coef": 0.01, "threads": 1}),
        "rollout": rollout_nested({"max_concurrency": 16, "threads": 1}),
    }
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONUNBUFFERED="1", SLIPSTREAM_CACHE=str(builtin_cache),
               SLIPSTREAM=f"{sys.executable} -m deploy.cli", ENGINE="hf", GPUS_PER_NODE="2",
               LEARNER_HOST="127.0.0.1", METRICS_PORT="0", READY_TIMEOUT_S="180")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("SLURM_JOB_NODELIST", None)
    run = module_process_groups.watch(["bash", str(SBATCH), str(tmp / "cfg.yaml"), str(run_dir)],
                                      env=env, cwd=REPO)
    learner = run.wait_for_event("ready", 180)
    assert learner["proc"] == "learner"
    server = run.wait_for_event("ready", 180)
    assert server["proc"] == "rollout"
    run.wait_for_event("weights_applied", 180)            # the server is at version 1 or later
    live = Live(run, run_dir, env, learner, server)
    live.prometheus_url = _start_prometheus(module_process_groups, live, tmp, env)
    return live


def test_prometheus_scrapes_the_learners_and_each_servers_version(live):
    up = live.wait_query("up == 1", 30, n=2)
    assert {s["metric"]["job"] for s in up} == {"slipstream-learner", "slipstream-rollout"}
    versions = live.wait_query("slipstream_policy_version > 0", 30, n=2)
    by_job = {s["metric"]["job"]: float(s["value"][1]) for s in versions}
    assert set(by_job) == {"slipstream-learner", "slipstream-rollout"}
    # (No lag check here: the two scrapes are up to 1 s apart and the tiny model steps ~10 times
    # a second. The lag rule is an alert, unit-tested in deploy/prometheus/alerts_test.yml.)
    # The learner's view of each server: one series per server id, with its version.
    servers = live.wait_query("slipstream_server_policy_version > 0", 30)
    assert [s["metric"]["server"] for s in servers] == [live.server["server_id"]]
    # The statistics the alert rules select on are there under their names.
    stats = {s["metric"]["name"] for s in live.query("slipstream_train_stat")}
    rules = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    assert set(re.findall(r'slipstream_train_stat\{name="(\w+)"\}', rules)) <= stats


def test_the_alert_rules_evaluate_on_live_data(live):
    """Every rule has been evaluated against the real series without an error."""
    deadline = time.monotonic() + 30
    while True:
        body = json.loads(_get(f"{live.prometheus_url}/api/v1/rules"))
        rules = [r for g in body["data"]["groups"] for r in g["rules"]]
        if rules and all(r["health"] == "ok" for r in rules):      # "unknown" until evaluated
            break
        assert not [r for r in rules if r["health"] == "err"], rules
        assert time.monotonic() < deadline, [(r["name"], r["health"], r.get("lastError")) for r in rules]
        time.sleep(0.25)
    names = {r["name"] for r in rules}
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert names == {r["alert"] for g in alerts["groups"] for r in g["rules"]}
    # The run is healthy: nothing reports a process down. (One scrape over the 1 s timeout on a
    # loaded machine makes up == 0 once and a Down alert pending: what counts is that both are
    # being scraped, and that no Down alert fires.)
    live.wait_query('up{job=~"slipstream-.*"} == 1', 30, n=2)
    alerts = json.loads(_get(f"{live.prometheus_url}/api/v1/alerts"))["data"]["alerts"]
    assert not [a for a in alerts if a["labels"]["alertname"].endswith("Down")
                and a["state"] == "firing"], alerts


@pytest.mark.parametrize("process", ["learner", "server"])
def test_promtool_check_metrics_passes_on_a_live_scrape(live, process):
    text = _get(getattr(live, process)["metrics"])
    r = run_tool([require("promtool"), "check", "metrics"], input=text.decode())
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout


def _exposed(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """Names a scrape answers for: its samples' names and every declared family (a labelled
    counter nobody has counted yet has no sample but is declared), and each sample's label values
    (``{"name": {...}}`` of ``slipstream_train_stat``)."""
    names: set[str] = set()
    stat_names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            suffixes = ("_bucket", "_sum", "_count") if kind in ("histogram", "summary") else ("",)
            names.update(family + s for s in suffixes)
        elif line and not line.startswith("#"):
            name = re.match(r"[a-zA-Z_:][\w:]*", line).group(0)
            names.add(name)
            if name == "slipstream_train_stat":
                stat_names.add(re.search(r'name="([^"]*)"', line).group(1))
    return names, {"name": stat_names}


def test_every_metric_the_dashboard_queries_exists_in_a_live_scrape(live):
    """Each panel's metrics are served by the process its job names (vllm: ones are checked on a
    live vLLM engine in tests/rollout_server/test_engine_vllm.py); every query is valid PromQL."""
    scraped = {"slipstream-learner": _exposed(_get(live.learner["metrics"]).decode()),
               "slipstream-rollout": _exposed(_get(live.server["metrics"]).decode())}
    checked = 0
    for expr in dashboard_queries.exprs():
        live.query(expr)                                 # Prometheus parses and evaluates it
        for name, labels in dashboard_queries.selectors(expr):
            if name.startswith("vllm:") or name == "up":     # up: made by Prometheus (queried above)
                continue
            jobs = [j for j in scraped if re.fullmatch(labels.get("job", ".*"), j)]
            assert any(name in scraped[j][0] for j in jobs), f"{name} ({labels}) is not served: {expr}"
            if name == "slipstream_train_stat":
                assert labels["name"] in scraped["slipstream-learner"][1]["name"], expr
            checked += 1
    assert checked > 50


def test_ctl_stop_ends_the_run_and_the_script_stops_the_server_and_writes_the_report(
        live, module_process_groups):
    """Last in the module: the run ends as an operator ends it; the report is of this run."""
    run_id = json.loads((live.run_dir / "learner.json").read_text())["run_id"]
    # The script's file_sd targets name the learner's real metrics port.
    targets = json.loads((live.run_dir / "prometheus" / "learner.json").read_text())
    assert targets == [{"targets": [f"127.0.0.1:{urllib.parse.urlsplit(live.learner['metrics']).port}"]}]
    stop = module_process_groups.run([*CLI, "ctl", "--endpoint", live.learner["control"], "stop"],
                                     timeout=60, env=live.env)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    live.run.wait_for_line(r"^\[slurm\] learner exited with code 0; stopping the servers", 60)
    path = Path(live.run.wait_for_line(r"^(/\S+/report\.md)$", 120).group(1))
    assert live.run.proc.wait(timeout=60) == 0, live.run.output()
    rows = [json.loads(line) for line in (live.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = len(rows)
    assert steps >= 2 and [r["step"] for r in rows] == list(range(1, steps + 1))
    assert {r["run_id"] for r in rows} == {run_id}
    assert path == live.run_dir / "report" / "report.md"
    md = path.read_text()
    assert md.startswith(f"# slipstream run `{run_id}`") and f"{steps} policy steps" in md
    assert f"servers at the end: {live.server['server_id']} v" in md
    pngs = {p.stem for p in path.parent.glob("*.png")}
    assert {"reward", "kl", "entropy", "importance", "mismatch_kl", "staleness", "versions",
            "step_time", "overview"} <= pngs
