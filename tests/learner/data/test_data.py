"""The prompt stream (learner.data.prompts): every source format, chat templates through a real tokenizer,
max_prompt_tokens skipping, per-epoch seeded shuffles, epochs, length buckets, the checkpointable
position, and one-line errors for bad datasets."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from config_kit import nested

import protocol
from learner.config import LearnerConfig
from learner.data.prompts import PromptSource, check_dataset
from learner.models.builtin import build_tokenizer
from protocol import StartupError

TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}.{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")
"""A tiny chat template in the tokenizer's alphabet: 'u:hi.' per message, 'a:' to answer."""


def rows(n: int, length=lambda i: 1) -> list[dict]:
    return [{"prompt": f"q{i}" + "x" * (length(i) - 1), "answer": i, "level": i % 3} for i in range(n)]


def write(tmp_path, fmt: str, data: list[dict]):
    """``data`` in format ``fmt``; the path (a file, or a save_to_disk directory)."""
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in data))
    elif fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(data))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist(data), path)
    elif fmt == "dataset":
        import datasets

        path = tmp_path / "ds"
        datasets.Dataset.from_list(data).save_to_disk(str(path))
    else:                                          # a DatasetDict: the train split is ours
        import datasets

        path = tmp_path / "dd"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(data),
                              "test": datasets.Dataset.from_list(data[:1])}).save_to_disk(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    t = build_tokenizer()
    t.chat_template = TEMPLATE
    return t


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "dataset", "datasetdict"])
def test_every_format_gives_the_same_rows_and_metadata(tmp_path, fmt):
    data = rows(6)
    data[2]["tags"] = ["a", "b"]                    # nested metadata travels as plain lists
    data = [{**r, "tags": r.get("tags", [])} for r in data]
    src = PromptSource(write(tmp_path, fmt, data), seed=0, shuffle=False)
    got = src.take(6)
    assert [p["prompt"] for p in got] == [f"q{i}" for i in range(6)]
    assert [p["answer"] for p in got] == [str(i) for i in range(6)]
    assert got[2]["metadata"] == {"level": 2, "tags": ["a", "b"]}
    assert type(got[2]["metadata"]["level"]) is int                # not a NumPy scalar
    assert src.rows == 6 and src.status()["rows"] == 6


def test_datasetdict_split_and_custom_keys(tmp_path):
    import datasets

    path = tmp_path / "dd"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"question": "1+1=", "solution": "2", "id": 7}]),
        "test": datasets.Dataset.from_list([{"question": "2+2=", "solution": "4", "id": 8}]),
    }).save_to_disk(str(path))
    src = PromptSource(str(path), split="test", prompt_key="question", answer_key="solution")
    assert next(src) == {"prompt_id": "p0", "prompt": "2+2=", "answer": "4", "metadata": {"id": 8}}
    with pytest.raises(StartupError, match=r"no split 'dev'.*splits: train, test"):
        PromptSource(str(path), split="dev", prompt_key="question", answer_key="solution")


def test_plain_prompts_are_tokenized_once_like_the_trainer(tmp_path, tok):
    src = PromptSource(write(tmp_path, "jsonl", rows(3)), seed=0, shuffle=False, tokenizer=tok)
    p = next(src)
    assert p["prompt"] == "q0"                                    # no template: the text as it is
    assert p["prompt_token_ids"].dtype == np.int32
    assert p["prompt_token_ids"].tolist() == [tok.bos_token_id, *tok.encode("q0", add_special_tokens=False)]


def test_built_in_draws_tokenize_each_distinct_prompt_once(tok, monkeypatch):
    """builtin:arith repeats its 100 prompts: each is encoded once, its ids shared read-only by
    every draw of it and equal to a fresh encode; the memo is bounded (oldest out first)."""
    import learner.data.prompts as data

    calls = Counter()

    def encode(text):
        calls[text] += 1
        return np.asarray([tok.bos_token_id, *tok.encode(text, add_special_tokens=False)], np.int32)

    src = PromptSource("builtin:arith", seed=3, tokenizer=tok, encode=encode)
    calls.clear()                                   # attach() drew one to check max_prompt_tokens
    drawn = [next(src) for _ in range(400)]
    texts = {p["prompt"] for p in drawn}
    assert len(texts) < 100 < len(drawn)             # prompts repeat
    assert set(calls) <= texts and max(calls.values()) == 1
    first = {}
    for p in drawn:
        ids = p["prompt_token_ids"]
        assert ids.tolist() == encode(p["prompt"]).tolist()
        assert ids is first.setdefault(p["prompt"], ids)       # one shared array per prompt
        assert not ids.flags.writeable
        with pytest.raises(ValueError):
            ids[0] = 0
    monkeypatch.setattr(data, "RENDER_CACHE", 8)
    bounded = PromptSource("builtin:arith", seed=4, tokenizer=tok, encode=encode)
    for _ in range(200):
        next(bounded)
        assert len(bounded._rendered) <= 8


def test_chat_messages_and_system_prompt_use_the_tokenizers_template(tmp_path, chat_tok):
    data = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"},
            {"prompt": "plain", "answer": "y"},
            {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}], "answer": "z"}]
    path = write(tmp_path, "jsonl", data)
    auto = PromptSource(path, shuffle=False, tokenizer=chat_tok).take(3)
    assert [p["prompt"] for p in auto] == ["u:hi.a:", "plain", "s:own.u:q.a:"]   # plain text stays plain
    expected = chat_tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                            add_generation_prompt=True, tokenize=False)
    assert auto[0]["prompt"] == expected
    assert auto[0]["prompt_token_ids"].tolist() == chat_tok.encode(expected, add_special_tokens=False)
    system = PromptSource(path, shuffle=False, tokenizer=chat_tok, system_prompt="be").take(3)
    assert [p["prompt"] for p in system] == ["s:be.u:hi.a:", "s:be.u:plain.a:", "s:own.u:q.a:"]
    always = PromptSource(path, shuffle=False, tokenizer=chat_tok, chat_template="always").take(3)
    assert always[1]["prompt"] == "u:plain.a:"
    # What the template formatted travels as the prompt's messages (an agent program's first
    # request sends them, rollout_server/agents.py): the system prompt and a string's user
    # message included; a prompt sent as its own text has none.
    key = protocol.PROMPT_MESSAGES_KEY
    assert [p["metadata"].get(key) for p in system] == [
        [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be"}, {"role": "user", "content": "plain"}],
        data[2]["prompt"]]
    assert always[1]["metadata"][key] == [{"role": "user", "content": "plain"}]
    assert key not in auto[1]["metadata"]
    draw = next(PromptSource("builtin:arith", seed=1, tokenizer=chat_tok, chat_template="always"))
    assert draw["metadata"][key] == [{"role": "user", "content": draw["prompt"][2:-3]}]


@pytest.mark.parametrize("kwargs, prompts, needle", [
    ({"chat_template": "always"}, "text", "chat_template: always, but the policy tokenizer has no chat template"),
    ({"system_prompt": "be"}, "text", "system_prompt is set, but the policy tokenizer has no chat template"),
    ({}, "messages", "row 0: the prompt is chat messages but the policy tokenizer has no chat template"),
    ({"chat_template": "never", "template": True}, "messages", "row 0: the prompt is chat messages but "
                                                               "learner.data.chat_template is never"),
])
def test_template_rules_refuse_in_one_line(tmp_path, tok, chat_tok, kwargs, prompts, needle):
    prompt = "hi" if prompts == "text" else [{"role": "user", "content": "hi"}]
    path = write(tmp_path, "jsonl", [{"prompt": prompt, "answer": "1"}])
    tokenizer = chat_tok if kwargs.pop("template", False) else tok
    src = PromptSource(path, **kwargs)                  # without a tokenizer the rows are fine
    with pytest.raises(StartupError) as e:
        src.attach(tokenizer)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_max_prompt_tokens_skips_and_counts(tmp_path, tok):
    skips = Counter()
    path = write(tmp_path, "jsonl", rows(10, length=lambda i: 2 + i))     # 'q0x'..: 4..13 tokens with BOS
    src = PromptSource(path, shuffle=False, tokenizer=tok, max_prompt_tokens=6,
                       on_skip=lambda reason, n: skips.update({reason: n}))
    kept = src.take(20)
    assert all(len(p["prompt_token_ids"]) <= 6 for p in kept)
    assert src.rows == 3 and skips == {"too_long": 7} and src.status()["skipped"] == {"too_long": 7}
    assert sorted({p["prompt"] for p in kept}) == [f"q{i}" + "x" * (1 + i) for i in range(3)]
    with pytest.raises(StartupError, match="every row .* is longer than learner.data.max_prompt_tokens=2"):
        PromptSource(path, tokenizer=tok, max_prompt_tokens=2)
    # A built-in task passes over the draws that are too long, each counted once.
    arith = PromptSource("builtin:arith", seed=0, tokenizer=tok, max_prompt_tokens=5)  # '<s>a+b=' is 5
    assert all(len(p["prompt_token_ids"]) <= 5 for p in arith.take(50))
    with pytest.raises(StartupError, match="first 100 prompts of builtin:arith are all longer"):
        PromptSource("builtin:arith", tokenizer=tok, max_prompt_tokens=3)


def test_shuffle_is_new_each_epoch_and_reproducible(tmp_path):
    path = write(tmp_path, "jsonl", rows(20))

    def epochs(seed, n=3, **kw):
        src = PromptSource(path, seed=seed, **kw)
        return [[p["prompt"] for p in src.take(20)] for _ in range(n)]

    first = epochs(5)
    assert all(sorted(e) == sorted(first[0]) for e in first)               # every row once per epoch
    assert first[0] != first[1] != first[2]                                # a new order each epoch
    assert epochs(5) == first                                              # same seed, same orders
    assert epochs(6) != first
    assert epochs(5, n=1, shuffle=False)[0] == [f"q{i}" for i in range(20)]


def test_epochs_end_the_stream_on_a_whole_batch(tmp_path):
    src = PromptSource(write(tmp_path, "jsonl", rows(5)), epochs=2, batch_prompts=3)
    got = list(src)
    assert len(got) == 9 and src.exhausted and src.unused == 1           # 10 prompts, 3 batches of 3
    assert Counter(p["prompt"] for p in got).most_common(1)[0][1] == 2
    assert next(src, None) is None
    with pytest.raises(StartupError, match="fewer than one batch"):
        PromptSource(write(tmp_path, "jsonl", rows(2)), epochs=1, batch_prompts=3)
    endless = PromptSource(write(tmp_path, "jsonl", rows(2)))
    assert len(endless.take(100)) == 100 and not endless.finite


def test_length_buckets_group_similar_lengths(tmp_path, tok):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=64).tolist()
    path = write(tmp_path, "jsonl", rows(64, length=lambda i: lengths[i]))

    def spreads(buckets):
        src = PromptSource(path, seed=1, tokenizer=tok, length_buckets=buckets, batch_prompts=4)
        items = src.take(64)
        assert sorted(p["prompt"] for p in items) == sorted(r["prompt"] for r in rows(64, lambda i: lengths[i]))
        batches = [items[k:k + 4] for k in range(0, 64, 4)]
        return [max(len(p["prompt_token_ids"]) for p in b) - min(len(p["prompt_token_ids"]) for p in b)
                for b in batches]

    bucketed, mixed = spreads(8), spreads(0)
    # 8 buckets of 8 rows, 2 batches each: the spread within a batch is at most its bucket's range.
    assert np.mean(bucketed) < np.mean(mixed) / 3, (bucketed, mixed)
    src = PromptSource(path, seed=1, tokenizer=tok, length_buckets=8, batch_prompts=4)
    first = [p["prompt"] for p in src.take(64)]
    assert [p["prompt"] for p in src.take(64)] != first                    # still reshuffled per epoch


@pytest.mark.parametrize("kwargs", [{}, {"length_buckets": 3, "batch_prompts": 2}])
def test_state_dict_mid_epoch_continues_exactly(tmp_path, tok, kwargs):
    path = write(tmp_path, "jsonl", rows(11, length=lambda i: 1 + i % 5))
    src = PromptSource(path, seed=3, tokenizer=tok, **kwargs)
    src.take(15)                                                           # into the second epoch
    state = json.loads(json.dumps(src.state_dict()))                       # plain data
    after = src.take(20)
    resumed = PromptSource(path, seed=3, tokenizer=tok, **kwargs)
    resumed.load_state_dict(state)
    again = resumed.take(20)
    assert [p["prompt_id"] for p in again] == [p["prompt_id"] for p in after] == [f"p{i}" for i in range(15, 35)]
    assert [p["prompt"] for p in again] == [p["prompt"] for p in after]
    assert all(np.array_equal(a["prompt_token_ids"], b["prompt_token_ids"]) for a, b in zip(after, again))
    other = PromptSource(write(tmp_path, "json", rows(4)), seed=3)
    with pytest.raises(StartupError, match="saved prompt position is for spec"):
        other.load_state_dict(state)


@pytest.mark.parametrize("name, content, needle", [
    ("d.json", '{"prompt": "a"}', "a .json dataset is a list of rows, got a dict"),
    ("d.json", '[{"prompt": "a", "answer": 1}, 3]', "d.json: row 1: each row needs an object"),
    ("d.json", '[{"prompt": "a", ', "d.json:1: not JSON"),
    ("d.jsonl", '{"prompt": 5, "answer": 1}', "d.jsonl:1: 'prompt' must be a string or a list of chat messages"),
    ("d.jsonl", '{"prompt": [{"role": "user"}], "answer": 1}', "'prompt' is a list but not chat messages"),
    ("d.jsonl", '{"prompt": "a", "answer": {"x": 1}}', "'answer' must be a string or a number, got dict"),
    ("d.parquet", "not parquet", "d.parquet: not a readable Parquet file"),
    ("d.csv", "prompt,answer", "unknown format '.csv'"),
    ("dir", None, "not a datasets save_to_disk directory"),
    ("nope.jsonl", "missing", "no such file"),
    ("openai/gsm8k", "missing", "nothing is downloaded from the Hub"),
])
def test_bad_datasets_are_one_line_errors(tmp_path, name, content, needle):
    path = tmp_path / name
    if content is None:
        path.mkdir()
        (path / "junk.txt").write_text("x")
    elif content != "missing":
        path.write_text(content)
    with pytest.raises(StartupError) as e:
        PromptSource(str(path))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and msg.startswith("learner.data.dataset: "), msg


def test_check_dataset_reads_the_config_keys_and_eval_data(tmp_path):
    good = write(tmp_path, "json", [{"q": "1+1=", "a": "2"}])
    cfg = LearnerConfig(**nested(dataset=good, prompt_key="q", answer_key="a", eval_data=good, eval_every=2))
    check_dataset(cfg.data, cfg.evaluation.data, seed=cfg.seed, batch_prompts=cfg.batch.batch_prompts)
    with pytest.raises(StartupError, match=r"^learner.evaluation.data: .*no such file"):
        check_dataset(cfg.data, str(tmp_path / "none.jsonl"), seed=cfg.seed, batch_prompts=1)
    with pytest.raises(ValueError, match="evaluation.every > 0 needs evaluation.data"):
        LearnerConfig(**nested(eval_every=3))


@pytest.mark.parametrize("command", ["learner", "run"])
def test_the_cli_checks_the_dataset_with_its_keys_and_the_eval_data(tmp_path, capsys, command):
    import yaml

    from deploy.cli import main

    good = write(tmp_path, "json", [{"q": "1+1=", "a": "2"}])
    learner = {"dataset": good, "prompt_key": "q", "answer_key": "a", "run_dir": str(tmp_path / "run"),
               "eval_data": str(tmp_path / "none.jsonl"), "eval_every": 1}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": "/nonexistent/model-dir", "learner": nested(learner)}))
    assert main([command, "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert "learner.evaluation.data: " in err and "none.jsonl" in err and "\n" not in err, err


@pytest.mark.parametrize("fmt", ["parquet", "dataset", "json"])
def test_chat_messages_survive_every_columnar_format(tmp_path, chat_tok, fmt):
    data = [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": f"{i}"}],
             "answer": str(i)} for i in range(3)]
    src = PromptSource(write(tmp_path, fmt, data), shuffle=False, tokenizer=chat_tok)
    assert [p["prompt"] for p in src.take(3)] == [f"s:s.u:{i}.a:" for i in range(3)]


def test_the_config_keys_reach_the_stream(tmp_path, tok):
    path = write(tmp_path, "jsonl", rows(8, length=lambda i: 1 + i))
    cfg = LearnerConfig(**nested(dataset=path, seed=4, shuffle=False, epochs=2, length_buckets=3, batch_prompts=2,
                        max_prompt_tokens=8))
    src = PromptSource.from_config(cfg.data, seed=cfg.seed, batch_prompts=cfg.batch.batch_prompts,
                                   tokenizer=tok)                        # kept: 2..7 tokens, 3 buckets of 2
    assert src.rows == 6 and src.total == 12 and len(src._buckets) == 3 and src.skipped == {"too_long": 2}
    first = [len(p["prompt_token_ids"]) for p in src.take(6)]
    assert [max(first[k:k + 2]) - min(first[k:k + 2]) for k in range(0, 6, 2)] == [1, 1, 1]


def test_every_run_of_a_batch_carries_one_bucket_id(tmp_path, tok):
    """issue 27.4: with length_buckets each prompt says its bucket (the learner puts it in the
    assignment; its buffer makes a batch of one bucket): a run of batch_prompts shares one id, a
    run of remainders has an id of its own, and the ids follow the lengths."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 40, size=30).tolist()
    path = write(tmp_path, "jsonl", rows(30, length=lambda i: lengths[i]))
    src = PromptSource(path, seed=2, tokenizer=tok, length_buckets=3, batch_prompts=4)
    items = src.take(30)
    count = Counter(p["bucket"] for p in items)
    # 3 buckets of 10 rows: two runs of 4 each (id 0-2), the 6 left over in runs of their own (id >= 3)
    assert sorted(n for b, n in count.items() if b < 3) == [8, 8, 8]
    assert sorted(n for b, n in count.items() if b >= 3) == [2, 4]
    span = {}
    for p in items:
        lo, hi = span.get(p["bucket"], (10**9, 0))
        span[p["bucket"]] = (min(lo, len(p["prompt_token_ids"])), max(hi, len(p["prompt_token_ids"])))
    full = sorted((lo, hi) for b, (lo, hi) in span.items() if b < 3)
    assert all(a[1] <= b[0] for a, b in zip(full, full[1:], strict=False))       # buckets do not overlap
    assert any(b >= 3 for b in span)                                             # 30 = 3 x 10: remainders
    assert "bucket" not in PromptSource(path, seed=2, tokenizer=tok).take(1)[0]


def test_a_built_in_task_is_bucketed_too_and_resumes_exactly(tok):
    """issue 27.4: built-in draws go to the bucket of their length and leave in runs of
    batch_prompts from one bucket (the draws are the unbucketed stream's, reordered); the
    position, with the draws still waiting, continues exactly from a checkpoint."""
    src = PromptSource("builtin:longtail", seed=4, tokenizer=tok, length_buckets=3, batch_prompts=4)
    items = src.take(48)
    runs = [items[k:k + 4] for k in range(0, 48, 4)]
    assert all(len({p["bucket"] for p in run}) == 1 for run in runs)
    assert len({p["bucket"] for p in items}) >= 2
    plain = PromptSource("builtin:longtail", seed=4, tokenizer=tok).take(200)
    assert {p["prompt"] for p in items} <= {p["prompt"] for p in plain}
    state = json.loads(json.dumps(src.state_dict()))
    rest = [(p["prompt_id"], p["prompt"], p["bucket"]) for p in src.take(40)]
    again = PromptSource("builtin:longtail", seed=4, tokenizer=tok, length_buckets=3, batch_prompts=4)
    again.load_state_dict(state)
    assert [(p["prompt_id"], p["prompt"], p["bucket"]) for p in again.take(40)] == rest


def test_a_dotted_key_reaches_into_a_nested_column_as_verls_parquet_keeps_it(tmp_path, tok):
    """issue 39.1: verl's RL parquet (chat-message prompt, data_source, ability, reward_model,
    extra_info) loads with answer_key reward_model.ground_truth; every column reaches the reward;
    a row without the nested field is one line naming it."""
    rows_ = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"q{i}"}],
              "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)},
              "extra_info": {"index": i, "split": "train"}} for i in range(4)]
    path = write(tmp_path, "parquet", rows_)
    src = PromptSource(path, seed=0, answer_key="reward_model.ground_truth")
    items = src.take(4)
    assert sorted(it["answer"] for it in items) == ["0", "1", "2", "3"]
    first = next(it for it in items if it["answer"] == "0")
    assert first["metadata"]["reward_model"] == {"style": "rule", "ground_truth": "0"}
    assert first["metadata"]["data_source"] == "openai/gsm8k" and first["metadata"]["extra_info"]["index"] == 0
    # a column whose own name has a dot is taken as it is
    dotted = write(tmp_path, "jsonl", [{"q.text": "q1", "answer": 1}])
    assert PromptSource(dotted, seed=0, prompt_key="q.text").take(1)[0]["prompt"] == "q1"
    bad = write(tmp_path, "jsonl", [{"prompt": "q", "reward_model": {"style": "rule"}}])
    with pytest.raises(StartupError, match=r"d.jsonl:1: .*'reward_model.ground_truth'"):
        PromptSource(bad, seed=0, answer_key="reward_model.ground_truth")


def test_presets_read_verl_and_trl_layouts_as_they_are(tmp_path, chat_tok):
    """issue 39.1: learner.data.preset sets the keys of another trainer's layout (an explicit key
    wins); TRL's rows have no answer column, and a prompt of chat messages also travels as they are
    (protocol.PROMPT_MESSAGES_KEY), for TRL's conversational rewards."""
    from learner.config import DataSettings
    from protocol import PROMPT_MESSAGES_KEY

    assert DataSettings(preset="verl").answer_key == "reward_model.ground_truth"
    assert DataSettings(preset="trl").answer_key is None
    assert DataSettings(preset="verl", answer_key="extra_info.answer").answer_key == "extra_info.answer"
    assert DataSettings().answer_key == "answer"
    data = LearnerConfig.model_validate(nested({"data": {"dataset": "x.jsonl", "preset": "trl"}})).data
    assert data.answer_key is None and data.prompt_key == "prompt"

    msgs = [{"role": "user", "content": "q1"}]
    trl_rows = [{"prompt": msgs, "solution": "1", "level": 2}, {"prompt": "plain q2", "solution": "2"}]
    src = PromptSource(write(tmp_path, "jsonl", trl_rows), seed=0, shuffle=False, answer_key=None,
                       tokenizer=chat_tok)
    conv, plain = src.take(2)
    assert conv["answer"] is None and conv["metadata"] == {"solution": "1", "level": 2, PROMPT_MESSAGES_KEY: msgs}
    assert conv["prompt"] == "u:q1.a:"                               # the text the model sees
    assert plain["metadata"] == {"solution": "2"}                     # a text prompt is its own text
    bad = write(tmp_path, "jsonl", [{"question": "q"}])
    with pytest.raises(StartupError, match=r"each row needs an object with 'prompt' \("):
        PromptSource(bad, seed=0, answer_key=None)
