"""The records of one policy step: what it decided and computed, phase by phase, and what its
updates measured (:class:`learner.train.trainer.Trainer` fills them; :func:`step_stats` reads them).

Statistics stay on the device as 0-dim tensors until they are needed as numbers: once per update
(:meth:`MiniBatch.read`: its losses, for the finite check, with the gradient norms) and once at the
end of the step (:func:`step_stats`: everything else), each one transfer (``ops.read_tensors``).
A read inside the micro-batch loop would wait for the device at every micro-batch."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

import ops
from learner.train.batching import BatchTensors

__all__ = ["PHASES", "MiniBatch", "Phases", "SkippedStep", "StepData", "UpdateLog", "step_stats"]

PHASES = ("collate", "reference", "values", "proximal", "advantages", "update")
"""The timed phases of a step (``time_<phase>_s`` in its stats); publishing is the service's."""


class SkippedStep(Exception):
    """A policy step that changed nothing: a loss or gradient norm was not finite.

    ``reason`` says which and where; ``stats`` holds what was measured before the stop. The policy,
    critic, optimizers and running statistics are as before the step.
    """

    def __init__(self, reason: str, stats: dict[str, float]):
        super().__init__(reason)
        self.reason = reason
        self.stats = stats


class BrokenWeights(Exception):
    """An optimizer update left a trained weight non-finite (or past float32's norm) and there is
    no copy to roll back to (``algorithm.rollback_nonfinite: false``): the model in memory is
    broken, must not be published nor checkpointed, and the run stops (the learner's exit 6)."""


class Phases:
    """Wall-clock seconds per named phase of a step."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0


@dataclass
class StepData:
    """The tensors and choices of one policy step, filled phase by phase."""

    bt: BatchTensors
    flagged: torch.Tensor                          # (B,) bool
    version: int
    any_flagged: bool = False                      # flagged.any(), known on the host
    lr: float = 0.0
    critic_lr: float = 0.0
    train_policy: bool = True
    generator: torch.Generator | None = None
    mini: int = 0
    n_updates: int = 1
    beta: float = 0.0
    use_kl: bool = False
    group_sizes: list[int] = field(default_factory=list)
    current_rows: bool = True
    needed_early: bool = False
    separate: bool = False
    sanity_on: bool = False
    moments_before: dict = field(default_factory=dict)
    ref_lp: torch.Tensor | None = None             # (B, L-1)
    old_values: torch.Tensor | None = None         # (B, L-1)
    prox_pass: torch.Tensor | None = None          # (B, L-1) the proximal pass's log-probs
    proximal: torch.Tensor | None = None           # (B, L-1) π_prox; None: filled by the shortcut
    weights: torch.Tensor | None = None            # (B, L-1) behavior weights (M2PO applied)
    scores: torch.Tensor | None = None             # (B,)
    rewards_t: torch.Tensor | None = None          # (B, L-1)
    adv: torch.Tensor | None = None                # (B, L-1)
    targets: torch.Tensor | None = None            # (B, L-1) critic targets
    plan: list = field(default_factory=list)
    is_parts: list = field(default_factory=list)
    m2po_stats: dict = field(default_factory=dict)
    filter_stats: dict = field(default_factory=dict)
    kl_next: float = 0.0


class _Sanity:
    """The seeds' check on the first mini-batch: |ratio − 1| and KL(current ‖ proximal). Each
    micro-batch adds its (tokens, Σ|r − 1|, max |r − 1|, Σ KL) as tensors; :meth:`read` sums them."""

    def __init__(self) -> None:
        self.dev_sum = self.dev_max = self.kl_sum = 0.0
        self.tokens = 0
        self.parts: list[tuple[torch.Tensor, ...]] = []

    @torch.no_grad()
    def add(self, current: torch.Tensor, proximal: torch.Tensor, mask: torch.Tensor) -> None:
        keep = mask != 0
        dev = torch.where(keep, (torch.exp(current - proximal) - 1.0).abs(), torch.zeros_like(current))
        self.parts.append((keep.sum(), dev.sum(), dev.amax() if dev.numel() else dev.new_zeros(()),
                           ops.masked_sum(ops.kl_estimate(current, proximal, "k3"), mask)))

    def read(self, parts: list[tuple[float, ...]]) -> None:
        """Sum the parts (read: plain numbers), in their order, as the check always added them."""
        for n, dev_sum, dev_max, kl_sum in parts:
            if not n:
                continue
            self.dev_sum += dev_sum
            self.dev_max = max(self.dev_max, dev_max)
            self.kl_sum += kl_sum
            self.tokens += int(n)
        self.parts = []

    def stats(self, ratio_tolerance: float, kl_tolerance: float) -> dict[str, float]:
        kl = self.kl_sum / self.tokens
        return {"sanity_ratio_dev_mean": self.dev_sum / self.tokens, "sanity_ratio_dev_max": self.dev_max,
                "sanity_kl": kl,
                "sanity_failed": float(self.dev_max > ratio_tolerance or kl > kl_tolerance)}


@dataclass
class MiniBatch:
    """What one mini-batch's micro-batches measured before its optimizer step: each loss term per
    micro-batch (tensors until :meth:`read`), and the (stats, tokens) parts of the policy and
    value losses (tensors until the step's end)."""

    terms: dict[str, list] = field(default_factory=dict)
    pg_parts: list = field(default_factory=list)
    vf_parts: list = field(default_factory=list)
    losses: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: torch.Tensor) -> None:
        self.terms.setdefault(name, []).append(value.detach())

    def read(self, *more):
        """Sum each loss term over the micro-batches into :attr:`losses` (plain floats, added in
        order from 0.0) in one device read, together with ``more`` (returned read)."""
        terms, more = ops.read_tensors((self.terms, more))
        for name, values in terms.items():
            total = 0.0
            for v in values:
                total += v
            self.losses[name] = total
        self.terms = {}
        return more


@dataclass
class UpdateLog:
    """What the applied updates of a step measured."""

    filled: torch.Tensor                           # (B, L-1) π_prox as the shortcut filled it
    applied: int = 0
    early_stopped: bool = False
    losses: dict[str, list[float]] = field(default_factory=dict)
    pg_parts: list = field(default_factory=list)
    vf_parts: list = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    critic_grad_norms: list[float] = field(default_factory=list)
    entropy_sum: float = 0.0
    entropy_tokens: float = 0.0
    entropy_parts: list = field(default_factory=list)   # (Σ entropy, tokens) per forward, tensors
    sanity: _Sanity = field(default_factory=_Sanity)

    def read(self, s: StepData, *more):
        """The step's statistics still on the device, read at once: the policy and value loss
        parts, the importance parts, the entropy sums and the sanity check's, with ``more``
        (returned read)."""
        self.pg_parts, self.vf_parts, s.is_parts, entropy, sanity, more = ops.read_tensors(
            (self.pg_parts, self.vf_parts, s.is_parts, self.entropy_parts, self.sanity.parts, more))
        for total, tokens in entropy:
            self.entropy_sum += total
            self.entropy_tokens += tokens
        self.entropy_parts = []
        self.sanity.read(sanity)
        return more


def step_stats(cfg, batch, s: StepData, log: UpdateLog, *, ref_kl: tuple[float, float] | None,
               critic: bool, read: dict[str, float]) -> dict[str, float]:
    """The statistics of one trained step (every value a Python float): what the service records
    and exports. ``ref_kl`` is (token mean, sequence mean) of KL to the reference when the step
    used one; ``critic`` whether it trained a critic; ``read``: ``score_mean`` and
    ``advantage_abs_mean``, read from the device with the rest (:meth:`UpdateLog.read`, called
    before: every part of ``log`` is a plain number here)."""
    samples, B = batch.samples, len(batch.samples)
    raw = torch.tensor([x.reward for x in samples], dtype=torch.float32)
    lengths = torch.tensor([len(x.completion_token_ids) for x in samples], dtype=torch.float32)
    staleness = batch.staleness

    def mean(key: str) -> float:
        values = log.losses.get(key, [])
        return float(np.mean(values)) if values else 0.0

    stats: dict[str, float] = {
        "loss": mean("loss"),
        "reward_mean": float(raw.mean()),
        "reward_std": float(raw.std()) if B > 1 else 0.0,
        "score_mean": read["score_mean"],
        "advantage_abs_mean": read["advantage_abs_mean"],
        "entropy": log.entropy_sum / max(1.0, log.entropy_tokens),
        "completion_tokens_mean": float(lengths.mean()),
        "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
        "staleness_max": float(max(staleness)) if staleness else 0.0,
        "corrected_samples": float(sum(batch.needs_correction or [])),
        "samples": float(B),
        "policy_updated": float(s.train_policy and log.applied > 0),
        "optimizer_steps": float(log.applied),
        "ppo_epochs_run": log.applied / len(s.plan[0]),
        "early_stopped": float(log.early_stopped),
        "lr": s.lr,
        "proximal_pass": float(s.separate),
        "sanity_applicable": float(s.sanity_on),
    }
    if s.train_policy:
        stats["grad_norm"] = float(np.mean(log.grad_norms)) if log.grad_norms else 0.0
        stats["pg_loss"] = mean("pg_loss")
        if log.pg_parts:
            stats.update({f"pg_{k}": v for k, v in ops.merge_stats(log.pg_parts).items()})
        if s.is_parts:
            stats.update(ops.merge_stats(s.is_parts))  # is_weight_*, is_ess_ratio, mismatch_kl, ...
        stats.update(s.m2po_stats)
    if s.sanity_on and log.sanity.tokens:
        stats.update(log.sanity.stats(cfg.algorithm.sanity_ratio_tolerance, cfg.algorithm.sanity_kl_tolerance))
    if s.use_kl:
        stats["ref_kl"], stats["ref_kl_seq"] = ref_kl
        stats["kl_coef"] = s.beta
        stats["kl_coef_next"] = s.kl_next
        if not cfg.kl.in_reward:
            stats["kl_loss"] = mean("kl_loss")
    if cfg.algorithm.entropy_coef > 0:
        stats["entropy_bonus"] = mean("entropy_bonus")
    if critic:
        stats["critic_lr"] = s.critic_lr
        stats["vf_loss"] = mean("vf_loss")
        stats["critic_grad_norm"] = float(np.mean(log.critic_grad_norms)) if log.critic_grad_norms else 0.0
        if log.vf_parts:
            stats.update({k if k.startswith("vf_") else f"vf_{k}": v
                          for k, v in ops.merge_stats(log.vf_parts).items()})
    stats.update(s.filter_stats)
    return stats
