"""Loss functions: decoupled PPO policy loss, clipped value loss, entropy/KL terms, DPO.

Every loss takes per-token ``[B, T]`` tensors plus a ``[B, T]`` mask, returns ``(loss, stats)``:
``loss`` a 0-dim tensor with grad, ``stats`` a dict of detached 0-dim tensors for logging (no
device read here: ``ops.read_tensors`` reads a step's statistics at once). Per-token
losses are reduced with ``ops.aggregate_loss`` (``token_mean`` | ``seq_mean_token_sum`` |
``seq_mean_token_mean``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kl import LOG_RATIO_CLAMP, kl_estimate
from .masked import aggregate_loss, compute_dtype, masked_mean, masked_min_max, masked_var

__all__ = ["cispo_policy_loss", "dpo_loss", "entropy_loss", "gspo_policy_loss", "kl_loss", "ppo_policy_loss",
           "value_loss"]


def _f(x: torch.Tensor) -> torch.Tensor:
    """A statistic: detached, left on the device (read later, with the others)."""
    return x.detach()


def _counted(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x at counted positions, 0 at padding (``where`` also blocks NaN gradients from padding)."""
    return torch.where(keep, x, torch.zeros_like(x))


def ppo_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_weights: torch.Tensor | None = None,
    agg: str = "token_mean",
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO clipped surrogate (docs/design.md §4) -> (loss, stats).

    r_t = exp(clamp(log π_θ − log π_prox, −20, 20))                                      [B, T]
    l_t = w_t · max(−A_t r_t, −A_t clip(r_t, 1 − ε_low, 1 + ε_high))       (Schulman et al. 2017;
          asymmetric "clip-higher" bounds as in DAPO, Yu et al. 2025)
    dual clip (Ye et al. 2020, "Mastering complex control in MOBA games"): for A_t < 0,
          l_t ← min(l_t, −c·A_t) with c = ``dual_clip`` > 1, bounding the loss when r_t ≫ 1.
    w_t = ``is_weights`` (behavior correction from ``ops.importance_weights``, AReaL's decoupled
          objective, Fu et al. 2025), 1 when None. loss = aggregate(l, mask, agg) (``normalizer``:
          see ``ops.aggregate_loss``, for micro-batches).

    Gradients flow into ``logprobs`` only (proximal log-probs, advantages and weights are detached).
    Stats: ``clip_fraction`` (tokens where the clipped term is active), ``dual_clip_fraction``,
    ``approx_kl`` = mean((r − 1) − log r) (k3 estimate of KL(π_prox ‖ π_θ)), ``ratio_mean``,
    ``ratio_min``, ``ratio_max`` (over counted tokens; ``ops.merge_stats`` combines the stats of
    micro-batches into the whole batch's).
    """
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    # Padding is zeroed first, so NaN/inf there reaches neither the loss nor any gradient.
    logprobs, advantages, log_ratio, keep = _policy_inputs(logprobs, proximal_logprobs, advantages, mask)
    ratio = torch.exp(log_ratio)  # [B, T]
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(pg_unclipped, pg_clipped)  # [B, T]
    clipped = pg_clipped > pg_unclipped
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        pg_dual = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (pg_dual < loss_mat)
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, pg_dual), loss_mat)
    if is_weights is not None:
        loss_mat = loss_mat * _counted(is_weights.detach().to(loss_mat.dtype), keep)
    loss = aggregate_loss(loss_mat, mask, agg, normalizer)
    return loss, _ratio_stats(ratio, log_ratio, clipped, dual_clipped, keep)


@torch.no_grad()
def _ratio_stats(ratio: torch.Tensor, log_ratio: torch.Tensor, clipped: torch.Tensor,
                 dual_clipped: torch.Tensor, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """The statistics every policy loss reports, over the counted tokens ``keep`` [B, T]: the
    clip fractions, approx KL = mean((r − 1) − log r) of the *token* ratio r = π_θ/π_prox (k3 of
    KL(π_prox ‖ π_θ)), and the mean, min and max of the ratio the loss used (``ratio``)."""
    cdt = ratio.dtype
    r = ratio.detach()
    token_log_ratio = log_ratio.detach()
    ratio_min, ratio_max = masked_min_max(r, keep, 1.0)
    return {
        "clip_fraction": _f(masked_mean(clipped.to(cdt), keep)),
        "dual_clip_fraction": _f(masked_mean(dual_clipped.to(cdt), keep)),
        "approx_kl": _f(masked_mean((torch.exp(token_log_ratio) - 1.0) - token_log_ratio, keep)),
        "ratio_mean": _f(masked_mean(r, keep)),
        "ratio_min": ratio_min,
        "ratio_max": ratio_max,
    }


def _policy_inputs(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log π_θ, detached A, the clamped token log-ratio log π_θ − log π_prox, keep), padding zeroed
    first, in the compute dtype: what every policy loss starts from ([B, T] each)."""
    cdt = compute_dtype(logprobs.dtype)
    keep = mask != 0
    logprobs = _counted(logprobs.to(cdt), keep)
    proximal_logprobs = _counted(proximal_logprobs.detach().to(cdt), keep)
    advantages = _counted(advantages.detach().to(cdt), keep)
    log_ratio = torch.clamp(logprobs - proximal_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return logprobs, advantages, log_ratio, keep


def gspo_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    is_weights: torch.Tensor | None = None,
    agg: str = "seq_mean_token_mean",
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, "Group sequence policy optimization",
    the GSPO-token form) -> (loss, stats).

    The ratio is the sequence's, the geometric mean of its token ratios against π_prox:

    log s_i = mean_t (log π_θ − log π_prox) over the sequence's counted tokens          [B]
    s_{i,t} = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)]     (equal to s_i; its gradient is s_i ∇log π_θ(y_t))
    l_t = w_t · max(−A_t s_{i,t}, −A_t clip(s_{i,t}, 1 − ε_low, 1 + ε_high))                 [B, T]

    so a sequence is clipped whole: all its tokens or none. The clip range is that of a sequence's
    mean per-token ratio, hence the paper's small defaults (3e-4, 4e-4). ``is_weights`` and ``agg``
    / ``normalizer`` as in :func:`ppo_policy_loss` (the paper aggregates ``seq_mean_token_mean``;
    verl's default has become ``token_mean``). log s_i is clamped to [−20, 20].
    Stats as :func:`ppo_policy_loss`'s: ``clip_fraction`` over tokens (whole clipped sequences),
    ``ratio_*`` of the sequence ratio at each token, ``approx_kl`` of the token ratios.
    """
    logprobs, advantages, log_ratio, keep = _policy_inputs(logprobs, proximal_logprobs, advantages, mask)
    log_seq = masked_mean(log_ratio, keep, dim=-1).detach().unsqueeze(-1)               # [B, 1]
    log_s = torch.clamp(logprobs - logprobs.detach() + log_seq, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s = torch.exp(log_s)                                                                # [B, T]
    pg_unclipped = -advantages * s
    pg_clipped = -advantages * torch.clamp(s, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(pg_unclipped, pg_clipped)
    if is_weights is not None:
        loss_mat = loss_mat * _counted(is_weights.detach().to(loss_mat.dtype), keep)
    loss = aggregate_loss(loss_mat, mask, agg, normalizer)
    clipped = (pg_clipped > pg_unclipped) & keep
    return loss, _ratio_stats(s, log_ratio, clipped, torch.zeros_like(clipped), keep)


def cispo_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_weights: torch.Tensor | None = None,
    agg: str = "token_mean",
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1", §3.1) -> (loss, stats).

    REINFORCE whose token weight is the clipped ratio, without a gradient through it:

    r_t = exp(clamp(log π_θ − log π_prox, −20, 20))
    l_t = −w_t · sg[clip(r_t, 1 − ε_low, 1 + ε_high)] · A_t · log π_θ(y_t)                   [B, T]

    Unlike PPO's clip, which gives a token past 1 ± ε no gradient at all, every token keeps a
    gradient (its weight bounded): rare tokens that the clip would drop (the "forks" of a
    reasoning chain) still learn. At π_θ = π_prox the gradient is PPO's, −w_t A_t ∇log π_θ.
    ``is_weights``, ``agg`` and ``normalizer`` as in :func:`ppo_policy_loss`. Stats as its:
    ``clip_fraction`` = tokens whose ratio the clip changed.
    """
    logprobs, advantages, log_ratio, keep = _policy_inputs(logprobs, proximal_logprobs, advantages, mask)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
    loss_mat = -advantages * weight * logprobs
    if is_weights is not None:
        loss_mat = loss_mat * _counted(is_weights.detach().to(loss_mat.dtype), keep)
    loss = aggregate_loss(loss_mat, mask, agg, normalizer)
    clipped = keep & ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high))
    return loss, _ratio_stats(ratio, log_ratio, clipped, torch.zeros_like(clipped), keep)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    agg: str = "token_mean",
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 / CleanRL ``ppo.py``; verl ``compute_value_loss``) -> (loss, stats).

    v_clip = V_old + clamp(V − V_old, −clip, clip);  l_t = ½ · max((V − R)², (v_clip − R)²)      [B, T]
    ``clip=None`` gives the plain ½(V − R)². Gradients flow into ``values`` only.
    Stats: ``vf_clip_fraction`` (clipped term larger), ``value_mean``, ``value_error`` = mean (V − R)²,
    ``explained_variance`` = 1 − Var(R − V)/Var(R) (0 when Var(R) = 0).
    """
    cdt = compute_dtype(values.dtype)
    keep = mask != 0  # [B, T]
    values = _counted(values.to(cdt), keep)
    old_values = _counted(old_values.detach().to(cdt), keep)
    returns = _counted(returns.detach().to(cdt), keep)
    err_unclipped = (values - returns).square()  # [B, T]
    if clip is None:
        loss_mat = err_unclipped
        clipped = torch.zeros_like(err_unclipped, dtype=torch.bool)
    else:
        v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
        err_clipped = (v_clip - returns).square()
        loss_mat = torch.maximum(err_unclipped, err_clipped)
        clipped = err_clipped > err_unclipped
    loss = 0.5 * aggregate_loss(loss_mat, mask, agg, normalizer)
    with torch.no_grad():
        # In float64, as Python computed it from the two variances read back (the same figure).
        var_r = masked_var(returns, keep).double()
        var_res = masked_var(returns - values.detach(), keep).double()
        stats = {
            "vf_clip_fraction": _f(masked_mean(clipped.to(cdt), keep)),
            "value_mean": _f(masked_mean(values.detach(), keep)),
            "value_error": _f(masked_mean(err_unclipped.detach(), keep)),
            "explained_variance": torch.where(var_r > 0, 1.0 - var_res / var_r, torch.zeros_like(var_r)),
        }
    return loss, stats


def entropy_loss(
    entropy: torch.Tensor, mask: torch.Tensor, agg: str = "token_mean", normalizer: float | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Aggregated entropy bonus term (verl ``agg_loss(entropy)``) -> (value, stats).

    Returns the aggregated *entropy* (≥ 0, with grad); the trainer subtracts ``coef · value`` from the
    policy loss to encourage exploration. Stats: ``entropy`` (the same value, token mean).
    """
    value = aggregate_loss(entropy, mask, agg, normalizer)
    return value, {"entropy": _f(masked_mean(entropy.detach(), mask))}


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "k3",
    agg: str = "token_mean",
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL(π ‖ π_ref) penalty in the loss (GRPO, Shao et al. 2024: k3) -> (value, stats).

    value = aggregate(kl_estimate(logprobs, ref_logprobs, kind), mask, agg), with grad through
    ``logprobs`` (``ref_logprobs`` is detached); the trainer adds ``coef · value``.
    Stats: ``kl`` (token mean of the estimate).
    """
    keep = mask != 0  # [B, T]
    kl = kl_estimate(_counted(logprobs, keep), _counted(ref_logprobs.detach(), keep), kind)  # [B, T]
    value = aggregate_loss(kl, mask, agg, normalizer)
    return value, {"kl": _f(masked_mean(kl.detach(), mask))}


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct Preference Optimization (Rafailov et al. 2023) -> (loss, stats).

    Inputs are sequence log-probs [N] (sum of token log-probs of each completion).
    u = β·((log π_c − log π_r) − (log π_ref,c − log π_ref,r))
    loss = mean(−(1 − ε) log σ(u) − ε log σ(−u))       (ε = label_smoothing: conservative DPO, 0 = DPO)
    Implicit rewards: r_c = β(log π_c − log π_ref,c), r_r = β(log π_r − log π_ref,r).
    Stats: ``reward_accuracy`` = mean(r_c > r_r), ``reward_margin`` = mean(r_c − r_r),
    ``reward_chosen``, ``reward_rejected`` (means).
    """
    cdt = compute_dtype(policy_chosen_logps.dtype)
    pc, pr = policy_chosen_logps.to(cdt), policy_rejected_logps.to(cdt)
    rc, rr = ref_chosen_logps.detach().to(cdt), ref_rejected_logps.detach().to(cdt)
    u = beta * ((pc - pr) - (rc - rr))  # [N]
    losses = -(1.0 - label_smoothing) * F.logsigmoid(u) - label_smoothing * F.logsigmoid(-u)
    loss = losses.mean()
    with torch.no_grad():
        r_c = beta * (pc - rc)
        r_r = beta * (pr - rr)
        stats = {
            "reward_accuracy": _f((r_c > r_r).to(cdt).mean()),
            "reward_margin": _f((r_c - r_r).mean()),
            "reward_chosen": _f(r_c.mean()),
            "reward_rejected": _f(r_r.mean()),
        }
    return loss, stats
