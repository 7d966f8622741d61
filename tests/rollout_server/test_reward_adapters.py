"""Reward functions written for TRL or verl (issue 39): ``trl:module:fn`` batched over a group with
the dataset's columns as keyword arguments, ``verl:module:fn`` per sample with verl's four
keywords; their errors are start-up lines or counted sample failures. TRL's own reward functions
(``trl.rewards``) are imported by the spec, not copied."""

from __future__ import annotations

import asyncio
import sys
import types

import numpy as np
import pytest

from protocol import PROMPT_MESSAGES_KEY
from rollout_server.rewards import Rewarder, load_reward

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def item(completion: str, *, conversational: bool = True, tokens=(5, 6, 7), **columns) -> tuple:
    """One (prompt, completion, metadata) as the server hands the rewarder: the assignment's
    metadata plus what the server adds."""
    meta = {**columns, "completion_tokens": len(tokens), "finish_reason": "stop",
            "completion_ids": np.asarray(tokens, dtype=np.int32), "policy_version": 3}
    if conversational:
        meta[PROMPT_MESSAGES_KEY] = MESSAGES
    return ("u:What is 2+2?.a:", completion, meta)


def score(specs, items, **kw):
    r = Rewarder(specs, **kw)
    try:
        return asyncio.run(r.score_many(items))
    finally:
        r.close()


@pytest.fixture
def plugins(monkeypatch):
    mod = types.ModuleType("slipstream_test_trl_verl")
    calls: list[dict] = []

    def columns_seen(prompts, completions, completion_ids, trainer_state, solution, **kwargs):
        calls.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                          step=trainer_state.global_step, solution=solution, **kwargs))
        return [1.0 if c[0]["content"].strip() == s else 0.0 for c, s in zip(completions, solution)]

    def wrong_length(completions, **kwargs):
        return [1.0] * (len(completions) + 1)

    def not_a_list(completions, **kwargs):
        return 1.0

    def only_long(completions, **kwargs):       # "does not apply" to short completions
        return [float(len(c)) if len(c) > 3 else None for c in completions]

    def never(completions, **kwargs):
        return [None] * len(completions)

    def no_kwargs(completions):
        return [0.0] * len(completions)

    async def async_trl(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5] * len(completions)

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append(dict(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                          extra_info=extra_info))
        if data_source == "dict":
            return {"score": 2.0, "acc": True, "pred": solution_str}
        if data_source == "noscore":
            return {"acc": 1.0}
        return float(solution_str.strip() == str(ground_truth))

    def verl_two_args(solution_str, ground_truth):
        return 0.0

    def native_two_args(prompt, completion):
        return 0.0

    for f in (columns_seen, wrong_length, not_a_list, only_long, never, no_kwargs, async_trl, compute_score,
              verl_two_args, native_two_args):
        setattr(mod, f.__name__, f)
    mod.calls = calls
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_trl_think_format_reward_is_imported_and_called_as_trl_calls_it():
    """trl.rewards.think_format_reward reads completion[0]["content"]: the conversational shape."""
    got = score("trl:trl.rewards:think_format_reward",
                [item("<think>\nadd\n</think>\n4"), item("4 <think>x</think>"), item("<think>no end")])
    assert [s.total for s in got] == [1.0, 0.0, 0.0]
    assert got[0].parts == {"think_format_reward": 1.0}


def test_trl_overlong_punishment_reads_the_completion_ids(tmp_path, monkeypatch):
    """TRL's soft overlong punishment is a factory: a user module holds the function it makes."""
    (tmp_path / "my_trl_rewards.py").write_text(
        "from trl.rewards import get_soft_overlong_punishment\n"
        "overlong = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = score("trl:my_trl_rewards:overlong",
                [item("a", tokens=range(5)), item("b", tokens=range(8)), item("c", tokens=range(12))])
    # <= 6 tokens: 0; 6 < n <= 10: (6 - n) / 4; longer: -1 (TRL's formula).
    assert [s.total for s in got] == [0.0, -0.5, -1.0]


def test_trl_columns_arrive_as_lists_and_prompts_as_the_dataset_had_them(plugins):
    items = [item(" 4", solution="4", level=1, tags=["x"]), item("5", solution="4", level=1, tags=["x"])]
    got = score("trl:slipstream_test_trl_verl:columns_seen", items)
    assert [s.total for s in got] == [1.0, 0.0]
    call = plugins.calls[0]
    assert call["prompts"] == [MESSAGES, MESSAGES]
    assert call["completions"] == [[{"role": "assistant", "content": " 4"}], [{"role": "assistant", "content": "5"}]]
    assert call["completion_ids"] == [[5, 6, 7], [5, 6, 7]]
    assert call["solution"] == ["4", "4"] and call["level"] == [1, 1] and call["tags"] == [["x"], ["x"]]
    assert call["step"] == 3
    # What the server adds and slipstream's own keys are not dataset columns.
    assert not {"completion_tokens", "finish_reason", "policy_version", PROMPT_MESSAGES_KEY} & set(call)
    assert callable(call["log_extra"]) and callable(call["log_metric"])


def test_trl_plain_prompts_get_text(plugins):
    got = score("trl:slipstream_test_trl_verl:only_long", [item("long one", conversational=False),
                                                           item("ab", conversational=False)])
    assert got[0].total == 8.0 and got[0].failed is None
    # None from every function: no reward at all; the sample fails (counted, never trained).
    assert got[1].failed and "skipped" in got[1].failed and "returned None" in got[1].failed


def test_trl_none_leaves_that_part_out_when_another_function_scores(plugins):
    got = score(["trl:slipstream_test_trl_verl:never", "trl:slipstream_test_trl_verl:async_trl"],
                [item("x"), item("y")])
    assert [(s.failed, s.total, s.parts) for s in got] == [(None, 0.5, {"async_trl": 0.5})] * 2


@pytest.mark.parametrize("fn, message", [
    ("wrong_length", "returned 3 rewards for 2 completions"),
    ("not_a_list", "returned float, not a list of 2 rewards"),
])
def test_trl_bad_return_values_fail_the_group_saying_why(plugins, fn, message):
    got = score(f"trl:slipstream_test_trl_verl:{fn}", [item("a"), item("b")])
    assert all(s.failed and message in s.failed and fn in s.failed for s in got), got


def test_verl_compute_score_gets_verl_keywords_and_the_raw_ground_truth(plugins):
    meta = dict(data_source="openai/gsm8k", reward_model={"style": "rule", "ground_truth": 4},
                extra_info={"split": "train", "index": 7}, answer="4")
    got = score("verl:slipstream_test_trl_verl:compute_score",
                [item("4", conversational=False, **meta), item("5", conversational=False, **meta)])
    assert [s.total for s in got] == [1.0, 0.0]
    assert plugins.calls[0] == {"data_source": "openai/gsm8k", "solution_str": "4", "ground_truth": 4,
                                "extra_info": {"split": "train", "index": 7}}
    # Without reward_model, the row's answer is the ground truth.
    score("verl:slipstream_test_trl_verl:compute_score", [item("4", conversational=False, answer="4")])
    assert plugins.calls[-1]["ground_truth"] == "4" and plugins.calls[-1]["data_source"] is None


def test_verl_dict_score_is_the_reward_and_other_numbers_are_parts_outside_the_total(plugins):
    got = score("verl:slipstream_test_trl_verl:compute_score", [item("7", data_source="dict")])
    assert got[0].total == 2.0
    assert got[0].parts == {"compute_score": 2.0, "compute_score/acc": 1.0}     # "pred" (text) left out
    weighted = score("verl:slipstream_test_trl_verl:compute_score", [item("7", data_source="dict")],
                     weights={"compute_score/acc": 0.5})
    assert weighted[0].total == 2.5
    bad = score("verl:slipstream_test_trl_verl:compute_score", [item("7", data_source="noscore")])
    assert bad[0].failed and "without 'score'" in bad[0].failed


@pytest.mark.parametrize("spec, message", [
    ("trl:slipstream_test_trl_verl:no_kwargs", "needs **kwargs"),
    ("verl:slipstream_test_trl_verl:verl_two_args", "cannot be called as compute_score(data_source="),
    ("slipstream_test_trl_verl:native_two_args", "cannot be called as fn(prompt, completion, metadata)"),
    ("trl:slipstream_test_trl_verl", "'trl:module:function'"),
    ("verl:no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
])
def test_a_function_that_cannot_be_called_so_is_refused_in_one_line(plugins, spec, message):
    with pytest.raises(ValueError, match=None) as e:
        load_reward(spec)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_reward_module_may_be_a_file_as_verls_custom_reward_function_path(tmp_path):
    """verl names its reward by file (custom_reward_function.path): the spec takes a path/to/file.py;
    the file's sibling modules import as they do under verl."""
    (tmp_path / "helpers_for_reward.py").write_text("def same(a, b):\n    return str(a) == str(b)\n")
    (tmp_path / "my_reward.py").write_text(
        "from helpers_for_reward import same\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0 if same(solution_str.strip(), ground_truth) else 0.0\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('no\\nway')\n")
    got = score(f"verl:{tmp_path / 'my_reward.py'}:compute_score",
                [item("4", conversational=False, answer="4"), item("5", conversational=False, answer="4")])
    assert [s.total for s in got] == [1.0, 0.0]
    with pytest.raises(ValueError, match="no such file"):
        load_reward(f"verl:{tmp_path / 'missing.py'}:compute_score")
    with pytest.raises(ValueError, match=r"broken.py failed to load: RuntimeError: no$"):
        load_reward(f"{tmp_path / 'broken.py'}:f")


def test_a_trl_function_that_times_out_fails_its_group_as_a_native_one_would(plugins, monkeypatch):
    import threading

    release = threading.Event()

    def stuck(completions, **kwargs):
        release.wait(30)
        return [1.0] * len(completions)

    monkeypatch.setattr(plugins, "stuck", stuck, raising=False)
    try:
        got = score("trl:slipstream_test_trl_verl:stuck", [item("a"), item("b")], timeout_s=0.2)
    finally:
        release.set()
    assert all(s.failed and "timed out after 0.2s" in s.failed and s.timed_out for s in got), got
