"""Importance weights: every mode against the loop twin, caps, masks, stats."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_twins import importance_loop

from ops import IS_MODES, importance_weights


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
