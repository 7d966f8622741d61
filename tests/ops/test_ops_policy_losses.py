"""The policy losses beside PPO's (GSPO, CISPO), IcePop's importance weights and Dr. GRPO's
constant normaliser, each against its slow twin (tests/ops/ops_twins.py): values, gradients, and
what makes each differ from PPO."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_twins import aggregate_loop, cispo_grad_loop, gspo_loop, importance_loop, loss_normalizer_loop

from ops import (
    LOSS_AGG_MODES,
    aggregate_loss,
    cispo_policy_loss,
    gspo_policy_loss,
    importance_weights,
    loss_normalizer,
    ppo_policy_loss,
)

AGGS = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]


def _batch(B=4, T=6, seed=0, spread=0.1, p=0.75, seq_adv=False):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = prox + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    if seq_adv:                                           # an outcome advantage: one per sequence
        adv = adv[:, :1].expand(B, T).clone()
    mask = torch.rand(B, T, generator=g) < p
    mask[0, 0] = True
    return lp, prox, adv, mask


# --- GSPO --------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), agg=st.sampled_from(AGGS), clip=st.sampled_from([(0.01, 0.02), (0.05, 0.05), (0.2, 0.28)]),
       weighted=st.booleans())
def test_gspo_value_matches_the_sequence_level_twin(seed, agg, clip, weighted):
    lp, prox, adv, mask = _batch(seed=seed)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 if weighted else None
    loss, stats = gspo_policy_loss(lp, prox, adv, mask, clip[0], clip[1], w, agg)
    ref = gspo_loop(lp, prox, adv, mask, clip[0], clip[1], w, agg)
    assert loss.item() == pytest.approx(float(ref), abs=1e-9)
    # The ratio stats are the sequence ratio's; a sequence is clipped whole or not at all.
    rows = [[t for t in range(6) if mask[b, t]] for b in range(4)]
    s = [math.exp(sum(float(lp[b, t] - prox[b, t]) for t in ts) / len(ts)) for b, ts in enumerate(rows) if ts]
    assert float(stats["ratio_max"]) == pytest.approx(max(s), rel=1e-9)
    assert float(stats["ratio_min"]) == pytest.approx(min(s), rel=1e-9)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in stats.values())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), clip=st.sampled_from([(0.01, 0.02), (0.2, 0.28)]), weighted=st.booleans())
def test_gspo_token_form_has_the_sequence_gradient(seed, clip, weighted):
    """With one advantage per sequence and seq_mean_token_mean (the paper's setting), the token
    form's gradient is exactly that of the sequence ratio itself: the twin's, by autograd."""
    lp, prox, adv, mask = _batch(seed=seed, seq_adv=True)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 if weighted else None
    if w is not None:                                     # a sequence weight (seq_tis / geo_mis)
        w = w[:, :1].expand_as(w).clone()
    x = lp.clone().requires_grad_(True)
    (g_fast,) = torch.autograd.grad(gspo_policy_loss(x, prox, adv, mask, clip[0], clip[1], w, "seq_mean_token_mean")[0], x)
    y = lp.clone().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(gspo_loop(y, prox, adv, mask, clip[0], clip[1], w, "seq_mean_token_mean"), y)
    torch.testing.assert_close(g_fast, g_ref, atol=1e-10, rtol=1e-8)
    assert (g_fast[~mask] == 0).all()


def test_gspo_clips_whole_sequences_where_ppo_clips_tokens():
    """One sequence whose mean log-ratio is small but whose tokens move a lot: PPO clips some of
    its tokens, GSPO none; a sequence that moved as a whole is clipped on every token."""
    lp = torch.tensor([[0.3, -0.3, 0.0, 0.0], [0.3, 0.3, 0.3, 0.3]], dtype=torch.float64)
    prox = torch.zeros(2, 4, dtype=torch.float64)
    adv = torch.ones(2, 4, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    x = lp.clone().requires_grad_(True)
    loss, stats = gspo_policy_loss(x, prox, adv, mask, 0.2, 0.2)
    (g,) = torch.autograd.grad(loss, x)
    assert (g[0] != 0).all() and (g[1] == 0).all()        # row 1: s = e^0.3 > 1.2, A > 0: clipped whole
    assert float(stats["clip_fraction"]) == pytest.approx(0.5)
    _, ppo_stats = ppo_policy_loss(lp, prox, adv, mask, 0.2, 0.2)
    assert float(ppo_stats["clip_fraction"]) == pytest.approx(5 / 8)   # row 0's first token too


def test_gspo_on_policy_is_reinforce():
    lp, _, adv, mask = _batch(seq_adv=True)
    x = lp.clone().requires_grad_(True)
    loss, stats = gspo_policy_loss(x, lp, adv, mask, agg="token_mean")
    (g,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(g, torch.where(mask, -adv / mask.sum(), 0.0))
    assert float(stats["clip_fraction"]) == 0.0 and float(stats["approx_kl"]) == 0.0


# --- CISPO -------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), agg=st.sampled_from(LOSS_AGG_MODES), clip=st.sampled_from([(0.2, 0.2), (0.99, 0.28)]),
       weighted=st.booleans())
def test_cispo_gradient_matches_twin_and_never_vanishes(seed, agg, clip, weighted):
    lp, prox, adv, mask = _batch(seed=seed, spread=0.6)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 if weighted else None
    n = loss_normalizer(mask, agg, norm_tokens=8)
    x = lp.clone().requires_grad_(True)
    loss, stats = cispo_policy_loss(x, prox, adv, mask, clip[0], clip[1], w, agg, normalizer=n)
    (g,) = torch.autograd.grad(loss, x)
    if agg == "token_mean":
        torch.testing.assert_close(g, cispo_grad_loop(lp, prox, adv, mask, clip[0], clip[1], w, n), atol=1e-12, rtol=1e-9)
    # A counted token with A != 0 and w != 0 always has a gradient, clipped or not (PPO's has none).
    live = mask & (adv != 0) & (True if w is None else (w != 0))
    assert (g[live] != 0).all() and (g[~mask] == 0).all()
    r = torch.exp(lp - prox)
    clipped = mask & ((r < 1 - clip[0]) | (r > 1 + clip[1]))
    assert float(stats["clip_fraction"]) == pytest.approx(int(clipped.sum()) / int(mask.sum()), abs=1e-12)


def test_cispo_keeps_the_gradient_ppo_clips_away():
    lp = torch.tensor([[1.0, 0.0]], dtype=torch.float64)  # ratio e ≈ 2.72 on token 0
    prox = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    x = lp.clone().requires_grad_(True)
    (g_ppo,) = torch.autograd.grad(ppo_policy_loss(x, prox, adv, mask, 0.2, 0.28)[0], x)
    (g_cispo,) = torch.autograd.grad(cispo_policy_loss(x, prox, adv, mask, 0.2, 0.28)[0], x)
    assert g_ppo[0, 0] == 0.0                             # PPO: past 1 + ε, no gradient
    assert g_cispo[0, 0] == pytest.approx(-1.28 / 2)      # CISPO: weight clipped to 1 + ε, still learns
    assert g_cispo[0, 1] == pytest.approx(g_ppo[0, 1]) == pytest.approx(-0.5)


# --- IcePop ------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), bounds=st.sampled_from([(0.5, 5.0), (0.8, 1.25), (1.0, 1.0), (0.2, 2.0)]))
def test_icepop_masks_both_sides_like_its_twin(seed, bounds):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(4, 6, generator=g) * 3
    prox = behav + torch.randn(4, 6, generator=g) * 0.5
    mask = torch.rand(4, 6, generator=g) < 0.8
    w, keep, stats = importance_weights(prox, behav, mask, "icepop", cap=None, bounds=bounds)
    w_ref, keep_ref = importance_loop(prox, behav, mask, "icepop", None, bounds=bounds)
    assert torch.equal(keep, keep_ref)
    torch.testing.assert_close(w.double(), w_ref, atol=1e-6, rtol=1e-6)
    raw = torch.exp(prox - behav)
    assert (raw[keep] >= bounds[0] - 1e-6).all() and (raw[keep] <= bounds[1] + 1e-6).all()
    n = int(mask.sum())
    assert float(stats["is_masked_fraction"]) == pytest.approx((n - int(keep.sum())) / n if n else 0.0)


def test_icepop_is_mis_with_its_own_region_and_refuses_a_region_without_one():
    g = torch.Generator().manual_seed(3)
    behav = -torch.rand(3, 5, generator=g) * 3
    prox = behav + torch.randn(3, 5, generator=g) * 0.7
    mask = torch.ones(3, 5, dtype=torch.bool)
    w_ice, keep_ice, _ = importance_weights(prox, behav, mask, "icepop", bounds=(0.5, 2.0))
    w_mis, keep_mis, _ = importance_weights(prox, behav, mask, "mis", cap=2.0)
    assert torch.equal(keep_ice, keep_mis) and torch.equal(w_ice, w_mis)
    _, keep_asym, _ = importance_weights(prox, behav, mask, "icepop", bounds=(0.9, 2.0))
    assert int(keep_asym.sum()) < int(keep_mis.sum())     # the low side alone moved
    for bad in ((0.0, 2.0), (1.5, 2.0), (0.5, 0.9)):
        with pytest.raises(ValueError, match="icepop"):
            importance_weights(prox, behav, mask, "icepop", bounds=bad)


# --- Dr. GRPO's constant normaliser ------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), C=st.sampled_from([None, 1, 7, 64]), micro=st.integers(1, 3))
def test_seq_mean_token_sum_norm_is_a_sum_over_a_constant(seed, C, micro):
    lp, prox, adv, mask = _batch(seed=seed)
    mask[1] = False                                        # an empty row counts nowhere
    agg = "seq_mean_token_sum_norm"
    n = loss_normalizer(mask, agg, norm_tokens=C)
    assert n == pytest.approx(loss_normalizer_loop(mask, agg, norm_tokens=C))
    whole = aggregate_loss(adv, mask, agg, normalizer=n)
    assert whole.item() == pytest.approx(aggregate_loop(adv, mask, agg, norm_tokens=C), abs=1e-12)
    if C is None:                                          # without a normalizer: the mask's length
        assert aggregate_loss(adv, mask, agg).item() == pytest.approx(whole.item(), abs=1e-12)
    parts = sum(aggregate_loss(adv[i:i + micro], mask[i:i + micro], agg, normalizer=n) for i in range(0, 4, micro))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-12)
    # No length normaliser: a token of a long sequence weighs what a token of a short one does.
    x = lp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ppo_policy_loss(x, x.detach(), torch.ones_like(x), mask, agg=agg, normalizer=n)[0], x)
    assert torch.allclose(g[mask], torch.full_like(g[mask], -1.0 / n))
    with pytest.raises(ValueError):
        loss_normalizer(mask, agg, norm_tokens=0)
