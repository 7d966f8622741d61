"""GAE / group advantages / REINFORCE++ / V-trace against loop twins; padding semantics."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_twins import gae_compact_loop, gae_loop, group_advantages_loop, returns_to_go_loop, vtrace_sum

from ops import (
    discounted_reverse_cumsum,
    gae,
    group_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    returns_to_go,
    vtrace,
)


def _traj(B=3, T=8, seed=0, p=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype)
    mask = torch.rand(B, T, generator=g) < p
    return r, v, mask


def _layout(mask_kind: str, lengths: list[int], T: int) -> torch.Tensor:
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        if mask_kind == "right":
            mask[b, :n] = True
        else:
            mask[b, T - n :] = True
    return mask


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130, 200, 4100])
@pytest.mark.parametrize("g", [0.0, 0.5, 0.95, 1.0])
def test_discounted_reverse_cumsum_matches_loop(T, g):
    x = torch.randn(3, T, dtype=torch.float64)
    ref = torch.zeros_like(x)
    acc = torch.zeros(3, dtype=torch.float64)
    for t in reversed(range(T)):
        acc = x[:, t] + g * acc
        ref[:, t] = acc
    torch.testing.assert_close(discounted_reverse_cumsum(x, g), ref)
    torch.testing.assert_close(discounted_reverse_cumsum(x, g, block=4), ref)


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 5),
    T=st.integers(1, 90),
    seed=st.integers(0, 2**16),
    p=st.sampled_from([0.0, 0.4, 0.9, 1.0]),
    gamma=st.sampled_from([1.0, 0.99, 0.5]),
    lam=st.sampled_from([1.0, 0.95, 0.0]),
)
def test_gae_matches_both_loop_twins(B, T, seed, p, gamma, lam):
    r, v, mask = _traj(B, T, seed, p)
    adv, ret = gae(r, v, mask, gamma, lam)
    assert adv.shape == ret.shape == (B, T) and adv.dtype == torch.float32
    ref_adv, ref_ret = gae_loop(r, v, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), ref_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, atol=1e-5, rtol=1e-5)
    adv2, ret2 = gae_compact_loop(r, v, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), adv2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.double(), ret2, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4))
def test_gae_left_right_padding_equal_unpadded(seed, lengths):
    """Left and right padding give, on counted tokens, the values of each unpadded sequence alone."""
    T = 12
    g = torch.Generator().manual_seed(seed)
    for b, n in enumerate(lengths):
        r1 = torch.randn(1, n, generator=g)
        v1 = torch.randn(1, n, generator=g)
        alone_adv, alone_ret = gae(r1, v1, torch.ones(1, n), 0.99, 0.95)
        for side in ("right", "left"):
            rows = [0] if side == "right" else [T - n]
            mask = _layout(side, [n], T)
            r = torch.full((1, T), float("nan"))
            v = torch.full((1, T), float("nan"))
            r[mask], v[mask] = r1.flatten(), v1.flatten()
            adv, ret = gae(r, v, mask, 0.99, 0.95)
            torch.testing.assert_close(adv[mask].reshape(1, n), alone_adv)
            torch.testing.assert_close(ret[mask].reshape(1, n), alone_ret)
            assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all(), (b, rows)


def test_gae_interior_holes_are_skipped():
    r = torch.tensor([[1.0, 50.0, 2.0, 3.0, 0.0]])
    v = torch.tensor([[0.5, 99.0, 0.25, 0.125, 7.0]])
    holes = torch.tensor([[1, 0, 1, 1, 0]])
    adv, ret = gae(r, v, holes, 0.9, 0.8)
    alone_adv, alone_ret = gae(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.5, 0.25, 0.125]]), torch.ones(1, 3), 0.9, 0.8)
    torch.testing.assert_close(adv[holes.bool()], alone_adv.flatten())
    torch.testing.assert_close(ret[holes.bool()], alone_ret.flatten())


def test_gae_row_permutation_and_bf16():
    r, v, mask = _traj(4, 10, 3, 0.8)
    adv, ret = gae(r, v, mask, 1.0, 0.95)
    perm = torch.tensor([3, 1, 0, 2])
    adv_p, ret_p = gae(r[perm], v[perm], mask[perm], 1.0, 0.95)
    torch.testing.assert_close(adv_p, adv[perm])
    torch.testing.assert_close(ret_p, ret[perm])
    adv_bf, _ = gae(r.bfloat16(), v.bfloat16(), mask, 1.0, 0.95)
    assert adv_bf.dtype == torch.float32
    ref, _ = gae_loop(r.bfloat16(), v.bfloat16(), mask, 1.0, 0.95)
    torch.testing.assert_close(adv_bf.double(), ref, atol=1e-5, rtol=1e-5)


def test_gae_long_sequence_float32_within_1e5():
    r, v, mask = _traj(4, 2000, 5, 1.0)
    r = r * 0.1
    adv, ret = gae(r, v, mask, 1.0, 0.95)
    ref_adv, _ = gae_loop(r, v, mask, 1.0, 0.95)
    assert (adv.double() - ref_adv).abs().max() < 1e-5


def test_gae_sparse_terminal_reward_lambda_one_is_monte_carlo():
    T = 6
    r = torch.zeros(2, T)
    r[:, -1] = torch.tensor([1.0, -1.0])
    v = torch.zeros(2, T)
    adv, ret = gae(r, v, torch.ones(2, T), 1.0, 1.0)
    torch.testing.assert_close(ret, r[:, -1:].expand(2, T))


# --- group advantages --------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(
    G=st.integers(1, 6),
    n_groups=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    method=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
    binary=st.booleans(),
)
def test_group_advantages_match_loop(G, n_groups, seed, method, binary):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(G * n_groups, generator=g)
    if binary:
        s = (s > 0).float()
    out = group_advantages(s, G, method)
    assert out.shape == s.shape
    torch.testing.assert_close(out.double(), group_advantages_loop(s, G, method), atol=1e-4, rtol=1e-4)
    # permuting whole groups permutes the result; identical scores give 0
    perm = torch.randperm(n_groups, generator=g)
    idx = (perm[:, None] * G + torch.arange(G)).flatten()
    torch.testing.assert_close(group_advantages(s[idx], G, method), out[idx])
    assert (group_advantages(torch.full((G * n_groups,), 0.7), G, method) == 0).all()


def test_group_advantages_examples_and_errors():
    s = torch.tensor([1.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(s, 4, "dr_grpo"), torch.tensor([0.75, -0.25, -0.25, -0.25]))
    torch.testing.assert_close(group_advantages(s, 4, "rloo"), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    torch.testing.assert_close(group_advantages(s, 4, "grpo"), torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        group_advantages(s, 3, "grpo")
    with pytest.raises(ValueError):
        group_advantages(s, 4, "ppo")


# --- REINFORCE++ -------------------------------------------------------------------------------------

@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("p", [1.0, 0.6])
def test_reinforce_pp_matches_loop(gamma, p):
    r, _, mask = _traj(4, 9, 7, p)
    adv = reinforce_pp_advantages(r, mask, gamma)
    ret = returns_to_go(r, mask, gamma)
    ref_ret = returns_to_go_loop(r, mask, gamma)
    torch.testing.assert_close(ret.double(), ref_ret, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(adv.double(), masked_whiten(ref_ret, mask).double(), atol=1e-5, rtol=1e-5)
    assert (adv[~mask] == 0).all()


# --- V-trace -----------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    T=st.integers(1, 12),
    p=st.sampled_from([1.0, 0.6]),
    gamma=st.sampled_from([1.0, 0.9]),
    bars=st.sampled_from([(1.0, 1.0), (2.0, 0.5), (0.8, 1.2)]),
)
def test_vtrace_matches_paper_formula(seed, T, p, gamma, bars):
    r, v, mask = _traj(3, T, seed, p)
    g = torch.Generator().manual_seed(seed + 1)
    mu = -torch.rand(3, T, generator=g) * 2
    pi = mu + torch.randn(3, T, generator=g) * 0.7
    vs, pg = vtrace(mu, pi, r, v, mask, gamma, *bars)
    ref_vs, ref_pg = vtrace_sum(mu, pi, r, v, mask, gamma, *bars)
    torch.testing.assert_close(vs.double(), ref_vs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pg.double(), ref_pg, atol=1e-5, rtol=1e-5)


def test_vtrace_on_policy_is_monte_carlo_return():
    """π = μ, ρ̄ = c̄ = 1: v_s is the discounted return-to-go and pg advantage = GAE with λ = 1."""
    r, v, mask = _traj(3, 10, 11, 0.7)
    lp = -torch.rand(3, 10)
    vs, pg = vtrace(lp, lp, r, v, mask, 0.95)
    torch.testing.assert_close(vs.double(), returns_to_go_loop(r, mask, 0.95), atol=1e-5, rtol=1e-5)
    adv, _ = gae(r, v, mask, 0.95, 1.0)
    torch.testing.assert_close(pg, adv, atol=1e-5, rtol=1e-5)


def test_empty_time_axis():
    z = torch.zeros(2, 0)
    for out in (*gae(z, z, z.bool()), *vtrace(z, z, z, z, z.bool()), reinforce_pp_advantages(z, z.bool())):
        assert out.shape == (2, 0)
