"""Reward shaping: per-token rewards with a KL penalty, length penalty, clipping, batch and running
normalization."""

from __future__ import annotations

import math

import torch

from .masked import compute_dtype

__all__ = [
    "RunningMoments",
    "batch_normalize",
    "clip_rewards",
    "last_token_index",
    "length_penalty",
    "overlong_penalty",
    "shape_token_rewards",
]


def last_token_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the last counted token of each row and whether the row has one: [B, T] -> ([B], [B]).

    Works for right padding, left padding and holes (the largest t with mask != 0); an all-masked
    row gets index 0 and ``has_token`` False.
    """
    keep = mask != 0  # [B, T]
    T = keep.shape[-1]
    t = torch.arange(T, device=keep.device).expand_as(keep)
    idx = torch.where(keep, t, -1).amax(dim=-1)  # [B]
    return idx.clamp(min=0), idx >= 0


def shape_token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards r_t = −β·KL_t on every counted token, + the sequence score on the last one.

    scores: [B] sequence rewards; mask: [B, T]; kl: [B, T] per-token KL estimate (e.g.
    ``kl_estimate(proximal_logprobs, ref_logprobs, "k1")``), β = ``kl_coef``. Returns [B, T] (0 at
    masked positions; an all-masked row is all zeros). As InstructGPT / Ziegler et al. 2019 and TRL's
    ``PPOTrainer.compute_rewards``, with the last counted token found for left or right padding.
    """
    keep = mask != 0  # [B, T]
    cdt = compute_dtype(scores.dtype if kl is None else torch.promote_types(scores.dtype, kl.dtype))
    rewards = torch.zeros(keep.shape, dtype=cdt, device=keep.device)  # [B, T]
    if kl is not None and kl_coef != 0.0:
        rewards = torch.where(keep, -kl_coef * kl.to(cdt), rewards)
    idx, has = last_token_index(keep)  # [B]
    bonus = torch.where(has, scores.to(cdt).reshape(-1), 0.0)  # [B]
    return rewards.scatter_add(1, idx.unsqueeze(1), bonus.unsqueeze(1))


def clip_rewards(scores: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Clamp rewards to [−limit, limit] (``None``: unchanged). As verl/TRL ``reward_clip``."""
    if limit is None:
        return scores
    if not limit > 0:
        raise ValueError(f"clip limit must be > 0, got {limit}")
    return torch.clamp(scores, -limit, limit)


def length_penalty(scores: torch.Tensor, lengths: torch.Tensor, coef: float, max_length: float) -> torch.Tensor:
    """s − coef · n / n_max: a linear penalty on the completion length n (tokens), as a fraction of
    the longest allowed completion n_max. scores, lengths: [B] -> [B] (coef = 0: unchanged).

    One penalty for every length, so a short correct answer beats a long one by at most ``coef``;
    the completion-length trend is visible in the reward itself.
    """
    if not max_length > 0:
        raise ValueError(f"max_length must be > 0, got {max_length}")
    if coef == 0.0:
        return scores
    cdt = compute_dtype(scores.dtype)
    return scores.to(cdt) - coef * lengths.to(cdt) / max_length


def overlong_penalty(scores: torch.Tensor, lengths: torch.Tensor, max_length: int, buffer: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, §3.4): s + R(n) with

        R(n) = 0                               n ≤ n_max − buffer
             = −factor · (n − (n_max − buffer)) / buffer     n_max − buffer < n ≤ n_max
             = −factor                         n > n_max

    so a completion is penalised linearly over the last ``buffer`` tokens before the limit
    ``max_length`` (verl's ``overlong_buffer``). scores, lengths: [B] -> [B] (buffer = 0: unchanged).
    """
    if buffer == 0:
        return scores
    if not 0 < buffer <= max_length:
        raise ValueError(f"buffer must be in (0, max_length={max_length}], got {buffer}")
    cdt = compute_dtype(scores.dtype)
    exceed = lengths.to(cdt) - (max_length - buffer)                                  # [B]
    return scores.to(cdt) - factor * torch.clamp(exceed / buffer, min=0.0, max=1.0)


def batch_normalize(scores: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(s − mean) / (std + eps) over the batch (unbiased std; one score gives 0): [B] -> [B]."""
    cdt = compute_dtype(scores.dtype)
    s = scores.to(cdt)
    if s.numel() < 2:
        return s - s.mean() if s.numel() else s
    return (s - s.mean()) / (s.std() + eps)


class RunningMoments:
    """Mean and variance of a stream of values, merged batch by batch exactly (parallel Welford).

    Chan, Golub & LeVeque (1979): merging (n_a, μ_a, M2_a) with (n_b, μ_b, M2_b), δ = μ_b − μ_a:
    n = n_a + n_b,  μ = μ_a + δ·n_b/n,  M2 = M2_a + M2_b + δ²·n_a·n_b/n.
    Feeding a stream in any batching gives the moments of the concatenation (up to float64 rounding).
    State is plain Python floats (float64). ``var``/``std`` are the unbiased sample versions (0 with
    fewer than two values). Used for running reward normalization (TRL ``RunningMoments``).
    """

    def __init__(self) -> None:
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def var(self) -> float:
        return self.m2 / (self.count - 1) if self.count > 1 else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def _merge(self, n: float, mean: float, m2: float) -> None:
        if n <= 0:
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    def update(self, xs: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[float, float]:
        """Add a batch (all elements of ``xs``, or those where ``mask != 0``); returns the batch's
        (mean, unbiased std) as floats."""
        x = xs.detach().to(torch.float64)
        if mask is not None:
            x = x[mask != 0]
        x = x.reshape(-1)
        n = x.numel()
        if n == 0:
            return 0.0, 0.0
        mean = x.mean()
        m2 = (x - mean).square().sum()
        self._merge(float(n), float(mean), float(m2))
        return float(mean), math.sqrt(float(m2) / (n - 1)) if n > 1 else 0.0

    def merge(self, other: RunningMoments) -> RunningMoments:
        """Fold another accumulator in (e.g. from another data-parallel rank); returns self."""
        self._merge(other.count, other.mean, other.m2)
        return self

    def normalize(self, xs: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
        """(x − mean) / (std + eps) with the running moments (only scaled when shift_mean=False)."""
        out = xs / (self.std + eps) if not shift_mean else (xs - self.mean) / (self.std + eps)
        return out

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])

    def __repr__(self) -> str:
        return f"RunningMoments(count={self.count:g}, mean={self.mean:.6g}, std={self.std:.6g})"
