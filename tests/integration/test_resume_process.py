"""R2 at the process level: `slipstream learner` and a real `slipstream rollout` server (HF engine,
tiny model) as subprocesses; the learner is SIGKILLed mid-run after a checkpoint and started again
with `--resume`, a torn checkpoint placed as the newest. The version and the data position
continue from the checkpoint, the server re-joins on its own within 10 s, and no sample id is
trained twice (trained_ids.jsonl across both lives, rolled-back steps taken out). Also: `--resume`
with nothing to resume is one line and exit code 2."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time

import pytest
import yaml
from config_kit import nested, rollout_nested

from learner.state.checkpoint import effective_trained_ids

CLI = [sys.executable, "-m", "deploy.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp_path, model: str, port: int) -> str:
    cfg = {
        "model": model,
        "learner": nested({"rollout_port": port, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                    "total_steps": 10_000, "batch_prompts": 2, "group_size": 2, "max_new_tokens": 4,
                    "max_staleness": 1, "run_dir": str(tmp_path / "run"), "save_every": 3,
                    "keep_last": 3, "threads": 1, "lease_timeout_s": 600, "server_timeout_s": 30,
                    "reannounce_s": 1.0}),
        "rollout": rollout_nested({"learner": f"tcp://127.0.0.1:{port}", "metrics_port": 0, "max_concurrency": 4,
                    "heartbeat_interval_s": 0.5, "reconnect_ivl_s": 0.05, "reconnect_ivl_max_s": 0.5,
                    "threads": 1, "drain_timeout_s": 5, "exit_on_learner_finished": False}),
    }
    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _events(lines: list[str], proc: str, event: str) -> list[dict]:
    out = []
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("proc") == proc and ev.get("event") == event:
            out.append(ev)
    return out


def test_resume_with_nothing_to_resume_is_one_line(tmp_path, tiny_model_dir, subprocess_env, process_groups):
    cfg = _config(tmp_path, tiny_model_dir, _free_port())
    r = process_groups.run([*CLI, "learner", "--config", cfg, "--resume"], timeout=120, env=subprocess_env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr and "no complete checkpoint" in lines[0], r.stderr


@pytest.mark.slow
def test_sigkilled_learner_resumes_and_the_server_rejoins(tmp_path, tiny_model_dir, subprocess_env,
                                                           process_groups):
    port = _free_port()
    cfg = _config(tmp_path, tiny_model_dir, port)
    run_dir, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    env = subprocess_env
    t = {"start": time.monotonic()}
    first = process_groups.watch([*CLI, "learner", "--config", cfg], env=env)
    # Started together: the server connects (and re-connects) to the learner's port on its own.
    server = process_groups.watch([*CLI, "rollout", "--config", cfg,
                                   "--set", "rollout.server_id=r0"], env=env)
    first.wait_for_event("ready", 90)
    t["learner_ready"] = time.monotonic()
    saved = first.wait_for(lambda line: (ev := _parse(line)) and ev.get("event") == "checkpoint"
                           and ev["version"] >= 3 and ev, 60, "a checkpoint at version >= 3")
    # Mid-run after the checkpoint: one more step, then SIGKILL (no chance to save anything).
    first.wait_for(lambda line: (ev := _parse(line)) and ev.get("event") == "step"
                   and ev["version"] > saved["version"], 30, "a step after the checkpoint")
    t["checkpoint"] = time.monotonic()
    os.killpg(first.proc.pid, signal.SIGKILL)
    killed_at = max(e["version"] for e in _events(first.read_to_end(), "learner", "step"))
    latest = max((int(p.name.split("-")[1]), p) for p in ck.glob("step-*") if (p / "COMPLETE").exists())
    torn = ck / "step-999999"                     # the newest directory, without its marker
    shutil.copytree(latest[1], torn)
    (torn / "COMPLETE").unlink()
    (torn / "trainer.safetensors").write_bytes(b"\0" * 100)
    state = json.loads((latest[1] / "state.json").read_text())

    second = process_groups.watch([*CLI, "learner", "--config", cfg, "--resume"], env=env)
    resumed = second.wait_for_event("resumed", 120)    # (a torch import and a model load)
    assert resumed["checkpoint"] == str(latest[1]) and resumed["resumed_version"] == latest[0]
    assert resumed["run_id"] == state["run_id"] == saved["run_id"]
    assert resumed["data_position"] == state["data"]["position"] > 0
    assert resumed["assignment_counter"] == state["assignment_counter"]
    ready = second.wait_for_event("ready", 120)
    t_ready = t["resumed_ready"] = time.monotonic()
    second.wait_for(lambda line: (ev := _parse(line)) and ev.get("event") in ("server_joined", "server_rejoined")
                    and ev.get("server") == "r0", 30, "the server re-joining")
    rejoin_s = time.monotonic() - t_ready
    assert rejoin_s < 10, rejoin_s
    assert ready["version"] == latest[0]
    target = latest[0] + 4
    second.wait_for(lambda line: (ev := _parse(line)) and ev.get("event") == "step"
                    and ev["version"] >= target, 60, f"step {target}")
    t["4_steps_more"] = time.monotonic()
    process_groups.stop(second.proc)              # SIGTERM: a final checkpoint, exit 0
    t["stopped"] = time.monotonic()
    process_groups.stop(server.proc, grace_s=2)   # (its drain would wait for a learner that is gone)
    assert second.proc.returncode == 0, second.output()
    steps2 = [e["version"] for e in _events(second.lines, "learner", "step")]
    assert steps2[:4] == [latest[0] + 1, latest[0] + 2, latest[0] + 3, latest[0] + 4]
    assert _events(second.lines, "learner", "checkpoint")[-1]["reason"] == "stop"
    assert not torn.exists() or not (torn / "COMPLETE").exists()

    lines = [json.loads(x) for x in (run_dir / "trained_ids.jsonl").read_text().splitlines()]
    marks = [r for r in lines if "resumed_at_version" in r]
    assert [m["resumed_at_version"] for m in marks] == [latest[0]]
    life1 = [r for r in lines[:lines.index(marks[0])]]
    # Rolled back: life 1 trained past the checkpoint. A step is recorded in trained_ids.jsonl
    # just before its step event is printed, so a kill in between leaves one more recorded.
    trained_to = max(r["trained_on_version"] for r in life1) + 1
    assert killed_at <= trained_to <= killed_at + 1 and trained_to > latest[0], (trained_to, killed_at)
    ids = effective_trained_ids(run_dir / "trained_ids.jsonl")
    final_version = steps2[-1]
    assert len(ids) == len(set(ids)) == final_version * 4, "a sample id trained twice"
    # A server ahead of the resumed version (it applied a version trained after the checkpoint)
    # sees the learner behind it, drops that work and re-fetches version c; one at c keeps it.
    server_events = [ev for ev in map(_parse, server.lines) if ev]
    new_run = [i for i, ev in enumerate(server_events) if ev.get("event") == "new_run"]
    if new_run:
        assert server_events[new_run[0]]["learner_version"] == latest[0]
        assert any(ev.get("event") == "weights_applied" and ev["weights_version"] == latest[0]
                   for ev in server_events[new_run[0]:])
    else:
        applied = [ev["weights_version"] for ev in server_events if ev.get("event") == "weights_applied"]
        assert latest[0] in applied and applied[applied.index(latest[0]) + 1] == latest[0] + 1
    print(f"R2 resume: checkpoint v{latest[0]}, killed at v{killed_at}, rejoin {rejoin_s:.2f}s, "
          f"load {resumed['load_s']}s; at (s): " + ", ".join(f"{k} {v - t['start']:.1f}" for k, v in t.items()))


def _parse(line: str) -> dict | None:
    try:
        ev = json.loads(line)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) else None
