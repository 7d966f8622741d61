"""A resumed run is the run that was not interrupted (issue 27.9): at η = 0 with fixed seeds and
per-assignment sampling seeds (learner.sampling.seed_per_assignment), `slipstream run` SIGKILLed
(every process of it) after a checkpoint and resumed with `--resume` ends with the same weights
(≤ 1e-6) and the same per-step losses as the same run uninterrupted. The control: without
per-assignment seeds the rollout servers' randomness restarts with the processes, the resumed run
samples other completions, and it does not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

STEPS, SAVE = 24, 8


def _cli(run_dir, seeded: bool) -> list[str]:
    sets = {"learner.network.rollout_port": 0, "learner.network.weights_port": 0,
            "learner.network.control_port": 0, "learner.network.metrics_port": 0,
            "rollout.network.metrics_port": 0, "learner.batch.batch_prompts": 4,
            "learner.batch.group_size": 4, "rollout.generation.max_concurrency": 16,
            "learner.staleness.max_staleness": 0, "learner.total_steps": STEPS,
            "learner.checkpoint.save_every": SAVE, "learner.run_dir": str(run_dir),
            "learner.sampling.seed_per_assignment": seeded, "learner.threads": 1}
    out = [sys.executable, "-m", "deploy.cli", "run"]
    for k, v in sets.items():
        out += ["--set", f"{k}={json.dumps(v) if isinstance(v, bool) else v}"]
    return out


def _losses(run_dir) -> dict[int, float]:
    """The loss of each step, the last row of each (a killed life's rows past its checkpoint are
    trained again after the resume)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "kind" not in row:
            out[row["step"]] = row["loss"]
    return out


def _weights(run_dir) -> dict[str, torch.Tensor]:
    (path,) = (run_dir / "final").glob("*.safetensors")
    return load_file(str(path))


def _killed_and_resumed(tmp_path, name, seeded, subprocess_env, process_groups):
    run_dir = tmp_path / name
    cli = _cli(run_dir, seeded)
    log = open(tmp_path / f"{name}.out", "w")  # noqa: SIM115 - closed below
    proc = process_groups.popen(cli, stdout=log, stderr=subprocess.STDOUT, env=subprocess_env, cwd=tmp_path)
    marker = run_dir / "checkpoints" / f"step-{SAVE}" / "COMPLETE"
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.poll() is None, (tmp_path / f"{name}.out").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in 300 s"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)                       # the launcher, the learner, the server
    proc.wait(timeout=30)
    log.close()
    killed_at = max(_losses(run_dir), default=0)
    assert SAVE <= killed_at < STEPS, killed_at               # killed mid-run, after the checkpoint
    resumed = process_groups.run([*cli, "--resume"], timeout=600, env=subprocess_env, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    assert "[learner] resumed" in resumed.stdout
    return run_dir


def _same(a_dir, b_dir) -> tuple[float, float]:
    """(largest weight difference, largest loss difference) of two runs' ends."""
    wa, wb = _weights(a_dir), _weights(b_dir)
    assert wa.keys() == wb.keys()
    dw = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)
    la, lb = _losses(a_dir), _losses(b_dir)
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    dl = max(abs(la[s] - lb[s]) for s in la)
    return dw, dl


def test_a_killed_and_resumed_run_ends_as_the_uninterrupted_one(tmp_path, subprocess_env, process_groups):
    whole = tmp_path / "whole"
    done = process_groups.run(_cli(whole, True), timeout=600, env=subprocess_env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    resumed = _killed_and_resumed(tmp_path, "resumed", True, subprocess_env, process_groups)
    dw, dl = _same(whole, resumed)
    print(f"seeded: max |dw| {dw:.3g}, max |dloss| {dl:.3g}")
    assert dw <= 1e-6 and dl <= 1e-6, (dw, dl)
    # The control: the same kill and resume without per-assignment seeds is another run.
    unseeded = _killed_and_resumed(tmp_path, "unseeded", False, subprocess_env, process_groups)
    plain = tmp_path / "plain"
    done = process_groups.run(_cli(plain, False), timeout=600, env=subprocess_env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    dw, dl = _same(plain, unseeded)
    print(f"unseeded: max |dw| {dw:.3g}, max |dloss| {dl:.3g}")
    assert dw > 1e-6, (dw, dl)
