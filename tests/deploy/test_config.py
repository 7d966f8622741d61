"""Config loading: YAML + --set overrides; every error is one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deploy.cli import main
from deploy.config_file import ConfigError, load_config


def test_default_config_loads():
    cfg = load_config()
    assert cfg.model == "builtin:tiny-arith"
    assert cfg.learner.batch.batch_samples == cfg.learner.batch.batch_prompts * cfg.learner.batch.group_size


def test_overrides_parse_yaml_scalars(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("learner:\n  optimizer:\n    lr: 0.001\n")
    cfg = load_config(f, ["learner.optimizer.lr=1e-4", "learner.staleness.max_staleness=3", "rollout.server_id=s7",
                          "learner.algorithm.recompute_logprobs=false"])
    assert cfg.learner.optimizer.lr == pytest.approx(1e-4)
    assert cfg.learner.staleness.max_staleness == 3
    assert cfg.rollout.server_id == "s7"
    assert cfg.learner.algorithm.recompute_logprobs is False


@pytest.mark.parametrize("text, overrides, needle", [
    ("learner:\n  optimizer:\n    lr: abc\n", [], "learner.optimizer.lr"),
    ("learner:\n  lrr: 0.1\n", [], "learner.lrr: unknown key"),
    ("learner:\n  optimizer:\n    lrr: 0.1\n", [], "learner.optimizer.lrr: unknown key; did you mean optimizer.lr or"),
    # the flat layout (before the sections): its new place, for a file and for --set
    ("learner:\n  lr: 0.001\n", [], "learner.lr: moved to learner.optimizer.lr"),
    ("", ["learner.max_staleness=2"], "learner.max_staleness: moved to learner.staleness.max_staleness"),
    ("", ["learner.kl_coef=0.1"], "learner.kl_coef: moved to learner.kl.coef"),
    ("learner:\n  staleness:\n    max_staleness: -1\n", [], "learner.staleness.max_staleness"),
    ("learner: [1, 2\n", [], "not valid YAML at line"),
    ("- 1\n- 2\n", [], "top level must be a mapping"),
    ("", ["learner.batch.group_size=1"], "group_size must be >= 2"),
    ("", ["learner.algorithm.is_mode=bogus"], "learner.algorithm.is_mode"),
    ("", ["nonsense"], "expected KEY=VALUE"),
    ("learner:\n  deepspeed:\n    reduce_bucket_bytes: 4096\n", [],
     "deepspeed.reduce_bucket_bytes is now deepspeed.reduce_bucket_elements"),
    ("rollout:\n  vllm:\n    weight_transfer: zmq\n", [],
     "rollout.vllm: Value error, weight_transfer was removed (full weights always travel over ZeroMQ): "
     "delete rollout.vllm.weight_transfer from the config"),
    ("rollout:\n  vllm:\n    weight_transfr: zmq\n", [], "rollout.vllm.weight_transfr: unknown key"),
])
def test_bad_config_is_one_clear_line(tmp_path, text, overrides, needle):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f, overrides)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


VLLM_LORA = ["learner.lora.r=8", "rollout.engine=vllm", "rollout.vllm.enable_lora=true",
             "rollout.vllm.max_lora_rank=8", "rollout.vllm.max_loras=2", "learner.staleness.max_staleness=1"]


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.vllm.enable_lora=false"],
     "learner.lora trains LoRA adapters but rollout.vllm.enable_lora is false: set rollout.vllm.enable_lora: true"),
    (["learner.lora.r=16"],
     "learner.lora.r is 16 but rollout.vllm.max_lora_rank is 8: set rollout.vllm.max_lora_rank to at least 16"),
    (["learner.staleness.max_staleness=4"],
     "rollout.vllm.max_loras is 2 but learner.staleness.max_staleness is 4 (rollout.generation.inflight_update: finish)"),
    (["learner.runtime.dtype=bfloat16", "rollout.runtime.dtype=float16"],
     "learner.runtime.dtype is bfloat16 but rollout.runtime.dtype is float16"),
    (["learner.runtime.dtype=float16", "rollout.runtime.dtype=bfloat16"],
     "learner.runtime.dtype is float16 but rollout.runtime.dtype is bfloat16"),
    (["rollout.vllm.enable_lora=false", "learner.lora.r=16"], "enable_lora is false: set rollout.vllm.enable_lora: true (+1 more)"),
])
def test_learner_and_rollout_settings_that_contradict_are_one_line(tmp_path, overrides, needle):
    """Issue 37 item 6: start-up cross-checks between the learner's and the servers' settings."""
    f = tmp_path / "c.yaml"
    f.write_text("")
    load_config(f, VLLM_LORA)                        # the base is consistent
    with pytest.raises(ConfigError) as e:
        load_config(f, VLLM_LORA + overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["learner.staleness.max_staleness=4", "rollout.generation.inflight_update=resubmit"],   # the newest adapter only
    ["learner.staleness.max_staleness=4", "rollout.vllm.max_loras=5"],
    ["rollout.engine=hf", "rollout.vllm.enable_lora=false", "learner.lora.r=64"],  # the HF engine merges
    ["learner.runtime.dtype=bfloat16", "rollout.runtime.dtype=auto"],
    ["learner.runtime.dtype=float32", "rollout.runtime.dtype=float16"],
])
def test_settings_that_agree_pass_the_cross_checks(tmp_path, overrides):
    f = tmp_path / "c.yaml"
    f.write_text("")
    load_config(f, VLLM_LORA + overrides)


def test_a_contradiction_exits_2_in_every_process(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("learner:\n  lora: {r: 32}\nrollout:\n  engine: vllm\n  vllm: {enable_lora: true}\n")
    for command in ("learner", "rollout", "run"):
        assert main([command, "--config", str(f)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "rollout.vllm.max_lora_rank to at least 32" in err, err


def test_an_old_flat_key_exits_2_with_its_new_place(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("learner:\n  max_new_tokens: 8\n")
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "learner", "--config", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "learner.max_new_tokens: moved to learner.sampling.max_new_tokens" in r.stderr


@pytest.mark.parametrize(("text", "overrides", "line"), [
    ("rollout:\n  max_concurrency: 8\n", [], "rollout.max_concurrency: moved to rollout.generation.max_concurrency"),
    ("", ["rollout.metrics_port=0"], "rollout.metrics_port: moved to rollout.network.metrics_port"),
    ("rollout:\n  reward_options: {format_reward: 0.5}\n", [], "rollout.reward_options: moved to rollout.reward.options"),
])
def test_an_old_flat_rollout_key_exits_2_with_its_new_place(tmp_path, capsys, text, overrides, line):
    """Issue 37 item 6: the rollout server's config has sections like the learner's; a key of its
    flat layout is one line naming the new place, in every process that reads the file."""
    f = tmp_path / "c.yaml"
    f.write_text(text)
    for command in ("rollout", "learner"):
        assert main([command, "--config", str(f), *[a for o in overrides for a in ("--set", o)]]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and line in err and "Traceback" not in err, err


def test_missing_file_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")


def test_cli_exit_code_2_without_traceback(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("learner:\n  total_steps: zero\n")
    assert main(["learner", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "learner.total_steps" in err and "Traceback" not in err


def test_cli_subprocess_exit_code(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  engine: tpu\n")
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "rollout", "--config", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "rollout.engine" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_unknown_model_path_is_config_error(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text(f"model: {tmp_path / 'no-such-model'}\n")
    assert main(["learner", "--config", str(f)]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_the_task_names_the_reward_unless_the_config_does(tmp_path):
    assert load_config().rollout.reward.fn == "builtin:exact_numeric"     # from learner/tasks/arith.py
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  reward: [builtin:exact_numeric, builtin:format]\n")
    assert load_config(f).rollout.reward.fn == ["builtin:exact_numeric", "builtin:format"]
    f.write_text("rollout:\n  reward: {threads: 2}\n")                   # the section, without fn
    assert load_config(f).rollout.reward.fn == "builtin:exact_numeric" and load_config(f).rollout.reward.threads == 2
    with pytest.raises(ConfigError) as e:
        load_config(None, ["learner.data.dataset=builtin:arithmetic"])
    assert "unknown built-in task 'builtin:arithmetic'; known: builtin:arith" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_mixture_names_each_datasets_reward_for_the_servers(tmp_path):
    """issue 27.5: learner.data.datasets fills rollout.reward.by_dataset with each dataset's reward
    (a built-in task's own when it names none); the rollout section's own entries win."""
    f = tmp_path / "c.yaml"
    f.write_text("learner:\n  data:\n    datasets:\n"
                 "      - {path: 'builtin:arith', weight: 2}\n"
                 "      - {path: 'facts.jsonl', name: facts, reward: 'builtin:exact_match'}\n"
                 "      - {path: 'other.jsonl'}\n")
    assert load_config(f).rollout.reward.by_dataset == {"arith": "builtin:exact_numeric",
                                                         "facts": "builtin:exact_match"}
    g = load_config(f, ["rollout.reward.by_dataset.facts=mine:score"])
    assert g.rollout.reward.by_dataset == {"arith": "builtin:exact_numeric", "facts": "mine:score"}
