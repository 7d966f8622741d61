"""The offline DPO trainer (learner/train/dpo.py) with the tiny model: its log-probs are the
Trainer's (one LogprobForward, the same numbers for the same rows), its loss is the slow twin's,
micro-batching changes no gradient, and LoRA trains only the adapter."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch
from config_kit import nested

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops"))
from ops_twins import dpo_loss_loop  # noqa: E402
from test_trainer import make_samples  # noqa: E402

import ops  # noqa: E402
from learner.config import LearnerConfig, TrainerConfig  # noqa: E402
from learner.models.forward import LogprobForward  # noqa: E402
from learner.train.batching import collate  # noqa: E402
from learner.train.dpo import DPOTrainer, best_and_worst  # noqa: E402
from learner.train.trainer import Trainer  # noqa: E402

LORA = {"r": 4, "alpha": 8.0, "target_modules": "all-linear"}
BETA = 0.5


def make_pairs():
    """Four (chosen, rejected) pairs of ragged rows (prompt and completion lengths differ)."""
    ss = make_samples()
    return list(zip(ss[0::2], ss[1::2], strict=True))


def make_cfg(**overrides) -> LearnerConfig:
    cfg = dict(seed=0, threads=1, micro_batch_samples=64, max_grad_norm=1e6)
    cfg.update(overrides)
    return LearnerConfig(**nested(cfg))


def rows_of(pairs):
    return [c for c, _ in pairs] + [r for _, r in pairs]


def test_best_and_worst_pairs_skip_ties_and_failed_completions():
    ss = make_samples()                                      # rewards 1, 0, .5, 0 | 0, 1, 1, .25
    ss[0] = dataclasses.replace(ss[0], failed="reward timed out")
    pairs = best_and_worst([ss[:4], ss[4:], [ss[1], ss[3]]])  # the last group: rewards 0 and 0
    assert [(c.sample_id, r.sample_id) for c, r in pairs] == [("a0-2", "a0-1"), ("a1-1", "a1-0")]


def test_dpo_logprobs_are_the_trainers_and_its_loss_the_twins(tiny_model_dir):
    cfg = make_cfg()
    pairs = make_pairs()
    trainer = Trainer(TrainerConfig.of(cfg), tiny_model_dir)
    dpo = DPOTrainer(TrainerConfig.of(cfg), tiny_model_dir, pairs, beta=BETA, lr=1e-2)
    assert type(dpo.forward) is type(trainer.forward) is LogprobForward
    assert dpo.forward.uses_hidden and trainer.forward.uses_hidden
    # The Trainer's forward on the same rows (one micro-batch: the collated batch as it is).
    bt = collate(rows_of(pairs), trainer.pad_id)
    trainer.model.eval()
    with torch.no_grad():
        token_lp, _ = trainer.forward(bt.input_ids, bt.attention_mask, bt.targets, bt.temperatures)
    want = ops.masked_sum(token_lp, bt.mask, dim=-1)                            # (2N,)
    assert torch.equal(torch.cat([dpo.ref_chosen, dpo.ref_rejected]), want)   # same numbers, bit for bit
    # Step 0: the policy is the reference, so u = 0 and the loss is log 2.
    first = dpo.step()
    assert first["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6) and first["applied"] == 1.0
    # Afterwards: the loss of a step is the twin's on the sequence log-probs of the Trainer's forward
    # function applied to the updated weights.
    with torch.no_grad():
        seq = ops.masked_sum(LogprobForward(dpo.model.eval())(bt.input_ids, bt.attention_mask, bt.targets,
                                                              bt.temperatures)[0], bt.mask, dim=-1)
    dpo.model.train()
    torch.testing.assert_close(torch.cat(dpo.sequence_logprobs()), seq, atol=1e-6, rtol=0)
    n = len(pairs)
    want_loss = dpo_loss_loop(seq[:n], seq[n:], dpo.ref_chosen, dpo.ref_rejected, BETA)
    second = dpo.step()
    assert second["dpo_loss"] == pytest.approx(want_loss, abs=1e-6) and second["dpo_loss"] < math.log(2)


@pytest.mark.parametrize("split", [{"micro_batch_samples": 2}, {"micro_batch_tokens": 20}])
def test_micro_batches_change_no_gradient(tiny_model_dir, split):
    """One pair per micro-batch, or pairs packed by a token budget, against one micro-batch: the
    same loss, statistics and (with SGD, whose update is the gradient) the same weights after."""
    pairs = make_pairs()
    whole = DPOTrainer(TrainerConfig.of(make_cfg()), tiny_model_dir, pairs, beta=BETA)
    cut = DPOTrainer(TrainerConfig.of(make_cfg(**split)), tiny_model_dir, pairs, beta=BETA)
    assert len(whole.micro_batches) == 1 and len(cut.micro_batches) > 1
    assert all(sorted(torch.cat(t.micro_batches).tolist()) == list(range(len(pairs))) for t in (whole, cut))
    for t in (whole, cut):
        t.optimizer = torch.optim.SGD(t.trainable, lr=1.0)
    torch.testing.assert_close(whole.ref_chosen, cut.ref_chosen, atol=1e-6, rtol=0)
    for _ in range(2):
        a, b = whole.step(), cut.step()
        assert a == pytest.approx(b, abs=1e-6)
    for (name, p), q in zip(whole.model.named_parameters(), cut.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)


def test_lora_trains_only_the_adapter(tiny_model_dir, tmp_path):
    pairs = make_pairs()
    dpo = DPOTrainer(TrainerConfig.of(make_cfg(lora=LORA)), tiny_model_dir, pairs, beta=BETA, lr=1e-2)
    trainable = {n for n, p in dpo.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # The reference (the identity adapter) is the plain policy's.
    plain = DPOTrainer(TrainerConfig.of(make_cfg()), tiny_model_dir, pairs, beta=BETA)
    torch.testing.assert_close(dpo.ref_chosen, plain.ref_chosen, atol=1e-6, rtol=0)
    before = {n: p.detach().clone() for n, p in dpo.model.named_parameters()}
    losses = [dpo.step()["dpo_loss"] for _ in range(4)]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6) and losses[-1] < losses[0] - 0.05, losses
    changed = {n for n, p in dpo.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed <= trainable and any("lora_B" in n for n in changed)
    out = dpo.save_policy(tmp_path / "policy")
    assert (out / "adapter_config.json").is_file() and (out / "tokenizer_config.json").is_file()
