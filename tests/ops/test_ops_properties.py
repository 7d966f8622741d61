"""Cross-cutting properties of every [B, T] + mask function: padding (left or right, with garbage
values) changes nothing, and permuting rows permutes the results (or leaves scalars unchanged)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ops import (
    cispo_policy_loss,
    entropy_loss,
    gae,
    gspo_policy_loss,
    importance_weights,
    kl_loss,
    masked_whiten,
    ppo_policy_loss,
    reinforce_pp_advantages,
    shape_token_rewards,
    value_loss,
    vtrace,
)

AGGS = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]


def _per_token_fns(agg):
    """name -> f(a, b, c, d, mask, scores) returning a tuple of [B, T] tensors, [B] tensors or scalars."""
    return {
        "gae": lambda a, b, c, d, m, s: gae(a, b, m, 0.99, 0.9),
        "reinforce_pp": lambda a, b, c, d, m, s: (reinforce_pp_advantages(a, m, 0.97),),
        "vtrace": lambda a, b, c, d, m, s: vtrace(c, d, a, b, m, 0.99, 1.0, 1.0),
        "importance_tis": lambda a, b, c, d, m, s: importance_weights(d, c, m, "tis", 2.0)[:2],
        "importance_seq_mis": lambda a, b, c, d, m, s: importance_weights(d, c, m, "seq_mis", 1.5)[:2],
        "importance_icepop": lambda a, b, c, d, m, s: importance_weights(d, c, m, "icepop", bounds=(0.8, 1.3))[:2],
        "ppo": lambda a, b, c, d, m, s: (ppo_policy_loss(d, c, a, m, 0.2, 0.28, 3.0, b.abs(), agg)[0],),
        "gspo": lambda a, b, c, d, m, s: (gspo_policy_loss(d, c, a, m, 0.05, 0.08, b.abs(), agg)[0],),
        "cispo": lambda a, b, c, d, m, s: (cispo_policy_loss(d, c, a, m, 0.2, 0.28, b.abs(), agg)[0],),
        "value": lambda a, b, c, d, m, s: (value_loss(a, b, c, m, 0.2, agg)[0],),
        "kl": lambda a, b, c, d, m, s: (kl_loss(d, c, m, "k3", agg)[0],),
        "entropy": lambda a, b, c, d, m, s: (entropy_loss(b.abs(), m, agg)[0],),
        "whiten": lambda a, b, c, d, m, s: (masked_whiten(a, m),),
        "shape_rewards": lambda a, b, c, d, m, s: (shape_token_rewards(s, m, a, 0.1),),
    }


def _inputs(B, T, seed, p):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    c = -torch.rand(B, T, generator=g) * 3
    d = c + torch.randn(B, T, generator=g) * 0.3
    mask = torch.rand(B, T, generator=g) < p
    scores = torch.randn(B, generator=g)
    return a, b, c, d, mask, scores


def _pad(tensors, mask, k, left):
    B = mask.shape[0]
    garbage = torch.full((B, k), float("nan"))
    cat = (lambda x, y: torch.cat([y, x], 1)) if left else (lambda x, y: torch.cat([x, y], 1))
    return [cat(t, garbage) for t in tensors], cat(mask, torch.zeros(B, k, dtype=torch.bool))


def _close(x, y):
    if x.dim() == 0 or x.dtype == torch.bool:
        assert torch.equal(x, y) if x.dtype == torch.bool else x.item() == pytest.approx(y.item(), abs=1e-5)
    else:
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 4),
    T=st.integers(1, 10),
    seed=st.integers(0, 2**16),
    p=st.sampled_from([0.5, 0.9, 1.0]),
    k=st.integers(1, 3),
    agg=st.sampled_from(AGGS),
)
def test_padding_and_row_permutation(B, T, seed, p, k, agg):
    a, b, c, d, mask, scores = _inputs(B, T, seed, p)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
    for name, fn in _per_token_fns(agg).items():
        base = fn(a, b, c, d, mask, scores)
        for left in (False, True):
            (pa, pb, pc, pd), pm = _pad([a, b, c, d], mask, k, left)
            padded = fn(pa, pb, pc, pd, pm, scores)
            for x, y in zip(base, padded, strict=True):
                if x.dim() == 2:
                    y = y[:, k:] if left else y[:, :T]
                assert torch.isfinite(y.float()).all(), name
                _close(x, y)
        permuted = fn(a[perm], b[perm], c[perm], d[perm], mask[perm], scores[perm])
        for x, y in zip(base, permuted, strict=True):
            _close(x[perm] if x.dim() == 2 else x, y)
