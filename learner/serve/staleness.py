"""The adaptive staleness controller (``staleness_controller: adaptive``).

Asynchrony buys throughput with off-policy data; the importance weights say what it costs. When
a step's samples look too far from the policy being trained — the effective-sample-size ratio of
the importance weights below ``staleness_ess_min``, or the mismatch KL (behavior → proximal, per
token) above ``staleness_mismatch_kl_max`` — η is cut by one at once: every further stale batch
would be worse. It grows back by one only after ``staleness_recover_steps`` healthy steps in a row,
where healthy is stricter than "not bad" (ESS ratio ≥ ``staleness_ess_recover`` and mismatch KL ≤
``staleness_mismatch_kl_recover``): the gap between the two pairs of thresholds is the hysteresis
that keeps η from flapping on a statistic that hovers at one bound. η stays in [``min_staleness``,
``max_staleness``]; ``max_staleness`` is the operator's bound (``ctl set max_staleness`` moves it).

Pure Python over the step statistics (no torch, no sockets): the service feeds it every step and
applies what it returns to the buffer's gate (learner.serve.service).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessDecision:
    eta: int                 # the new η
    reason: str              # "ess_low", "mismatch_kl_high", "recovered"


class StalenessController:
    def __init__(self, *, min_staleness: int, ess_min: float, mismatch_kl_max: float,
                 ess_recover: float, mismatch_kl_recover: float, recover_steps: int):
        if ess_recover < ess_min or mismatch_kl_recover > mismatch_kl_max:
            raise ValueError("the recover thresholds must be at least as strict as the shrink ones "
                             "(ess_recover >= ess_min, mismatch_kl_recover <= mismatch_kl_max)")
        self.min_staleness = min_staleness
        self.ess_min, self.mismatch_kl_max = ess_min, mismatch_kl_max
        self.ess_recover, self.mismatch_kl_recover = ess_recover, mismatch_kl_recover
        self.recover_steps = recover_steps
        self.healthy = 0         # healthy steps in a row since the last change or bad step

    def update(self, eta: int, high: int, stats: dict[str, float]) -> StalenessDecision | None:
        """One step's statistics with η now and the bound ``high``: the new η, or None (no change).

        A step without importance statistics (nothing off-policy to judge) changes nothing and
        does not count as healthy either.
        """
        ess, kl = stats.get("is_ess_ratio"), stats.get("mismatch_kl")
        if ess is None or kl is None or ess != ess or kl != kl:       # absent or NaN
            return None
        if eta > high:                          # the operator lowered the bound
            self.healthy = 0
            return StalenessDecision(high, "bound")
        bad = "ess_low" if ess < self.ess_min else "mismatch_kl_high" if kl > self.mismatch_kl_max else None
        if bad is not None:
            self.healthy = 0
            return StalenessDecision(eta - 1, bad) if eta > self.min_staleness else None
        if ess >= self.ess_recover and kl <= self.mismatch_kl_recover:
            self.healthy += 1
        else:
            self.healthy = 0
        if self.healthy >= self.recover_steps and eta < high:
            self.healthy = 0
            return StalenessDecision(eta + 1, "recovered")
        return None

    def state_dict(self) -> dict:
        return {"healthy": self.healthy}

    def load_state_dict(self, state: dict) -> None:
        self.healthy = int(state["healthy"])
