"""Second-moment token masking for very stale data (M2PO; Zheng et al. 2025, "Prosperity before
collapse: how far can off-policy RL reach with stale data on LLMs?", arXiv:2510.01161).

With log behavior weights ℓ_t = log π_prox(y_t) − log μ(y_t) over the counted tokens of a batch,
the second moment M₂ = mean_t ℓ_t² measures how far the data drifted from the policy being
trained (it bounds the variance of the importance weights, unlike a clip on each weight alone).
M2PO masks the tokens with the largest ℓ² until the mean of ℓ² over the tokens left is ≤ τ:
a few extreme tokens go, the bulk of a stale batch keeps training (reported to train stably on data
256 steps stale, with τ = 0.04).

Computed without a loop: sort the counted ℓ² ascending, s₁ ≤ … ≤ s_N. The mean of the n smallest,
P_n / n, never decreases with n (each added value is ≥ all before it), so "remove the largest until
the mean of the rest is ≤ τ" keeps exactly the n* smallest, n* = max{n : P_n / n ≤ τ} (0 if none). Equal values
are kept in the order of their flattened position (a stable sort), as removing one at a time would.
Log-ratios are clamped to [−20, 20] like every log-ratio in ``ops``.
"""

from __future__ import annotations

import torch

from .kl import LOG_RATIO_CLAMP
from .masked import compute_dtype

__all__ = ["m2po_mask"]


@torch.no_grad()
def m2po_mask(
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Tokens M2PO keeps -> (keep [B, T] bool, stats).

    proximal_logprobs, behavior_logprobs, mask: [B, T]; ``threshold`` τ ≥ 0 bounds the mean of
    ℓ² = (log π_prox − log μ)² over the kept tokens. ``keep`` is a subset of ``mask != 0``; apply it
    by zeroing the loss weights of the other tokens (the batch is one set: pass the whole batch,
    not a micro-batch, since the rule is a batch mean).

    Stats: ``m2po_second_moment`` (mean ℓ² over all counted tokens), ``m2po_second_moment_kept``
    (over the kept ones, ≤ τ), ``m2po_masked_fraction`` (counted tokens removed).
    """
    if not threshold >= 0:
        raise ValueError(f"m2po threshold must be >= 0, got {threshold!r}")
    cdt = compute_dtype(proximal_logprobs.dtype)
    counted = mask != 0  # [B, T]
    log_w = torch.clamp(proximal_logprobs.to(cdt) - behavior_logprobs.to(cdt), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    sq = log_w.square()[counted]  # [N] in flattened (row-major) order
    n = sq.numel()
    keep = torch.zeros_like(counted)
    if n == 0:
        return keep, {"m2po_second_moment": 0.0, "m2po_second_moment_kept": 0.0, "m2po_masked_fraction": 0.0}
    order = torch.sort(sq, stable=True).indices  # [N] ascending
    s = sq[order]
    prefix_mean = torch.cumsum(s, 0) / torch.arange(1, n + 1, dtype=s.dtype, device=s.device)  # [N]
    ok = (prefix_mean <= threshold).nonzero()
    n_keep = int(ok[-1]) + 1 if ok.numel() else 0  # the largest n whose mean is <= τ
    kept_flat = torch.zeros(n, dtype=torch.bool, device=sq.device)
    kept_flat[order[:n_keep]] = True
    keep[counted] = kept_flat
    stats = {
        "m2po_second_moment": float(sq.mean()),
        "m2po_second_moment_kept": float(prefix_mean[n_keep - 1]) if n_keep else 0.0,
        "m2po_masked_fraction": 1.0 - n_keep / n,
    }
    return keep, stats
