"""Importance weights: every mode against the loop twin, caps, masks, stats."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_twins import behavior_anchored_loop, importance_loop

from ops import IS_MODES, behavior_anchored_weights, importance_weights, ppo_policy_loss


def _batch(B=4, T=6, seed=0, spread=0.8, p=0.75):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(B, T, generator=g) * 3
    prox = behav + torch.randn(B, T, generator=g) * spread
    mask = torch.rand(B, T, generator=g) < p
    return prox, behav, mask


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), mode=st.sampled_from(IS_MODES), cap=st.sampled_from([1.5, 2.0, 5.0]),
       veto=st.sampled_from([None, 0.3, 0.6]))
def test_modes_match_loop_twin(seed, mode, cap, veto):
    prox, behav, mask = _batch(seed=seed)
    w, m, stats = importance_weights(prox, behav, mask, mode, cap, veto=veto)
    w_ref, keep_ref = importance_loop(prox, behav, mask, mode, cap, veto=veto)
    assert m.dtype == mask.dtype and torch.equal(m.bool(), keep_ref)
    torch.testing.assert_close(w.double(), w_ref, atol=1e-5, rtol=1e-5)
    assert not w.requires_grad
    if mode in ("tis", "seq_tis"):
        assert (w <= cap).all()  # seeds' check: TIS weights never exceed the cap
    # stats on the raw weights over the counted tokens
    raw = [math.exp(float(a) - float(b)) for a, b, k in zip(prox.flatten(), behav.flatten(), mask.flatten(), strict=True) if k]
    if raw:
        assert stats["is_weight_mean"] == pytest.approx(sum(raw) / len(raw), rel=1e-5)
        assert stats["is_weight_max"] == pytest.approx(max(raw), rel=1e-5)
        ess = sum(raw) ** 2 / (len(raw) * sum(x * x for x in raw))
        assert stats["is_ess_ratio"] == pytest.approx(ess, rel=1e-5)
        kl = sum(x - 1 - math.log(x) for x in raw) / len(raw)
        assert stats["mismatch_kl"] == pytest.approx(kl, rel=1e-4, abs=1e-6)
        masked = sum(1 for b, t in mask.nonzero().tolist() if not keep_ref[b, t])
        assert stats["is_masked_fraction"] == pytest.approx(masked / len(raw))
    assert 0.0 < stats["is_ess_ratio"] <= 1.0 + 1e-6


def test_on_policy_weights_are_one():
    prox, _, mask = _batch()
    for mode in IS_MODES:
        w, m, stats = importance_weights(prox, prox.clone(), mask, mode, 2.0)
        assert torch.equal(m, mask)
        assert (w[mask] == 1).all() and (w[~mask] == 0).all()
        assert stats["is_ess_ratio"] == pytest.approx(1.0) and stats["mismatch_kl"] == 0.0
        assert stats["is_masked_fraction"] == 0.0


def test_mis_masks_outliers_and_float_mask():
    prox = torch.tensor([[0.0, 2.0, -2.0, 0.5]])
    behav = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, m, stats = importance_weights(prox, behav, mask, "mis", 2.0)
    torch.testing.assert_close(m, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert stats["is_masked_fraction"] == pytest.approx(2 / 3)
    w, m, stats = importance_weights(prox, behav, mask, "tis", 2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, math.exp(-2.0), 0.0]]))
    assert stats["is_truncated_fraction"] == pytest.approx(1 / 3)


def test_seq_modes_use_geometric_mean_and_ignore_padding():
    prox = torch.tensor([[1.0, -1.0, 3.0], [2.0, 2.0, float("nan")]])
    behav = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    w, m, _ = importance_weights(prox, behav, mask, "seq_tis", 5.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 0.0], [5.0, 5.0, 0.0]]))
    w, m, _ = importance_weights(prox, behav, mask, "seq_mis", 5.0)
    assert m.tolist() == [[True, True, False], [False, False, False]]
    assert torch.isfinite(w).all()


def test_geo_mis_rejects_whole_sequences_keeps_the_rest_unweighted_and_vetoes():
    # row 0: log w = (0.3, −0.3) -> geometric mean 1, every token kept with weight 1
    # row 1: log w = (1.0, 1.0) -> geometric mean e > 2: the whole row is rejected
    # row 2: log w = (2.5, −2.6) -> geometric mean e^−0.05 inside [1/2, 2], but token 2 has
    #        w = e^−2.6 ≈ 0.074 < veto 0.1: vetoed (without the veto it is kept)
    prox = torch.tensor([[0.3, -0.3], [1.0, 1.0], [2.5, -2.6]])
    behav = torch.zeros(3, 2)
    mask = torch.ones(3, 2, dtype=torch.bool)
    w, m, stats = importance_weights(prox, behav, mask, "geo_mis", 2.0, veto=0.1)
    assert m.tolist() == [[True, True], [False, False], [False, False]]
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
    assert stats["is_masked_fraction"] == pytest.approx(4 / 6)
    assert stats["is_veto_fraction"] == pytest.approx(2 / 6)
    _, m, stats = importance_weights(prox, behav, mask, "geo_mis", 2.0)
    assert m.tolist() == [[True, True], [False, False], [True, True]]
    assert stats["is_veto_fraction"] == 0.0
    # the veto is geo_mis's: other modes ignore it
    w_tis, _, _ = importance_weights(prox, behav, mask, "tis", 2.0, veto=0.1)
    torch.testing.assert_close(w_tis, torch.exp(prox).clamp(max=2.0))
    with pytest.raises(ValueError):
        importance_weights(prox, behav, mask, "geo_mis", 2.0, veto=0.0)


def test_all_masked_and_bad_arguments():
    prox, behav, _ = _batch()
    w, m, stats = importance_weights(prox, behav, torch.zeros(4, 6, dtype=torch.bool), "tis", 2.0)
    assert (w == 0).all() and not m.any() and stats["is_ess_ratio"] == 1.0
    with pytest.raises(ValueError):
        importance_weights(prox, behav, torch.ones(4, 6), "bogus", 2.0)
    with pytest.raises(ValueError):
        importance_weights(prox, behav, torch.ones(4, 6), "tis", None)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), mode=st.sampled_from(IS_MODES))
def test_behavior_anchored_weights_match_loop_twin(seed, mode):
    prox, behav, mask = _batch(seed=seed)
    w, _, _ = importance_weights(prox, behav, mask, mode, 5.0)
    out = behavior_anchored_weights(w, prox, behav, mask)
    torch.testing.assert_close(out.double(), behavior_anchored_loop(w, prox, behav, mask), atol=1e-6, rtol=1e-5)
    assert not out.requires_grad and (out[~mask] == 0).all()


def test_behavior_anchor_keeps_the_correction_inside_the_sampler_trust_region():
    """At pi_theta = pi_prox, the PPO gradient with the ratio against mu and the anchored weights is
    the decoupled gradient -w A grad(log pi) on every token still within 1 +- eps of mu, and zero on
    a token that already moved past it in its advantage's direction."""
    prox = torch.log(torch.tensor([[0.5, 0.3, 0.9, 0.1]]))
    #             ratio to mu:     1.1   3.0  0.5  0.85 (token 1: already far above mu)
    behav = prox - torch.log(torch.tensor([[1.1, 3.0, 0.5, 0.85]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])      # token 2: A < 0 and already below 1 - eps
    mask = torch.ones(1, 4, dtype=torch.bool)
    w, _, _ = importance_weights(prox, behav, mask, "tis", 5.0)

    def grad(anchor, weights):
        lp = prox.clone().requires_grad_(True)
        loss, _ = ppo_policy_loss(lp, anchor, adv, mask, clip_low=0.2, clip_high=0.2, is_weights=weights,
                                  agg="token_mean")
        loss.backward()
        return lp.grad[0]

    decoupled = grad(prox, w)
    anchored = grad(behav, behavior_anchored_weights(w, prox, behav, mask))
    torch.testing.assert_close(anchored[[0, 3]], decoupled[[0, 3]])   # inside: the same correction
    assert anchored[1] == 0 and anchored[2] == 0                    # outside, in A's direction: none
    assert decoupled[1] != 0 and decoupled[2] != 0                  # the decoupled step pushes on
    # on-policy data (mu = pi_prox): the anchor changes nothing
    torch.testing.assert_close(grad(prox, behavior_anchored_weights(w * 0 + 1, prox, prox, mask)), grad(prox, w * 0 + 1))
