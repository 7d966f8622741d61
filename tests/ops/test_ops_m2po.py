"""M2PO second-moment masking against the remove-the-largest-one-at-a-time loop twin."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_twins import m2po_loop

from ops import m2po_mask


def _batch(B, T, seed, spread, p):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(B, T, generator=g) * 3
    prox = behav + torch.randn(B, T, generator=g) * spread
    mask = torch.rand(B, T, generator=g) < p
    return prox, behav, mask


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(1, 8), seed=st.integers(0, 2**16),
       spread=st.sampled_from([0.05, 0.3, 1.0]), p=st.sampled_from([0.0, 0.5, 1.0]),
       tau=st.sampled_from([0.0, 0.01, 0.04, 0.5, 100.0]))
def test_matches_loop_twin(B, T, seed, spread, p, tau):
    prox, behav, mask = _batch(B, T, seed, spread, p)
    keep, stats = m2po_mask(prox, behav, mask, tau)
    ref = m2po_loop(prox, behav, mask, tau)
    assert torch.equal(keep, ref)
    assert not (keep & ~mask).any()                        # only counted tokens are kept
    n = int(mask.sum())
    sq = (prox - behav).square()
    if n:
        assert stats["m2po_second_moment"] == pytest.approx(float(sq[mask].mean()), rel=1e-5)
        assert stats["m2po_masked_fraction"] == pytest.approx(1 - int(keep.sum()) / n)
    if keep.any():
        kept_m2 = float(sq[keep].mean())
        assert kept_m2 <= tau * (1 + 1e-6)                 # the rule's promise
        assert stats["m2po_second_moment_kept"] == pytest.approx(kept_m2, rel=1e-5)


def test_removes_the_extreme_tokens_only():
    # log w = 0.1 on six tokens, 2.0 on one: M2 = (6·0.01 + 4)/7 ≈ 0.58 > 0.04; dropping the
    # outlier leaves M2 = 0.01 <= 0.04, so exactly that token goes.
    prox = torch.tensor([[0.1, 0.1, 0.1, 2.0], [0.1, 0.1, 0.1, 0.0]])
    behav = torch.zeros(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    keep, stats = m2po_mask(prox, behav, mask, 0.04)
    assert keep.tolist() == [[True, True, True, False], [True, True, True, False]]
    assert stats["m2po_masked_fraction"] == pytest.approx(1 / 7)
    assert stats["m2po_second_moment_kept"] == pytest.approx(0.01, rel=1e-5)
    # on-policy data (w = 1) keeps everything at any threshold
    keep, stats = m2po_mask(behav, behav, mask, 0.0)
    assert torch.equal(keep, mask != 0) and stats["m2po_masked_fraction"] == 0.0
    with pytest.raises(ValueError):
        m2po_mask(prox, behav, mask, -1.0)
