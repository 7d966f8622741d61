"""R1 chaos: `slipstream run` with 3 rollout servers, SIGKILL a random server again and again, the
launcher's supervision restarting it; then check the run. Shared by the CI test (test_chaos.py,
modest counts) and tests/bench/bench_chaos.py (the long variant, with its figures).

What is checked (:func:`check_run`), from the run directory and the learner's own events:

- the run reached its step count (metrics.jsonl has every step) and exited 0;
- no sample id trained twice, and every step trained a full batch (trained_ids.jsonl);
- the buffer's conservation identity: accepted == consumed + pending + dropped_stale +
  dropped_incomplete (RolloutBuffer's docstring), consumed == steps x batch size == the gate's
  consumed_total, and the gate's in-flight count == the samples of the open leases;
- every issued sample slot ended exactly once (the buffer's second identity): issued == accepted
  + (stale - stale_late) + abandoned + (failed - failed_reported) + cancelled + in flight;
- the longest stall: the longest time between two steps, and the longest after a kill.

R7 variant (:func:`nan_window`): the servers' reward is ``chaos_rewards:spiky``; while a trigger
file exists it returns 1e300, which becomes inf in the learner's float32 rewards, so the step's
loss is NaN: such a step must be skipped (``step_skipped``), publish nothing (the version and
the step rows go on without a gap), and train none of its samples (they are consumed, not
trained: the gate gives their capacity back).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: config_kit
from config_kit import nested, rollout_nested  # noqa: E402


def config(run_dir: Path, model: str, *, total_steps: int, servers: int = 3, seed: int = 0,
           spiky_reward: bool = False) -> dict:
    cfg = {
        "model": model,
        "learner": nested({"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                    "total_steps": total_steps, "batch_prompts": 2, "group_size": 2,
                    "max_new_tokens": 4, "max_staleness": 1, "run_dir": str(run_dir),
                    "lease_timeout_s": 600, "server_timeout_s": 30, "final_sync_s": 5,
                    "reannounce_s": 1.0, "seed": seed}),
        "rollout": rollout_nested({"metrics_port": 0, "max_concurrency": 4, "heartbeat_interval_s": 0.5,
                    "reconnect_ivl_s": 0.05, "reconnect_ivl_max_s": 0.5, "drain_timeout_s": 5}),
        "launcher": {"num_rollout_servers": servers, "restart_backoff_s": 0.2,
                     "restart_backoff_max_s": 2.0, "restart_limit": 1000, "shutdown_timeout_s": 20},
    }
    if spiky_reward:
        cfg["rollout"]["reward"] = "chaos_rewards:spiky"
        # Intake refuses |reward| > max_abs_reward (1e6 by default), which would stop a 1e300
        # before the trainer; R7 is about what the trainer does with a NaN loss, so let it in.
        cfg["learner"]["servers"]["max_abs_reward"] = 1.0e308
    return cfg


def chaos_env(env: dict, workdir: Path) -> dict:
    """``env`` with this directory importable (the reward plugin) and the R7 trigger file named."""
    here = str(Path(__file__).resolve().parent)
    return dict(env, PYTHONPATH=os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")])),
                SLIPSTREAM_CHAOS_NAN_FILE=str(workdir / "nan.trigger"))


class ChaosRun:
    """The launcher subprocess and what it prints (a reader thread), and the kills."""

    def __init__(self, cfg: dict, workdir: Path, env: dict, popen=subprocess.Popen):
        import queue
        import threading

        self.cfg_file = workdir / "chaos.yaml"
        self.cfg_file.write_text(yaml.safe_dump(cfg))
        self.run_dir = Path(cfg["learner"]["run_dir"])
        cmd = [sys.executable, "-m", "deploy.cli", "run", "--config", str(self.cfg_file)]
        kwargs = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir)
        if popen is subprocess.Popen:
            kwargs["start_new_session"] = True       # (the test fixture's popen does this itself)
        self.proc = popen(cmd, **kwargs)
        self.lines: list[str] = []
        self.pids: dict[str, int] = {}
        self.kills: list[tuple[float, str, int]] = []      # (time, server, pid)
        self.kills_left_serving: list[int] = []            # per kill: the other servers serving
        self.steps = 0
        self.skipped: list[dict] = []                        # the learner's step_skipped events
        self.trigger = Path(env.get("SLIPSTREAM_CHAOS_NAN_FILE", workdir / "nan.trigger"))
        self.joins: list[tuple[float, str]] = []            # (time, server) of the learner's events
        self.started: dict[str, float] = {}                 # server -> time its process started
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def _take(self, timeout_s: float) -> str | None:
        import queue

        try:
            line = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return ""
        if line is None:
            self._queue.put(None)
            return None
        self.lines.append(line)
        if line.startswith("[run] rollout-") and " pid " in line:
            name, _, pid = line[len("[run] "):].split()
            self.pids[name], self.started[name] = int(pid), time.time()
        elif line.startswith("[run] server_restarted "):
            ev = json.loads(line.split(" ", 2)[2])
            self.pids[ev["server"]], self.started[ev["server"]] = ev["pid"], time.time()
        elif line.startswith("[learner] step_skipped "):
            self.skipped.append(json.loads(line.split(" ", 2)[2]))
        elif line.startswith("[learner] server_joined "):
            self.joins.append((time.time(), json.loads(line.split(" ", 2)[2])["server"]))
        elif line.split()[:1] and line.split()[0].isdigit():          # a row of the step table
            self.steps = int(line.split()[0])
        return line

    def wait(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {what} within {timeout_s}s:\n{''.join(self.lines[-40:])}")
            if self._take(min(left, 0.5)) is None and not predicate():
                raise AssertionError(f"the run ended before {what}:\n{''.join(self.lines[-40:])}")

    def serving(self, name: str) -> bool:
        """``name``'s current process is alive and has joined the learner."""
        pid = self.pids.get(name)
        if pid is None or any(k[2] == pid for k in self.kills):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        started = self.started.get(name, 0.0)
        return any(js == name and jt >= started for jt, js in self.joins)

    def kill_random(self, rng: random.Random, servers: int) -> str | None:
        """SIGKILL a random server that is serving; its name, or None if none is."""
        names = [f"rollout-{i}" for i in range(servers) if self.serving(f"rollout-{i}")]
        if not names:
            return None
        name = rng.choice(names)
        pid = self.pids[name]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        self.kills.append((time.time(), name, pid))
        self.kills_left_serving.append(len(names) - 1)
        return name

    def finish(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None or self._take(0) is not None:
            if time.monotonic() > deadline:
                raise AssertionError(f"the run did not end within {timeout_s}s:\n{''.join(self.lines[-40:])}")
            self._take(0.5)
        return self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def chaos(run: ChaosRun, *, kills: int, servers: int, seed: int, steps_between: int,
          restart_timeout_s: float = 300, rejoin: bool = False, keep_serving: int = 1) -> None:
    """``kills`` SIGKILLs of a random serving server (alive and joined), each once the step
    count moved ``steps_between`` past the previous one, and the killed server restarted by the
    launcher. A kill waits until ``keep_serving`` other servers are serving, so the learner's stall
    measures what a kill costs while there is capacity left (killing the last server stalls it
    for a whole restart). With ``rejoin``, each kill also waits until the killed server has joined
    the learner again (a restart takes a model load: seconds to tens of seconds on a busy CPU)."""
    rng = random.Random(seed)
    run.wait(lambda: all(run.serving(f"rollout-{i}") for i in range(servers)) and run.steps >= 1,
             300, "every server serving and a first step")
    for _ in range(kills):
        at = run.steps
        run.wait(lambda at=at: run.steps >= at + steps_between, 300, f"step {at + steps_between}")
        run.wait(lambda: sum(run.serving(f"rollout-{i}") for i in range(servers)) > keep_serving,
                 restart_timeout_s, f"{keep_serving + 1} servers serving")
        name = run.kill_random(rng, servers)
        killed = run.pids[name]
        run.wait(lambda name=name, killed=killed: run.pids[name] != killed, restart_timeout_s,
                 f"{name} restarted")
        if rejoin:
            run.wait(lambda name=name: run.serving(name), restart_timeout_s, f"{name} joined again")


def nan_window(run: ChaosRun, skips: int = 1, timeout_s: float = 300) -> None:
    """R7: rewards of 1e300 until the learner skipped ``skips`` steps, then normal again."""
    run.trigger.write_text("nan")
    try:
        run.wait(lambda: len(run.skipped) >= skips, timeout_s, f"{skips} skipped step(s)")
    finally:
        run.trigger.unlink(missing_ok=True)


def check_run(run: ChaosRun, total_steps: int, batch_samples: int) -> dict:
    """The checks of the module docstring; returns the figures."""
    rows = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, total_steps + 1)), "the run missed steps"
    trained = [json.loads(x) for x in (run.run_dir / "trained_ids.jsonl").read_text().splitlines()]
    ids = [sid for t in trained for sid in t["sample_ids"]]
    twice = [sid for sid, n in Counter(ids).items() if n > 1]
    assert not twice, f"trained twice: {twice[:10]}"
    assert len(trained) == total_steps and all(len(t["sample_ids"]) == batch_samples for t in trained)
    ev = next(json.loads(line.split(" ", 2)[2]) for line in run.lines
              if line.startswith("[learner] finished "))
    c, gate = ev["counters"], ev["gate"]
    assert c["accepted"] == (c["consumed"] + ev["pending_samples"] + c["dropped_stale"]
                             + c["dropped_incomplete"]), c
    # A skipped step consumed its batch without training it (the gate gives its capacity back).
    skipped = sum(1 for line in run.lines if line.startswith("[learner] step_skipped "))
    assert c["consumed"] == (total_steps + skipped) * batch_samples, (c, skipped)
    assert gate["consumed_total"] == total_steps * batch_samples, gate
    not_trained = {sid for e in run.skipped for sid in e["sample_ids"]}
    assert not not_trained & set(ids), "a skipped step's samples were trained"
    for e in run.skipped:                 # nothing published: the next applied step is v -> v+1
        v = e["trained_on_version"]
        assert rows[v]["trained_on_version"] == v and rows[v]["step"] == v + 1
    assert gate["in_flight"] == ev["inflight_samples"], (gate, ev["inflight_samples"])
    assert c["issued"] == (c["accepted"] + c["stale"] - c["stale_late"] + c["abandoned"] + c["failed"]
                           - c["failed_reported"] + c["cancelled"] + ev["inflight_samples"]), c
    times = [r["time"] for r in rows]
    gaps = [b - a for a, b in zip(times, times[1:])]
    # The stall across a kill that left another server serving (no lease timeout: the dead
    # server's leases are re-issued at once); after a kill of the last serving server the learner
    # waits for a restart (a model load), so there it is measured from the first join after it.
    after_kill, after_rejoin = [], []
    for (t, _, _), left in zip(run.kills, run.kills_left_serving):
        later = [x for x in times if x > t]
        before = [x for x in times if x <= t]
        if not (later and before):
            continue
        if left:
            after_kill.append(later[0] - before[-1])
            continue
        joined = [jt for jt, _ in run.joins if jt > t]
        if joined:
            after_rejoin.append(max(0.0, later[0] - joined[0]))
    rejoin = []
    for t, name, _ in run.kills:
        later = [jt for jt, js in run.joins if js == name and jt > t]
        if later:
            rejoin.append(later[0] - t)
    return {"steps": total_steps, "kills": len(run.kills), "rejoins": len(rejoin),
            "longest_kill_to_rejoin_s": round(max(rejoin, default=0.0), 3), "restarts": sum(
                line.startswith("[run] server_restarted ") for line in run.lines),
            "samples_trained": len(ids), "longest_stall_s": round(max(gaps, default=0.0), 3),
            "longest_stall_across_a_kill_s": round(max(after_kill, default=0.0), 3),
            "kills_of_the_last_server": run.kills_left_serving.count(0),
            "longest_stall_after_a_rejoin_s": round(max(after_rejoin, default=0.0), 3),
            "median_step_gap_s": round(sorted(gaps)[len(gaps) // 2], 3) if gaps else None,
            "skipped_steps": skipped,
            "counters": c}
