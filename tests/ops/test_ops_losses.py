"""Policy / value / entropy / KL / DPO losses: loop twins, the seeds' sanity checks, gradchecks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_twins import aggregate_loop, dpo_loss_loop, ppo_token_losses_loop, value_token_losses_loop

from ops import dpo_loss, entropy_loss, kl_estimate, kl_loss, masked_mean, ppo_policy_loss, value_loss

AGGS = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]


def _batch(B=4, T=6, seed=0, spread=0.5, p=0.75, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = prox + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < p
    mask[0, 0] = True
    return lp.to(dtype), prox.to(dtype), adv.to(dtype), mask


# --- PPO ---------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    agg=st.sampled_from(AGGS),
    clip_low=st.sampled_from([0.1, 0.2]),
    clip_high=st.sampled_from([0.2, 0.28]),
    dual_clip=st.sampled_from([None, 3.0]),
    weighted=st.booleans(),
)
def test_ppo_matches_loop_twin(seed, agg, clip_low, clip_high, dual_clip, weighted):
    lp, prox, adv, mask = _batch(seed=seed)
    w = torch.rand(lp.shape, generator=torch.Generator().manual_seed(seed)) * 2 if weighted else None
    loss, stats = ppo_policy_loss(lp, prox, adv, mask, clip_low, clip_high, dual_clip, w, agg)
    ref = ppo_token_losses_loop(lp, prox, adv, mask, clip_low, clip_high, dual_clip, w)
    assert loss.item() == pytest.approx(aggregate_loop(ref, mask, agg), abs=1e-5)
    r = [math.exp(float(a) - float(b)) for a, b, m in zip(lp.flatten(), prox.flatten(), mask.flatten(), strict=True) if m]
    assert stats["ratio_min"] == pytest.approx(min(r), rel=1e-5)
    assert stats["ratio_max"] == pytest.approx(max(r), rel=1e-5)
    assert stats["ratio_mean"] == pytest.approx(sum(r) / len(r), rel=1e-5)
    assert stats["approx_kl"] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / len(r), abs=1e-5)
    clipped = [
        (-a * min(max(x, 1 - clip_low), 1 + clip_high)) > (-a * x)
        for x, a in zip(r, [float(a) for a, m in zip(adv.flatten(), mask.flatten(), strict=True) if m], strict=True)
    ]
    assert stats["clip_fraction"] == pytest.approx(sum(clipped) / len(clipped), abs=1e-6)
    # Statistics stay on the device: detached 0-dim tensors, read by the trainer all at once.
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in stats.values())


@pytest.mark.parametrize("agg", AGGS)
def test_ppo_on_policy_sanity(agg):
    """Seeds' check: logprobs == proximal -> ratio exactly 1, clip fraction 0, loss = −mean(A)."""
    lp, _, adv, mask = _batch()
    loss, stats = ppo_policy_loss(lp, lp.clone(), adv, mask, agg=agg)
    assert stats["ratio_min"] == stats["ratio_max"] == stats["ratio_mean"] == 1.0
    assert stats["clip_fraction"] == 0.0 and stats["approx_kl"] == 0.0
    assert loss.item() == pytest.approx(aggregate_loop(-adv, mask, agg), abs=1e-6)
    if agg == "token_mean":
        assert loss.item() == pytest.approx(-adv[mask].mean().item(), abs=1e-6)


def test_ppo_gradient_on_policy_is_minus_advantage():
    lp, _, adv, mask = _batch()
    lp = lp.clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(lp, lp.detach(), adv, mask)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.where(mask, -adv / mask.sum(), 0.0))


def test_dual_clip_bounds_loss_for_negative_advantages():
    lp = torch.tensor([[5.0, 5.0, 0.0]])  # ratio e^5 ≈ 148 on the first two tokens
    prox = torch.zeros(1, 3)
    adv = torch.tensor([[-1.0, 2.0, -1.0]])
    mask = torch.ones(1, 3)
    _, plain = ppo_policy_loss(lp, prox, adv, mask, agg="seq_mean_token_sum")
    loss, stats = ppo_policy_loss(lp, prox, adv, mask, dual_clip=3.0, agg="seq_mean_token_sum")
    # token 0: −A·r = 148 -> bounded by −c·A = 3; token 1: A > 0, clipped at 1.2 -> −2.4; token 2: r = 1 -> 1.
    assert loss.item() == pytest.approx(3.0 - 2.4 + 1.0, abs=1e-5)
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 3)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)  # token 1 (A > 0, r > 1 + ε)
    lp_big = torch.full((1, 3), 50.0)  # log-ratio clamped to 20 before exp
    l2, s2 = ppo_policy_loss(lp_big, prox, -torch.ones(1, 3), mask, dual_clip=3.0)
    assert l2.item() == pytest.approx(3.0) and math.isfinite(s2["ratio_max"])


def test_ppo_all_masked_row_and_padding_contribute_nothing():
    lp, prox, adv, mask = _batch()
    lp = lp.clone().requires_grad_(True)
    for agg in AGGS:
        base, _ = ppo_policy_loss(lp, prox, adv, mask, agg=agg)
        # extra all-masked row with garbage values
        lp2 = torch.cat([lp, torch.full((1, 6), float("nan"))])
        z = torch.full((1, 6), float("nan"))
        m2 = torch.cat([mask, torch.zeros(1, 6, dtype=torch.bool)])
        extra, _ = ppo_policy_loss(lp2, torch.cat([prox, z]), torch.cat([adv, z]), m2, agg=agg)
        assert extra.item() == pytest.approx(base.item(), abs=1e-6)
        # NaN padding columns: same loss, finite gradient, zero gradient on padding
        padl = torch.cat([lp, torch.full((4, 2), float("nan"))], 1)
        pad = torch.full((4, 2), float("nan"))
        mp = torch.cat([mask, torch.zeros(4, 2, dtype=torch.bool)], 1)
        padded, _ = ppo_policy_loss(padl, torch.cat([prox, pad], 1), torch.cat([adv, pad], 1), mp, agg=agg)
        assert padded.item() == pytest.approx(base.item(), abs=1e-6)
        g = torch.autograd.grad(padded, lp)[0]
        assert torch.isfinite(g).all() and (g[~mask] == 0).all()


def test_ppo_rows_permute():
    lp, prox, adv, mask = _batch()
    perm = torch.tensor([2, 0, 3, 1])
    for agg in AGGS:
        a, _ = ppo_policy_loss(lp, prox, adv, mask, agg=agg)
        b, _ = ppo_policy_loss(lp[perm], prox[perm], adv[perm], mask[perm], agg=agg)
        assert a.item() == pytest.approx(b.item(), abs=1e-6)


@pytest.mark.parametrize("agg", AGGS)
def test_ppo_gradcheck(agg):
    lp, prox, adv, mask = _batch(B=2, T=4, dtype=torch.float64)
    w = torch.rand(2, 4, dtype=torch.float64)
    lp.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: ppo_policy_loss(x, prox, adv, mask, 0.2, 0.3, 3.0, w, agg)[0], (lp,)
    )


def test_ppo_bf16_input():
    lp, prox, adv, mask = _batch()
    loss, _ = ppo_policy_loss(lp.bfloat16(), prox.bfloat16(), adv, mask)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


# --- value -------------------------------------------------------------------------------------------

def _value_loop(v, old, ret, mask, clip, agg):
    return aggregate_loop(value_token_losses_loop(v, old, ret, clip), mask, agg)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_loop_and_gradcheck(agg, clip):
    g = torch.Generator().manual_seed(1)
    v, old, ret = (torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(3, 5, generator=g) < 0.7
    mask[0, 0] = True
    loss, stats = value_loss(v, old, ret, mask, clip=clip, agg=agg)
    assert loss.item() == pytest.approx(_value_loop(v, old, ret, mask, clip, agg), abs=1e-9)
    assert set(stats) >= {"vf_clip_fraction", "value_mean", "explained_variance"}
    v.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: value_loss(x, old, ret, mask, clip, agg)[0], (v,))


def test_value_loss_perfect_prediction():
    ret = torch.randn(2, 4)
    loss, stats = value_loss(ret.clone(), ret.clone(), ret, torch.ones(2, 4))
    assert loss.item() == 0.0 and stats["explained_variance"] == pytest.approx(1.0)


# --- entropy / KL terms ------------------------------------------------------------------------------

@pytest.mark.parametrize("agg", AGGS)
def test_entropy_and_kl_loss(agg):
    lp, ref, _, mask = _batch(dtype=torch.float64)
    ent = torch.rand(4, 6, dtype=torch.float64)
    val, st_ = entropy_loss(ent, mask, agg)
    assert val.item() == pytest.approx(aggregate_loop(ent, mask, agg))
    assert st_["entropy"] == pytest.approx(masked_mean(ent, mask).item())
    for kind in ("k1", "k2", "k3"):
        kl, s = kl_loss(lp, ref, mask, kind, agg)
        assert kl.item() == pytest.approx(aggregate_loop(kl_estimate(lp, ref, kind), mask, agg))
        self_kl, _ = kl_loss(lp, lp, mask, kind, agg)
        assert self_kl.item() == 0.0
    ent.requires_grad_(True)
    lp.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: entropy_loss(e, mask, agg)[0], (ent,))
    for kind in ("k1", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda x, k=kind: kl_loss(x, ref, mask, k, agg)[0], (lp,))


# --- DPO ---------------------------------------------------------------------------------------------

def test_dpo_matches_formula_and_gradcheck():
    g = torch.Generator().manual_seed(2)
    pc, pr, rc, rr = (-torch.rand(5, generator=g, dtype=torch.float64) * 20 for _ in range(4))
    beta = 0.3
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=beta)
    assert loss.item() == pytest.approx(dpo_loss_loop(pc, pr, rc, rr, beta))
    margins = beta * ((pc - rc) - (pr - rr))
    assert stats["reward_accuracy"] == pytest.approx((margins > 0).double().mean().item())
    assert stats["reward_margin"] == pytest.approx(margins.mean().item())
    pc.requires_grad_(True)
    pr.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: dpo_loss(a, b, rc, rr, beta)[0], (pc, pr))
    # Policy == reference: loss log 2, accuracy 0, margin 0.
    l0, s0 = dpo_loss(rc, rr, rc, rr)
    assert l0.item() == pytest.approx(math.log(2)) and s0["reward_margin"] == 0.0
    ls, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=0.1)
    assert ls.item() == pytest.approx(dpo_loss_loop(pc, pr, rc, rr, beta, label_smoothing=0.1))
