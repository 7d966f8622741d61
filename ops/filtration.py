"""Policy filtration for PPO (PF-PPO; Zhang et al. 2024, "Policy Filtration in RLHF to Fine-Tune
LLM for Code Generation", arXiv:2409.06957), as verl's ``use_pf_ppo`` implements it.

What verl really does (``core_algos.compute_pf_ppo_reweight_data``): it does *not* weight the loss.
It computes a weight per sample from its score (the sum of its token-level scores), then *resamples
the batch* — ``torch.multinomial(weights, N, replacement=True)`` — and trains on the resampled batch
(same size, duplicates allowed, low-weight samples mostly dropped):

- ``pow``:        w = |score|^p
- ``max_min``:    w = 1 for samples with the batch's max or min score, else 0
- ``max_random``: w = 0.4 for samples with the max score, else 0.1
then w = max(w + 1e-8, 1e-8) so every sample keeps a (tiny) chance.
"""

from __future__ import annotations

import torch

from .names import PF_PPO_METHODS

__all__ = ["PF_PPO_METHODS", "pf_ppo_resample", "pf_ppo_weights"]



@torch.no_grad()
def pf_ppo_weights(scores: torch.Tensor, method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """Unnormalized resampling weights [N] from sequence scores [N] (verl ``compute_weights``).

    Sampling probabilities are ``w / w.sum()``; draw the batch with ``pf_ppo_resample``.
    """
    s = scores.detach().to(torch.float64 if scores.dtype == torch.float64 else torch.float32)
    if method == "pow":
        w = torch.abs(s).pow(weight_pow)
    elif method == "max_min":
        w = ((s == s.max()) | (s == s.min())).to(s.dtype)
    elif method == "max_random":
        w = torch.where(s == s.max(), 0.4, 0.1).to(s.dtype)
    else:
        raise ValueError(f"unknown PF-PPO method {method!r}; expected one of {PF_PPO_METHODS}")
    return torch.clamp(w + 1e-8, min=1e-8)


@torch.no_grad()
def pf_ppo_resample(
    weights: torch.Tensor, num_samples: int | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Indices [num_samples] (default N) drawn with replacement with probability ∝ ``weights``;
    index every per-sample tensor of the batch with them (verl: ``tensor[sample_indices]``)."""
    n = weights.numel() if num_samples is None else int(num_samples)
    return torch.multinomial(weights.reshape(-1), n, replacement=True, generator=generator)
