"""`slipstream config --from-trl` / `--from-verl` (issue 39.3): configs written the way TRL and verl
document them translate key by key (every mapped key checked here), every setting without an
equivalent gets its comment line, the translation loads as a slipstream config, and a file that is
neither is one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from deploy.config_file import load_config
from deploy.translate import from_trl, from_verl, read_trl, read_verl

REPO_CLI = [sys.executable, "-m", "deploy.cli", "config"]

# As TRL's docs write a GRPO run's config file (`trl grpo --config grpo.yaml`).
TRL_YAML = """\
model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct
dataset_name: trl-lib/DeepMath-103K
output_dir: Qwen2.5-0.5B-GRPO
learning_rate: 1.0e-6
lr_scheduler_type: cosine
warmup_ratio: 0.1
max_steps: 500
per_device_train_batch_size: 8
gradient_accumulation_steps: 4
num_generations: 16
max_completion_length: 1024
beta: 0.04
epsilon_high: 0.28
loss_type: dr_grpo
scale_rewards: batch
use_vllm: true
vllm_mode: colocate
reward_funcs: [accuracy_reward, think_format_reward]
reward_weights: [1.0, 0.2]
use_peft: true
lora_r: 32
lora_alpha: 64
bf16: true
logging_steps: 10
report_to: [wandb]
save_steps: 100
top_k: 50
"""

# verl's examples/grpo_trainer/run_qwen2-7b.sh, as written there (Hydra overrides).
VERL_COMMAND = """\
set -x
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files=$HOME/data/gsm8k/test.parquet \\
    data.train_batch_size=1024 \\
    data.max_prompt_length=512 \\
    data.max_response_length=1024 \\
    data.filter_overlong_prompts=True \\
    data.truncation='error' \\
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \\
    actor_rollout_ref.actor.optim.lr=1e-6 \\
    actor_rollout_ref.model.use_remove_padding=True \\
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \\
    actor_rollout_ref.actor.use_kl_loss=True \\
    actor_rollout_ref.actor.kl_loss_coef=0.001 \\
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \\
    actor_rollout_ref.actor.entropy_coeff=0 \\
    actor_rollout_ref.model.enable_gradient_checkpointing=True \\
    actor_rollout_ref.actor.fsdp_config.param_offload=False \\
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \\
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \\
    actor_rollout_ref.rollout.n=5 \\
    algorithm.use_kl_in_reward=False \\
    trainer.logger='["console","wandb"]' \\
    trainer.n_gpus_per_node=8 \\
    trainer.nnodes=1 \\
    trainer.save_freq=20 \\
    trainer.test_freq=5 \\
    trainer.total_epochs=15 $@
"""

# The fully-async recipe's knobs and a DAPO-style loss, as a (partial) verl YAML tree.
VERL_ASYNC_YAML = """\
data:
  train_batch_size: 0
  max_response_length: 2048
actor_rollout_ref:
  model:
    path: /models/qwen3-8b
    lora_rank: 16
    lora_alpha: 32
  actor:
    ppo_mini_batch_size: 32
    clip_ratio_low: 0.2
    clip_ratio_high: 0.28
    loss_agg_mode: seq-mean-token-sum-norm
    policy_loss:
      loss_mode: gspo
    optim:
      lr: 2.0e-6
      lr_warmup_steps: 10
      lr_scheduler_type: cosine
      min_lr_ratio: 0.1
  rollout:
    n: 8
    top_p: 0.9
algorithm:
  adv_estimator: grpo
  norm_adv_by_std_in_grpo: false
  rollout_correction:
    rollout_is: token
    rollout_is_threshold: "0.5_5.0"
    bypass_mode: true
async_training:
  staleness_threshold: 0.5
  trigger_parameter_sync_step: 4
  require_batches: 1
  partial_rollout: true
trainer:
  total_training_steps: 300
custom_reward_function:
  path: /work/rewards/math.py
  name: my_score
"""


def flat(cfg: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in cfg.items():
        if isinstance(v, dict) and k != "weights" and k != "lora":
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def notes_by_key(t) -> dict[str, str]:
    return {n.split("=", 1)[0]: n for n in t.notes}


def test_a_documented_trl_config_translates_key_by_key(tmp_path):
    (tmp_path / "grpo.yaml").write_text(TRL_YAML)
    settings, source = read_trl(tmp_path / "grpo.yaml")
    t = from_trl({**settings, "num_processes": 2}, source)
    got = flat(t.cfg)
    # 8 completions x 2 processes x 4 accumulation steps = 64 a generation batch = 4 prompts x 16.
    assert {k: got[k] for k in ("learner.batch.batch_prompts", "learner.batch.group_size",
                                "learner.batch.micro_batch_samples", "learner.batch.mini_batch_samples",
                                "learner.batch.ppo_epochs")} == {
        "learner.batch.batch_prompts": 4, "learner.batch.group_size": 16,
        "learner.batch.micro_batch_samples": 8, "learner.batch.mini_batch_samples": 0,
        "learner.batch.ppo_epochs": 1}
    expected = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct", "learner.total_steps": 500, "learner.optimizer.lr": 1e-6,
        "learner.optimizer.lr_schedule": "cosine", "learner.optimizer.lr_warmup_steps": 50,
        "learner.optimizer.max_grad_norm": 1.0, "learner.optimizer.weight_decay": 0.0,
        "learner.algorithm.loss_agg": "seq_mean_token_sum_norm", "learner.algorithm.policy_loss": "ppo",
        "learner.algorithm.clip_low": 0.2, "learner.algorithm.clip_high": 0.28,
        "learner.algorithm.advantage": "dr_grpo", "learner.reward.norm": "batch",
        "learner.kl.coef": 0.04, "learner.kl.kind": "k3", "learner.kl.in_reward": False,
        "learner.sampling.max_new_tokens": 1024, "learner.sampling.temperature": 1.0,
        "learner.algorithm.is_mode": "seq_mis", "learner.algorithm.is_cap": 3.0,
        "learner.staleness.max_staleness": 0, "learner.runtime.gradient_checkpointing": True,
        "learner.runtime.disable_dropout": False, "learner.seed": 42, "rollout.seed": 42,
        "learner.data.preset": "trl", "learner.data.answer_key": None,
        "learner.data.dataset": "trl-lib/DeepMath-103K", "learner.run_dir": "Qwen2.5-0.5B-GRPO",
        "learner.checkpoint.save_every": 100, "learner.metrics_sinks": ["jsonl", "wandb"],
        "learner.lora": {"r": 32, "alpha": 64, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]},
        "rollout.engine": "vllm", "rollout.vllm.enable_lora": True, "rollout.vllm.max_lora_rank": 32,
        "rollout.reward.fn": ["trl:trl.rewards:accuracy_reward", "trl:trl.rewards:think_format_reward"],
        "rollout.reward.weights": {"accuracy_reward": 1.0, "think_format_reward": 0.2},
    }
    assert {k: got.get(k) for k in expected} == expected
    notes = notes_by_key(t)
    # Set in the file with no (or another) meaning here: each has its line.
    for key in ("vllm_mode", "top_k", "use_bias_correction_kl", "vllm_importance_sampling_mode",
                "dataset_name", "lora_target_modules", "staleness"):
        assert key in notes, (key, t.notes)
    assert any("bf16" in n and "logging_steps" in n for n in t.notes)
    assert "world size" not in notes                    # given
    # It is a slipstream config (the Hub ids aside, which the notes say to fetch first).
    out = tmp_path / "out.yaml"
    out.write_text(yaml.safe_dump(t.cfg))
    cfg = load_config(out)
    assert cfg.learner.batch.batch_samples == 64 and cfg.learner.algorithm.clip_high == 0.28


def test_a_trl_grpo_command_line_and_the_async_trainer(tmp_path):
    (tmp_path / "run.sh").write_text(
        "accelerate launch --num_processes 4 --config_file zero2.yaml trl grpo \\\n"
        "  --model_name_or_path /models/qwen --dataset_name /data/math --learning_rate 3e-6 \\\n"
        "  --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --num_generations 8 \\\n"
        "  --num_iterations 2 --use_peft --lora_target_modules q_proj k_proj --lora-dropout 0.0 \\\n"
        "  --loss_type grpo --importance_sampling_level sequence --no_shuffle_dataset \\\n"
        "  --reward_funcs my_rewards.correct think_format_reward --max_steps 100 --warmup_steps 10 \\\n"
        "  --max_staleness 2 --weight_sync_steps 2 --epsilon=0.0003 --epsilon_high 0.0004\n")
    settings, source = read_trl(tmp_path / "run.sh")
    assert settings["num_processes"] == 4 and settings["lora_target_modules"] == ["q_proj", "k_proj"]
    t = from_trl(settings, source)
    got = flat(t.cfg)
    # 4 x 4 processes x 2 = 32 completions = 4 prompts x 8; 2 iterations: 2 optimizer steps a batch.
    assert got["learner.batch.batch_prompts"] == 4 and got["learner.batch.ppo_epochs"] == 2
    assert got["learner.total_steps"] == 50 and got["learner.optimizer.lr_warmup_steps"] == 5
    assert got["learner.algorithm.policy_loss"] == "gspo"
    assert got["learner.algorithm.loss_agg"] == "seq_mean_token_mean"
    assert (got["learner.algorithm.clip_low"], got["learner.algorithm.clip_high"]) == (0.0003, 0.0004)
    assert got["learner.data.shuffle"] is False and got["learner.optimizer.lr"] == 3e-6
    assert got["learner.lora"]["target_modules"] == ["q_proj", "k_proj"] and got["learner.lora"]["dropout"] == 0.0
    assert got["rollout.reward.fn"] == ["trl:my_rewards:correct", "trl:trl.rewards:think_format_reward"]
    # The async trainer's staleness counts weight syncs: 2 syncs x 2 steps each.
    assert got["learner.staleness.max_staleness"] == 4 and got["learner.staleness.stale_policy"] == "drop"
    assert "max_staleness" in notes_by_key(t) and "optimizer steps per batch" in notes_by_key(t)
    out = tmp_path / "out.yaml"
    out.write_text(yaml.safe_dump(t.cfg))
    assert load_config(out).learner.batch.mini_batch_samples == 0        # one optimizer step per epoch


def test_a_documented_verl_command_line_translates_key_by_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    (tmp_path / "run_qwen2-7b.sh").write_text(VERL_COMMAND)
    settings, source = read_verl(tmp_path / "run_qwen2-7b.sh")
    assert settings["data.truncation"] == "error" and settings["trainer.logger"] == ["console", "wandb"]
    t = from_verl(settings, source)
    got = flat(t.cfg)
    expected = {
        "model": "Qwen/Qwen2-7B-Instruct", "learner.batch.batch_prompts": 1024, "learner.batch.group_size": 5,
        "learner.batch.mini_batch_samples": 1280, "learner.batch.micro_batch_samples": 40,
        "learner.batch.ppo_epochs": 1, "learner.data.epochs": 15, "learner.data.max_prompt_tokens": 512,
        "learner.data.preset": "verl", "learner.data.dataset": "/home/u/data/gsm8k/train.parquet",
        "learner.data.prompt_key": "prompt", "learner.optimizer.lr": 1e-6, "learner.optimizer.lr_schedule": "constant",
        "learner.optimizer.weight_decay": 0.01, "learner.optimizer.max_grad_norm": 1.0,
        "learner.algorithm.clip_low": 0.2, "learner.algorithm.clip_high": 0.2, "learner.algorithm.dual_clip": 3.0,
        "learner.algorithm.policy_loss": "ppo", "learner.algorithm.loss_agg": "token_mean",
        "learner.algorithm.advantage": "grpo", "learner.algorithm.lam": 1.0, "learner.kl.coef": 0.001,
        "learner.kl.kind": "k3", "learner.kl.in_reward": False, "learner.staleness.max_staleness": 0,
        "learner.sampling.max_new_tokens": 1024, "learner.evaluation.data": "/home/u/data/gsm8k/test.parquet",
        "learner.evaluation.every": 5, "learner.runtime.gradient_checkpointing": True,
        "learner.checkpoint.save_every": 20, "learner.metrics_sinks": ["jsonl", "wandb"],
        "rollout.engine": "vllm", "rollout.vllm.tensor_parallel_size": 2,
        "rollout.vllm.gpu_memory_utilization": 0.6,
        "rollout.reward.fn": ["verl:verl.utils.reward_score:default_compute_score"],
    }
    assert {k: got.get(k) for k in expected} == expected
    notes = notes_by_key(t)
    for key in ("actor_rollout_ref.model.use_remove_padding", "data.truncation", "data.filter_overlong_prompts",
                "trainer.n_gpus_per_node", "trainer.nnodes", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.actor.fsdp_config.*", "algorithm.rollout_correction.rollout_is", "staleness",
                "custom_reward_function.path"):
        assert key in notes, (key, t.notes)
    out = tmp_path / "out.yaml"
    out.write_text(yaml.safe_dump(t.cfg))
    assert load_config(out).learner.batch.batch_samples == 5120


def test_verls_fully_async_recipe_and_correction_keys(tmp_path):
    (tmp_path / "async.yaml").write_text(VERL_ASYNC_YAML)
    t = from_verl(*read_verl(tmp_path / "async.yaml"))
    got = flat(t.cfg)
    # One slipstream step = one verl parameter sync: 4 optimizer steps of 32 prompts.
    assert got["learner.batch.batch_prompts"] == 128 and got["learner.batch.mini_batch_samples"] == 256
    assert got["learner.staleness.max_staleness"] == 1                   # ceil(0.5)
    assert got["rollout.generation.inflight_update"] == "continue"
    assert got["learner.algorithm.recompute_logprobs"] is False
    assert (got["learner.algorithm.is_mode"], got["learner.algorithm.icepop_low"],
            got["learner.algorithm.icepop_high"]) == ("icepop", 0.5, 5.0)
    assert got["learner.algorithm.policy_loss"] == "gspo" and "learner.algorithm.dual_clip" not in got
    assert got["learner.algorithm.advantage"] == "dr_grpo"
    assert got["learner.algorithm.loss_agg"] == "seq_mean_token_sum_norm"
    assert (got["learner.optimizer.lr_schedule"], got["learner.optimizer.lr_warmup_steps"],
            got["learner.optimizer.min_lr_ratio"]) == ("cosine", 10, 0.1)
    assert got["learner.lora"] == {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
    assert got["learner.total_steps"] == 300 and got["learner.sampling.max_new_tokens"] == 2048
    assert got["rollout.reward.fn"] == ["verl:/work/rewards/math.py:my_score"]
    notes = notes_by_key(t)
    assert "async_training.staleness_threshold" in notes and "actor_rollout_ref.rollout.top_p" in notes
    out = tmp_path / "out.yaml"
    out.write_text(yaml.safe_dump(t.cfg))
    load_config(out)


@pytest.mark.parametrize("flag, text, message", [
    ("--from-trl", "- just\n- a list\n", "neither a TRL GRPO config (YAML/JSON) nor a `trl grpo` command line"),
    ("--from-trl", "colour: blue\nsize: 3\n", "not a TRL GRPO config"),
    ("--from-verl", "colour: blue\n", "not a verl config"),
    ("--from-verl", "echo hello world\n", "neither a verl YAML nor a command line of key.path=value overrides"),
])
def test_a_file_that_is_neither_is_one_line_and_exit_2(tmp_path, flag, text, message):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    r = subprocess.run([*REPO_CLI, flag, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_the_command_prints_a_config_that_loads(tmp_path):
    (tmp_path / "grpo.yaml").write_text(TRL_YAML)
    r = subprocess.run([*REPO_CLI, "--from-trl", str(tmp_path / "grpo.yaml"), "--world-size", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# Translated from TRL config grpo.yaml")
    assert "# - vllm_mode=colocate: slipstream's rollout servers are processes of their own" in r.stdout
    (tmp_path / "out.yaml").write_text(r.stdout)
    assert load_config(tmp_path / "out.yaml").learner.batch.batch_prompts == 4


@pytest.mark.parametrize("args, message", [
    (["--from-trl", "A", "--from-verl", "B"], "give --from-trl or --from-verl, not both"),
    (["--from-verl", "X", "--world-size", "2"], "--world-size is for --from-trl"),
    (["--from-trl", "X", "--set", "learner.lr=1"], "drop --config and --set"),
])
def test_conflicting_flags_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    from deploy.cli import main

    for name in ("A", "B", "X"):
        (tmp_path / name).write_text(TRL_YAML)
    args = [str(tmp_path / a) if a in ("A", "B", "X") else a for a in args]
    assert main(["config", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
