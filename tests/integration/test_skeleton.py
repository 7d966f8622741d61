"""Walking skeleton end to end: learner and one rollout server as real subprocesses.

Real ZeroMQ sockets on loopback (ports chosen by the learner), real HF generation on CPU, real
weight publishes; the assertions read the processes' own logs and Prometheus endpoints.
"""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from config_kit import nested, rollout_nested

from ops.precision import OVERRIDE_ENV, native_bfloat16

pytestmark = pytest.mark.slow

STEPS = 4


def test_learner_and_rollout_server_advance_versions_together(tmp_path, tiny_model_dir, subprocess_env,
                                                              process_groups, scrape, monkeypatch):
    # Precision auto as on this machine: the CPU's own answer, not the suite's override.
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    subprocess_env = {k: v for k, v in subprocess_env.items() if k != OVERRIDE_ENV}
    native, why = native_bfloat16("cpu")
    run_dir = tmp_path / "run"
    cfg = {
        "model": tiny_model_dir,
        "learner": nested({"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                    "total_steps": STEPS, "batch_prompts": 2, "group_size": 4, "max_new_tokens": 4,
                    "max_staleness": 1, "run_dir": str(run_dir), "threads": 1,
                    "exit_on_finish": False}),                # stays up to be scraped, then ctl stop
        # The server stays up after the run too (its default is to exit 0 when the learner says the
        # run finished), so its /metrics can be scraped; SIGTERM ends it at the end of the test.
        "rollout": rollout_nested({"metrics_port": 0, "max_concurrency": 16, "threads": 1,
                    "exit_on_learner_finished": False}),
    }
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    cli = [sys.executable, "-m", "deploy.cli"]
    learner = process_groups.watch([*cli, "learner", "--config", str(cfg_file)],
                                   env=subprocess_env, cwd=tmp_path)
    # Where and in what precision the learner computes, and why, said once at start (issue 40).
    runtime = learner.wait_for_event("runtime", 120)
    assert (runtime["device"], runtime["dtype"]) == ("cpu", "float32")
    assert runtime["autocast"] == ("bfloat16" if native else "none")
    assert f"autocast {runtime['autocast']} (auto: {why})" in runtime["line"]
    assert runtime["threads"] == 1 and runtime["attention"] in ("sdpa", "eager")
    ready = learner.wait_for_event("ready", 120)
    # Change the staleness limit on the live learner (`slipstream ctl`) before any server joins:
    # from then on training must be strictly on-policy.
    r = process_groups.run([*cli, "ctl", "--json", "--endpoint", ready["control"], "set", "max_staleness", "0"],
                           timeout=60, env=subprocess_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["staleness.max_staleness"] == 0
    bad = process_groups.run([*cli, "ctl", "--endpoint", ready["control"], "set", "max_staleness", "-1"],
                             timeout=60, env=subprocess_env)
    # A refused setting: exit 2, one line on stderr naming the setting, the status untouched.
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout + bad.stderr
    assert "max_staleness" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    server = process_groups.watch([*cli, "rollout", "--config", str(cfg_file), "--learner", ready["rollout"]],
                                  env=subprocess_env, cwd=tmp_path)
    server_runtime = server.wait_for_event("runtime", 120)
    assert (server_runtime["engine"], server_runtime["device"]) == ("hf", "cpu")
    assert server_runtime["dtype"] == ("bfloat16" if native else "float32")
    assert f"(auto: {why})" in server_runtime["line"]
    server_ready = server.wait_for_event("ready", 120)
    steps = [learner.wait_for_event("step", 180) for _ in range(STEPS)]
    # Every trained token was produced by a version <= the learner's version at training time;
    # with eta = 0, by exactly that version.
    for st in steps:
        assert st["token_version_max"] <= st["trained_on_version"]
        assert st["token_version_min"] == st["trained_on_version"]    # eta = 0: on-policy
        assert st["staleness_max"] == 0
        assert st["samples"] == 8
    assert [st["step"] for st in steps] == list(range(1, STEPS + 1))

    finished = learner.wait_for_event("finished", 120)
    assert finished["version"] == STEPS
    metrics = scrape(ready["metrics"])
    assert metrics["slipstream_policy_version"] == STEPS
    assert metrics["slipstream_rollouts_received_total"] >= STEPS * 8
    # The server applied the learner's latest version and says so (to the learner and on /metrics).
    smetrics = scrape(server_ready["metrics"])
    assert smetrics["slipstream_policy_version"] == STEPS
    assert metrics[f'slipstream_server_policy_version{{server="{server_ready["server_id"]}"}}'] == STEPS
    assert smetrics["slipstream_rollout_generated_tokens_total"] > 0
    learner.wait_for_event("idle", 60)
    status = process_groups.run([*cli, "ctl", "--json", "--endpoint", ready["control"], "status"],
                                timeout=60, env=subprocess_env)
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["runtime"]["line"] == runtime["line"]
    assert json.loads((run_dir / "runtime.json").read_text())["line"] == runtime["line"]
    stop = process_groups.run([*cli, "ctl", "--endpoint", ready["control"], "stop"],
                              timeout=60, env=subprocess_env)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert learner.wait_for_event("stopped", 60)["exit_code"] == 0
    assert learner.proc.wait(timeout=60) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    log = [r for r in rows if "kind" not in r]                 # the step rows
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert log[-1]["server_versions"]  # per-server versions are recorded
    # The accepted ctl set is a row of its own (the report marks it at its step); the refused one is not.
    assert [(r["key"], r["value"], r["step"]) for r in rows if r.get("kind") == "control"] == [
        ("staleness.max_staleness", 0, 0)]
    assert (run_dir / "final" / "config.json").exists()
    # SIGTERM: the server drains (nothing queued) and exits cleanly.
    assert process_groups.stop(server.proc, grace_s=30) == 0, server.output(30)
