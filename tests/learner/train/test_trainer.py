"""Trainer.step on a fixed batch with the tiny model: the loss and gradients against references built
from the ops slow twins, micro-batching that changes nothing, and correction of flagged samples."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops"))
from config_kit import nested
from ops_twins import (  # noqa: E402
    aggregate_loop,
    behavior_anchored_loop,
    group_advantages_loop,
    importance_loop,
    ppo_token_losses_loop,
    token_logprobs_loop,
)

from buffer import Batch  # noqa: E402
from learner.config import LearnerConfig, TrainerConfig  # noqa: E402
from learner.train.batching import sampling_temperature  # noqa: E402
from learner.train.trainer import FLAGGED_IS_MODE, Trainer  # noqa: E402
from protocol import Sample  # noqa: E402

GROUP = 4
VOCAB = 49          # the tiny model's character vocabulary (4 specials + 45 characters)
B = 8
# (prompt length, completion length) of each row: ragged, so padding is exercised.
SHAPES = [(3, 5), (4, 2), (3, 6), (5, 1), (4, 4), (3, 3), (5, 6), (4, 2)]
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.25]


def make_samples(seed: int = 0, spread: float = 0.6) -> list[Sample]:
    """Fixed samples; behavior log-probs near a uniform policy's (−log V) plus noise, so the
    importance weights are neither all 1 nor astronomically far from it."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, t) in enumerate(SHAPES):
        g, gi = divmod(i, GROUP)
        prompt = np.concatenate([[1], rng.integers(4, VOCAB, p - 1)]).astype(np.int32)  # <s> first
        out.append(Sample(
            sample_id=f"a{g}-{gi}", assignment_id=f"a{g}", group_index=gi, group_size=GROUP,
            prompt_token_ids=prompt,
            completion_token_ids=rng.integers(4, VOCAB, t).astype(np.int32),
            behavior_logprobs=(-np.log(VOCAB) + spread * rng.standard_normal(t)).astype(np.float32),
            token_versions=np.zeros(t, dtype=np.int32), reward=REWARDS[i]))
    return out


def make_batch(flags: list[bool] | None = None, **kw) -> Batch:
    flags = [False] * B if flags is None else flags
    return Batch(make_samples(**kw), version=3, staleness=[3 if f else 1 for f in flags],
                 needs_correction=list(flags), group_sizes=[GROUP] * (B // GROUP))


def make_trainer(model_dir: str, **overrides) -> Trainer:
    cfg = dict(group_size=GROUP, batch_prompts=B // GROUP, micro_batch_samples=B, lr=1e-2,
               max_grad_norm=1e6, is_mode="tis", is_cap=1.5, seed=0, threads=1)
    cfg.update(overrides)
    return Trainer(TrainerConfig.of(LearnerConfig(**nested(cfg))), model_dir)


def grads(tr: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}


def params(tr: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.model.named_parameters()}


def _completion_logits(model, s: Sample) -> torch.Tensor:
    """Logits predicting each completion token, from a forward of this sample alone (no padding)."""
    ids = torch.from_numpy(np.concatenate([s.prompt_token_ids, s.completion_token_ids]).astype(np.int64))
    p, t = len(s.prompt_token_ids), len(s.completion_token_ids)
    return model(input_ids=ids[None], use_cache=False).logits[0, p - 1:p - 1 + t]   # (t, V)


def reference(model_dir: str, batch: Batch, cfg: LearnerConfig):
    """The step's loss, per-token weights and gradients, computed row by row without the trainer.

    Log-probs, advantages, importance weights, token losses and aggregation come from the slow
    twins (float64 loops over the formulas); the gradient from autograd through a plain
    log_softmax on an independent copy of the model.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    samples = batch.samples
    T = max(len(s.completion_token_ids) for s in samples)
    mask = torch.zeros(B, T, dtype=torch.bool)
    logp = torch.zeros(B, T, dtype=torch.float64)       # twin log-probs, completion-aligned
    behav = torch.zeros(B, T, dtype=torch.float64)
    logp_grad = torch.zeros(B, T)                        # differentiable, plain torch
    for i, s in enumerate(samples):
        t = len(s.completion_token_ids)
        logits = _completion_logits(model, s)
        tokens = torch.from_numpy(s.completion_token_ids.astype(np.int64))
        tau = sampling_temperature(s, cfg.sampling.temperature)       # each row at its own temperature
        logp[i, :t] = token_logprobs_loop(logits.detach()[None], tokens[None], tau)[0]
        behav[i, :t] = torch.from_numpy(s.behavior_logprobs.astype(np.float64))
        lp = torch.log_softmax(logits / tau, dim=-1).gather(-1, tokens[:, None])[:, 0]
        logp_grad = logp_grad.index_put((torch.full((t,), i), torch.arange(t)), lp)
        mask[i, :t] = True
    scores = [s.reward for s in samples]
    cache, n_max = cfg.reward.overlong_buffer_tokens, cfg.sampling.max_new_tokens
    if cache:                                            # DAPO's soft overlong punishment, by hand
        for i, s in enumerate(samples):
            n = len(s.completion_token_ids)
            if n > n_max - cache:
                scores[i] -= cfg.reward.overlong_penalty * min(1.0, (n - (n_max - cache)) / cache)
    adv = group_advantages_loop(scores, GROUP, cfg.algorithm.advantage)[:, None].expand(B, T)
    if cfg.reward.mask_truncated:                        # overlong filtering: after the advantages
        for i, s in enumerate(samples):
            if s.finish_reason == "length":
                mask[i] = False
    w, keep = importance_loop(logp, behav, mask, cfg.algorithm.is_mode, cfg.algorithm.is_cap,
                              bounds=(cfg.algorithm.icepop_low, cfg.algorithm.icepop_high))
    flagged = torch.tensor(batch.needs_correction, dtype=torch.bool)
    if cfg.algorithm.is_mode == "none" and bool(flagged.any()):
        w_f, keep_f = importance_loop(logp, behav, mask, FLAGGED_IS_MODE, cfg.algorithm.is_cap)
        w = torch.where(flagged[:, None], w_f, w)
        keep = torch.where(flagged[:, None], keep_f, keep)
    # Single optimizer step: the proximal policy is the current one (ratio 1).
    inside = torch.ones(B, T, dtype=torch.bool)
    if cfg.algorithm.clip_anchor == "behavior":
        # The ratio against mu: a token already past 1 +- eps of mu in its advantage's direction
        # is clipped (no gradient); the others keep the decoupled gradient -w A.
        token_loss = ppo_token_losses_loop(logp, behav, adv, keep, cfg.algorithm.clip_low, cfg.algorithm.clip_high, None,
                                           behavior_anchored_loop(w, logp, behav, keep))
        r = torch.exp(logp - behav)
        inside = ~(((adv > 0) & (r > 1 + cfg.algorithm.clip_high)) | ((adv < 0) & (r < 1 - cfg.algorithm.clip_low)))
    else:
        token_loss = ppo_token_losses_loop(logp, logp, adv, keep, cfg.algorithm.clip_low, cfg.algorithm.clip_high, None, w)
    if cfg.algorithm.policy_loss == "cispo":    # −w · clip(r) · A · log π with r = 1 (GSPO's s = 1: PPO's)
        token_loss = torch.where(keep, -w * adv * logp, torch.zeros_like(logp))
    # Masked tokens (mis) keep their place in the denominator with weight 0: aggregate over `mask`.
    C = cfg.algorithm.loss_norm_tokens or cfg.sampling.max_new_tokens
    loss = aggregate_loop(token_loss, mask, cfg.algorithm.loss_agg, norm_tokens=C)
    # Gradient at ratio 1: d l_t / d log π_t = −w_t A_t (inside the clip range), so the surrogate
    # Σ_t c_t · (−w_t A_t) · exp(log π_t − sg(log π_t)) has the same value and the same gradient.
    rows = [int(m.sum()) for m in mask]
    coef = torch.zeros(B, T, dtype=torch.float64)
    counted = sum(1 for n in rows if n)                  # rows with a token in the loss
    for i, n in enumerate(rows):
        if not n:
            continue
        c = {"token_mean": 1.0 / sum(rows), "seq_mean_token_sum": 1.0 / counted,
             "seq_mean_token_mean": 1.0 / (counted * n), "seq_mean_token_sum_norm": 1.0 / (counted * C)}[cfg.algorithm.loss_agg]
        coef[i, :n] = c
    wk = torch.where(keep & inside, w, torch.zeros_like(w))
    surrogate = (coef * (-wk * adv)).float() * torch.exp(logp_grad - logp_grad.detach())
    model.zero_grad()
    surrogate[mask].sum().backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss, w, keep, ref_grads


def assert_close_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float, rtol: float):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=atol, rtol=rtol, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("is_mode,loss_agg,flags", [
    ("tis", "token_mean", None),
    ("none", "token_mean", None),                                  # nothing flagged: w = 1
    ("none", "seq_mean_token_sum", [True, False, False, True, False, False, True, False]),
    ("mis", "seq_mean_token_mean", [False, True] * 4),
])
def test_step_matches_reference_from_twins(tiny_model_dir, is_mode, loss_agg, flags):
    tr = make_trainer(tiny_model_dir, is_mode=is_mode, loss_agg=loss_agg, micro_batch_samples=3)
    batch = make_batch(flags)
    ref_loss, w, keep, ref_grads = reference(tiny_model_dir, batch, tr.cfg)
    if is_mode == "none" and flags is None:
        assert (w[keep] == 1).all()
    else:
        assert (w[keep] != 1).any()             # the weights really do something here
    stats = tr.step(batch)
    assert stats["loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert stats["pg_ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert stats["corrected_samples"] == float(sum(flags or []))
    assert_close_dicts(grads(tr), ref_grads, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("policy_loss,is_mode,loss_agg", [
    ("gspo", "tis", "seq_mean_token_mean"),
    ("gspo", "icepop", "seq_mean_token_sum_norm"),
    ("cispo", "icepop", "token_mean"),
    ("cispo", "mis", "seq_mean_token_sum_norm"),
])
def test_policy_losses_step_matches_reference_from_twins(tiny_model_dir, policy_loss, is_mode, loss_agg):
    """issue 27.2: GSPO and CISPO in one update (ratio 1): the loss each defines and the decoupled
    gradient −w·A, IcePop's weights and Dr. GRPO's constant normaliser (max_new_tokens)."""
    tr = make_trainer(tiny_model_dir, is_mode=is_mode, is_cap=1.5, loss_agg=loss_agg, micro_batch_samples=3,
                      algorithm=dict(policy_loss=policy_loss, icepop_low=0.7, icepop_high=1.4))
    batch = make_batch(spread=0.5)
    ref_loss, w, keep, ref_grads = reference(tiny_model_dir, batch, tr.cfg)
    assert (w[keep] != 1).any()                 # the weights really do something here
    stats = tr.step(batch)
    assert stats["loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert stats["pg_ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert_close_dicts(grads(tr), ref_grads, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("is_mode", ["tis", "mis"])
def test_clip_anchor_behavior_matches_reference_from_twins(tiny_model_dir, is_mode):
    """clip_anchor: behavior: the PPO ratio against the behavior log-probs, the importance weights
    kept; tokens past the sampler's trust region get no gradient, the rest the decoupled one."""
    tr = make_trainer(tiny_model_dir, is_mode=is_mode, is_cap=5.0, clip_anchor="behavior",
                      micro_batch_samples=3)
    batch = make_batch(spread=1.0)
    ref_loss, _, keep, ref_grads = reference(tiny_model_dir, batch, tr.cfg)
    stats = tr.step(batch)
    assert stats["loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert 0 < stats["pg_clip_fraction"] < 1             # some tokens are past mu's trust region
    assert_close_dicts(grads(tr), ref_grads, atol=1e-5, rtol=1e-4)
    plain = make_trainer(tiny_model_dir, is_mode=is_mode, is_cap=5.0, micro_batch_samples=3)
    assert plain.step(batch)["pg_clip_fraction"] == 0     # the one-update decoupled step: none


def test_clip_anchor_behavior_refuses_target_kl():
    with pytest.raises(ValueError, match="target_kl"):
        LearnerConfig(**nested(clip_anchor="behavior", target_kl=0.1))


@pytest.mark.parametrize("overrides,flags", [
    # proximal := behavior, so ratios, clipping and approx KL are not trivial; flagged rows are
    # weighed against the current policy with tis, the others get w = 1
    (dict(recompute_logprobs=False, is_mode="none"), [True, False, True, False, False, False, True, True]),
    (dict(recompute_logprobs=False, is_mode="mis", loss_agg="seq_mean_token_mean"), None),
    (dict(is_mode="seq_tis", loss_agg="seq_mean_token_sum"), [False] * 6 + [True] * 2),
])
@pytest.mark.parametrize("micro", [dict(micro_batch_samples=4), dict(micro_batch_samples=3),
                                   dict(micro_batch_tokens=24)], ids=["4", "3", "tokens24"])
def test_micro_batches_change_nothing(tiny_model_dir, overrides, flags, micro):
    """micro_batch_samples = B vs B/2 (and an uneven 3 + 3 + 2), and a 24-token budget (the rows
    longest first: 11 + 9 | 8 + 8 + 6 | 6 + 6 + 6 tokens, three passes of their own widths): the
    same loss, gradients, updated weights and step statistics, every stat over the whole batch."""
    one = make_trainer(tiny_model_dir, micro_batch_samples=B, **overrides)
    split = make_trainer(tiny_model_dir, **{"micro_batch_samples": B, **micro}, **overrides)
    widths = []
    forward = split.model.forward
    split.model.forward = lambda *a, **k: widths.append(k["input_ids"].shape) or forward(*a, **k)
    s1 = one.step(make_batch(flags, spread=0.3))
    s2 = split.step(make_batch(flags, spread=0.3))
    if "micro_batch_tokens" in micro:
        assert [tuple(w) for w in widths] == [(2, 11), (3, 8), (3, 6)]
    if not overrides.get("recompute_logprobs", True):
        assert s1["pg_clip_fraction"] > 0 and s1["pg_approx_kl"] > 0 and s1["pg_ratio_max"] > 1
    if overrides.get("recompute_logprobs", True) or flags:   # else proximal := behavior: w = 1
        assert s1["is_weight_max"] > s1["is_weight_min"] and s1["is_ess_ratio"] < 1
    assert s1.keys() == s2.keys()
    for k in s1:
        if k != "step_s" and not k.startswith("time_"):
            assert s2[k] == pytest.approx(s1[k], abs=1e-6, rel=1e-6), k
    g_one = grads(one)
    assert_close_dicts(grads(split), g_one, atol=1e-6, rtol=1e-5)
    # Updated weights: AdamW's first step is lr·g/(|g| + eps), so where |g| is near eps (1e-8) a
    # float-rounding difference in g moves the step by a visible part of lr; elsewhere 1e-6.
    lr = one.cfg.optimizer.lr
    p_one, p_split = params(one), params(split)
    for n, g in g_one.items():
        diff = (p_split[n] - p_one[n]).abs()
        assert float(torch.where(g.abs() > 1e-5, diff, 0.0).max()) <= 1e-6, n
        assert diff.max() <= 2 * lr, n


@pytest.mark.parametrize("recompute", [True, False])
def test_flagged_samples_are_corrected_under_is_mode_none(tiny_model_dir, recompute):
    flags = [True, False, False, True, True, False, False, False]
    plain = make_trainer(tiny_model_dir, is_mode="none", recompute_logprobs=recompute)
    corrected = make_trainer(tiny_model_dir, is_mode="none", recompute_logprobs=recompute)
    s_plain = plain.step(make_batch())
    s_corr = corrected.step(make_batch(flags))
    assert s_corr["corrected_samples"] == 3.0 and s_plain["corrected_samples"] == 0.0
    assert s_corr["loss"] != pytest.approx(s_plain["loss"], abs=1e-4)
    g_plain, g_corr = grads(plain), grads(corrected)
    assert any(not torch.allclose(g_plain[n], g_corr[n], atol=1e-6) for n in g_plain)
    p_plain, p_corr = params(plain), params(corrected)
    assert any(not torch.allclose(p_plain[n], p_corr[n], atol=1e-6) for n in p_plain)


def test_flags_change_nothing_when_nothing_is_flagged_or_every_sample_is_weighed(tiny_model_dir):
    """No flag set: identical to a batch that carries no flags at all. Under is_mode tis every
    sample already gets the correction, so flags change nothing either."""
    for is_mode, flags in (("none", [False] * B), ("tis", [True, False] * 4)):
        a = make_trainer(tiny_model_dir, is_mode=is_mode)
        b = make_trainer(tiny_model_dir, is_mode=is_mode)
        batch_a = make_batch()
        batch_a.needs_correction = []
        sa, sb = a.step(batch_a), b.step(make_batch(flags))
        assert sa["loss"] == sb["loss"]
        assert_close_dicts(grads(a), grads(b), atol=0, rtol=0)
        assert_close_dicts(params(a), params(b), atol=0, rtol=0)


def test_vocab_size_and_bad_batches(tiny_model_dir):
    tr = make_trainer(tiny_model_dir)
    assert tr.vocab_size == tr.model.get_input_embeddings().num_embeddings == len(tr.tokenizer)
    bad = make_batch()
    bad.samples[2].completion_token_ids[0] = tr.vocab_size
    before = params(tr)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tr.step(bad)
    with pytest.raises(ValueError, match="needs_correction"):
        tr.step(make_batch([True]))
    assert_close_dicts(params(tr), before, atol=0, rtol=0)


def test_the_policy_optimizer_is_fused_and_updates_as_the_default_adamw():
    """learner.train.policy_io.adamw: torch's fused AdamW on CPU parameters, whose steps match the
    default (for-loop) AdamW's."""
    import torch

    from learner.train.policy_io import adamw

    torch.manual_seed(0)
    a = [torch.randn(7, 5, requires_grad=True), torch.randn(5, requires_grad=True)]
    b = [p.detach().clone().requires_grad_(True) for p in a]
    fused, plain = adamw(a, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"] is True and not plain.defaults.get("fused")
    for _ in range(5):
        g = [torch.randn_like(p) for p in a]
        for p, q, x in zip(a, b, g):
            p.grad, q.grad = x.clone(), x.clone()
        fused.step()
        plain.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_trainer_takes_its_sections_not_the_learner_config(tiny_model_dir):
    """The trainer is given a TrainerConfig (the training sections, the same paths); the whole
    learner config (sockets, data, checkpoints, security) is refused."""
    cfg = LearnerConfig(**nested(lr=1e-3, is_mode="mis", max_staleness=3))
    with pytest.raises(TypeError, match="TrainerConfig.of"):
        Trainer(cfg, tiny_model_dir)
    own = TrainerConfig.of(cfg)
    assert own.optimizer.lr == 1e-3 and own.algorithm.is_mode == "mis"
    assert not hasattr(own, "network") and not hasattr(own, "staleness") and not hasattr(own, "data")
    own.optimizer.lr = 5e-4                              # its own copy: the learner's is untouched
    assert cfg.optimizer.lr == 1e-3


DEVICE_READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy")
# Reads of tensors the host holds by design, not the device's: a micro-batch's width and the rows'
# temperatures (learner.train.batching.HOST_FIELDS stay on the CPU), and transformers' own check
# of the attention mask in every forward (its code, not ours).
HOST_SITES = (("learner/train/batching.py", "width"), ("learner/models/forward.py", "row_temperature_groups"),
              ("transformers/masking_utils.py", None))


def count_reads(monkeypatch, trainer: Trainer, batch: Batch) -> tuple[dict, int]:
    """Run one step counting every read of a tensor's value by the host (Tensor.item, float(),
    int(), bool(), tolist(), numpy()) outside :data:`HOST_SITES`: on a GPU each waits for the
    device's queued work."""
    reads = []
    for name in DEVICE_READS:
        original = getattr(torch.Tensor, name)

        def counted(t, *a, _original=original, _name=name, **k):
            caller = sys._getframe(1)
            site = (caller.f_code.co_filename, caller.f_code.co_name)
            if not any(site[0].endswith(f) and fn in (None, site[1]) for f, fn in HOST_SITES):
                reads.append((_name, site))
            return _original(t, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        stats = trainer.step(batch)
    finally:
        monkeypatch.undo()
    return stats, len(reads)


@pytest.mark.parametrize("overrides", [
    {},                                                        # the demo's step: one update
    dict(ppo_epochs=2, mini_batch_samples=4),                  # four updates, a proximal pass
    dict(is_mode="geo_mis", kl_coef=0.05, kl_in_reward=False, entropy_coef=0.01),
], ids=["one-update", "four-updates", "kl-entropy"])
def test_a_step_reads_its_statistics_once_not_per_micro_batch(tiny_model_dir, monkeypatch, overrides):
    """The step keeps its statistics on the device and reads them back together (issue 37 item 7):
    per update its loss terms and gradient norms, at the end everything else. Eight micro-batches
    cost no more reads than one (before: about ten a micro-batch), and the figures are the same."""
    one = make_trainer(tiny_model_dir, micro_batch_samples=B, **overrides)
    eight = make_trainer(tiny_model_dir, micro_batch_samples=1, **overrides)
    s1, reads_one = count_reads(monkeypatch, one, make_batch(spread=0.3))
    s8, reads_eight = count_reads(monkeypatch, eight, make_batch(spread=0.3))
    print(overrides, {"reads, 1 micro-batch": reads_one, "reads, 8 micro-batches": reads_eight,
                      "optimizer steps": s1["optimizer_steps"]})
    assert reads_eight == reads_one, (reads_one, reads_eight)
    # Per update: its one read (losses and norms), the finite-weights check and the mini-batch's
    # loss normalizer; per step: the collate's token-range check (on the host), the final read
    # and the reward figures of the host's samples.
    assert reads_one <= 3 * s1["optimizer_steps"] + 8, reads_one
    if s1["optimizer_steps"] == 1:      # (after a first update, rounding of the split compounds)
        for k in s1:
            if k != "step_s" and not k.startswith("time_"):
                assert s8[k] == pytest.approx(s1[k], abs=1e-6, rel=1e-6), k


@pytest.mark.parametrize("micro", [1, 3, B])
def test_gradient_clipping_binds_on_the_accumulated_gradient(tiny_model_dir, micro):
    """issue 27.3: max_grad_norm clips the gradient of the whole mini-batch once, after the
    micro-batches accumulated: the clipped gradient is the one-batch twin's scaled to the bound,
    whatever the split (clipping each micro-batch would change its direction)."""
    bound = 1e-3
    tr = make_trainer(tiny_model_dir, max_grad_norm=bound, micro_batch_samples=micro)
    batch = make_batch(spread=0.5)
    _, _, _, ref_grads = reference(tiny_model_dir, batch, tr.cfg)
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())))
    assert norm > 100 * bound                                  # the bound binds, by far
    stats = tr.step(batch)
    assert stats["grad_norm"] == pytest.approx(norm, rel=1e-4)  # reported before clipping
    clipped = grads(tr)
    assert float(torch.sqrt(sum((g.double() ** 2).sum() for g in clipped.values()))) == pytest.approx(bound, rel=1e-4)
    assert_close_dicts(clipped, {n: g * (bound / norm) for n, g in ref_grads.items()}, atol=1e-9, rtol=1e-3)


def test_dapo_overlong_punishment_and_filtering_match_reference(tiny_model_dir):
    """issue 27.1: the soft overlong punishment shapes the scores before the group baseline, and
    overlong filtering drops truncated completions from the loss after it (their rewards still
    count in their groups' advantages)."""
    tr = make_trainer(tiny_model_dir, max_new_tokens=6, micro_batch_samples=3,
                      reward=dict(overlong_buffer_tokens=3, overlong_penalty=0.5, mask_truncated=True))
    samples = make_samples()
    for smp in samples:
        if len(smp.completion_token_ids) == 6:           # rows 2 and 6 hit the limit
            smp.finish_reason = "length"
    batch = Batch(samples, version=3, staleness=[1] * B, needs_correction=[False] * B, group_sizes=[GROUP] * (B // GROUP))
    ref_loss, _, _, ref_grads = reference(tiny_model_dir, batch, tr.cfg)
    stats = tr.step(batch)
    assert stats["truncated_masked_samples"] == 2.0
    assert stats["loss"] == pytest.approx(ref_loss, abs=1e-5)
    assert_close_dicts(grads(tr), ref_grads, atol=1e-5, rtol=1e-4)
    # Neither is a no-op: without them the step's gradient is another one.
    plain = make_trainer(tiny_model_dir, max_new_tokens=6, micro_batch_samples=3)
    plain.step(batch)
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(grads(plain).values(), ref_grads.values(), strict=True))


def test_overlong_buffer_longer_than_the_completion_limit_is_refused():
    with pytest.raises(ValueError, match="overlong_buffer_tokens"):
        LearnerConfig(**nested(max_new_tokens=8, reward=dict(overlong_buffer_tokens=9)))
