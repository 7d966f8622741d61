"""Behavior-policy importance weights for decoupled PPO (docs/design.md §4).

Tokens were sampled by the behavior policy μ (the engine, possibly several versions old, possibly a
different numerical stack); the PPO ratio is taken against the proximal policy π_prox (learner
recompute at step start). The correction is w_t = π_prox(y_t)/μ(y_t) = exp(log π_prox − log μ),
detached (Hilton et al. 2022 "Batch size-invariance for policy optimization" — decoupled PPO;
AReaL, Fu et al. 2025), treated by ``mode``:

- ``none``    w = 1;
- ``tis``     w ← min(w, C)                         (truncated IS; Yao et al. 2025, "Your efficient
                                                     RL framework secretly brings you off-policy RL");
- ``mis``     w kept where 1/C ≤ w ≤ C, else the token is masked (weight 0; masked IS / rejection);
- ``icepop``  w kept where α ≤ w ≤ β, else the token is masked, with its own bounds ``bounds`` =
              (α, β) (IcePop, Ling Team 2025, "Every step evolves: scaling RL for trillion-scale
              thinking model" (Ring-1T); INTELLECT-3 uses it as its default loss with α = 0.5,
              β = 5): ``mis`` with an asymmetric acceptance region;
- ``seq_tis`` / ``seq_mis``  the same on each sequence's geometric-mean weight
              w_seq = exp(mean_t log w_t) (verl rollout-correction "sequence" level, geometric form),
              broadcast to the sequence's tokens;
- ``geo_mis`` geometric rejection: a sequence is masked when w_seq leaves [1/C, C] *or* one of its
              tokens has w_t < ``veto`` (per-token veto: one extreme token is enough); a kept
              sequence's tokens weigh 1 — it rejects, it does not reweigh (verl's
              ``rollout_rs: geometric`` with ``rollout_token_veto_threshold``, Liu, Li et al. 2025
              "When speed kills stability"; DeepSeek-V3.2's off-policy sequence masking is the
              one-sided form of the same rule). Keeps very stale data usable: most sequences pass
              whole and unweighted, the few that drifted are dropped whole.

Log-ratios are clamped to [−20, 20] before exp.
"""

from __future__ import annotations

import torch

from .kl import LOG_RATIO_CLAMP, kl_estimate
from .masked import compute_dtype, masked_mean, masked_min_max, masked_sum
from .names import IS_MODES

__all__ = ["IS_MODES", "behavior_anchored_weights", "importance_weights"]



@torch.no_grad()
def importance_weights(
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "tis",
    cap: float | None = 2.0,
    veto: float | None = None,
    bounds: tuple[float, float] = (0.5, 5.0),
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Detached importance weights w = π_prox/μ -> (weights [B, T], mask [B, T], stats).

    proximal_logprobs, behavior_logprobs, mask: [B, T]. Returned ``weights`` are 0 wherever the
    returned ``mask`` is 0; the returned mask is the input mask with the tokens (``mis``) or sequences
    (``seq_mis``, ``geo_mis``) outside [1/cap, cap] removed, in the input mask's dtype. ``cap`` is
    unused by ``none``. ``veto`` (> 0, or None for no veto) is the per-token veto of ``geo_mis``: a
    sequence with a counted token whose weight is below it is removed whole; other modes ignore it.
    ``bounds`` = (α, β), 0 < α ≤ 1 ≤ β, is the acceptance region of ``icepop`` (which ignores
    ``cap``; INTELLECT-3's (0.5, 5) by default); other modes ignore it.

    Stats (0-dim tensors, computed on the raw weights over the counted tokens of the input mask):
    ``is_weight_mean``, ``is_weight_max``, ``is_weight_min``, ``is_ess_ratio`` = (Σw)²/(n·Σw²) ∈ (0, 1]
    (1 when on-policy; Kish's effective sample size over n), ``is_masked_fraction`` (counted tokens
    removed by mis/seq_mis/geo_mis/icepop), ``is_truncated_fraction`` (tokens whose weight the cap lowered),
    ``is_veto_fraction`` (counted tokens of sequences the veto removed, ``geo_mis`` only),
    ``mismatch_kl`` = mean k3 estimate of KL(μ ‖ π_prox) (samples come from μ). The stats of
    several row parts of a batch (micro-batches) combine into the whole batch's with
    ``ops.merge_stats``.
    """
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-weight mode {mode!r}; expected one of {IS_MODES}")
    if mode == "icepop":
        if not 0.0 < bounds[0] <= 1.0 <= bounds[1]:
            raise ValueError(f"mode 'icepop' needs bounds (low, high) with 0 < low <= 1 <= high, got {bounds!r}")
    elif mode != "none" and (cap is None or not cap >= 1.0):
        raise ValueError(f"mode {mode!r} needs a cap >= 1, got {cap!r}")
    if veto is not None and not veto > 0:
        raise ValueError(f"veto must be > 0 (or None), got {veto!r}")
    cdt = compute_dtype(proximal_logprobs.dtype)
    keep = mask != 0  # [B, T] bool
    log_w = torch.clamp(proximal_logprobs.to(cdt) - behavior_logprobs.to(cdt), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_w = torch.where(keep, log_w, torch.zeros_like(log_w))  # padding: log w := 0
    raw = torch.exp(log_w)  # [B, T]

    new_keep = keep
    vetoed = torch.zeros_like(keep)
    if mode == "none":
        w = torch.ones_like(raw)
    elif mode in ("tis", "mis", "icepop"):
        w = raw
    else:
        log_w_seq = masked_mean(log_w, keep, dim=-1)  # [B] mean log-weight = log geometric mean
        w = torch.exp(log_w_seq).unsqueeze(-1).expand_as(raw)  # [B, T]
    truncated = torch.zeros_like(keep)
    if mode in ("tis", "seq_tis"):
        truncated = keep & (w > cap)
        w = torch.clamp(w, max=cap)
    elif mode in ("mis", "seq_mis", "geo_mis"):
        new_keep = keep & (w >= 1.0 / cap) & (w <= cap)
    elif mode == "icepop":
        new_keep = keep & (w >= bounds[0]) & (w <= bounds[1])
    if mode == "geo_mis":
        if veto is not None:
            veto_row = (keep & (raw < veto)).any(dim=-1, keepdim=True)  # [B, 1]
            vetoed = keep & veto_row
            new_keep = new_keep & ~veto_row
        w = torch.ones_like(raw)  # rejection only: what is kept weighs 1
    weights = torch.where(new_keep, w, torch.zeros_like(w))

    # The statistics stay on the device (0-dim tensors; ops.read_tensors reads a step's at once).
    n = keep.sum()
    sum_w = masked_sum(raw, keep)
    sum_w2 = masked_sum(raw.square(), keep)
    with torch.no_grad():
        ess = torch.where(n > 0, sum_w.square() / (n * sum_w2), torch.ones_like(sum_w))
        w_min, w_max = masked_min_max(raw, keep, 0.0)
        stats = {
            "is_weight_mean": masked_mean(raw, keep),
            "is_weight_max": w_max,
            "is_weight_min": w_min,
            "is_ess_ratio": ess,
            "is_masked_fraction": masked_mean((keep & ~new_keep).to(cdt), keep),
            "is_truncated_fraction": masked_mean(truncated.to(cdt), keep),
            "is_veto_fraction": masked_mean(vetoed.to(cdt), keep),
            "mismatch_kl": masked_mean(kl_estimate(behavior_logprobs, proximal_logprobs, "k3"), keep),
        }
    out_mask = new_keep if mask.dtype == torch.bool else torch.where(new_keep, mask, torch.zeros_like(mask))
    return weights, out_mask, stats


@torch.no_grad()
def behavior_anchored_weights(
    weights: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Importance weights for a PPO surrogate whose ratio is taken against the behavior policy μ
    (``clip_anchor: behavior``) instead of π_prox -> weights [B, T], detached.

    The decoupled surrogate is w_t · max(−A_t r_t, −A_t clip(r_t)) with r_t = π_θ/π_prox (its
    trust region is centred on π_prox). With the ratio ρ_t = π_θ/μ instead, the weight becomes

        w'_t = w_t · μ(y_t)/π_prox(y_t) = w_t · exp(clamp(log μ − log π_prox, −20, 20))

    so that at π_θ = π_prox, for a token inside μ's clip range, the gradient is the decoupled
    one, −w_t A_t ∇log π_θ (w'_t ρ_t = w_t), whatever ``is_mode`` made w; a token whose
    probability has already moved past 1 ± ε of μ in the direction of its advantage gets none
    (the clip is active) — the trust region PPO draws around the policy that sampled the data,
    kept with the mode's correction. ``weights``: [B, T] from :func:`importance_weights` (0 where
    masked); the result is 0 wherever ``weights`` or ``mask`` is.
    """
    cdt = compute_dtype(proximal_logprobs.dtype)
    log_back = torch.clamp(behavior_logprobs.to(cdt) - proximal_logprobs.to(cdt), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    out = weights.to(cdt) * torch.exp(log_back)
    return torch.where(mask != 0, out, torch.zeros_like(out))     # padding (NaN there too) -> 0
