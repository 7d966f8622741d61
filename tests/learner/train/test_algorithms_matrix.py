"""Every advantage estimator × every is_mode × both KL placements × every loss_agg, two steps
each through Trainer.step on a fixed batch (the first one optimizer step, the second two epochs
of two mini-batches): every statistic finite and in its range, the weights moved.

One trainer per estimator (the critic exists only for gae); the other keys are changed on its
config between combinations (validated assignment, as ``slipstream ctl set`` would), so 180
combinations cost 180 × 2 steps, not 180 model loads. The model is the tiny Llama cut to one layer
of width 32 (the matrix checks wiring, not learning), which makes a step ~4× cheaper.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from test_trainer import B, make_batch, make_trainer, params

from ops import ADVANTAGE_METHODS, IS_MODES, LOSS_AGG_MODES, POLICY_LOSSES

VOCAB = 49
FRACTIONS = ("pg_clip_fraction", "pg_dual_clip_fraction", "is_masked_fraction", "is_truncated_fraction",
             "is_veto_fraction", "is_ess_ratio", "policy_updated", "early_stopped")


def check(stats: dict[str, float], combo: str, multi: bool) -> None:
    for k, v in stats.items():
        assert math.isfinite(v), f"{combo}: {k} = {v}"
    for k in FRACTIONS:
        if k in stats:
            assert 0.0 <= stats[k] <= 1.0 + 1e-6, f"{combo}: {k} = {stats[k]}"
    assert stats["is_ess_ratio"] > 0, combo
    assert 0.0 <= stats["entropy"] <= math.log(VOCAB) + 1e-4, combo
    assert stats["pg_approx_kl"] >= 0 and stats["ref_kl"] >= 0, combo          # k3 estimates
    assert stats["is_weight_min"] <= stats["is_weight_mean"] <= stats["is_weight_max"], combo
    assert stats["optimizer_steps"] == (4 if multi else 1), combo
    assert stats["kl_coef"] == 0.05 and stats["grad_norm"] >= 0, combo
    if multi:
        assert stats["proximal_pass"] == 1.0 and stats["sanity_failed"] == 0.0, combo
        assert stats["sanity_ratio_dev_max"] <= 1e-5, combo
    else:
        assert stats["pg_ratio_mean"] == pytest.approx(1.0, abs=1e-5), combo   # one update: ratio 1
    if "vf_loss" in stats:
        assert stats["vf_loss"] >= 0 and stats["vf_value_error"] >= 0, combo


@pytest.fixture(scope="module")
def one_layer_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 1, 32, 64
    cfg.num_attention_heads = cfg.num_key_value_heads = 2
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("one-layer")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("advantage", ADVANTAGE_METHODS)
def test_every_combination_trains_with_plausible_statistics(one_layer_model_dir, advantage):
    tr = make_trainer(one_layer_model_dir, advantage=advantage, kl_coef=0.05, micro_batch_samples=B,
                      lr=1e-3, max_grad_norm=1.0)
    combos = list(itertools.product(IS_MODES, (False, True), LOSS_AGG_MODES))
    assert len(combos) == 7 * 2 * 4
    for is_mode, kl_in_reward, loss_agg in combos:
        combo = f"{advantage}/{is_mode}/kl_in_reward={kl_in_reward}/{loss_agg}"
        cfg = tr.cfg
        cfg.algorithm.is_mode, cfg.kl.in_reward, cfg.algorithm.loss_agg = is_mode, kl_in_reward, loss_agg
        for multi in (False, True):
            cfg.batch.ppo_epochs, cfg.batch.mini_batch_samples = (2, B // 2) if multi else (1, 0)
            before = params(tr)
            stats = tr.step(make_batch(spread=0.3))
            check(stats, combo, multi)
            assert ("kl_loss" in stats) == (not kl_in_reward), combo
            moved = any(not torch.equal(before[n], p) for n, p in params(tr).items())
            assert moved or stats["is_masked_fraction"] == 1.0, combo


# Each policy loss beside PPO with a few of the modes: (policy_loss, is_mode, loss_agg, clip range).
POLICY_COMBOS = (
    ("gspo", "tis", "seq_mean_token_mean", (3e-4, 4e-4)),     # the paper's setting
    ("gspo", "icepop", "token_mean", (0.05, 0.05)),
    ("gspo", "geo_mis", "seq_mean_token_sum_norm", (0.05, 0.05)),
    ("cispo", "icepop", "token_mean", (0.99, 0.28)),          # MiniMax-M1's clip: no lower bound
    ("cispo", "seq_tis", "seq_mean_token_sum_norm", (0.2, 0.28)),
)


@pytest.mark.parametrize("advantage", ADVANTAGE_METHODS)
def test_every_policy_loss_trains_with_every_estimator(one_layer_model_dir, advantage):
    """issue 27.2: GSPO and CISPO through Trainer.step with every estimator, single- and
    multi-update steps: finite statistics in range, the weights moved."""
    assert {c[0] for c in POLICY_COMBOS} == set(POLICY_LOSSES) - {"ppo"}
    tr = make_trainer(one_layer_model_dir, advantage=advantage, kl_coef=0.05, micro_batch_samples=B,
                      lr=1e-3, max_grad_norm=1.0)
    for policy_loss, is_mode, loss_agg, (low, high) in POLICY_COMBOS:
        cfg = tr.cfg
        cfg.algorithm.policy_loss, cfg.algorithm.is_mode, cfg.algorithm.loss_agg = policy_loss, is_mode, loss_agg
        cfg.algorithm.clip_low, cfg.algorithm.clip_high = low, high
        for multi in (False, True):
            combo = f"{advantage}/{policy_loss}/{is_mode}/{loss_agg}/multi={multi}"
            cfg.batch.ppo_epochs, cfg.batch.mini_batch_samples = (2, B // 2) if multi else (1, 0)
            before = params(tr)
            stats = tr.step(make_batch(spread=0.3))
            check(stats, combo, multi)
            moved = any(not torch.equal(before[n], p) for n, p in params(tr).items())
            assert moved or stats["is_masked_fraction"] == 1.0, combo
            if multi and policy_loss == "gspo" and low < 1e-3:
                assert stats["pg_clip_fraction"] > 0, combo       # 3e-4 binds on the second update
