"""Reward shaping, running moments, KL controllers, PF-PPO weights."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_twins import shape_token_rewards_loop

from ops import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    batch_normalize,
    clip_rewards,
    last_token_index,
    length_penalty,
    pf_ppo_resample,
    pf_ppo_weights,
    shape_token_rewards,
)

_shape_loop = shape_token_rewards_loop


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), B=st.integers(1, 5), T=st.integers(1, 8), coef=st.sampled_from([0.0, 0.05]))
def test_shape_token_rewards_matches_loop(seed, B, T, coef):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.6
    kl = torch.randn(B, T, generator=g)
    out = shape_token_rewards(scores, mask, kl, coef)
    torch.testing.assert_close(out.double(), _shape_loop(scores, mask, kl, coef), atol=1e-6, rtol=1e-6)
    # padding (NaN kl, mask 0) appended on either side changes nothing on the counted tokens
    pad_kl = torch.full((B, 2), float("nan"))
    pad_m = torch.zeros(B, 2, dtype=torch.bool)
    right = shape_token_rewards(scores, torch.cat([mask, pad_m], 1), torch.cat([kl, pad_kl], 1), coef)
    left = shape_token_rewards(scores, torch.cat([pad_m, mask], 1), torch.cat([pad_kl, kl], 1), coef)
    torch.testing.assert_close(right[:, :T], out)
    torch.testing.assert_close(left[:, 2:], out)
    assert (right[:, T:] == 0).all() and (left[:, :2] == 0).all()


def test_shape_token_rewards_left_right_examples():
    scores = torch.tensor([1.0, 2.0, 3.0])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    out = shape_token_rewards(scores, mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]))
    idx, has = last_token_index(mask)
    assert idx.tolist() == [1, 2, 0] and has.tolist() == [True, True, False]


def test_clip_rewards():
    torch.testing.assert_close(clip_rewards(torch.tensor([-5.0, 0.5, 7.0]), 2.0), torch.tensor([-2.0, 0.5, 2.0]))
    x = torch.tensor([-5.0, 7.0])
    assert clip_rewards(x, None) is x
    with pytest.raises(ValueError):
        clip_rewards(x, 0.0)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=0, max_size=12), min_size=1, max_size=6)
)
def test_running_moments_merge_exactly(batches):
    rm = RunningMoments()
    for b in batches:
        rm.update(torch.tensor(b, dtype=torch.float64))
    flat = [x for b in batches for x in b]
    assert rm.count == len(flat)
    if flat:
        mean = sum(flat) / len(flat)
        assert rm.mean == pytest.approx(mean, abs=1e-9 * (1 + max(abs(x) for x in flat)))
        if len(flat) > 1:
            var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
            assert rm.var == pytest.approx(var, rel=1e-9, abs=1e-6)
    # two accumulators merged == one accumulator over everything
    a, b = RunningMoments(), RunningMoments()
    for i, batch in enumerate(batches):
        (a if i % 2 else b).update(torch.tensor(batch, dtype=torch.float64))
    merged = a.merge(b)
    assert merged.count == rm.count
    assert merged.mean == pytest.approx(rm.mean, abs=1e-6)
    assert merged.var == pytest.approx(rm.var, rel=1e-9, abs=1e-6)


def test_running_moments_mask_normalize_and_state():
    rm = RunningMoments()
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, -99.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    mean, std = rm.update(x, mask)
    assert mean == pytest.approx(2.5) and std == pytest.approx(math.sqrt(5 / 3))
    torch.testing.assert_close(rm.normalize(torch.tensor([2.5])), torch.tensor([0.0]))
    copy = RunningMoments()
    copy.load_state_dict(rm.state_dict())
    assert copy.state_dict() == rm.state_dict()


def test_adaptive_kl_controller_matches_ziegler():
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    v = c.update(current_kl=9.0, n_steps=256)  # error 0.5 -> clipped to 0.2
    assert v == pytest.approx(0.1 * (1 + 0.2 * 256 / 10_000))
    v2 = c.update(current_kl=5.4, n_steps=256)  # error −0.1
    assert v2 == pytest.approx(v * (1 - 0.1 * 256 / 10_000))
    assert c.update(6.0, 512) == pytest.approx(v2)  # on target: unchanged
    restored = AdaptiveKLController(1.0, 1.0, 1.0)
    restored.load_state_dict(c.state_dict())
    assert restored.value == c.value and restored.target_kl == 6.0 and restored.horizon == 10_000
    for _ in range(200):
        c.update(100.0, 1000)
    assert c.value > 0.1  # large KL keeps pushing β up, at most 20 % × n/horizon per step
    f = FixedKLController(0.05)
    assert f.update(100.0, 10) == 0.05 and f.value == 0.05
    f2 = FixedKLController(0.0)
    f2.load_state_dict(f.state_dict())
    assert f2.value == 0.05
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, 0.0, 10)


def test_pf_ppo_weights_match_verl():
    s = torch.tensor([1.0, -2.0, 0.5, -2.0, 0.0])
    torch.testing.assert_close(pf_ppo_weights(s, "pow", 2.0), torch.tensor([1.0, 4.0, 0.25, 4.0, 0.0]) + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(s, "max_min"), torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0]) + 1e-8)
    torch.testing.assert_close(pf_ppo_weights(s, "max_random"), torch.tensor([0.4, 0.1, 0.1, 0.1, 0.1]) + 1e-8)
    w = pf_ppo_weights(s, "max_min")
    idx = pf_ppo_resample(w, generator=torch.Generator().manual_seed(0))
    assert idx.shape == (5,) and set(idx.tolist()) <= {0, 1, 3}
    assert torch.equal(idx, pf_ppo_resample(w, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError):
        pf_ppo_weights(s, "min")


def test_length_penalty_and_batch_normalize():
    scores = torch.tensor([1.0, 0.0, 1.0])
    lengths = torch.tensor([2, 4, 4])
    # s − 0.1 · n / 4
    torch.testing.assert_close(length_penalty(scores, lengths, 0.1, 4), torch.tensor([0.95, -0.1, 0.9]))
    assert length_penalty(scores, lengths, 0.0, 4) is scores
    with pytest.raises(ValueError):
        length_penalty(scores, lengths, 0.1, 0)
    out = batch_normalize(torch.tensor([1.0, 2.0, 3.0]))
    torch.testing.assert_close(out, torch.tensor([-1.0, 0.0, 1.0]), atol=1e-5, rtol=0)
    assert batch_normalize(torch.tensor([5.0])).tolist() == [0.0]
    assert batch_normalize(torch.tensor([2.0, 2.0])).tolist() == [0.0, 0.0]


def test_overlong_penalty_is_dapos_piecewise_linear_punishment():
    """DAPO §3.4 with n_max = 16, buffer 4, factor 0.5: nothing up to 12 tokens, then linear to
    −0.5 at the limit."""
    from ops import overlong_penalty

    lengths = torch.tensor([0.0, 12.0, 13.0, 14.0, 16.0, 20.0])
    scores = torch.ones(6)
    out = overlong_penalty(scores, lengths, max_length=16, buffer=4, factor=0.5)
    expected = [1.0 - 0.5 * min(1.0, max(0.0, (n - 12) / 4)) for n in lengths.tolist()]
    torch.testing.assert_close(out, torch.tensor(expected))
    assert overlong_penalty(scores, lengths, 16, 0) is scores            # off
    for bad in (-1, 17):
        with pytest.raises(ValueError, match="buffer"):
            overlong_penalty(scores, lengths, 16, bad)
