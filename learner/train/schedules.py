"""Learning-rate schedules, as a factor of the peak learning rate at a policy step.

    warm-up   f(v) = (v + 1) / W                                    for v < W
    constant  f(v) = 1
    linear    f(v) = 1 − (1 − m) · p                                p = (v − W) / (N − W), in [0, 1]
    cosine    f(v) = m + (1 − m) · ½ (1 + cos π p)

v is the policy step being trained (the batch's version: 0 for the first), W the warm-up steps, N
the run's total steps and m the final fraction (``min_lr_ratio``). A function of v alone, not of
how many optimizer steps ran: a resumed run, a skipped step or an early-stopped epoch see the
learning rate the schedule says for that version (as torchtitan's and HF's schedulers, which
count steps; here the step count is the policy version, which survives a resume).
"""

from __future__ import annotations

import math

__all__ = ["lr_factor"]


def lr_factor(schedule: str, step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """The factor f(v) of the module docstring for policy step ``step`` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    p = min(1.0, max(0.0, (step - warmup_steps) / span))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * p
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; expected constant, linear or cosine")
