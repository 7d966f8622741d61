"""Masked reductions over ``[B, T]`` token tensors.

Convention for every function in ``ops``: ``mask`` is ``[B, T]`` (bool or float), 1 for a completion
token that counts, 0 for padding (or prompt / observation tokens). Padding never changes a result:
values at masked positions are selected away with ``torch.where`` (so even NaN/inf padding is harmless)
and empty reductions return 0 instead of NaN.

Low-precision inputs (bf16/fp16) are reduced in float32; float64 stays float64.

Sources: TRL ``trl/core.py`` (``masked_mean``/``masked_var``/``masked_whiten``) and verl
``verl/utils/torch_functional.py``; the loss aggregation modes follow verl
``verl/trainer/ppo/core_algos.py::agg_loss``.
"""

from __future__ import annotations

import torch

from .names import LOSS_AGG_MODES

__all__ = [
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "compute_dtype",
    "loss_normalizer",
    "masked_mean",
    "masked_min_max",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]



def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for ``dtype``: float64 stays float64, everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _weights(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(x, m, keep)``: ``x`` in its compute dtype, ``m`` the mask as weights, ``keep = m != 0``."""
    if mask.shape != x.shape:
        mask = mask.expand_as(x)
    x = x.to(compute_dtype(x.dtype))
    m = mask.to(x.dtype)
    return x, m, m != 0


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` where ``den != 0``, else 0 (an empty reduction contributes nothing)."""
    nonzero = den != 0
    return torch.where(nonzero, num / torch.where(nonzero, den, torch.ones_like(den)), torch.zeros_like(num))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Σ_t m_t·x_t over ``dim`` (all dims when None).

    x, mask: [B, T] -> scalar (dim=None) or the reduced shape. Masked entries are dropped with
    ``torch.where``, so NaN/inf in padding never leak into the result or the gradient.
    """
    x, m, keep = _weights(x, mask)
    xm = torch.where(keep, x * m, torch.zeros_like(x))  # [B, T]
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Σ m·x / Σ m over ``dim`` (all dims when None); 0 where nothing is counted.

    x, mask: [B, T]; ``masked_mean(x, mask, dim=-1)`` -> [B] per-sequence means (all-masked row -> 0).
    """
    x, m, keep = _weights(x, mask)
    xm = torch.where(keep, x * m, torch.zeros_like(x))  # [B, T]
    if dim is None:
        return _safe_div(xm.sum(), m.sum())
    return _safe_div(xm.sum(dim=dim), m.sum(dim=dim))


def masked_min_max(x: torch.Tensor, keep: torch.Tensor, empty: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of ``x`` over the positions ``keep`` (bool, the shape of ``x``) as 0-dim tensors,
    ``empty`` when none is kept; without the device read that boolean indexing (``x[keep]``)
    would cost."""
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    has = keep.any()
    low = torch.where(has, torch.where(keep, x, inf).amin(), torch.full_like(inf, empty))
    high = torch.where(has, torch.where(keep, x, -inf).amax(), torch.full_like(inf, empty))
    return low, high


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Masked variance Σ m·(x − μ)² / (Σ m − 1 if unbiased else Σ m), μ = masked_mean(x, mask).

    As TRL's ``masked_var`` (Bessel correction with the count of counted tokens). When fewer than two
    tokens are counted (one for the biased form) the variance is defined as 0, not NaN.
    x, mask: [B, T] -> scalar (dim=None) or the reduced shape.
    """
    x, m, keep = _weights(x, mask)
    xm = torch.where(keep, x * m, torch.zeros_like(x))  # [B, T]
    if dim is None:
        n = m.sum()
        mean = _safe_div(xm.sum(), n)
    else:
        n = m.sum(dim=dim)
        mean = _safe_div(xm.sum(dim=dim, keepdim=True), m.sum(dim=dim, keepdim=True))
    centered = torch.where(keep, x - mean, torch.zeros_like(x))  # [B, T]
    sq = masked_sum(centered.square(), m, dim=dim)
    den = n - 1 if unbiased else n
    return _safe_div(sq, torch.clamp(den, min=0))


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x − μ) / sqrt(σ² + eps) over all counted tokens (TRL ``masked_whiten``, unbiased σ²).

    With ``shift_mean=False`` the mean is added back (only the scale changes). Masked positions of
    the result are 0. x, mask: [B, T] -> [B, T] in the compute dtype.
    """
    x, m, keep = _weights(x, mask)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)  # [B, T]
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(keep, whitened, torch.zeros_like(whitened))


def _denominator(mask: torch.Tensor, agg: str, norm_tokens: int | None = None) -> torch.Tensor:
    """What ``aggregate_loss`` divides by: Σ m (``token_mean``), the count of rows with Σ_t m ≠ 0
    (the other ``seq_mean_*`` modes), that count times ``norm_tokens`` (``seq_mean_token_sum_norm``;
    None: the mask's length T)."""
    if agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {LOSS_AGG_MODES}")
    m = mask.to(compute_dtype(mask.dtype) if mask.is_floating_point() else torch.float32)
    if agg == "token_mean":
        return m.sum()
    rows = (m.sum(dim=-1) != 0).to(m.dtype).sum()
    if agg == "seq_mean_token_sum_norm":
        if norm_tokens is not None and not norm_tokens >= 1:
            raise ValueError(f"norm_tokens must be >= 1 (or None), got {norm_tokens!r}")
        return rows * float(norm_tokens if norm_tokens is not None else m.shape[-1])
    return rows


def aggregate_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, agg: str = "token_mean", normalizer: float | None = None
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar (verl ``agg_loss``).

    - ``token_mean``: Σ_{b,t} m·l / Σ_{b,t} m (every counted token weighs the same);
    - ``seq_mean_token_sum``: mean over sequences of Σ_t m·l (Dr. GRPO-style sum per sequence);
    - ``seq_mean_token_mean``: mean over sequences of (Σ_t m·l / Σ_t m) (GRPO paper);
    - ``seq_mean_token_sum_norm``: mean over sequences of Σ_t m·l / C with a constant C (Dr. GRPO,
      Liu et al. 2025, "Understanding R1-Zero-like training": no length normaliser that favours
      long wrong answers; TRL's ``dr_grpo``). Without a ``normalizer`` C is the mask's length T;
      pass ``loss_normalizer(mask, agg, norm_tokens=C)`` to fix it (the trainer uses the maximum
      completion length, as the paper does).

    The sequence means run over rows with at least one counted token, so an all-masked row
    contributes nothing (neither to the numerator nor to the denominator).

    ``normalizer`` replaces the denominator (the local token count, or the local count of non-empty
    sequences) with a given number: pass ``loss_normalizer(mask_of_the_whole_batch, agg)`` when the
    batch is split into micro-batches (by rows) for gradient accumulation, so that summing the
    micro-batch losses gives exactly the full-batch loss (token weights do not depend on how the
    batch was split).
    """
    _, m, _ = _weights(loss_mat, mask)
    den = _denominator(m, agg)
    if agg == "token_mean":
        num = masked_sum(loss_mat, m)
    else:
        row_counted = (m.sum(dim=-1) != 0).to(m.dtype)  # [B]
        if agg in ("seq_mean_token_sum", "seq_mean_token_sum_norm"):
            per_row = masked_sum(loss_mat, m, dim=-1)  # [B]
        else:
            per_row = masked_mean(loss_mat, m, dim=-1)  # [B]
        num = masked_sum(per_row, row_counted)
    if normalizer is None:
        return _safe_div(num, den.to(num.dtype))
    return num / normalizer


def loss_normalizer(mask: torch.Tensor, agg: str = "token_mean", norm_tokens: int | None = None) -> float:
    """The denominator ``aggregate_loss(·, mask, agg)`` divides by, as a plain number -> float.

    ``token_mean``: Σ_{b,t} m (the counted tokens, mask values as weights); the ``seq_mean_*`` modes:
    the rows with at least one counted token (times ``norm_tokens``, the constant C, for
    ``seq_mean_token_sum_norm``; None: the mask's length T, as ``aggregate_loss`` uses). Computed once over the whole batch and passed as
    ``normalizer`` to every micro-batch's ``aggregate_loss`` (or ``ppo_policy_loss``), the
    micro-batch losses add up to the full-batch loss. An empty mask gives 1.0: its numerator is 0,
    so the loss is 0, as ``aggregate_loss`` gives without a normalizer (never 0/0).
    mask: [B, T], the full shape of the loss (no broadcasting here).
    """
    den = float(_denominator(mask, agg, norm_tokens))
    return den if den != 0 else 1.0
