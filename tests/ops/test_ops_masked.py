"""Masked statistics and loss aggregation against loop twins; padding invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_twins import aggregate_loop, loss_normalizer_loop, masked_mean_loop, masked_var_loop

from ops import (
    LOSS_AGG_MODES,
    aggregate_loss,
    loss_normalizer,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)


def _data(B=4, T=7, seed=0, p=0.7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < p
    return x, mask


@st.composite
def batches(draw, min_b=1, max_b=5, max_t=9):
    B = draw(st.integers(min_b, max_b))
    T = draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**16))
    p = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    return _data(B, T, seed, p)


def _pad(x, mask, k=3, fill=float("nan")):
    """Append k padding columns whose values are garbage (NaN) and mask 0."""
    B = x.shape[0]
    return (
        torch.cat([x, torch.full((B, k), fill, dtype=x.dtype)], dim=1),
        torch.cat([mask, torch.zeros(B, k, dtype=mask.dtype)], dim=1),
    )


@settings(max_examples=40, deadline=None)
@given(batches())
def test_masked_stats_match_loops(batch):
    x, mask = batch
    assert masked_sum(x, mask).item() == pytest.approx(sum(float(v) for v in x[mask]), abs=1e-5)
    assert masked_mean(x, mask).item() == pytest.approx(masked_mean_loop(x, mask), abs=1e-5)
    assert masked_var(x, mask).item() == pytest.approx(masked_var_loop(x, mask), abs=1e-5)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(masked_var_loop(x, mask, False), abs=1e-5)
    per_row = masked_mean(x, mask, dim=-1)
    assert per_row.shape == (x.shape[0],)
    for b in range(x.shape[0]):
        assert per_row[b].item() == pytest.approx(masked_mean_loop(x[b : b + 1], mask[b : b + 1]), abs=1e-5)


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]))
def test_aggregate_matches_loop_and_ignores_padding(batch, agg):
    x, mask = batch
    out = aggregate_loss(x, mask, agg)
    assert out.dim() == 0
    assert out.item() == pytest.approx(aggregate_loop(x, mask, agg), abs=1e-5)
    xp, mp = _pad(x, mask)
    assert aggregate_loss(xp, mp, agg).item() == pytest.approx(out.item(), abs=1e-6)
    # An appended all-masked row contributes nothing.
    xr = torch.cat([x, torch.full((1, x.shape[1]), 5.0)])
    mr = torch.cat([mask, torch.zeros(1, x.shape[1], dtype=torch.bool)])
    assert aggregate_loss(xr, mr, agg).item() == pytest.approx(out.item(), abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(batches(), st.booleans())
def test_whiten_padding_invariance_and_permutation(batch, shift_mean):
    x, mask = batch
    w = masked_whiten(x, mask, shift_mean=shift_mean)
    assert w.shape == x.shape
    assert torch.isfinite(w).all()
    assert (w[~mask] == 0).all()
    xp, mp = _pad(x, mask)
    torch.testing.assert_close(masked_whiten(xp, mp, shift_mean=shift_mean)[:, : x.shape[1]], w)
    perm = torch.randperm(x.shape[0])
    torch.testing.assert_close(masked_whiten(x[perm], mask[perm], shift_mean=shift_mean), w[perm])
    if mask.sum() >= 2:
        vals = w[mask].double()
        mu, var = masked_mean_loop(x, mask), masked_var_loop(x, mask)
        if shift_mean:
            assert vals.mean().item() == pytest.approx(0.0, abs=1e-5)
        if var > 1e-3:
            assert vals.var().item() == pytest.approx(var / (var + 1e-8), abs=1e-4)
        expect = (x[mask].double() - mu) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mu)
        torch.testing.assert_close(vals, expect, atol=1e-4, rtol=1e-4)


def test_empty_and_nan_padding():
    x = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])
    m = torch.tensor([[1, 0], [0, 1]])
    assert masked_sum(x, m).item() == 3.0
    assert masked_mean(x, m).item() == 1.5
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([1.0, 2.0]))
    none = torch.zeros_like(m)
    assert masked_mean(x, none).item() == 0.0
    assert masked_var(x, none).item() == 0.0
    assert masked_var(torch.ones(1, 1), torch.ones(1, 1)).item() == 0.0  # one token: unbiased var := 0
    assert (masked_whiten(x, none) == 0).all()
    xg = x.clone().requires_grad_(True)
    masked_mean(xg, m).backward()
    torch.testing.assert_close(xg.grad, torch.tensor([[0.5, 0.0], [0.0, 0.5]]))


def test_float_mask_weights_and_bf16():
    x, mask = _data()
    torch.testing.assert_close(masked_mean(x, mask.float()), masked_mean(x, mask))
    out = masked_mean(x.bfloat16(), mask)
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(masked_mean_loop(x.bfloat16().float(), mask), abs=1e-6)
    assert masked_mean(x.double(), mask).dtype == torch.float64


def test_aggregate_rejects_unknown_mode():
    x, mask = _data()
    with pytest.raises(ValueError):
        aggregate_loss(x, mask, "sum")


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(LOSS_AGG_MODES), st.booleans())
def test_loss_normalizer_matches_loop_and_aggregate(batch, agg, float_mask):
    """The normalizer is what aggregate_loss divides by: passing it changes nothing."""
    x, mask = batch
    if float_mask:  # mask values are weights
        mask = mask.float() * torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
    n = loss_normalizer(mask, agg)
    assert isinstance(n, float)
    assert n == pytest.approx(loss_normalizer_loop(mask, agg), rel=1e-6)
    assert aggregate_loss(x, mask, agg, normalizer=n).item() == pytest.approx(
        aggregate_loss(x, mask, agg).item(), abs=1e-5)


def test_loss_normalizer_of_an_empty_mask_is_one():
    x = torch.randn(2, 3)
    for agg in LOSS_AGG_MODES:
        empty = torch.zeros(2, 3, dtype=torch.bool)
        assert loss_normalizer(empty, agg) == 1.0
        assert aggregate_loss(x, empty, agg, normalizer=loss_normalizer(empty, agg)).item() == 0.0
    with pytest.raises(ValueError):
        loss_normalizer(torch.ones(2, 3), "sum")


@settings(max_examples=40, deadline=None)
@given(batches(min_b=2, max_b=7), st.sampled_from(LOSS_AGG_MODES), st.integers(1, 3))
def test_aggregate_with_global_normalizer_sums_over_micro_batches(batch, agg, micro):
    """Micro-batch losses with loss_normalizer(whole batch) add up to the full-batch loss."""
    x, mask = batch
    mask[0] = False  # an empty row
    full = aggregate_loss(x, mask, agg)
    n = loss_normalizer(mask, agg)
    B = x.shape[0]
    parts = sum(aggregate_loss(x[i : i + micro], mask[i : i + micro], agg, normalizer=n)
                for i in range(0, B, micro))
    assert parts.item() == pytest.approx(full.item(), abs=1e-5)
