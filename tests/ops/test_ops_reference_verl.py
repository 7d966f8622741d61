"""The policy losses, aggregations and IcePop weights against verl's own (``core_algos``,
``rollout_corr_helper``, verl 0.9.1): the same inputs give the same loss and the same gradient.

verl is installed only for this check (tests/ops/verl-reference.txt, ``--no-deps``; .ci/run does
it and sets ``SLIPSTREAM_REQUIRE_VERL=1``, which makes a missing verl a failure, not a skip).
Where verl's names differ: its ``old_log_prob`` is our π_prox, its ``rollout_is_weights`` our
``is_weights``, its ``clip_ratio_low/high`` our ``clip_low/high``, its ``loss_scale_factor`` the
constant of ``seq_mean_token_sum_norm``, and its aggregation names use dashes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ops import (
    aggregate_loss,
    cispo_policy_loss,
    gspo_policy_loss,
    importance_weights,
    loss_normalizer,
    ppo_policy_loss,
)

REQUIREMENTS = Path(__file__).with_name("verl-reference.txt")


@pytest.fixture(scope="module")
def verl():
    try:
        from verl.trainer.ppo import core_algos, rollout_corr_helper
        from verl.workers.config import ActorConfig
    except ImportError as e:
        why = f"needs verl ({e}; pip install --no-deps -r {REQUIREMENTS.relative_to(Path.cwd()) if REQUIREMENTS.is_relative_to(Path.cwd()) else REQUIREMENTS})"
        if os.environ.get("SLIPSTREAM_REQUIRE_VERL") == "1":
            pytest.fail(f"SLIPSTREAM_REQUIRE_VERL=1 but the test {why}")
        pytest.skip(why)
    return core_algos, rollout_corr_helper, ActorConfig


def _batch(seed, B=5, T=9, spread=0.08):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = prox + torch.randn(B, T, generator=g, dtype=torch.float64) * spread
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True                                      # no empty row: verl divides by its length
    w = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return lp, prox, adv, mask, w


def _grad(fn, lp):
    x = lp.clone().requires_grad_(True)
    loss = fn(x)
    (g,) = torch.autograd.grad(loss, x)
    return loss.detach(), g


OURS = {"token-mean": "token_mean", "seq-mean-token-sum": "seq_mean_token_sum",
        "seq-mean-token-mean": "seq_mean_token_mean", "seq-mean-token-sum-norm": "seq_mean_token_sum_norm"}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("verl_agg", list(OURS))
@pytest.mark.parametrize("loss_name", ["vanilla", "gspo", "cispo"])
def test_policy_losses_equal_verls(verl, seed, verl_agg, loss_name):
    core_algos, _, ActorConfig = verl
    lp, prox, adv, mask, w = _batch(seed, spread=0.02 if loss_name == "gspo" else 0.3)
    low, high = (0.01, 0.015) if loss_name == "gspo" else (0.2, 0.28)
    config = ActorConfig(strategy="fsdp", clip_ratio=low, clip_ratio_low=low, clip_ratio_high=high,
                         clip_ratio_c=3.0, loss_agg_mode=verl_agg, ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    ref_fn = core_algos.get_policy_loss_fn(loss_name)
    m = mask.to(torch.float64)
    agg = OURS[verl_agg]
    normalizer = loss_normalizer(mask, agg)               # C = T, verl's default loss_scale_factor

    def theirs(x):
        return ref_fn(old_log_prob=prox, log_prob=x, advantages=adv, response_mask=m, loss_agg_mode=verl_agg,
                      config=config, rollout_is_weights=w)[0]

    def ours(x):
        if loss_name == "gspo":
            return gspo_policy_loss(x, prox, adv, mask, low, high, w, agg, normalizer)[0]
        if loss_name == "cispo":
            return cispo_policy_loss(x, prox, adv, mask, low, high, w, agg, normalizer)[0]
        return ppo_policy_loss(x, prox, adv, mask, low, high, 3.0, w, agg, normalizer)[0]

    ref_loss, ref_g = _grad(theirs, lp)
    loss, g = _grad(ours, lp)
    # verl's seq-mean-token-mean adds 1e-8 to each row's token count: agreement to ~1e-8 relative.
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-7, abs=1e-12)
    torch.testing.assert_close(g, ref_g, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("C", [None, 4, 64])
def test_dr_grpo_normaliser_equals_verls_loss_scale_factor(verl, C):
    core_algos, _, _ = verl
    lp, _, _, mask, _ = _batch(7)
    ref = core_algos.agg_loss(lp, mask.to(torch.float64), "seq-mean-token-sum-norm", loss_scale_factor=C)
    ours = aggregate_loss(lp, mask, "seq_mean_token_sum_norm",
                          normalizer=loss_normalizer(mask, "seq_mean_token_sum_norm", norm_tokens=C))
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("bounds", [(0.5, 5.0), (0.8, 1.25)])
def test_icepop_weights_equal_verls_token_icepop(verl, seed, bounds):
    _, rollout_corr_helper, _ = verl
    g = torch.Generator().manual_seed(seed)
    behavior = -torch.rand(6, 10, generator=g, dtype=torch.float64) * 3
    prox = behavior + torch.randn(6, 10, generator=g, dtype=torch.float64) * 0.6
    mask = torch.rand(6, 10, generator=g) < 0.8
    ref, _ = rollout_corr_helper.compute_rollout_correction_weights(
        prox - behavior, mask.to(torch.float64), rollout_is="token", rollout_is_threshold=f"{bounds[0]}_{bounds[1]}")
    ours, keep, _ = importance_weights(prox, behavior, mask, "icepop", bounds=bounds)
    torch.testing.assert_close(ours, ref.to(ours.dtype), rtol=1e-12, atol=0)
    assert bool((ref[mask & ~keep] == 0).all())           # what we mask, verl weighs 0
