"""Issue 31.5 through real processes: a `slipstream learner` (tiny model) whose run directory is a
real small filesystem (a tmpfs), fed by protocol-level clients (load_client.py).

- The disk fills up mid-run under ``checkpoint_failure: continue``: the train task goes on (every
  failed row and checkpoint is an event, never a traceback), no torn line is left in
  ``metrics.jsonl`` or ``trained_ids.jsonl``, the rows come back once space is freed, and SIGTERM
  still ends the run cleanly (exit 0). Under ``stop`` it stops cleanly (exit 3) instead.
- ``--resume`` with a torn last line in ``trained_ids.jsonl`` (what a crash or a full disk left)
  resumes, with a warning, instead of crashing on JSONDecodeError (exit 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from config_kit import nested
from disk_kit import fill, small_disk
from load_kit import event_line

from learner.metrics import JsonlLog
from learner.state.checkpoint import effective_trained_ids

CLI = [sys.executable, "-m", "deploy.cli"]
LOAD_CLIENT = Path(__file__).resolve().parent / "load_client.py"
pytestmark = pytest.mark.slow


def _config(tmp_path: Path, run_dir: Path, model: str, **more) -> str:
    cfg = {"model": model,
           "learner": nested({"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                              "total_steps": 10_000_000, "batch_prompts": 2, "group_size": 4,
                              "max_new_tokens": 4, "max_staleness": 2, "run_dir": str(run_dir),
                              "save_every": 2, "keep_last": 2, "threads": 1, "lease_timeout_s": 600,
                              "server_timeout_s": 600, "exit_on_finish": False, **more})}
    path = tmp_path / "full_disk.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _start(process_groups, cfg: str, env: dict, tmp_path: Path, *extra: str):
    learner = process_groups.watch([*CLI, "learner", "--config", cfg, *extra], env=env, cwd=tmp_path)
    ready = learner.wait_for_event("ready", 120)
    clients = process_groups.popen([sys.executable, str(LOAD_CLIENT), ready["rollout"], "2", "120",
                                    str(tmp_path / "clients.json"), "8"], env=env, cwd=tmp_path)
    return learner, clients


def _whole(path: Path) -> list[dict]:
    """Every line of ``path`` a JSON object, the last one ended: nothing torn, nothing merged."""
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), data[-200:]
    records, torn = JsonlLog.read(path)
    assert torn == b""
    return records


def _no_traceback(learner) -> None:
    out = "".join(learner.lines)
    assert "Traceback" not in out and '"event": "crashed"' not in out, learner.output(60)


def test_a_full_run_directory_is_an_event_and_training_goes_on(tmp_path, tiny_model_dir, subprocess_env,
                                                               process_groups):
    with small_disk("64m") as run_dir:
        cfg = _config(tmp_path, run_dir, tiny_model_dir, checkpoint_failure="continue")
        learner, clients = _start(process_groups, cfg, subprocess_env, tmp_path)
        learner.wait_for(event_line("checkpoint"), 60, "a first checkpoint")
        filler = fill(run_dir)
        failed = learner.wait_for(event_line("record_failed", errno="ENOSPC"), 60, "a failed row")
        assert "training goes on" in failed["action"], failed
        learner.wait_for(event_line("checkpoint_failed", errno="ENOSPC"), 60, "a failed checkpoint")
        at = learner.wait_for(event_line("step"), 30, "a step on the full disk")["version"]
        learner.wait_for(lambda line: (ev := event_line("step")(line)) and ev["version"] >= at + 5, 60,
                         "5 more steps on the full disk")
        filler.unlink()
        recovered = learner.wait_for(event_line("record_recovered"), 60, "rows written again")
        # (a row can still fit in the last page a file already has, so a streak may be short)
        assert recovered["lost"] >= 1, recovered
        learner.wait_for(event_line("checkpoint"), 60, "a checkpoint once freed")
        clients.kill()
        assert process_groups.stop(learner.proc) == 0, learner.output(60)
        learner.read_to_end()
        _no_traceback(learner)
        rows = _whole(run_dir / "metrics.jsonl")
        steps = [r["step"] for r in rows]
        assert steps == sorted(steps) and len(steps) == len(set(steps)) and steps[-1] > at + 5
        _whole(run_dir / "trained_ids.jsonl")
        ids = effective_trained_ids(run_dir / "trained_ids.jsonl")
        assert len(ids) == len(set(ids)), "a sample id trained twice"


def test_a_full_run_directory_under_checkpoint_failure_stop_stops_cleanly(
        tmp_path, tiny_model_dir, subprocess_env, process_groups):
    with small_disk("64m") as run_dir:
        cfg = _config(tmp_path, run_dir, tiny_model_dir, checkpoint_failure="stop", save_every=1000)
        learner, clients = _start(process_groups, cfg, subprocess_env, tmp_path)
        learner.wait_for(event_line("step"), 60, "a first step")
        fill(run_dir)
        failed = learner.wait_for(event_line("record_failed", errno="ENOSPC"), 60, "a failed row")
        assert failed["action"].startswith("stopping"), failed
        assert learner.proc.wait(60) == 3, learner.output(60)
        clients.kill()
        learner.read_to_end()
        _no_traceback(learner)
        _whole(run_dir / "metrics.jsonl")
        _whole(run_dir / "trained_ids.jsonl")


def test_resume_past_a_torn_last_line_of_trained_ids(tmp_path, tiny_model_dir, subprocess_env, process_groups):
    run_dir = tmp_path / "run"
    cfg = _config(tmp_path, run_dir, tiny_model_dir, rollout_log={})
    learner, clients = _start(process_groups, cfg, subprocess_env, tmp_path)
    learner.wait_for(event_line("checkpoint"), 60, "a checkpoint")
    clients.kill()
    assert process_groups.stop(learner.proc) == 0, learner.output(60)
    trained = run_dir / "trained_ids.jsonl"
    before = effective_trained_ids(trained)
    with open(trained, "ab") as f:           # the line a crash or a full disk leaves
        f.write(b'{"run_id": "x", "trained_on_version": 99, "sample_ids": ["load-0-a')
    again = process_groups.watch([*CLI, "learner", "--config", cfg, "--resume"], env=subprocess_env,
                                 cwd=tmp_path)
    torn = again.wait_for(event_line("record_torn"), 120, "the torn line reported")
    assert torn["file"] == str(trained) and torn["level"] == "warning", torn
    again.wait_for_event("rollout_log_restored", 60)
    again.wait_for_event("ready", 60)
    assert process_groups.stop(again.proc) == 0, again.output(60)
    again.read_to_end()
    _no_traceback(again)
    records = _whole(trained)
    # the resumed life's line, then whatever it trained from the restored samples before the stop
    at = next(i for i, r in enumerate(records) if "resumed_at_version" in r)
    resumed_at = records[at]["resumed_at_version"]
    assert all("sample_ids" in r and r["trained_on_version"] != 99 for r in records[:at])  # torn line gone
    old = [sid for r in records[:at] if r["trained_on_version"] < resumed_at for sid in r["sample_ids"]]
    new = [sid for r in records[at + 1:] for sid in r["sample_ids"]]
    assert effective_trained_ids(trained) == old + new
    assert set(old) <= set(before) and len(old + new) == len(set(old + new))
