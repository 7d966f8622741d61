"""slipstream replay: statistics of a rollout log (torn records counted), re-training from it
through the learner's Trainer, and DPO on each group's best and worst completion."""

from __future__ import annotations

import json
import math
import zlib

import numpy as np
import pytest
import torch

import protocol
from deploy.cli import main
from deploy.replay import dpo_offline, dpo_pairs, read_samples
from learner.models.forward import LogprobForward
from learner.state.rollout_log import LIFE, RESULT, LogReader, RolloutLogWriter
from learner.train.batching import collate
from learner.train.dpo import sequence_logprobs


def sample(aid: str, i: int, reward: float, versions=(0, 0, 0), size: int = 2) -> protocol.Sample:
    n = len(versions)
    rng = np.random.default_rng(zlib.crc32(f"{aid}/{i}".encode()))
    return protocol.Sample(
        sample_id=protocol.sample_id(aid, i), assignment_id=aid, group_index=i, group_size=size,
        prompt_token_ids=np.array([1, 5, 6, 7], np.int32),
        completion_token_ids=rng.integers(5, 15, n).astype(np.int32),
        behavior_logprobs=np.full(n, -2.0, np.float32), token_versions=np.asarray(versions, np.int32),
        reward=reward)


def make_log(root, groups: int = 6, torn: bool = False):
    """``groups`` groups of 2 (rewards 1 and 0), alternately from servers s1 and s2, accepted at
    version 2 with tokens of version 1 (staleness 1), then optionally a torn tail."""
    w = RolloutLogWriter(root, 1 << 20)
    w.append(LIFE, {"life": w.life, "start_version": 0, "started_at": 0.0})
    for g in range(groups):
        msg = protocol.RolloutResult(server_id=f"s{g % 2 + 1}",
                                     samples=[sample(f"r-a{g}", 0, 1.0, (1, 1, 2)),
                                              sample(f"r-a{g}", 1, 0.0, (1, 1, 1))])
        w.append(RESULT, {"life": w.life, "version": 2}, protocol.encode(msg))
    w.close()
    if torn:
        [seg] = LogReader(root).segment_paths()
        seg.write_bytes(seg.read_bytes()[:-7])


def test_replay_prints_the_statistics(tmp_path, capsys):
    log = tmp_path / "rollout_log"
    make_log(log, torn=True)
    # The run directory's trained_ids.jsonl: groups 0 and 1 trained, then group 1's step rolled back.
    (tmp_path / "trained_ids.jsonl").write_text("\n".join(json.dumps(x) for x in [
        {"trained_on_version": 0, "sample_ids": ["r-a0/0", "r-a0/1"]},
        {"trained_on_version": 1, "sample_ids": ["r-a1/0", "r-a1/1"]},
        {"resumed_at_version": 1}]) + "\n")
    assert main(["replay", str(log), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    # The torn last record (group 5) is skipped and counted: 5 groups of 2 remain.
    assert st["torn"] == 1 and st["samples"] == 10 and st["groups"] == 5 and st["lives"] == 1
    assert st["reward_mean"] == pytest.approx(0.5) and st["reward_std"] == pytest.approx(0.5)
    assert st["staleness_mean"] == 1 and st["staleness_histogram"] == {"1": 10}
    assert (st["token_version_min"], st["token_version_max"]) == (1, 2)
    assert {k: v["samples"] for k, v in st["servers"].items()} == {"s1": 6, "s2": 4}
    assert st["trained_samples"] == 2 and st["untrained_samples"] == 8
    assert main(["replay", str(log)]) == 0
    text = capsys.readouterr().out
    assert "torn records skipped 1" in text and "s2" in text and "untrained 8" in text
    assert main(["replay", str(tmp_path / "nothing")]) == 2          # one line, exit 2


def test_replay_train_runs_trainer_steps_on_logged_batches(tmp_path, tiny_model_dir, capsys):
    make_log(tmp_path)
    code = main(["replay", str(tmp_path), "--train", "--model", tiny_model_dir, "--steps", "2",
                 "--set", "learner.batch.batch_prompts=2", "--set", "learner.batch.group_size=2",
                 "--set", "learner.threads=1", "--out", str(tmp_path / "policy")])
    assert code == 0 and (tmp_path / "policy" / "config.json").is_file()
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"step"')]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["pg_loss"]) and r["reward_mean"] == pytest.approx(0.5) for r in rows)


def test_sequence_logprobs_match_a_per_sample_loop(tiny_model_dir):
    """The batched, padded sum of completion log-probs against the obvious loop (slow twin)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    ss = [sample("x", 0, 1.0, (0,) * 2), sample("y", 0, 0.0, (0,) * 5)]
    ss[1].prompt_token_ids = np.array([1, 5], np.int32)        # different prompt lengths: padding
    with torch.no_grad():
        got = sequence_logprobs(LogprobForward(model), collate(ss, pad_id=0))
        for k, s in enumerate(ss):
            ids = torch.tensor([list(s.prompt_token_ids) + list(s.completion_token_ids)])
            logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
            p = len(s.prompt_token_ids)
            want = sum(logp[p - 1 + t, int(tok)] for t, tok in enumerate(s.completion_token_ids))
            assert got[k].item() == pytest.approx(float(want), rel=1e-6)


def test_offline_dpo_on_best_and_worst_lowers_the_loss(tmp_path, tiny_model_dir):
    make_log(tmp_path, groups=4)
    entries, _ = read_samples(tmp_path)
    pairs = dpo_pairs(entries)
    assert len(pairs) == 4 and all(c.reward == 1.0 and r.reward == 0.0 for c, r in pairs)
    losses = dpo_offline(tmp_path, tiny_model_dir, steps=6, beta=0.5, lr=3e-3, emit=lambda line: None)
    # Step 0: the policy is the reference, so the loss is exactly log 2; then it goes down.
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert losses[-1] < losses[0] - 0.05 and losses[-1] == min(losses), losses
