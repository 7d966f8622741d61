"""Issue 31.1 through real processes: a setting that breaks the model never reaches the servers
or a checkpoint, and a model that keeps failing stops the run.

A real ``slipstream learner`` (tiny model) fed by protocol-level clients (load_client.py), set
live with the real ``slipstream ctl``:

- ``set optimizer.lr Infinity`` (and ``NaN``) is refused, exit 2; the config file's ``.inf``
  too (tests/deploy/test_startup_errors.py has the start-up side).
- ``set optimizer.lr 1e30`` is accepted (finite), and every update after it leaves weights whose
  norm overflows: each step is rolled back and skipped, the version stays, nothing is published,
  and after ``max_consecutive_skips`` the run stops, exit 6, one stderr line; the checkpoint it
  writes at the stop holds the last good (finite) weights. Before: the model went NaN, was
  published and checkpointed, and every later step was skipped with no stop.
- with ``rollback_nonfinite: false`` the first such update stops the run (exit 6) with no
  checkpoint of the broken model.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from config_kit import nested
from load_kit import event_line

from learner.state.checkpoint import Checkpointer

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "deploy.cli"]
LOAD_CLIENT = Path(__file__).resolve().parent / "load_client.py"
EXIT_DIVERGED = 6


def _start(tmp_path: Path, model: str, env: dict, process_groups, **more):
    run_dir = tmp_path / "run"
    cfg = {"model": model, "learner": nested({
        "rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
        "total_steps": 10_000_000, "batch_prompts": 2, "group_size": 4, "max_new_tokens": 4,
        "max_staleness": 1, "run_dir": str(run_dir), "save_every": 0, "threads": 1,
        "lease_timeout_s": 600, "server_timeout_s": 600, "exit_on_finish": False, **more})}
    path = tmp_path / "learner.yaml"
    path.write_text(yaml.safe_dump(cfg))
    learner = process_groups.watch([*CLI, "learner", "--config", str(path)], env=env, cwd=tmp_path)
    ready = learner.wait_for_event("ready", 120)
    clients = process_groups.popen([sys.executable, str(LOAD_CLIENT), ready["rollout"], "2", "120",
                                    str(tmp_path / "clients.json"), "8"], env=env, cwd=tmp_path)
    return learner, clients, run_dir


def _ctl(run_dir: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "ctl", "--run-dir", str(run_dir), *args], capture_output=True,
                          text=True, env=env, timeout=60)


def _set_at(learner) -> int:
    """The index of the learner's line that says the learning rate was set to 1e30."""
    return next(i for i, line in enumerate(learner.lines)
                if (ev := event_line("control_set", key="optimizer.lr")(line)) and ev["value"] == 1e30)


def _after(learner, name: str, start: int) -> list[dict]:
    """The ``name`` events among the learner's lines from index ``start`` on."""
    return [ev for line in learner.lines[start:] if (ev := event_line(name)(line))]


def test_a_learning_rate_that_breaks_the_model_is_rolled_back_and_the_run_stops(
        tmp_path, tiny_model_dir, subprocess_env, process_groups):
    learner, clients, run_dir = _start(tmp_path, tiny_model_dir, subprocess_env, process_groups,
                                       algorithm={"max_consecutive_skips": 3})
    learner.wait_for(lambda line: (ev := event_line("step")(line)) and ev["version"] >= 3, 60, "3 steps")
    for bad in ("Infinity", "NaN"):
        r = _ctl(run_dir, subprocess_env, "set", "optimizer.lr", bad)
        assert r.returncode == 2 and "finite" in r.stderr and len(r.stderr.splitlines()) == 1, r
    r = _ctl(run_dir, subprocess_env, "set", "optimizer.lr", "1e30")
    assert r.returncode == 0, r
    assert learner.proc.wait(120) == EXIT_DIVERGED, learner.output(60)
    clients.kill()
    learner.read_to_end()
    mark = _set_at(learner)
    skipped = _after(learner, "step_skipped", mark)
    assert len(skipped) >= 3 and all("rolled back" in s["reason"] for s in skipped[-3:]), learner.output(30)
    steps = _after(learner, "step", mark)
    # at most the step in progress when the setting landed was trained (before_step applies it
    # to the next one); after that the version stood still (a version is published only after a
    # step that applied)
    assert len(steps) <= 1, steps
    last = steps[-1]["version"] if steps else skipped[0]["trained_on_version"]
    assert all(s["trained_on_version"] == last for s in skipped)
    errors = [line for line in learner.lines if line.startswith("slipstream learner: stopping:")]
    assert len(errors) == 1 and "3 steps in a row skipped" in errors[0], learner.output(60)
    output = "".join(learner.lines)
    assert "Traceback" not in output
    # and no noise (issue 30.9): no progress bar at the checkpoint, no DeepSpeed accelerator warning
    assert "Writing model shards" not in output and "Setting accelerator to CPU" not in output
    # the checkpoint written at the stop holds the last good weights
    store = Checkpointer(run_dir / "checkpoints", keep_last=5)
    ckpt, _ = store.read_latest()
    assert ckpt.path.name == f"step-{last}"
    tensors = [t for f in sorted((ckpt.path / "policy").glob("*.safetensors")) for t in _load(f)]
    assert tensors and all(torch.isfinite(t).all() and t.float().norm() < 1e6 for t in tensors)


def test_without_rollback_a_broken_update_stops_the_run_and_is_never_saved(
        tmp_path, tiny_model_dir, subprocess_env, process_groups):
    learner, clients, run_dir = _start(tmp_path, tiny_model_dir, subprocess_env, process_groups,
                                       algorithm={"rollback_nonfinite": False})
    learner.wait_for(lambda line: (ev := event_line("step")(line)) and ev["version"] >= 2, 60, "2 steps")
    assert _ctl(run_dir, subprocess_env, "set", "optimizer.lr", "1e30").returncode == 0
    assert learner.proc.wait(120) == EXIT_DIVERGED, learner.output(60)
    clients.kill()
    learner.read_to_end()
    mark = _set_at(learner)
    diverged = _after(learner, "diverged", mark)
    assert len(diverged) == 1 and "no copy to roll back to" in diverged[0]["reason"], learner.output(60)
    assert not _after(learner, "checkpoint", mark), "the broken model was checkpointed"
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").glob("step-*"))


def _load(path: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return list(load_file(str(path)).values())
