"""Trainer.step on the full PPO path: a critic with GAE, a KL term to a reference (in the loss or
in the reward), an entropy bonus, dual-clip, value clipping, whitening, REINFORCE++ — the loss
against the ops slow twins (float64 loops over the formulas), the policy's and the critic's
gradients against plain autograd through the formulas written out, on independent model copies."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trainer import GROUP, B, assert_close_dicts, make_batch, make_trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops"))
from ops_twins import (  # noqa: E402
    aggregate_loop,
    entropy_loop,
    gae_compact_loop,
    group_advantages_loop,
    importance_loop,
    kl_token_loop,
    ppo_token_losses_loop,
    returns_to_go_loop,
    shape_token_rewards_loop,
    token_logprobs_loop,
    value_token_losses_loop,
)

CASES = {
    # proximal := behavior, so ratios spread and both clips and the dual clip act
    "gae_kl_loss_entropy_dualclip": dict(
        advantage="gae", recompute_logprobs=False, kl_coef=0.3, kl_kind="k3", entropy_coef=0.05,
        dual_clip=1.2, clip_low=0.1, clip_high=0.15, value_clip=0.05, loss_agg="token_mean",
        gamma=0.9, lam=0.8),
    # KL (k1) per token in the reward, from the proximal pass; whitened GAE advantages
    "gae_kl_in_reward_whitened": dict(
        advantage="gae", kl_coef=0.2, kl_in_reward=True, kl_kind="k1", whiten_advantages=True,
        loss_agg="seq_mean_token_mean", value_clip=None, lam=1.0),
    # REINFORCE++ (whitened returns-to-go) with a k2 KL loss; is_mode none
    "reinforce_pp_k2": dict(advantage="reinforce_pp", kl_coef=0.5, kl_kind="k2", is_mode="none",
                            entropy_coef=0.02, loss_agg="seq_mean_token_sum", gamma=0.95),
    # GRPO with KL in the reward: the summed token rewards are the group scores
    "grpo_kl_in_reward": dict(advantage="grpo", kl_coef=0.4, kl_in_reward=True, kl_kind="k3"),
}


def _rows(model, s):
    ids = torch.from_numpy(np.concatenate([s.prompt_token_ids, s.completion_token_ids]).astype(np.int64))
    p, t = len(s.prompt_token_ids), len(s.completion_token_ids)
    return ids[None], p, t


def _whiten64(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    vals = [float(v) for v in x[mask]]
    n = len(vals)
    mu = sum(vals) / n
    var = sum((v - mu) ** 2 for v in vals) / (n - 1)
    return torch.where(mask, (x - mu) / math.sqrt(var + 1e-8), torch.zeros_like(x))


def _agg_torch(loss: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """aggregate_loop with autograd: python sums over rows."""
    rows = [loss[b][mask[b]] for b in range(loss.shape[0])]
    if agg == "token_mean":
        return sum(r.sum() for r in rows) / int(mask.sum())
    per = [r.sum() if agg == "seq_mean_token_sum" else r.mean() for r in rows]
    return sum(per) / len(per)


def reference(tr, batch, policy, ref_model, critic):
    """(loss, value loss, policy grads, critic grads) of the step, written out."""
    cfg = tr.cfg
    samples = batch.samples
    T = max(len(s.completion_token_ids) for s in samples)
    mask = torch.zeros(B, T, dtype=torch.bool)
    z = lambda: torch.zeros(B, T, dtype=torch.float64)  # noqa: E731
    lp64, ref64, ent64, behav, v_old = z(), z(), z(), z(), z()
    lp_g = [None] * B
    ent_g = [None] * B
    v_g = [None] * B
    for i, s in enumerate(samples):
        ids, p, t = _rows(policy, s)
        logits = policy(input_ids=ids, use_cache=False).logits[0, p - 1:p - 1 + t]           # (t, V)
        tokens = torch.from_numpy(s.completion_token_ids.astype(np.int64))
        mask[i, :t] = True
        lp64[i, :t] = token_logprobs_loop(logits.detach()[None], tokens[None], cfg.sampling.temperature)[0]
        ent64[i, :t] = entropy_loop(logits.detach()[None], cfg.sampling.temperature)[0]
        behav[i, :t] = torch.from_numpy(s.behavior_logprobs.astype(np.float64))
        logp = torch.log_softmax(logits / cfg.sampling.temperature, -1)
        lp_g[i] = logp.gather(-1, tokens[:, None])[:, 0]
        ent_g[i] = -(logp.exp() * logp).sum(-1)
        if ref_model is not None:
            with torch.no_grad():
                rl = ref_model(input_ids=ids, use_cache=False).logits[0, p - 1:p - 1 + t]
            ref64[i, :t] = token_logprobs_loop(rl[None], tokens[None], cfg.sampling.temperature)[0]
        if critic is not None:
            v = critic(ids, torch.ones_like(ids))[0, p - 1:p - 1 + t]
            v_g[i] = v
            v_old[i, :t] = v.detach().double()
    prox64 = lp64 if cfg.algorithm.recompute_logprobs else behav
    kl64 = kl_token_loop(prox64, ref64, cfg.kl.kind) if ref_model is not None else None
    scores = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    in_reward = ref_model is not None and cfg.kl.in_reward
    rewards = shape_token_rewards_loop(scores, mask, kl64 if in_reward else None, cfg.kl.coef)
    returns = None
    if cfg.algorithm.advantage == "gae":
        adv, returns = gae_compact_loop(rewards, v_old, mask, cfg.algorithm.gamma, cfg.algorithm.lam)
    elif cfg.algorithm.advantage == "reinforce_pp":
        adv = _whiten64(returns_to_go_loop(rewards, mask, cfg.algorithm.gamma), mask)
    else:
        seq = rewards.sum(-1)
        adv = group_advantages_loop(seq, GROUP, cfg.algorithm.advantage)[:, None] * mask
    if cfg.algorithm.whiten_advantages and cfg.algorithm.advantage != "reinforce_pp":
        adv = _whiten64(adv, mask)
    # behavior weights w = π_prox/μ by is_mode (all 1 when π_prox := μ)
    w, keep = importance_loop(prox64, behav, mask, cfg.algorithm.is_mode, cfg.algorithm.is_cap)
    w = torch.where(keep, w, torch.zeros_like(w))
    token_loss = ppo_token_losses_loop(lp64, prox64, adv, mask, cfg.algorithm.clip_low, cfg.algorithm.clip_high,
                                       cfg.algorithm.dual_clip, w)
    loss = aggregate_loop(token_loss, mask, cfg.algorithm.loss_agg)
    if ref_model is not None and not cfg.kl.in_reward:
        loss += cfg.kl.coef * aggregate_loop(kl_token_loop(lp64, ref64, cfg.kl.kind), mask, cfg.algorithm.loss_agg)
    if cfg.algorithm.entropy_coef:
        loss -= cfg.algorithm.entropy_coef * aggregate_loop(ent64, mask, cfg.algorithm.loss_agg)

    # gradients: the same loss in plain torch (float32), autograd
    lp = torch.zeros(B, T)
    ent = torch.zeros(B, T)
    for i in range(B):
        t = int(mask[i].sum())
        lp = lp.index_put((torch.full((t,), i), torch.arange(t)), lp_g[i])
        ent = ent.index_put((torch.full((t,), i), torch.arange(t)), ent_g[i])
    prox = (lp.detach() if cfg.algorithm.recompute_logprobs else behav.float())
    a = adv.float()
    ratio = torch.exp(lp - prox)
    tok = torch.maximum(-a * ratio, -a * ratio.clamp(1 - cfg.algorithm.clip_low, 1 + cfg.algorithm.clip_high))
    if cfg.algorithm.dual_clip is not None:
        tok = torch.where(a < 0, torch.minimum(tok, -a * cfg.algorithm.dual_clip), tok)
    tok = tok * w.float()
    total = _agg_torch(tok, mask, cfg.algorithm.loss_agg)
    if ref_model is not None and not cfg.kl.in_reward:
        lr = ref64.float() - lp                                    # log (π_ref / π)
        kl = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.expm1(lr) - lr}[cfg.kl.kind]
        total = total + cfg.kl.coef * _agg_torch(kl, mask, cfg.algorithm.loss_agg)
    if cfg.algorithm.entropy_coef:
        total = total - cfg.algorithm.entropy_coef * _agg_torch(ent, mask, cfg.algorithm.loss_agg)
    policy.zero_grad()
    total.backward()
    pgrads = {n: p.grad.detach().clone() for n, p in policy.named_parameters()}
    vloss, cgrads = None, None
    if critic is not None:
        vloss = aggregate_loop(value_token_losses_loop(v_old, v_old, returns, cfg.critic.value_clip), mask, cfg.algorithm.loss_agg)
        v = torch.zeros(B, T)
        for i in range(B):
            t = int(mask[i].sum())
            v = v.index_put((torch.full((t,), i), torch.arange(t)), v_g[i])
        old, ret = v_old.float(), returns.float()
        e = (v - ret) ** 2
        if cfg.critic.value_clip is not None:
            vc = old + (v - old).clamp(-cfg.critic.value_clip, cfg.critic.value_clip)
            e = torch.maximum(e, (vc - ret) ** 2)
        critic.zero_grad()
        (0.5 * _agg_torch(e, mask, cfg.algorithm.loss_agg)).backward()
        cgrads = {n: p.grad.detach().clone() for n, p in critic.named_parameters()}
    return loss, vloss, pgrads, cgrads


@pytest.mark.parametrize("case", list(CASES))
def test_full_step_matches_the_twins(tiny_model_dir, case):
    from transformers import AutoModelForCausalLM

    tr = make_trainer(tiny_model_dir, micro_batch_samples=3, critic_max_grad_norm=1e6, **CASES[case])
    ref_model = None
    if tr.reference is not None:
        # A reference that differs from the policy, so the KL term and its gradient are not 0.
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in tr.reference.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        ref_model = tr.reference.model
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy.train()
    critic = copy.deepcopy(tr.critic) if tr.critic is not None else None
    batch = make_batch(spread=0.3)
    for smp in batch.samples:          # rewards of both signs: negative advantages under GAE too
        smp.reward -= 0.5
    loss, vloss, pgrads, cgrads = reference(tr, batch, policy, ref_model, critic)
    stats = tr.step(batch)
    assert stats["loss"] == pytest.approx(loss, abs=1e-5)
    if not tr.cfg.algorithm.recompute_logprobs:
        assert stats["pg_clip_fraction"] > 0 and stats["pg_dual_clip_fraction"] > 0   # both clips act
    if tr.cfg.kl.in_reward:
        assert stats["proximal_pass"] == 1.0 and stats["sanity_ratio_dev_max"] <= 1e-6
    assert_close_dicts({n: p.grad for n, p in tr.model.named_parameters()}, pgrads, atol=1e-5, rtol=1e-4)
    if critic is not None:
        assert stats["vf_loss"] == pytest.approx(vloss, abs=1e-5)
        assert_close_dicts({n: p.grad for n, p in tr.critic.named_parameters()}, cgrads, atol=1e-5, rtol=1e-4)
