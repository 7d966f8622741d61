"""A mixture of datasets (learner.data.datasets, issue 27.5): seeded shares that follow the weights,
each prompt tagged with its dataset, a position that a checkpoint restores exactly, per-dataset
keys, and one-line errors for what a mixture cannot do."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from config_kit import nested

from learner.config import DataSettings, LearnerConfig
from learner.data.prompts import MixedSource, PromptSource, check_dataset, open_prompts
from learner.models.builtin import build_tokenizer
from protocol import DATASET_KEY, StartupError


def _file(tmp_path, name: str, n: int, key: str = "prompt") -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(json.dumps({key: f"{name}{i}", "answer": i, "src": name}) for i in range(n)))
    return str(path)


def _mixture(tmp_path, weights=(3.0, 1.0), **data) -> DataSettings:
    return DataSettings(datasets=[
        {"path": "builtin:arith", "weight": weights[0]},
        {"path": _file(tmp_path, "facts", 5, key="question"), "weight": weights[1], "prompt_key": "question",
         "reward": "builtin:exact_match"},
    ], **data)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_shares_follow_the_weights_and_every_prompt_names_its_dataset(tmp_path, tok):
    source = open_prompts(_mixture(tmp_path), seed=7, tokenizer=tok)
    assert isinstance(source, MixedSource) and source.names == ["arith", "facts"]
    items = source.take(4000)
    counts = Counter(it["metadata"][DATASET_KEY] for it in items)
    # 3 : 1 -> 3000 : 1000 expected; the binomial sd of the count is ~27
    assert abs(counts["arith"] - 3000) < 150, counts
    assert [it["prompt_id"] for it in items] == [f"p{i}" for i in range(4000)]
    facts = [it for it in items if it["metadata"][DATASET_KEY] == "facts"]
    # the file's rows, with its own prompt key, a new seeded order each pass (endless: 5 rows, ~1000 draws)
    assert {it["prompt"] for it in facts} == {f"facts{i}" for i in range(5)}
    assert all(it["metadata"]["src"] == "facts" and "prompt_token_ids" in it for it in facts)
    arith = [it for it in items if it["metadata"][DATASET_KEY] == "arith"]
    assert all("+" in it["prompt"] for it in arith[:50])
    # the same seed gives the same stream; another seed another one
    again = open_prompts(_mixture(tmp_path), seed=7, tokenizer=tok).take(200)
    assert [(a["prompt"], a["metadata"][DATASET_KEY]) for a in again] == [
        (a["prompt"], a["metadata"][DATASET_KEY]) for a in items[:200]]
    other = open_prompts(_mixture(tmp_path), seed=8, tokenizer=tok).take(200)
    assert [a["metadata"][DATASET_KEY] for a in other] != [a["metadata"][DATASET_KEY] for a in items[:200]]
    assert source.status()["datasets"]["facts"]["drawn"] == len(facts)


def test_the_position_continues_exactly_after_a_restore(tmp_path, tok):
    a = open_prompts(_mixture(tmp_path), seed=3, tokenizer=tok)
    a.take(37)
    state = json.loads(json.dumps(a.state_dict()))        # what a checkpoint holds, as plain data
    rest = [(x["prompt_id"], x["prompt"], x["metadata"][DATASET_KEY]) for x in a.take(60)]
    b = open_prompts(_mixture(tmp_path), seed=3, tokenizer=tok)
    b.load_state_dict(state)
    assert [(x["prompt_id"], x["prompt"], x["metadata"][DATASET_KEY]) for x in b.take(60)] == rest
    # another mixture's position, or one dataset's, is refused in one line
    c = open_prompts(_mixture(tmp_path, weights=(1.0, 1.0)), seed=3, tokenizer=tok)
    with pytest.raises(StartupError, match="weights"):
        c.load_state_dict(state)
    single = PromptSource("builtin:arith", 3, tokenizer=tok)
    with pytest.raises(StartupError, match="mixture"):
        b.load_state_dict(single.state_dict())


def test_names_default_from_the_path_and_what_a_mixture_refuses(tmp_path):
    data = _mixture(tmp_path)
    assert [d.label for d in data.datasets] == ["arith", "facts"]
    with pytest.raises(ValueError, match="not both"):
        DataSettings(dataset="data.jsonl", datasets=[{"path": "builtin:arith"}])
    for key in ("epochs", "length_buckets"):
        with pytest.raises(ValueError, match=key):
            DataSettings(datasets=[{"path": "builtin:arith"}], **{key: 2})
    with pytest.raises(ValueError, match="used twice"):
        DataSettings(datasets=[{"path": "builtin:arith"}, {"path": "builtin:arith", "weight": 2}])
    with pytest.raises(ValueError):
        DataSettings(datasets=[{"path": "builtin:arith", "weight": 0}])
    with pytest.raises(ValueError):
        DataSettings(datasets=[{"path": "builtin:arith", "name": "no spaces"}])
    # a broken dataset of a mixture is the usual one-line error, naming which one
    bad = DataSettings(datasets=[{"path": "builtin:arith"}, {"path": str(tmp_path / "missing.jsonl")}])
    with pytest.raises(StartupError, match=r"datasets\[1\]"):
        check_dataset(bad, None, seed=0, batch_prompts=1)
    cfg = LearnerConfig(**nested(data={"datasets": [{"path": "builtin:arith", "name": "a"}]}))
    assert cfg.data.datasets[0].label == "a"
