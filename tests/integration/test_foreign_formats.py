"""Users arriving from verl and TRL (issue 39): their dataset and reward functions train through
`slipstream run` with nothing rewritten.

- verl: the RL parquet verl's data preprocessing writes (chat-message ``prompt``, ``data_source``,
  ``ability``, ``reward_model.ground_truth``, ``extra_info``) with ``learner.data.preset: verl``,
  scored by a ``compute_score`` written as verl documents it (``verl:module:fn``).
- TRL: a conversational dataset (``prompt`` messages, a ``solution`` column, no answer) with
  ``learner.data.preset: trl``, scored by TRL's own ``trl.rewards.think_format_reward`` and a
  TRL-style function that reads the ``solution`` column (``trl:module:fn``).

Each custom function returns 0.25 only when it was called with its own project's conventions (the
right keywords and values), else 0: the steps' mean reward says which it was.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from config_kit import nested, rollout_nested
from run_kit import slipstream_run, step_rows

pytestmark = pytest.mark.slow

TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}.{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")

VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    ok = (data_source == "openai/gsm8k" and isinstance(solution_str, str)
          and ground_truth == extra_info["index"] * 2 and extra_info["split"] == "train")
    return {"score": 0.25 if ok else 0.0, "acc": float(ok), "pred": solution_str}
'''

TRL_REWARD = '''
def uses_solution(prompts, completions, completion_ids, solution, **kwargs):
    ok = (all(p[-1]["role"] == "user" and p[-1]["content"].endswith("+1=") for p in prompts)
          and all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions)
          and all(isinstance(ids, list) for ids in completion_ids)
          and len(set(solution)) == 1 and "answer" not in kwargs and kwargs["level"][0] == 1
          and kwargs["trainer_state"].global_step >= 0)
    return [0.25 if ok else 0.0 for _ in completions]
'''


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> str:
    """The random tiny model with a chat template in its tokenizer's alphabet."""
    from learner.models.builtin import build_model, build_tokenizer

    path = tmp_path_factory.mktemp("tiny-chat-model")
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    build_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def run(tmp_path, model: str, data: dict, reward: list[str], plugin: tuple[str, str], subprocess_env,
        process_groups, steps: int = 3) -> list[dict]:
    cfg = {"model": model,
           "learner": nested({"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                              "total_steps": steps, "batch_prompts": 2, "group_size": 2, "max_new_tokens": 4,
                              "run_dir": str(tmp_path / "run"), "save_every": 0, "data": data}),
           "rollout": {**rollout_nested({"metrics_port": 0, "max_concurrency": 8}), "reward": {"fn": reward}},
           "launcher": {"num_rollout_servers": 1, "restart_limit": 0, "shutdown_timeout_s": 20}}
    code, out = slipstream_run(tmp_path, cfg, subprocess_env, process_groups, plugins=dict([plugin]))
    assert code == 0, out[-3000:]
    rows = step_rows(tmp_path / "run")
    assert len(rows) == steps, rows
    return rows


def test_a_verl_parquet_and_compute_score_train_unchanged(tmp_path, chat_model_dir, subprocess_env, process_groups):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # As verl's examples/data_preprocess/gsm8k.py writes it (the ground truth an integer here, to
    # see that it reaches compute_score as the row has it, not as text).
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"{i}+{i}="}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": 2 * i},
             "extra_info": {"split": "train", "index": i}} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    got = run(tmp_path, chat_model_dir, {"dataset": str(tmp_path / "train.parquet"), "preset": "verl"},
              ["verl:my_verl_reward:compute_score"], ("my_verl_reward.py", VERL_REWARD),
              subprocess_env, process_groups)
    # The dict's score is the reward; its acc is a part outside the total.
    assert all(r["reward_mean"] == 0.25 for r in got), [r["reward_mean"] for r in got]


def test_a_trl_conversational_dataset_and_trl_rewards_train_unchanged(tmp_path, chat_model_dir, subprocess_env,
                                                                        process_groups):
    rows = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}],
             "solution": "2", "level": 1}] * 6
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    got = run(tmp_path, chat_model_dir, {"dataset": str(tmp_path / "train.jsonl"), "preset": "trl"},
              ["trl:trl.rewards:think_format_reward", "trl:my_trl_reward:uses_solution"],
              ("my_trl_reward.py", TRL_REWARD), subprocess_env, process_groups)
    # think_format_reward gives the random model's 4-token completions 0 ("<think>" is 7 tokens).
    assert all(r["reward_mean"] == 0.25 for r in got), [r["reward_mean"] for r in got]


def _translated(flag: str, path, subprocess_env) -> dict:
    """`slipstream config --from-trl/--from-verl PATH`, parsed."""
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "config", flag, str(path)], capture_output=True,
                       text=True, env=subprocess_env, timeout=120)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def _local(cfg: dict, tmp_path) -> dict:
    """The translation with what only this machine decides: free ports, the HF engine, one server."""
    learner, rollout = cfg["learner"], cfg.setdefault("rollout", {})
    learner.update(run_dir=str(tmp_path / "run"))
    learner.setdefault("network", {}).update(rollout_port=0, weights_port=0, control_port=0, metrics_port=0)
    learner.setdefault("checkpoint", {})["save_every"] = 0
    rollout["engine"] = "hf"
    rollout.pop("vllm", None)
    rollout.setdefault("network", {})["metrics_port"] = 0
    cfg["launcher"] = {"num_rollout_servers": 1, "restart_limit": 0, "shutdown_timeout_s": 20}
    return cfg


def test_a_translated_verl_config_runs(tmp_path, chat_model_dir, subprocess_env, process_groups):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i}+{i}="}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": 2 * i},
             "extra_info": {"split": "train", "index": i}} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    (tmp_path / "verl.yaml").write_text(yaml.safe_dump({
        "data": {"train_files": str(tmp_path / "train.parquet"), "train_batch_size": 2,
                 "max_prompt_length": 64, "max_response_length": 4},
        "actor_rollout_ref": {"model": {"path": chat_model_dir},
                              "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 4,
                                        "optim": {"lr": 1e-4}},
                              "rollout": {"n": 2, "name": "vllm"}},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": 3},
        "custom_reward_function": {"path": str(tmp_path / "reward.py"), "name": "compute_score"}}))
    cfg = _local(_translated("--from-verl", tmp_path / "verl.yaml", subprocess_env), tmp_path)
    assert cfg["rollout"]["reward"]["fn"] == [f"verl:{tmp_path / 'reward.py'}:compute_score"]
    code, out = slipstream_run(tmp_path, cfg, subprocess_env, process_groups)
    assert code == 0, out[-3000:]
    got = step_rows(tmp_path / "run")
    assert len(got) == 3 and all(r["reward_mean"] == 0.25 for r in got), got


def test_a_translated_trl_config_runs(tmp_path, chat_model_dir, subprocess_env, process_groups):
    rows = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}],
             "solution": "2", "level": 1}] * 6
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "my_trl_reward.py").write_text(TRL_REWARD)
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump({
        "model_name_or_path": chat_model_dir, "dataset_name": str(tmp_path / "train.jsonl"),
        "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 4, "max_steps": 3,
        "learning_rate": 1e-4, "reward_funcs": ["think_format_reward", "my_trl_reward.uses_solution"],
        "save_strategy": "no"}))
    cfg = _local(_translated("--from-trl", tmp_path / "grpo.yaml", subprocess_env), tmp_path)
    assert cfg["rollout"]["reward"]["fn"] == ["trl:trl.rewards:think_format_reward", "trl:my_trl_reward:uses_solution"]
    code, out = slipstream_run(tmp_path, cfg, subprocess_env, process_groups)
    assert code == 0, out[-3000:]
    got = step_rows(tmp_path / "run")
    assert len(got) == 3 and all(r["reward_mean"] == 0.25 for r in got), got
