"""DAPO's dynamic sampling through real processes (issue 27.1): ``slipstream run`` with a real
rollout server whose reward makes some groups uniform trains only informative groups and counts the
dropped ones per step; a reward that is the same for every completion stops the run with one line
and exit code 5 instead of issuing work forever."""

from __future__ import annotations

import json

import pytest
from config_kit import nested, rollout_nested
from run_kit import slipstream_run

pytestmark = pytest.mark.slow

REWARDS = '''
import random


def constant(prompt, completion, metadata):
    return 0.5


def coin(prompt, completion, metadata):
    """A fair coin per completion: a group of two is uniform half the time."""
    return float(random.random() < 0.5)
'''


def _run(tmp_path, subprocess_env, process_groups, reward: str, steps: int, batch: dict):
    model = subprocess_env["TINY_MODEL_DIR"]
    cfg = {"model": model,
           "learner": nested({"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                              "total_steps": steps, "batch_prompts": 2, "group_size": 2, "max_new_tokens": 4,
                              "run_dir": str(tmp_path / "run"), "save_every": 0, "batch": batch}),
           "rollout": rollout_nested({"metrics_port": 0, "max_concurrency": 8, "reward": f"ds_rewards:{reward}"}),
           "launcher": {"num_rollout_servers": 1, "restart_limit": 0, "shutdown_timeout_s": 20}}
    return slipstream_run(tmp_path, cfg, subprocess_env, process_groups, plugins={"ds_rewards.py": REWARDS})


@pytest.fixture
def env_with_model(subprocess_env, tiny_model_dir):
    return dict(subprocess_env, TINY_MODEL_DIR=tiny_model_dir)


def test_dynamic_sampling_trains_only_groups_that_teach(tmp_path, env_with_model, process_groups):
    code, out = _run(tmp_path, env_with_model, process_groups, "coin", steps=4,
                     batch={"dynamic_sampling": True})
    assert code == 0, out[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    dropped = sum(r["dynamic_sampling_dropped_groups"] for r in rows)
    assert dropped > 0, rows                       # about half the groups are uniform: some were dropped
    # What was trained: every group carried a reward spread (the score std within groups > 0).
    for r in rows:
        assert r["reward_std"] > 0, r


def test_a_reward_without_spread_stops_dynamic_sampling_with_one_line(tmp_path, env_with_model, process_groups):
    code, out = _run(tmp_path, env_with_model, process_groups, "constant", steps=50,
                     batch={"dynamic_sampling": True, "dynamic_sampling_max_drops": 12})
    reasons = [line for line in out.splitlines() if "stopping: dynamic sampling dropped" in line]
    assert code == 5, out[-3000:]
    assert len(reasons) == 1 and "learner.batch.dynamic_sampling_max_drops 12" in reasons[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
