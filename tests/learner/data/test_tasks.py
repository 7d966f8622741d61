"""Built-in tasks and the prompt stream: one file defines a task; PromptSource streams a task or a
JSONL file reproducibly, resumes from its state, and refuses a bad dataset in one line."""

from __future__ import annotations

import random
import sys

import pytest

import learner.data.tasks
from deploy.config_file import load_config
from learner.data.prompts import PromptSource
from learner.data.tasks import get_task, names
from learner.data.tasks.arith import MAX_OPERAND
from protocol import StartupError

KEYS = {"prompt_id", "prompt", "answer", "metadata"}


def test_arith_examples_are_sums_of_single_digits():
    task = get_task("builtin:arith")
    assert task is get_task("arith") and task.reward == "builtin:exact_numeric"
    rng = random.Random(0)
    for _ in range(200):
        ex = task.example(rng)
        a, b = ex.prompt.rstrip("=").split("+")
        assert 0 <= int(a) <= MAX_OPERAND and 0 <= int(b) <= MAX_OPERAND
        assert ex.answer == str(int(a) + int(b)) and ex.metadata == {}


def test_builtin_stream_is_seeded_by_position_and_resumes():
    src = PromptSource("builtin:arith", seed=3)
    first = [next(src) for _ in range(50)]
    assert all(set(p) == KEYS for p in first)
    assert [p["prompt_id"] for p in first] == [f"p{i}" for i in range(50)]
    assert len({p["prompt"] for p in first}) > 20                        # not one prompt repeated
    state = src.state_dict()
    after = [next(src) for _ in range(10)]
    resumed = PromptSource("builtin:arith", seed=3)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(10)] == after
    other = PromptSource("builtin:arith", seed=4)
    assert [next(other)["prompt"] for _ in range(50)] != [p["prompt"] for p in first]   # seed matters


def test_jsonl_rows_pass_extra_keys_as_metadata_and_cover_every_row_each_epoch(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(f'{{"prompt": "q{i}", "answer": {i}, "level": {i % 2}}}' for i in range(7)))
    src = PromptSource(str(data), seed=1)
    epoch1 = [next(src) for _ in range(7)]
    epoch2 = [next(src) for _ in range(7)]
    for epoch in (epoch1, epoch2):
        assert sorted(p["prompt"] for p in epoch) == [f"q{i}" for i in range(7)]
    assert [p["prompt"] for p in epoch1] != [p["prompt"] for p in epoch2]   # reshuffled per epoch
    row = next(p for p in epoch1 if p["prompt"] == "q3")
    assert row["answer"] == "3" and row["metadata"] == {"level": 1}
    row["metadata"]["level"] = 99                                  # a consumer cannot corrupt it
    assert next(p for p in epoch2 if p["prompt"] == "q3")["metadata"] == {"level": 1}


@pytest.mark.parametrize("text, needle", [
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n', "d.jsonl:2: not JSON"),
    ('{"prompt": "a"}\n', "d.jsonl:1: each row needs an object with 'prompt' and 'answer'"),
    ('[1, 2]\n', "d.jsonl:1: each row needs"),
    ("\n\n", "has no rows"),
])
def test_bad_jsonl_is_one_line_naming_file_and_line(tmp_path, text, needle):
    (tmp_path / "d.jsonl").write_text(text)
    with pytest.raises(StartupError) as e:
        PromptSource(str(tmp_path / "d.jsonl"))
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("learner.data.dataset: ")


def test_missing_file_and_unknown_task(tmp_path):
    with pytest.raises(StartupError, match="no such file"):
        PromptSource(str(tmp_path / "nope.jsonl"))
    with pytest.raises(StartupError, match="known: builtin:arith"):
        PromptSource("builtin:nope")


NEW_TASK = '''
from learner.data.tasks import Example, Task

def example(rng):
    word = rng.choice(["abc", "hello", "xyz"])
    return Example(prompt=f"echo {word}:", answer=word, metadata={"kind": "echo"})

TASK = Task(name="echo", example=example, reward="builtin:format")
'''


def test_a_new_task_is_one_file(tmp_path, monkeypatch):
    """Drop a module with TASK into the package: the prompt stream and the config see it."""
    (tmp_path / "echo.py").write_text(NEW_TASK)
    monkeypatch.setattr(learner.data.tasks, "__path__", [*learner.data.tasks.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "learner.data.tasks.echo", raising=False)
    try:
        assert "echo" in names()
        p = next(PromptSource("builtin:echo", seed=0))
        assert p["prompt"] == f"echo {p['answer']}:" and p["metadata"] == {"kind": "echo"}
        cfg = load_config(None, ["learner.data.dataset=builtin:echo"])
        assert cfg.rollout.reward.fn == "builtin:format"              # the task's own reward
        cfg = load_config(None, ["learner.data.dataset=builtin:echo", "rollout.reward=builtin:exact_numeric"])
        assert cfg.rollout.reward.fn == "builtin:exact_numeric"       # unless the config says
    finally:
        sys.modules.pop("learner.data.tasks.echo", None)
