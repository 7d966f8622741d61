"""R2 with the rollout log: `slipstream learner` (learner.rollout_log on) and a real HF `slipstream
rollout` server (tiny model) as processes; the learner is SIGKILLed two steps after a checkpoint
and started again with --resume. Reports what came back from the log (restored samples, those left
out by reason: accepted before the checkpoint, tokens of rolled-back versions), the log's records
and torn count, and checks that no sample id was trained twice across both lives.

    python tests/bench/bench_rollout_log_crash.py [--fsync step|record]
                                                  [--out bench_results/bench_rollout_log_crash.json]

About a minute on 2 CPU cores (two learner starts, one server).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: config_kit
from bench_machine import machine, machine_line  # noqa: E402
from config_kit import nested, rollout_nested  # noqa: E402

from learner.models.builtin import build_model, build_tokenizer  # noqa: E402
from learner.state.checkpoint import effective_trained_ids  # noqa: E402

CLI = [sys.executable, "-m", "deploy.cli"]


class Proc:
    """A CLI process in its own process group; its output lines, waited on by predicate."""

    def __init__(self, args: list[str], env: dict):
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=env, start_new_session=True, cwd=str(REPO))
        self.lines: list[str] = []
        self.cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            with self.cv:
                self.lines.append(line)
                self.cv.notify_all()

    def events(self, name: str) -> list[dict]:
        out = []
        for line in list(self.lines):
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("event") == name:
                out.append(ev)
        return out

    def wait_for(self, pred, timeout_s: float) -> dict:
        end = time.monotonic() + timeout_s
        i = 0
        with self.cv:
            while True:
                while i < len(self.lines):
                    try:
                        ev = json.loads(self.lines[i])
                    except ValueError:
                        ev = None
                    i += 1
                    if isinstance(ev, dict) and pred(ev):
                        return ev
                if time.monotonic() > end:
                    raise TimeoutError("".join(self.lines[-20:]))
                self.cv.wait(max(0.01, end - time.monotonic()))

    def kill(self, sig: int) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass
        self.p.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fsync", choices=["step", "record"], default="step")
    ap.add_argument("--out", default="bench_results/bench_rollout_log_crash.json")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-rollout-log-crash-"))
    tok = build_tokenizer()
    build_model(tok).save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = {"model": str(tmp / "model"),
           "learner": nested({"rollout_port": port, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                       "total_steps": 10_000, "batch_prompts": 2, "group_size": 2, "max_new_tokens": 4,
                       "max_staleness": 2, "run_dir": str(tmp / "run"), "save_every": 3, "keep_last": 3,
                       "threads": 1, "lease_timeout_s": 600, "server_timeout_s": 30, "reannounce_s": 1.0,
                       "rollout_log": {"fsync": a.fsync}}),
           "rollout": rollout_nested({"learner": f"tcp://127.0.0.1:{port}", "metrics_port": 0, "max_concurrency": 4,
                       "heartbeat_interval_s": 0.5, "reconnect_ivl_s": 0.05, "reconnect_ivl_max_s": 0.5,
                       "threads": 1, "drain_timeout_s": 5, "exit_on_learner_finished": False})}
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    t0 = time.monotonic()
    procs: list[Proc] = []
    try:
        first = Proc([*CLI, "learner", "--config", str(config)], env)
        procs.append(first)
        procs.append(Proc([*CLI, "rollout", "--config", str(config), "--set", "rollout.server_id=r0"], env))
        saved = first.wait_for(lambda e: e.get("event") == "checkpoint" and e["version"] >= 3, 120)
        first.wait_for(lambda e: e.get("event") == "step" and e["version"] > saved["version"] + 1, 60)
        first.kill(signal.SIGKILL)
        killed_at = max(e["version"] for e in first.events("step"))
        second = Proc([*CLI, "learner", "--config", str(config), "--resume"], env)
        procs.append(second)
        restored = second.wait_for(lambda e: e.get("event") == "rollout_log_restored", 90)
        second.wait_for(lambda e: e.get("event") == "step" and e["version"] >= saved["version"] + 4, 90)
        second.kill(signal.SIGTERM)
    finally:
        for p in procs:
            p.kill(signal.SIGKILL)
    ids = effective_trained_ids(tmp / "run" / "trained_ids.jsonl")
    row = {"fsync": a.fsync, "checkpoint_version": saved["version"], "killed_at_version": killed_at,
           "restored_samples": restored["samples"], "restore_outcome": restored["outcome"],
           "left_out": restored["left_out"], "log": restored["log"], "trained_ids": len(ids),
           "trained_ids_unique": len(set(ids)), "wall_s": round(time.monotonic() - t0, 1)}
    m = machine(threads=1)                          # learner's and server's threads (cfg)
    print(machine_line(m))
    for k, v in row.items():
        print(f"{k:<20} {v}")
    assert row["trained_ids"] == row["trained_ids_unique"], "a sample id trained twice"
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**row, "machine": m}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
