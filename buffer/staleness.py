"""η, the staleness limit, and its one owner (issue 37): :class:`StalenessLimit`.

η bounds how far generation may run ahead of training (the gate's capacity rule, buffer.gate)
and how stale a trained sample may be (the buffer's sweep, drop or correct). It has one writer,
:class:`StalenessLimit`, and every change goes through it:

- ``ctl set staleness.max_staleness`` (learner.serve.control): :meth:`StalenessLimit.set`;
- the adaptive controller after each step (learner.serve.step_records): :meth:`StalenessLimit.after_step`;
- a resume (learner.state.learner_checkpoints): :meth:`StalenessLimit.set` with the η the run starts
  with; a checkpoint's own value is put back quietly by :meth:`StalenessLimit.restore` while the
  buffer is loaded (before anything may act on it).

Readers: the gate and the buffer (``limit.eta``), and whoever :meth:`StalenessLimit.subscribe` d
to hear of a change: the buffer (its sweep), the learner's gauge and events.
``tests/buffer/test_staleness_owner.py`` fails when any other module assigns η.

The adaptive controller (``staleness.controller: adaptive``). Asynchrony buys throughput with
off-policy data; the importance weights say what it costs. When a step's samples look too far
from the policy being trained — the effective-sample-size ratio of the importance weights below
``staleness.ess_min``, or the mismatch KL (behavior → proximal, per token) above
``staleness.mismatch_kl_max`` — η is cut by one at once: every further stale batch would be
worse. It grows back by one only after ``staleness.recover_steps`` healthy steps in a row, where
healthy is stricter than "not bad" (ESS ratio ≥ ``staleness.ess_recover`` and mismatch KL ≤
``staleness.mismatch_kl_recover``): the gap between the two pairs of thresholds is the hysteresis
that keeps η from flapping on a statistic that hovers at one bound. η stays in
[``min_staleness``, ``max_staleness``]; ``max_staleness`` is the operator's bound (``ctl set
max_staleness`` moves it). Pure Python over the step statistics (no torch, no sockets).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class StalenessDecision:
    eta: int                 # the new η
    reason: str              # "ess_low", "mismatch_kl_high", "recovered"
    previous: int | None = None   # η before (set by StalenessLimit.after_step)


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


def _check_eta(eta: object) -> int:
    if type(eta) is not int or eta < 0:
        raise ValueError(f"max_staleness: expected a non-negative integer, got {eta!r}")
    return eta


class StalenessLimit:
    """η and its changes (the module docstring). ``controller``: the adaptive controller, or None
    (``staleness.controller: fixed``)."""

    def __init__(self, eta: int, controller: StalenessController | None = None):
        self._eta = _check_eta(eta)
        self.controller = controller
        self._listeners: list[Callable[[int, int, str], None]] = []

    @property
    def eta(self) -> int:
        return self._eta

    def subscribe(self, listener: Callable[[int, int, str], None]) -> None:
        """``listener(previous, eta, reason)`` after every change (not after :meth:`restore`)."""
        self._listeners.append(listener)

    def set(self, eta: int, reason: str) -> int:
        """η becomes ``eta`` now (``reason``: ``ctl``, ``resume``, or the controller's); returns
        the previous value. Listeners hear of it even when it is unchanged (the buffer sweeps
        again: a resume's buffer may hold groups over the limit)."""
        previous, self._eta = self._eta, _check_eta(eta)
        for listener in self._listeners:
            listener(previous, self._eta, reason)
        return previous

    def restore(self, eta: int) -> None:
        """A checkpoint's η, put back while the buffer is loaded: no listener runs (the loader
        finishes first; the resume then :meth:`set` s the η the run starts with)."""
        self._eta = _check_eta(eta)

    def after_step(self, bound: int, stats: dict[str, float]) -> StalenessDecision | None:
        """The adaptive controller's turn after a step (``bound``: the operator's max_staleness):
        the decision it applied, or None (fixed, or no change)."""
        if self.controller is None:
            return None
        decision = self.controller.update(self._eta, bound, stats)
        if decision is None or decision.eta == self._eta:
            return None
        decision.previous = self._eta
        self.set(decision.eta, decision.reason)
        return decision
