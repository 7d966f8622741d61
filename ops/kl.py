"""Per-token KL estimators between the policy π and a reference π_ref, from sampled-token log-probs.

With x ~ π and log-ratio ℓ = log π_ref(x) − log π(x) (so r = π_ref/π = e^ℓ), the estimators of
KL(π ‖ π_ref) = E_π[−ℓ] are (J. Schulman, "Approximating KL Divergence", 2020,
http://joschu.net/blog/kl-approx.html):

- ``k1`` = −ℓ = log π − log π_ref               unbiased, high variance, can be negative;
- ``k2`` = ½ ℓ²                                  biased, low variance, ≥ 0;
- ``k3`` = (r − 1) − log r = e^ℓ − ℓ − 1         unbiased, low variance, ≥ 0 (GRPO's KL term).

verl/TRL names are accepted as aliases (``kl`` = k1, ``mse`` = k2, ``low_var_kl`` = k3).
"""

from __future__ import annotations

import torch

from .masked import compute_dtype
from .names import KL_KINDS

__all__ = ["KL_KINDS", "LOG_RATIO_CLAMP", "kl_estimate"]

_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}

# Log-ratios are clamped to this range before exp (as in verl) so one wild token cannot overflow.
LOG_RATIO_CLAMP = 20.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref): logprobs, ref_logprobs [B, T] -> [B, T].

    ``k3`` is computed as expm1(ℓ) − ℓ with ℓ clamped to [−20, 20] and the result clamped at 0, so it
    is never negative even after rounding (exp(ℓ) − ℓ − 1 in float32 can be −1e-8 for tiny ℓ).
    Differentiable in both arguments; mask and aggregate with ``ops.masked_mean`` / ``ops.kl_loss``.
    """
    kind = _ALIASES.get(kind, kind)
    cdt = compute_dtype(torch.promote_types(logprobs.dtype, ref_logprobs.dtype))
    logprobs, ref_logprobs = logprobs.to(cdt), ref_logprobs.to(cdt)
    if kind == "k1":
        return logprobs - ref_logprobs
    if kind == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    if kind == "k3":
        log_ratio = torch.clamp(ref_logprobs - logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # ℓ = log r
        return torch.clamp(torch.expm1(log_ratio) - log_ratio, min=0.0)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS} (or {tuple(_ALIASES)})")
