"""A mixture of datasets through real processes (issue 27.5): `slipstream run` with the built-in
arithmetic task and a file of other prompts whose reward is a plug-in of its own; the rollout
server scores each prompt by its dataset's reward, and metrics.jsonl has each dataset's mean reward
and sample count per step."""

from __future__ import annotations

import json

import pytest
from config_kit import nested, rollout_nested
from run_kit import slipstream_run, step_rows

pytestmark = pytest.mark.slow

REWARD = '''
def quarter(prompt, completion, metadata):
    assert metadata["slipstream_dataset"] == "facts"
    return 0.25
'''


def test_each_dataset_is_scored_by_its_reward_and_reported(tmp_path, tiny_model_dir, subprocess_env, process_groups):
    facts = tmp_path / "facts.jsonl"
    facts.write_text("\n".join(json.dumps({"question": f"{i}+{i}=", "answer": 2 * i}) for i in range(10)))
    steps = 4
    cfg = {"model": tiny_model_dir,
           "learner": nested({"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                              "total_steps": steps, "batch_prompts": 4, "group_size": 2, "max_new_tokens": 4,
                              "run_dir": str(tmp_path / "run"), "save_every": 0,
                              "data": {"datasets": [
                                  {"path": "builtin:arith", "weight": 1},
                                  {"path": str(facts), "weight": 1, "prompt_key": "question",
                                   "reward": "mix_reward:quarter"}]}}),
           "rollout": rollout_nested({"metrics_port": 0, "max_concurrency": 8}),
           "launcher": {"num_rollout_servers": 1, "restart_limit": 0, "shutdown_timeout_s": 20}}
    code, out = slipstream_run(tmp_path, cfg, subprocess_env, process_groups, plugins={"mix_reward.py": REWARD})
    assert code == 0, out[-3000:]
    rows = step_rows(tmp_path / "run")
    assert len(rows) == steps
    for r in rows:
        counts = {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("dataset_samples/")}
        assert set(counts) <= {"arith", "facts"} and sum(counts.values()) == r["samples"], r
        if "facts" in counts:            # every facts completion scored by the plug-in, none by arith's
            assert r["dataset_reward_mean/facts"] == 0.25, r
        if "arith" in counts:
            assert r["dataset_reward_mean/arith"] in (0.0, 0.5, 1.0) or 0.0 <= r["dataset_reward_mean/arith"] <= 1.0
    seen = {k for r in rows for k in r if k.startswith("dataset_samples/")}
    assert seen == {"dataset_samples/arith", "dataset_samples/facts"}, seen
