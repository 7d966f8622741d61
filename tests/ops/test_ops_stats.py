"""merge_stats: the stats of a batch cut into row parts, combined, equal the stats of the whole batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ops import IS_MODES, STAT_REDUCTIONS, importance_weights, merge_stats, ppo_policy_loss


def _batch(B, T, seed, p):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(B, T, generator=g) * 3
    prox = behav + torch.randn(B, T, generator=g) * 0.7
    logprobs = prox + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < p
    return logprobs, prox, behav, adv, mask


def _cuts(B: int, sizes: list[int]) -> list[slice]:
    out, lo = [], 0
    for n in sizes:
        if lo >= B:
            break
        out.append(slice(lo, min(B, lo + n)))
        lo += n
    if lo < B:
        out.append(slice(lo, B))
    return out


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 6), T=st.integers(1, 7), seed=st.integers(0, 2**16),
       p=st.sampled_from([0.0, 0.4, 0.9, 1.0]), mode=st.sampled_from(IS_MODES),
       sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_merged_parts_equal_the_whole_batch(B, T, seed, p, mode, sizes):
    logprobs, prox, behav, adv, mask = _batch(B, T, seed, p)
    w, loss_mask, is_whole = importance_weights(prox, behav, mask, mode, 1.5)
    _, pg_whole = ppo_policy_loss(logprobs, prox, adv, loss_mask, is_weights=w, dual_clip=3.0)
    is_parts, pg_parts = [], []
    for rows in _cuts(B, sizes):
        w_k, lm_k, s_k = importance_weights(prox[rows], behav[rows], mask[rows], mode, 1.5)
        # Every mode is row-local, so a part's weights are the whole batch's rows (what a
        # trainer that computes them once per micro-batch relies on).
        torch.testing.assert_close(w_k, w[rows])
        assert torch.equal(lm_k, loss_mask[rows])
        is_parts.append((s_k, int((mask[rows] != 0).sum())))
        _, pg_k = ppo_policy_loss(logprobs[rows], prox[rows], adv[rows], lm_k, is_weights=w_k, dual_clip=3.0)
        pg_parts.append((pg_k, int((lm_k != 0).sum())))
    for whole, parts in ((is_whole, is_parts), (pg_whole, pg_parts)):
        merged = merge_stats(parts)
        assert merged.keys() == whole.keys()
        for k in whole:
            assert merged[k] == pytest.approx(float(whole[k]), abs=1e-6, rel=1e-5), k


def test_rules_and_empty_parts():
    a = {"x": 1.0, "ratio_max": 2.0, "ratio_min": 0.5}
    b = {"x": 4.0, "ratio_max": 1.5, "ratio_min": 0.9}
    empty = {"x": 0.0, "ratio_max": 1.0, "ratio_min": 1.0}  # defaults of a part that counted nothing
    merged = merge_stats([(a, 1), (empty, 0), (b, 3)])
    # token-weighted mean (1·1 + 3·4) / 4 = 3.25; max/min over the parts that counted a token
    assert merged == {"x": 3.25, "ratio_max": 2.0, "ratio_min": 0.5}
    assert merge_stats([(empty, 0), (empty, 0)]) == empty
    assert set(STAT_REDUCTIONS.values()) == {"max", "min", "ess"}
    with pytest.raises(ValueError):
        merge_stats([])
    with pytest.raises(ValueError):
        merge_stats([(a, 1), ({"x": 1.0}, 1)])
