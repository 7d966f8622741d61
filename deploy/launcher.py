"""``slipstream run``: one learner and N rollout servers as separate OS processes, supervised.

The launcher builds/resolves the model once, writes the resolved config into the run directory,
starts the learner, waits for its ``ready`` line (endpoints), starts the servers pointed at it,
and prints a live table of the learner's steps. It stops everything — SIGTERM, then SIGKILL after
``launcher.shutdown_timeout_s`` — when the learner exits, when any process fails, or on Ctrl-C.
Each child is signalled by its own pid.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from deploy.config import SlipstreamConfig

TABLE_COLUMNS = (("step", "{:>5}"), ("reward_mean", "{:>7.3f}"), ("entropy", "{:>7.3f}"),
                 ("mismatch_kl", "{:>11.2e}"), ("staleness_mean", "{:>6.2f}"), ("step_s", "{:>6.2f}"))
TABLE_HEADER = "  step  reward  entropy  mismatch_kl  stale  step_s  server versions"


def _format_step(ev: dict) -> str:
    cells = []
    for key, fmt in TABLE_COLUMNS:
        value = ev.get(key, float("nan"))
        cells.append(fmt.format(value) if isinstance(value, (int, float)) else str(value))
    servers = ",".join(str(v) for v in ev.get("server_versions", {}).values())
    return " ".join(cells) + f"  [{servers}]"


class Child:
    def __init__(self, name: str, cmd: list[str], events: queue.Queue, env: dict):
        self.name = name
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, env=env)
        self.thread = threading.Thread(target=self._pump, args=(events,), daemon=True)
        self.thread.start()

    def _pump(self, events: queue.Queue) -> None:
        for line in self.proc.stdout:
            events.put((self.name, line.rstrip("\n")))
        events.put((self.name, None))

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def _print_line(name: str, line: str, verbose: bool) -> dict | None:
    try:
        ev = json.loads(line)
    except ValueError:
        ev = None
    if not isinstance(ev, dict):
        if verbose or "Error" in line or "Traceback" in line:
            print(f"[{name}] {line}", flush=True)
        return None
    if ev.get("event") == "step":
        print(_format_step(ev), flush=True)
    elif ev.get("event") in ("ready", "finished", "crashed", "server_joined", "server_lost",
                             "stopped", "control_set", "protocol_error") or verbose:
        rest = {k: v for k, v in ev.items() if k not in ("proc", "event", "run_id")}
        print(f"[{name}] {ev.get('event')} {json.dumps(rest)}", flush=True)
    return ev


def launch(cfg: SlipstreamConfig, config_path: str | None, overrides: list[str]) -> int:
    from deploy.builtin import resolve_model

    verbose = bool(os.environ.get("SLIPSTREAM_VERBOSE"))
    model_path = resolve_model(cfg.model, log=lambda m: print(f"[setup] {m}", flush=True))
    run_dir = Path(cfg.learner.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = cfg.model_dump(mode="json")
    resolved["model"] = model_path
    cfg_file = run_dir / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(resolved, sort_keys=False))
    for stale in ("learner.json",):
        (run_dir / stale).unlink(missing_ok=True)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    base = [sys.executable, "-m", "deploy.cli"]
    events: queue.Queue = queue.Queue()
    children: list[Child] = []
    interrupted = threading.Event()

    def on_signal(signum, frame):
        interrupted.set()

    old_int = signal.signal(signal.SIGINT, on_signal)
    old_term = signal.signal(signal.SIGTERM, on_signal)
    exit_code = 0
    try:
        learner = Child("learner", [*base, "learner", "--config", str(cfg_file)], events, env)
        children.append(learner)
        endpoint = None
        started_servers = False
        print(f"[run] learner pid {learner.proc.pid}; run dir {run_dir}", flush=True)
        finished = set()
        while True:
            if interrupted.is_set():
                print("[run] interrupted: stopping all processes", flush=True)
                exit_code = 130
                break
            try:
                name, line = events.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                finished.add(name)
                child = next(c for c in children if c.name == name)
                code = child.proc.wait()
                if name == "learner":
                    exit_code = code
                    print(f"[run] learner exited with code {code}", flush=True)
                    break
                if code != 0 and not interrupted.is_set():
                    print(f"[run] {name} exited with code {code}: stopping the run", flush=True)
                    exit_code = code or 1
                    break
                continue
            ev = _print_line(name, line, verbose)
            if ev and name == "learner" and ev.get("event") == "ready" and not started_servers:
                endpoint = ev["rollout"]
                if started_servers is False:
                    print(TABLE_HEADER, flush=True)
                for i in range(cfg.launcher.num_rollout_servers):
                    port = cfg.rollout.metrics_port + i if cfg.rollout.metrics_port else 0
                    cmd = [*base, "rollout", "--config", str(cfg_file), "--learner", endpoint,
                           "--set", f"rollout.server_id=rollout-{i}",
                           "--set", f"rollout.metrics_port={port}",
                           "--set", f"rollout.seed={cfg.rollout.seed + i}"]
                    child = Child(f"rollout-{i}", cmd, events, env)
                    children.append(child)
                    print(f"[run] rollout-{i} pid {child.proc.pid}", flush=True)
                started_servers = True
    finally:
        _stop_all(children, cfg.launcher.shutdown_timeout_s)
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    final = run_dir / "final"
    if exit_code == 0 and final.exists():
        print(f"[run] done: metrics in {run_dir / 'metrics.jsonl'}, final model in {final}", flush=True)
    return exit_code


def _stop_all(children: list[Child], timeout_s: float) -> None:
    for c in children:
        c.terminate()
    deadline = time.monotonic() + timeout_s
    for c in children:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"[run] {c.name} did not stop in {timeout_s}s: killing pid {c.proc.pid}", flush=True)
            c.kill()
            c.proc.wait()
