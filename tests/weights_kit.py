"""Weights as an optimizer step leaves them, for the delta and relay tests."""

from __future__ import annotations

import torch


def step_bf16(named, fraction: float, seed: int):
    """``named`` after an update that moves ``fraction`` of the bf16 elements one ulp (what an
    optimizer step at an RL learning rate does to bf16 weights: most stay as they were); other
    dtypes unchanged."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in named:
        t = t.clone()
        if t.dtype == torch.bfloat16:
            flat = t.view(-1)
            moved = torch.rand(flat.numel(), generator=g) < fraction
            flat[moved] = torch.nextafter(flat[moved], torch.full_like(flat[moved], 1e9))
        out.append((name, t))
    return out
