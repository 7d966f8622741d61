"""From the batch's rewards to per-token advantages and critic targets (docs/design.md §4), as the
config says; the math is ``ops``, this module only chooses and orders it.

    score_i   = clip(r_i − length_penalty · n_i / max_new_tokens + overlong_i, ±reward_clip), then
                normalized (none | batch mean/std | running moments over the run); overlong_i is
                DAPO's soft overlong punishment (ops.overlong_penalty)
    reward_it = −β · KL_it on every completion token (kl_in_reward) + score_i on the last one
    advantage = group estimators (grpo, dr_grpo, rloo) on Σ_t reward_it per sample, broadcast to its
                tokens | reinforce_pp on the token rewards | gae with the critic's values;
                optionally whitened over the batch's completion tokens
    targets   = gae returns A + V, or V-trace targets from behavior and proximal log-probs

The score is "at the last token": a completion is one episode whose only reward arrives when it
ends; with γ = 1 and no KL every token of a sample sees the same return.
"""

from __future__ import annotations

import torch

import ops
from learner.config import TrainerConfig

__all__ = ["advantages_and_targets", "sequence_scores", "token_rewards"]


def sequence_scores(cfg: TrainerConfig, rewards: torch.Tensor, lengths: torch.Tensor,
                    moments: ops.RunningMoments) -> torch.Tensor:
    """Scores (B,) from raw rewards (B,) and completion lengths (B,); updates ``moments`` under
    ``reward_norm: running`` (the running statistics include this batch, as TRL's)."""
    s = ops.length_penalty(rewards.float(), lengths, cfg.reward.length_penalty, cfg.sampling.max_new_tokens)
    s = ops.overlong_penalty(s, lengths, cfg.sampling.max_new_tokens, cfg.reward.overlong_buffer_tokens,
                             cfg.reward.overlong_penalty)
    s = ops.clip_rewards(s, cfg.reward.clip)
    if cfg.reward.norm == "batch":
        s = ops.batch_normalize(s)
    elif cfg.reward.norm == "running":
        moments.update(s)
        s = moments.normalize(s).float()
    return s


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None, beta: float) -> torch.Tensor:
    """Per-token rewards (B, L-1): −β·KL on completion tokens (when ``kl`` is given), + the score
    on each row's last completion token."""
    return ops.shape_token_rewards(scores, mask, kl, beta if kl is not None else 0.0)


def _group_advantages(scores: torch.Tensor, group_sizes: list[int], method: str) -> torch.Tensor:
    """``ops.group_advantages`` over consecutive groups of possibly different sizes: (B,) -> (B,)."""
    if len(set(group_sizes)) <= 1:
        return ops.group_advantages(scores, group_sizes[0] if group_sizes else len(scores), method)
    parts, lo = [], 0
    for n in group_sizes:
        parts.append(ops.group_advantages(scores[lo:lo + n], n, method))
        lo += n
    return torch.cat(parts)


def advantages_and_targets(
    cfg: TrainerConfig,
    rewards_t: torch.Tensor,
    mask: torch.Tensor,
    group_sizes: list[int],
    values: torch.Tensor | None = None,
    behavior_logprobs: torch.Tensor | None = None,
    proximal_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages (B, L-1), critic targets (B, L-1) or None without a critic).

    rewards_t: per-token rewards (B, L-1) from :func:`token_rewards`; values: the critic's values at
    the start of the step (``gae``); behavior and proximal log-probs: for V-trace targets.
    """
    targets = None
    if cfg.algorithm.advantage in ops.GROUP_ADVANTAGE_METHODS:
        adv = _group_advantages(rewards_t.sum(dim=-1), group_sizes, cfg.algorithm.advantage)  # (B,)
        adv = adv[:, None] * mask                                                  # (B, L-1)
    elif cfg.algorithm.advantage == "reinforce_pp":
        adv = ops.reinforce_pp_advantages(rewards_t, mask, gamma=cfg.algorithm.gamma)
    elif cfg.algorithm.advantage == "gae":
        if values is None:
            raise ValueError("advantage gae needs the critic's values")
        adv, targets = ops.gae(rewards_t, values, mask, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam)
        if cfg.critic.targets == "vtrace":
            targets, _ = ops.vtrace(behavior_logprobs, proximal_logprobs, rewards_t, values, mask,
                                    gamma=cfg.algorithm.gamma, rho_bar=cfg.critic.vtrace_rho_bar, c_bar=cfg.critic.vtrace_c_bar)
    else:
        raise ValueError(f"unknown advantage estimator {cfg.algorithm.advantage!r}")
    if cfg.algorithm.whiten_advantages and cfg.algorithm.advantage != "reinforce_pp":
        adv = ops.masked_whiten(adv, mask)
    return adv.float(), targets
