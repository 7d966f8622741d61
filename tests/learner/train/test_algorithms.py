"""Trainer.step's algorithm keys on a fixed batch with the tiny model: the proximal pass and the
seeds' sanity check, target_kl, skipped steps, the critic warm-up, the reference, the KL
controller, schedules, PF-PPO, M2PO, checkpoint hooks and the config's refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from config_kit import nested
from pydantic import ValidationError
from test_trainer import B, make_batch, make_trainer, params

from learner.config import LearnerConfig
from learner.train.dropout import disable_dropout
from learner.train.returns import sequence_scores
from learner.train.schedules import lr_factor
from learner.train.trainer import SkippedStep, Trainer
from ops import RunningMoments


def count_forwards(model: torch.nn.Module) -> dict[str, int]:
    """Counts the model's forwards in train and in eval mode (a forward pre-hook)."""
    counts = {"train": 0, "eval": 0}

    def hook(module, args, kwargs):
        counts["train" if module.training else "eval"] += 1

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return counts


def dropout_model_dir(tiny_model_dir: str, tmp_path, p: float = 0.5) -> str:
    """The tiny model with attention dropout p (Llama's only dropout), saved next to the test."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=p)
    out = tmp_path / "dropout-model"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return str(out)


# ---- the proximal pass and the sanity check --------------------------------------------------

@pytest.mark.parametrize("mini,eval_forwards,extra", [
    (0, 3, {}), (4, 4, {}),
    (4, 4, dict(kl_coef=0.1, kl_in_reward=True)),    # the pass runs before the advantages
])
def test_ppo_epochs_2_makes_a_separate_proximal_pass_with_ratio_one(tiny_model_dir, mini, eval_forwards, extra):
    """Two epochs: one no-grad pass in eval mode over the first epoch's micro-batches (3 + 3 + 2
    rows: 3 forwards; with mini-batches of 4: 2 + 2), then 2 epochs of gradient forwards; at the
    first mini-batch the ratio is 1 within 1e-6 (the same rows in the same micro-batches)."""
    tr = make_trainer(tiny_model_dir, ppo_epochs=2, mini_batch_samples=mini, micro_batch_samples=3, **extra)
    counts = count_forwards(tr.model)
    stats = tr.step(make_batch())
    per_epoch = 3 if mini == 0 else 4
    assert counts == {"eval": eval_forwards, "train": 2 * per_epoch}
    assert stats["proximal_pass"] == 1.0 and stats["optimizer_steps"] == 2 * (B // (mini or B))
    assert stats["sanity_applicable"] == 1.0 and stats["sanity_failed"] == 0.0
    assert stats["sanity_ratio_dev_max"] <= 1e-6 and stats["sanity_kl"] <= 1e-10
    # the later mini-batches really moved away from the proximal policy (lr 1e-2)
    assert stats["pg_ratio_max"] > 1.0 + 1e-4 or stats["pg_ratio_min"] < 1.0 - 1e-4


def test_single_step_shortcut_has_no_pass_and_no_sanity_values(tiny_model_dir):
    tr = make_trainer(tiny_model_dir, micro_batch_samples=3)
    counts = count_forwards(tr.model)
    stats = tr.step(make_batch())
    assert counts == {"eval": 0, "train": 3}
    assert stats["proximal_pass"] == 0.0 and stats["sanity_applicable"] == 0.0
    assert not any(k.startswith("sanity_") and k != "sanity_applicable" for k in stats)


@pytest.mark.parametrize("disable", [False, True])
def test_single_step_shortcut_checks_sanity_every_n_steps(tiny_model_dir, tmp_path, disable):
    """issue 27.7: under the default one-update step, at a version divisible by sanity_every one
    eval-mode forward of the first micro-batch checks the gradient forward: it passes with dropout
    disabled (the default) and fires with dropout left on; other versions make no extra pass."""
    model_dir = dropout_model_dir(tiny_model_dir, tmp_path)
    tr = make_trainer(model_dir, micro_batch_samples=3, disable_dropout=disable, algorithm=dict(sanity_every=3))
    counts = count_forwards(tr.model)
    stats = tr.step(make_batch())                            # version 3: due
    assert counts == {"eval": 1, "train": 3}
    assert stats["proximal_pass"] == 0.0 and stats["sanity_applicable"] == 1.0
    if disable:
        assert stats["sanity_failed"] == 0.0 and stats["sanity_ratio_dev_max"] <= 1e-6 and stats["sanity_kl"] <= 1e-10
    else:
        assert stats["sanity_failed"] == 1.0
        assert stats["sanity_ratio_dev_max"] > tr.cfg.algorithm.sanity_ratio_tolerance
    batch = make_batch()
    batch.version = 4                                        # not due: no extra pass, no values
    counts.update(eval=0, train=0)
    stats = tr.step(batch)
    assert counts == {"eval": 0, "train": 3} and stats["sanity_applicable"] == 0.0
    assert "sanity_failed" not in stats


@pytest.mark.parametrize("disable", [False, True])
def test_sanity_check_fires_when_dropout_is_left_on(tiny_model_dir, tmp_path, disable):
    """The seeds' failure: dropout on in the gradient forward (the proximal pass is in eval
    mode), so the ratio at the first mini-batch is noise and the check fires; the default
    (dropout disabled at load) passes it."""
    model_dir = dropout_model_dir(tiny_model_dir, tmp_path)
    tr = make_trainer(model_dir, ppo_epochs=2, disable_dropout=disable)
    assert (tr.model.config.attention_dropout == 0.0) == disable
    stats = tr.step(make_batch())
    assert stats["sanity_applicable"] == 1.0
    if disable:
        assert stats["sanity_failed"] == 0.0 and stats["sanity_ratio_dev_max"] <= 1e-6
    else:
        assert stats["sanity_failed"] == 1.0
        assert stats["sanity_ratio_dev_max"] > tr.cfg.algorithm.sanity_ratio_tolerance
        assert stats["sanity_kl"] > tr.cfg.algorithm.sanity_kl_tolerance


def left_padded_without_mask(tr: Trainer):
    """The seeds' other failure, made on purpose: a proximal pass that handles padding differently
    from the gradient forward (its rows left-padded, as generation engines pad, and the padding
    attended because the attention mask was forgotten). Returns the buggy pass."""
    def logprobs(sub):
        ids, keep = sub.input_ids.clone(), sub.attention_mask.bool()
        lens = keep.sum(1)
        width = ids.shape[1]
        left = torch.full_like(ids, tr.pad_id)
        for i, n in enumerate(lens.tolist()):
            left[i, width - n:] = ids[i, :n]
        targets = left[:, 1:]
        out = tr.forward(left, torch.ones_like(sub.attention_mask), targets, tr.cfg.sampling.temperature)[0]
        back = torch.zeros_like(out)                 # (b, L-1), back to right-aligned positions
        for i, n in enumerate(lens.tolist()):
            back[i, :n - 1] = out[i, width - n:]
        return back

    def proximal(bt, chunks):
        tr.model.eval()
        try:
            return tr._no_grad_pass(bt, chunks, logprobs)
        finally:
            tr.model.train()
    return proximal


@pytest.mark.parametrize("buggy", [False, True])
def test_sanity_check_fires_when_padding_is_handled_differently(tiny_model_dir, buggy):
    """The same check catches a proximal pass whose padding differs from the gradient forward's
    (the ragged rows of make_batch are the ones that change); the trainer's own pass passes it."""
    tr = make_trainer(tiny_model_dir, ppo_epochs=2)
    if buggy:
        tr._proximal_pass = left_padded_without_mask(tr)
    stats = tr.step(make_batch())
    assert stats["sanity_applicable"] == 1.0
    if buggy:
        assert stats["sanity_failed"] == 1.0
        assert stats["sanity_ratio_dev_max"] > tr.cfg.algorithm.sanity_ratio_tolerance
    else:
        assert stats["sanity_failed"] == 0.0 and stats["sanity_ratio_dev_max"] <= 1e-6


def test_disable_dropout_turns_modules_and_attributes_off(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dropout_model_dir(tiny_model_dir, tmp_path))
    model.train()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    a, b = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert not torch.equal(a, b)                       # dropout really is on
    assert disable_dropout(model) == 4                 # one attention_dropout per layer
    a, b = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert torch.equal(a, b)
    seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3))
    assert disable_dropout(seq) == 1 and seq[1].p == 0.0


# ---- early stop, skipped steps -------------------------------------------------------------------

@pytest.mark.parametrize("mini", [0, 4])
def test_target_kl_stops_the_remaining_updates(tiny_model_dir, mini):
    free = make_trainer(tiny_model_dir, ppo_epochs=4, mini_batch_samples=mini).step(make_batch())
    per_epoch = B // (mini or B)
    assert free["optimizer_steps"] == 4 * per_epoch and free["early_stopped"] == 0.0
    assert free["pg_approx_kl"] > 1e-6
    stopped = make_trainer(tiny_model_dir, ppo_epochs=4, mini_batch_samples=mini, target_kl=1e-6)
    before = params(stopped)
    stats = stopped.step(make_batch())
    # The first update always runs (its KL is the sanity check's); the next mini-batch sees the
    # policy moved past 1e-6 and stops the step there.
    assert stats["optimizer_steps"] == 1 and stats["early_stopped"] == 1.0
    assert stats["ppo_epochs_run"] == pytest.approx(1 / per_epoch)
    assert any(not torch.equal(before[n], p) for n, p in params(stopped).items())


def test_nan_reward_skips_the_step_and_changes_nothing(tiny_model_dir):
    tr = make_trainer(tiny_model_dir, reward_norm="running")
    before = params(tr)
    batch = make_batch()
    batch.samples[3].reward = float("nan")
    with pytest.raises(SkippedStep, match="non-finite loss at update 1 of 1"):
        tr.step(batch)
    assert all(torch.equal(before[n], p) for n, p in params(tr).items())
    assert len(tr.optimizer.state) == 0 and tr.reward_moments.count == 0
    assert all(p.grad is None for p in tr.model.parameters())
    tr.step(make_batch())                               # and the next good batch trains
    assert any(not torch.equal(before[n], p) for n, p in params(tr).items())


@pytest.mark.parametrize("critic", [False, True])
def test_nan_in_a_later_update_rolls_the_whole_step_back(tiny_model_dir, critic):
    """NaN logits from the second optimizer step on (a forward hook armed by the first step):
    the step is skipped and the first update is undone, weights and optimizer state alike."""
    extra = dict(advantage="gae") if critic else {}
    tr = make_trainer(tiny_model_dir, ppo_epochs=3, reward_norm="running", **extra)
    tr.step(make_batch())                                # the optimizer has state now
    before = params(tr)
    opt_before = copy.deepcopy(tr.optimizer.state_dict())
    critic_before = {n: p.detach().clone() for n, p in tr.critic.named_parameters()} if critic else {}
    moments = tr.reward_moments.state_dict()
    armed = {"on": False}
    tr.optimizer.register_step_post_hook(lambda *a: armed.__setitem__("on", True))
    tr.model.get_decoder().register_forward_hook(     # NaN hidden states: NaN logits
        lambda mod, args, out: (setattr(out, "last_hidden_state", out.last_hidden_state * float("nan")) or out)
        if armed["on"] else out)
    with pytest.raises(SkippedStep) as info:
        tr.step(make_batch())
    assert "update 2 of 3" in info.value.reason
    assert info.value.stats["updates_applied_before_skip"] == 1.0
    assert all(torch.equal(before[n], p) for n, p in params(tr).items())
    opt_after = tr.optimizer.state_dict()
    for k, st in opt_before["state"].items():
        for name, t in st.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(opt_after["state"][k][name])), name
    if critic:
        assert all(torch.equal(critic_before[n], p) for n, p in tr.critic.named_parameters())
    assert tr.reward_moments.state_dict() == moments


# ---- critic, reference, KL controller ----------------------------------------------------------------

def test_critic_warmup_trains_the_critic_only(tiny_model_dir):
    tr = make_trainer(tiny_model_dir, advantage="gae", critic_warmup_steps=4)   # batch version 3
    policy = params(tr)
    critic = {n: p.detach().clone() for n, p in tr.critic.named_parameters()}
    stats = tr.step(make_batch())
    assert stats["policy_updated"] == 0.0 and stats["vf_loss"] > 0 and "pg_loss" not in stats
    assert all(torch.equal(policy[n], p) for n, p in params(tr).items())
    assert any(not torch.equal(critic[n], p) for n, p in tr.critic.named_parameters())
    batch = make_batch()
    batch.version = 4                                    # warm-up over: both train
    stats = tr.step(batch)
    assert stats["policy_updated"] == 1.0
    assert any(not torch.equal(policy[n], p) for n, p in params(tr).items())


def test_reference_is_a_frozen_copy_of_the_initial_policy(tiny_model_dir):
    tr = make_trainer(tiny_model_dir, kl_coef=0.1, reference_on_cpu=True)
    initial = params(tr)
    s1 = tr.step(make_batch())
    # At the first step the policy is the reference: KL 0 exactly (same numbers, dropout off).
    assert s1["ref_kl"] == 0.0 and s1["kl_loss"] == 0.0
    s2 = tr.step(make_batch())
    assert s2["ref_kl"] > 0 and s2["kl_loss"] > 0
    for n, p in tr.reference.model.named_parameters():
        assert torch.equal(p, initial[n]) and not p.requires_grad
    assert not tr.reference.model.training


def test_kl_in_reward_enters_the_scores_and_needs_the_proximal_pass(tiny_model_dir):
    plain = make_trainer(tiny_model_dir, kl_coef=0.5, kl_in_reward=True, kl_kind="k1")
    s1, s2 = plain.step(make_batch()), plain.step(make_batch())
    assert s1["proximal_pass"] == 1.0 and "kl_loss" not in s1
    assert s2["ref_kl"] != 0.0
    # the KL moved into the rewards: the advantages differ from the same step without it
    other = make_trainer(tiny_model_dir, kl_coef=0.5, kl_in_reward=False)
    other.step(make_batch())
    assert other.step(make_batch())["advantage_abs_mean"] != pytest.approx(s2["advantage_abs_mean"], abs=1e-6)


def test_adaptive_kl_controller_moves_beta(tiny_model_dir):
    """Ziegler's rule with horizon 8 = one batch: β ← β·(1 + clip(KL/target − 1, ±0.2))."""
    tr = make_trainer(tiny_model_dir, kl_coef=0.1, kl_controller="adaptive", kl_target=1e-3,
                      kl_horizon=8)
    s1 = tr.step(make_batch())
    assert s1["ref_kl_seq"] == 0.0 and s1["kl_coef_next"] == pytest.approx(0.1 * 0.8)   # KL 0 < target
    s2 = tr.step(make_batch())
    assert s2["kl_coef"] == pytest.approx(0.08) and s2["ref_kl_seq"] > 1e-3
    assert s2["kl_coef_next"] == pytest.approx(0.08 * 1.2)
    assert tr.kl_controller.value == pytest.approx(0.096)


# ---- schedules, rewards, filters ------------------------------------------------------------------

def test_lr_schedules():
    assert [lr_factor("constant", v, 2, 10) for v in range(4)] == [0.5, 1.0, 1.0, 1.0]
    # linear after 2 warm-up steps over the 8 that remain, down to 0.1
    assert lr_factor("linear", 2, 2, 10, 0.1) == 1.0
    assert lr_factor("linear", 6, 2, 10, 0.1) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_factor("linear", 10, 2, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor("cosine", 6, 2, 10, 0.0) == pytest.approx(0.5)
    assert lr_factor("cosine", 12, 2, 10, 0.2) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        lr_factor("step", 3, 0, 10)


def test_learning_rates_follow_the_version(tiny_model_dir):
    tr = make_trainer(tiny_model_dir, advantage="gae", lr=1e-3, lr_schedule="linear", lr_warmup_steps=4,
                      total_steps=20, critic_lr=2e-3, critic_lr_schedule="cosine")
    batch = make_batch()                                 # version 3: warm-up step 4 of 4
    stats = tr.step(batch)
    assert stats["lr"] == pytest.approx(1e-3) and tr.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert stats["critic_lr"] == pytest.approx(2e-3 * lr_factor("cosine", 3, 0, 20))
    batch = make_batch()
    batch.version = 12
    assert tr.step(batch)["lr"] == pytest.approx(1e-3 * (1 - 8 / 16))


def test_scores_length_penalty_clip_and_normalization():
    rewards = torch.tensor([1.0, 0.0, 3.0, -2.0])
    lengths = torch.tensor([4.0, 2.0, 1.0, 3.0])
    cfg = LearnerConfig(**nested(length_penalty=0.4, max_new_tokens=4, reward_clip=1.5))
    # 1 − 0.4, 0 − 0.2, 3 − 0.1 -> 1.5 (clipped), −2 − 0.3 -> −1.5 (clipped)
    out = sequence_scores(cfg, rewards, lengths, RunningMoments())
    torch.testing.assert_close(out, torch.tensor([0.6, -0.2, 1.5, -1.5]))
    cfg = LearnerConfig(**nested(reward_norm="batch"))
    out = sequence_scores(cfg, rewards, lengths, RunningMoments())
    assert float(out.mean()) == pytest.approx(0.0, abs=1e-6) and float(out.std()) == pytest.approx(1.0, rel=1e-4)
    cfg = LearnerConfig(**nested(reward_norm="running"))
    moments = RunningMoments()
    sequence_scores(cfg, rewards, lengths, moments)
    out = sequence_scores(cfg, torch.tensor([1.0, 1.0]), lengths[:2], moments)
    assert moments.count == 6
    torch.testing.assert_close(out, (torch.tensor([1.0, 1.0]) - moments.mean) / (moments.std + 1e-8))


def test_pf_ppo_resamples_the_batch_by_score(tiny_model_dir):
    """max_min keeps (almost surely) only the rows with the batch's highest and lowest score."""
    tr = make_trainer(tiny_model_dir, batch_filter="pf_ppo", pf_ppo_method="max_min")
    seen = {}
    original = tr._update

    def spy(s, x, start):                                # the update phase's inputs: the resampled rows
        seen["rewards"] = x.rows.bt.rewards.clone()
        return original(s, x, start)

    tr._update = spy
    stats = tr.step(make_batch())
    assert set(seen["rewards"].tolist()) <= {0.0, 1.0} and stats["pf_ppo_unique_fraction"] < 1.0
    assert stats["samples"] == B and torch.isfinite(torch.tensor(stats["loss"]))


def test_m2po_masks_the_most_stale_tokens(tiny_model_dir):
    tr = make_trainer(tiny_model_dir, m2po_threshold=0.05, is_mode="none")
    stats = tr.step(make_batch(spread=0.6))             # (log w)² ≈ 0.36 on average: far off
    assert stats["proximal_pass"] == 1.0
    assert 0.0 < stats["m2po_masked_fraction"] < 1.0
    assert stats["m2po_second_moment"] > 0.05 >= stats["m2po_second_moment_kept"]
    off = make_trainer(tiny_model_dir, is_mode="none").step(make_batch(spread=0.6))
    assert off["loss"] != pytest.approx(stats["loss"], abs=1e-6)


def test_geo_mis_rejects_sequences(tiny_model_dir):
    stats = make_trainer(tiny_model_dir, is_mode="geo_mis", is_cap=1.2).step(make_batch(spread=0.6))
    assert 0.0 < stats["is_masked_fraction"] < 1.0 and torch.isfinite(torch.tensor(stats["loss"]))


# ---- checkpoint hooks, config ------------------------------------------------------------------

def test_state_dict_round_trip_gives_the_same_next_step(tiny_model_dir):
    kw = dict(advantage="gae", kl_coef=0.1, kl_controller="adaptive", reward_norm="running")
    a = make_trainer(tiny_model_dir, **kw)
    a.step(make_batch())
    state = copy.deepcopy(a.state_dict())
    assert {"policy", "optimizer", "critic", "critic_optimizer", "reference", "kl_controller",
            "reward_moments"} <= state.keys()
    b = make_trainer(tiny_model_dir, **kw)
    b.load_state_dict(state)
    sa, sb = a.step(make_batch()), b.step(make_batch())
    for k in sa:
        if not k.startswith("time_") and k != "step_s":
            assert sa[k] == pytest.approx(sb[k], abs=1e-6), k
    with pytest.raises(ValueError, match="critic"):
        make_trainer(tiny_model_dir, kl_coef=0.1).load_state_dict(state)


@pytest.mark.parametrize("fields,words", [
    (dict(top_p=0.9), "top_p: 1.0"),
    (dict(critic_warmup_steps=2), "advantage: gae"),
    (dict(critic_targets="vtrace"), "advantage: gae"),
    (dict(kl_controller="adaptive"), "kl.coef > 0"),
    (dict(mini_batch_samples=65), "or 0 for the whole batch"),
    (dict(dual_clip=1.0), "greater than 1"),
])
def test_config_refusals_say_how_to_fix(fields, words):
    with pytest.raises(ValidationError) as info:
        LearnerConfig(**nested(fields))
    message = info.value.errors()[0]["msg"]
    assert words in message and "\n" not in message


def test_defaults_are_todays_demo():
    """GRPO, one optimizer step per batch, tis, no reference, no critic: the old single-pass step."""
    cfg = LearnerConfig()
    assert (cfg.algorithm.advantage, cfg.algorithm.is_mode, cfg.batch.ppo_epochs, cfg.batch.mini_batch_samples, cfg.kl.coef) == (
        "grpo", "tis", 1, 0, 0.0)
    assert not cfg.kl.uses_reference and not cfg.algorithm.uses_critic and cfg.sampling.top_p == 1.0


def test_gae_and_reinforce_pp_need_no_groups(tiny_model_dir):
    for advantage in ("gae", "reinforce_pp"):
        LearnerConfig(**nested(advantage=advantage, group_size=1))
    with pytest.raises(ValidationError):
        LearnerConfig(**nested(advantage="rloo", group_size=1))
    assert isinstance(make_trainer(tiny_model_dir, advantage="gae").critic, torch.nn.Module)
    assert Trainer  # the class the service builds
