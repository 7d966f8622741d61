"""`slipstream run --resume`: a run that ended (checkpointed at its end) continues with more steps
under the same run id, version numbering going on."""

from __future__ import annotations

import json
import sys

import pytest

pytestmark = pytest.mark.slow

SMALL = ["--set", "learner.network.rollout_port=0", "--set", "learner.network.weights_port=0",
         "--set", "learner.network.control_port=0", "--set", "learner.network.metrics_port=0",
         "--set", "rollout.network.metrics_port=0", "--set", "learner.batch.batch_prompts=2",
         "--set", "learner.batch.group_size=4", "--set", "rollout.generation.max_concurrency=8"]


def test_run_resume_continues_the_run(tmp_path, subprocess_env, process_groups):
    run_dir = tmp_path / "run"
    cli = [sys.executable, "-m", "deploy.cli", "run", *SMALL, "--set", f"learner.run_dir={run_dir}"]
    first = process_groups.run([*cli, "--set", "learner.total_steps=3"], timeout=600,
                               env=subprocess_env, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    assert (run_dir / "checkpoints" / "step-3" / "COMPLETE").exists()
    assert "--resume" in first.stdout                       # the summary says how to go on
    # a new run in the same directory is refused before anything starts (it would mix the runs)
    final = sorted((p.name, p.stat().st_mtime_ns) for p in (run_dir / "final").iterdir())
    again = process_groups.run([*cli, "--set", "learner.total_steps=3"], timeout=120,
                               env=subprocess_env, cwd=tmp_path)
    assert again.returncode == 2 and "pid" not in again.stdout, again.stdout[-2000:] + again.stderr
    line, = again.stderr.strip().splitlines()
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    assert f"holds run {run_id}" in line and "--resume" in line, line
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (run_dir / "final").iterdir()) == final
    second = process_groups.run([*cli, "--set", "learner.total_steps=5", "--resume"], timeout=600,
                                env=subprocess_env, cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-2000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert len({r["run_id"] for r in rows}) == 1             # the same run, continued
    assert "[learner] resumed" in second.stdout and "steps          4 → 5" in second.stdout
