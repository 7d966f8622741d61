"""Rewards: built-ins, plug-ins (sync/async), weights, failures, and the reward-model scorer."""

from __future__ import annotations

import asyncio
import math
import sys
import types

import pytest
import torch
from config_kit import rollout_config
from fake_learner import wait_until

from rollout_server.config import RewardOptions, RolloutConfig
from rollout_server.rewards import Rewarder, RewardModelScorer, exact_numeric, load_reward


@pytest.mark.parametrize("completion, answer, want", [
    ("so the total is #### 42", "42", 1.0),
    ("#### 1,234", "#### 1234", 1.0),                       # GSM8K answers carry '#### n' too
    ("#### -3.50", "-3.5", 1.0),
    ("the answer is \\boxed{17}", "17", 1.0),
    ("\\boxed{16}", "17", 0.0),
    ("12 then #### 13", "13", 1.0),                         # '####' wins over earlier numbers
    ("no number here", "5", 0.0),
    ("7", "", 0.0),
])
def test_exact_numeric_forms(completion, answer, want):
    assert exact_numeric("q", completion, {"answer": answer}) == want


def test_format_and_length_penalty_builtins():
    o = RewardOptions(format_regex=r"^<think>.*</think>", format_reward=0.5,
                      length_penalty_per_token=0.1, length_free_tokens=3)
    fmt = load_reward("builtin:format", o)
    assert fmt("p", "<think>x\ny</think> 4", {}) == 0.5 and fmt("p", "4", {}) == 0.0
    pen = load_reward("builtin:length_penalty", o)
    assert pen("p", "whatever", {"completion_tokens": 3}) == 0.0
    assert math.isclose(pen("p", "whatever", {"completion_tokens": 8}), -0.5)
    default_fmt = load_reward("builtin:format")
    assert default_fmt("", "x #### 4", {}) == 1.0 and default_fmt("", "\\boxed{4}", {}) == 1.0
    with pytest.raises(ValueError, match="unknown built-in"):
        load_reward("builtin:nope")
    with pytest.raises(ValueError, match="reward_model"):
        load_reward("builtin:reward_model")


@pytest.fixture
def plugin_module():
    mod = types.ModuleType("slipstream_test_rewards")

    def sync_parts(prompt, completion, metadata):
        return {"a": 1.0, "b": 2.0}

    async def async_one(prompt, completion, metadata):
        return 0.25

    def boom(prompt, completion, metadata):
        if "bad" in completion:
            raise RuntimeError("cannot score")
        return 1.0

    def nan(prompt, completion, metadata):
        return float("nan") if "nan" in completion else 0.0

    def leave(prompt, completion, metadata):
        sys.exit(3)

    async def async_leave(prompt, completion, metadata):
        raise SystemExit("bye")

    mod.sync_parts, mod.async_one, mod.boom, mod.nan = sync_parts, async_one, boom, nan
    mod.leave, mod.async_leave = leave, async_leave
    sys.modules[mod.__name__] = mod
    yield mod.__name__
    del sys.modules[mod.__name__]


async def test_sum_of_parts_weights_and_failures(plugin_module):
    m = plugin_module
    r = Rewarder([f"{m}:sync_parts", f"{m}:async_one", "builtin:exact_numeric"])
    (s,) = await r.score_many([("q", "#### 3", {"answer": "3"})])
    assert s.failed is None and s.parts == {"a": 1.0, "b": 2.0, "async_one": 0.25, "exact_numeric": 1.0}
    assert s.total == 4.25
    w = Rewarder([f"{m}:sync_parts", "builtin:exact_numeric"], weights={"a": 0.0, "exact_numeric": 10})
    (s,) = await w.score_many([("q", "#### 3", {"answer": "3"})])
    assert s.total == 2.0 + 10.0                      # b keeps weight 1
    f = Rewarder([f"{m}:boom", f"{m}:nan"])
    out = await f.score_many([("q", "ok", {}), ("q", "bad", {}), ("q", "nan", {})])
    assert out[0].failed is None and out[0].total == 1.0
    assert "RuntimeError: cannot score" in out[1].failed
    assert "non-finite" in out[2].failed
    with pytest.raises(ValueError, match="cannot import"):
        Rewarder("no_such_module_xyz:f")


async def test_a_plugin_that_calls_sys_exit_fails_its_samples_not_the_server(plugin_module):
    for fn in ("leave", "async_leave"):
        r = Rewarder(f"{plugin_module}:{fn}")
        out = await r.score_many([("q", "a", {}), ("q", "b", {})])
        assert all(s.failed and "SystemExit" in s.failed for s in out), out
        r.close()


def test_config_accepts_one_spec_or_a_list():
    assert rollout_config().reward.fn == "builtin:exact_numeric"
    cfg = rollout_config(reward=["builtin:exact_numeric", "builtin:format"],
                         reward_weights={"format": 0.1})
    assert cfg.reward.fn == ["builtin:exact_numeric", "builtin:format"]        # the shorthand: reward.fn
    assert len(Rewarder(cfg.reward.fn, cfg.reward.weights, cfg.reward.options).fns) == 2
    full = RolloutConfig(reward={"fn": "builtin:format", "threads": 2, "options": {"format_reward": 0.5}})
    assert (full.reward.fn, full.reward.threads, full.reward.options.format_reward) == ("builtin:format", 2, 0.5)


@pytest.mark.parametrize(("old", "new"), [("reward_weights", "reward.weights"), ("reward_threads", "reward.threads"),
                                          ("reward_timeout_s", "reward.timeout_s"),
                                          ("reward_options", "reward.options"),
                                          ("metrics_port", "network.metrics_port"),
                                          ("max_concurrency", "generation.max_concurrency"),
                                          ("weights_wait_s", "weights.wait_s"), ("dtype", "runtime.dtype"),
                                          ("drain_timeout_s", "shutdown.drain_timeout_s")])
def test_a_key_of_the_flat_layout_names_its_new_place(old, new):
    with pytest.raises(ValueError, match=rf"{old} moved to {new.replace('.', '[.]')}"):
        RolloutConfig(**{old: {} if old == "reward_options" else 1})


# ---- reward model ------------------------------------------------------------------------------

CHAT = ("{% for m in messages %}{{ '<s>' if loop.first else '' }}{{ m['role'][0] }}: "
        "{{ m['content'] }}{{ '</s>' if m['role'] == 'assistant' else ' ' }}{% endfor %}")


def _save_rm(path, chat_template: str | None = CHAT):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from learner.models.builtin import build_tokenizer

    tok = build_tokenizer()
    if chat_template:
        tok.chat_template = chat_template
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return _save_rm(tmp_path_factory.mktemp("rm"))


PROBE = "the answer is 42."


@pytest.mark.parametrize("side", ["left", "right"])
def test_rm_scores_last_real_token_with_either_padding(rm_dir, side):
    rm = RewardModelScorer(rm_dir, probe_text=PROBE, batch_size=8)
    rm.tok.padding_side = side
    pairs = [("1+1=", "2"), ("12+30=", "42 because 12 plus 30"), ("a", "bcd efg hij")]
    batched = rm.score_batch([p for p, _ in pairs], [c for _, c in pairs], [{}] * 3)
    single = [rm.score_batch([p], [c], [{}])[0] for p, c in pairs]
    assert batched == pytest.approx(single, abs=1e-5)
    assert len(set(round(x, 4) for x in single)) == 3        # distinct inputs, distinct scores
    # The chat template was applied and the RM tokenizer read the text.
    assert rm.use_template and rm.text("q", "c") == "<s>u: q a: c</s>"


async def test_rm_through_rewarder_is_batched(rm_dir):
    o = RewardOptions(reward_model=rm_dir, rm_probe_text=PROBE, rm_chat_template="always")
    r = Rewarder(["builtin:reward_model", "builtin:exact_numeric"], options=o)
    out = await r.score_many([("1+1=", "2", {"answer": "2"}), ("2+2=", "5", {"answer": "4"})])
    rm = r.fns[0][1]
    assert [s.parts["reward_model"] for s in out] == pytest.approx(
        [rm("1+1=", "2", {}), rm("2+2=", "5", {})], abs=1e-5)
    assert out[0].parts["exact_numeric"] == 1.0 and out[1].parts["exact_numeric"] == 0.0


def test_rm_refuses_tokenizer_mismatch(rm_dir, tmp_path):
    # The char tokenizer has no capital letters: ordinary English would become <unk>.
    with pytest.raises(ValueError, match="garbles the probe text"):
        RewardModelScorer(rm_dir, probe_text="The Answer Is 42.")
    no_template = _save_rm(tmp_path / "plain", chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        RewardModelScorer(no_template, probe_text=PROBE, chat_template="always")
    plain = RewardModelScorer(no_template, probe_text=PROBE)
    assert not plain.use_template and plain.text("q", "c") == "qc"


# ---- where rewards run -------------------------------------------------------------------------

async def test_sync_rewards_run_in_a_bounded_pool_builtins_inline():
    import threading

    loop_thread = threading.current_thread()
    lock = threading.Lock()
    seen = {"threads": set(), "running": 0, "most": 0}
    gate = threading.Event()

    def user(prompt, completion, metadata):
        with lock:
            seen["threads"].add(threading.current_thread().name)
            seen["running"] += 1
            seen["most"] = max(seen["most"], seen["running"])
        gate.wait(10)
        with lock:
            seen["running"] -= 1
        return 1.0

    mod = types.ModuleType("slipstream_pool_rewards")
    mod.user = user
    sys.modules[mod.__name__] = mod
    try:
        r = Rewarder([f"{mod.__name__}:user", "builtin:exact_numeric"], threads=2, timeout_s=30)
        assert getattr(r.fns[1][1], "inline", False) and not getattr(r.fns[0][1], "inline", False)
        task = asyncio.ensure_future(r.score_many([("q", "#### 3", {"answer": "3"})] * 5))
        # Both workers busy (set by their threads), and the loop is still free to notice.
        await wait_until(lambda: seen["running"] == 2, timeout_s=30, what="two rewards running")
        gate.set()
        out = await asyncio.wait_for(task, 30)
        assert [s.total for s in out] == [2.0] * 5
        assert seen["most"] == 2 and len(seen["threads"]) == 2
        assert loop_thread.name not in seen["threads"]
        r.close()
    finally:
        del sys.modules[mod.__name__]


async def test_each_dataset_of_a_mixture_is_scored_by_its_own_reward(plugin_module):
    """issue 27.5: rollout.reward.by_dataset: an item whose metadata names a dataset with a reward
    of its own is scored by it (failures and all), the others by fn, in the items' order."""
    from protocol import DATASET_KEY

    m = plugin_module
    r = Rewarder("builtin:exact_numeric", by_dataset={"facts": "builtin:exact_match", "odd": f"{m}:boom"})
    items = [("q", "#### 3", {"answer": "3", DATASET_KEY: "arith"}),      # no route: fn
             ("q", "paris", {"answer": "paris", DATASET_KEY: "facts"}),
             ("q", "#### 3", {"answer": "3", DATASET_KEY: "facts"}),      # exact_match: not "3"
             ("q", "bad", {DATASET_KEY: "odd"}),
             ("q", "#### 4", {"answer": "4"})]
    out = await r.score_many(items)
    assert [s.parts for s in out[:3]] == [{"exact_numeric": 1.0}, {"exact_match": 1.0}, {"exact_match": 0.0}]
    assert "RuntimeError: cannot score" in out[3].failed
    assert out[4].total == 1.0 and out[4].parts == {"exact_numeric": 1.0}
    with pytest.raises(ValueError, match="by_dataset.facts"):
        Rewarder("builtin:exact_numeric", by_dataset={"facts": []})
