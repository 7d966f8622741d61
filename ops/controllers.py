"""KL-coefficient controllers for a reward-side KL penalty (r_t −= β·KL_t).

Adaptive (Ziegler et al. 2019, "Fine-tuning language models from human preferences", §2.2):
    e = clip(KL_current / KL_target − 1, −0.2, 0.2),     β ← β · (1 + e · n_steps / horizon)
a proportional controller in log-space that moves β to keep the measured KL near the target.
Same as TRL ``AdaptiveKLController`` and verl ``core_algos.AdaptiveKLController``.
"""

from __future__ import annotations

__all__ = ["AdaptiveKLController", "FixedKLController"]


class FixedKLController:
    """Constant β. ``update`` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """β adapted toward ``target_kl`` with time constant ``horizon`` (in samples or steps, the unit
    of ``n_steps``): β ← β · (1 + clip(KL/target − 1, ±0.2) · n_steps / horizon)."""

    ERROR_CLIP = 0.2

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Apply one controller step with the measured KL over ``n_steps``; returns the new β."""
        error = min(max(float(current_kl) / self.target_kl - 1.0, -self.ERROR_CLIP), self.ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target_kl = float(state.get("target_kl", self.target_kl))
        self.horizon = float(state.get("horizon", self.horizon))
