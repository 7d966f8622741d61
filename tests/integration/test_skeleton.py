"""Walking skeleton end to end: learner and one rollout server as real subprocesses.

Real ZeroMQ sockets on loopback (ports chosen by the learner), real HF generation on CPU, real
weight publishes; the assertions read the processes' own logs and Prometheus endpoints.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

STEPS = 4


class Proc:
    """A subprocess whose JSON stdout lines are read on a thread into a queue."""

    def __init__(self, cmd: list[str], env: dict, cwd: Path):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=cwd)
        self.lines: list[str] = []
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict):
                self.events.put(ev)
        self.events.put(None)

    def wait_for(self, event: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ev = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {event!r} within {timeout_s}s:\n" + "".join(self.lines[-40:])) from None
            if ev is None:
                raise AssertionError(f"process exited before {event!r}:\n" + "".join(self.lines[-40:]))
            if ev.get("event") == event:
                return ev

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_learner_and_rollout_server_advance_versions_together(tmp_path, tiny_model_dir, subprocess_env):
    run_dir = tmp_path / "run"
    cfg = {
        "model": tiny_model_dir,
        "learner": {"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                    "total_steps": STEPS, "batch_prompts": 2, "group_size": 4, "max_new_tokens": 4,
                    "max_staleness": 1, "run_dir": str(run_dir), "threads": 1,
                    "exit_on_finish": False},                # stays up to be scraped, then ctl stop
        "rollout": {"metrics_port": 0, "max_concurrency": 16, "threads": 1},
    }
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    cli = [sys.executable, "-m", "deploy.cli"]
    learner = Proc([*cli, "learner", "--config", str(cfg_file)], subprocess_env, tmp_path)
    server = None
    try:
        ready = learner.wait_for("ready", 120)
        # Change the staleness limit on the live learner (`slipstream ctl`) before any server joins:
        # from then on training must be strictly on-policy.
        r = subprocess.run([*cli, "ctl", "--endpoint", ready["control"], "set", "max_staleness", "0"],
                           env=subprocess_env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["max_staleness"] == 0
        bad = subprocess.run([*cli, "ctl", "--endpoint", ready["control"], "set", "max_staleness", "-1"],
                             env=subprocess_env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "max_staleness takes an integer >= 0" in bad.stdout
        server = Proc([*cli, "rollout", "--config", str(cfg_file), "--learner", ready["rollout"]],
                      subprocess_env, tmp_path)
        server_ready = server.wait_for("ready", 120)
        steps = [learner.wait_for("step", 180) for _ in range(STEPS)]
        # Every trained token was produced by a version <= the learner's version at training time;
        # with eta = 0, by exactly that version.
        for st in steps:
            assert st["token_version_max"] <= st["trained_on_version"]
            assert st["token_version_min"] == st["trained_on_version"]    # eta = 0: on-policy
            assert st["staleness_max"] == 0
            assert st["samples"] == 8
        assert [st["step"] for st in steps] == list(range(1, STEPS + 1))

        finished = learner.wait_for("finished", 120)
        assert finished["version"] == STEPS
        metrics = scrape(ready["metrics"])
        assert metrics["slipstream_policy_version"] == STEPS
        assert metrics["slipstream_rollouts_received_total"] >= STEPS * 8
        # The server applied the learner's latest version and says so (to the learner and on /metrics).
        smetrics = scrape(server_ready["metrics"])
        assert smetrics["slipstream_policy_version"] == STEPS
        assert metrics[f'slipstream_server_policy_version{{server="{server_ready["server_id"]}"}}'] == STEPS
        assert smetrics["slipstream_rollout_generated_tokens_total"] > 0
        learner.wait_for("idle", 60)
        stop = subprocess.run([*cli, "ctl", "--endpoint", ready["control"], "stop"],
                              env=subprocess_env, capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert learner.wait_for("stopped", 60)["exit_code"] == 0
        assert learner.proc.wait(timeout=60) == 0
        log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log] == list(range(1, STEPS + 1))
        assert log[-1]["server_versions"]  # per-server versions are recorded
        assert (run_dir / "final" / "config.json").exists()
    finally:
        if server is not None:
            assert server.stop() == 0, "".join(server.lines[-30:])
        learner.stop()
