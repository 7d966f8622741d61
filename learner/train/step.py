"""The records of one policy step: what it decided (:class:`StepPlan`), what each phase computed
(:class:`StepRows`, :class:`Passes`, :class:`Returns`, :class:`Weights`: each the output of one
phase of :class:`learner.train.trainer.Trainer` and an input of the next, never changed after) and
what its updates measured (:class:`UpdateLog`); :func:`step_stats` reads them.

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

__all__ = ["PHASES", "MiniBatch", "Passes", "Phases", "Returns", "SkippedStep", "StepPlan", "StepRows",
           "UpdateInputs", "UpdateLog", "Weights", "step_stats"]

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


@dataclass(frozen=True)
class StepPlan:
    """What one step decided before computing anything (``Trainer._plan``); read by every phase."""

    version: int
    lr: float
    critic_lr: float
    train_policy: bool                             # False while the critic warms up
    generator: torch.Generator                     # the step's draws (update plan, PF-PPO)
    mini: int                                      # rows per mini-batch
    n_updates: int                                 # ppo_epochs × mini-batches
    beta: float                                    # the KL coefficient this step
    use_kl: bool
    group_sizes: list[int]
    current_rows: bool                             # π_prox is the current weights' (all rows or the flagged)
    needed_early: bool                             # π_prox is needed before the advantages
    separate: bool                                 # a proximal pass of its own (not the shortcut)
    sanity_on: bool
    moments_before: dict                           # the reward moments, restored by a skip
    sanity_pass: bool = False                      # the check's own pass (no separate proximal pass)


@dataclass(frozen=True)
class StepRows:
    """The batch's rows in training order, their correction flags and the update plan (lists of
    micro-batch row indices per mini-batch per epoch); a PF-PPO resampling makes new ones."""

    bt: BatchTensors
    flagged: torch.Tensor                          # (B,) bool
    any_flagged: bool                              # flagged.any(), known on the host
    plan: list = field(default_factory=list)       # empty until drawn (after PF-PPO's resampling)
    truncated: tuple[bool, ...] = ()               # rows cut at max_new_tokens (finish_reason length)


@dataclass(frozen=True)
class Passes:
    """The passes without gradient at the step's starting weights (``Trainer._no_grad_passes``)."""

    ref_lp: torch.Tensor | None = None             # (B, L-1) the reference policy's log-probs
    old_values: torch.Tensor | None = None         # (B, L-1) the critic's values
    prox_pass: torch.Tensor | None = None          # (B, L-1) the proximal pass's log-probs


@dataclass(frozen=True)
class Returns:
    """Scores, rewards and advantages (``Trainer._advantages``)."""

    scores: torch.Tensor                           # (B,)
    rewards_t: torch.Tensor                        # (B, L-1)
    adv: torch.Tensor                              # (B, L-1)
    targets: torch.Tensor | None                   # (B, L-1) critic targets
    filter_stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Weights:
    """π_prox and the behavior importance weights where known before the updates
    (``Trainer._proximal_and_weights``); ``proximal`` None: the single-update shortcut computes
    them per micro-batch."""

    proximal: torch.Tensor | None = None           # (B, L-1)
    weights: torch.Tensor | None = None            # (B, L-1) M2PO applied
    is_parts: tuple = ()                           # the importance statistics' parts
    m2po_stats: dict = field(default_factory=dict)
    sanity: torch.Tensor | None = None             # (B, L-1) the sanity pass, on sanity_rows only
    sanity_rows: torch.Tensor | None = None        # the micro-batch it covers (StepPlan.sanity_pass)


@dataclass(frozen=True)
class UpdateInputs:
    """Everything the update phase reads, each part the output of the phase that made it."""

    rows: StepRows
    passes: Passes
    returns: Returns
    weights: Weights


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
    is_parts: list = field(default_factory=list)   # importance statistics: Weights' or the shortcut's

    def read(self, *more):
        """The step's statistics still on the device, read at once: the policy and value loss
        parts, the importance parts, the entropy sums and the sanity check's, with ``more``
        (returned read)."""
        self.pg_parts, self.vf_parts, self.is_parts, entropy, sanity, more = ops.read_tensors(
            (self.pg_parts, self.vf_parts, self.is_parts, self.entropy_parts, self.sanity.parts, more))
        for total, tokens in entropy:
            self.entropy_sum += total
            self.entropy_tokens += tokens
        self.entropy_parts = []
        self.sanity.read(sanity)
        return more


def step_stats(cfg, batch, s: StepPlan, log: UpdateLog, *, x: UpdateInputs,
               ref_kl: tuple[float, float] | None, kl_next: float, critic: bool,
               read: dict[str, float]) -> dict[str, float]:
    """The statistics of one trained step (every value a Python float): what the service records
    and exports. ``x``: what the phases computed; ``ref_kl`` is (token mean, sequence mean) of KL
    to the reference when the step used one, ``kl_next`` the KL coefficient of the next step;
    ``critic`` whether it trained a critic; ``read``: ``score_mean`` and
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
        "ppo_epochs_run": log.applied / len(x.rows.plan[0]),
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
        if log.is_parts:
            stats.update(ops.merge_stats(log.is_parts))  # is_weight_*, is_ess_ratio, mismatch_kl, ...
        stats.update(x.weights.m2po_stats)
    if s.sanity_on and log.sanity.tokens:
        stats.update(log.sanity.stats(cfg.algorithm.sanity_ratio_tolerance, cfg.algorithm.sanity_kl_tolerance))
    if s.use_kl:
        stats["ref_kl"], stats["ref_kl_seq"] = ref_kl
        stats["kl_coef"] = s.beta
        stats["kl_coef_next"] = kl_next
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
    if any(e.turn_spans is not None for e in samples):     # multi-turn episodes (issue 26)
        masks = [e.loss_mask() for e in samples]
        model = [float(m.sum()) if m is not None else float(len(e.completion_token_ids))
                 for m, e in zip(masks, samples)]
        stats["episode_turns_mean"] = float(np.mean([e.turns for e in samples]))
        stats["episode_model_tokens_mean"] = float(np.mean(model))
        stats["episode_truncated"] = float(np.mean([bool(e.metadata.get("truncated")) for e in samples]))
        stats["tool_calls_mean"] = float(np.mean([_count(e.metadata.get("tool_calls")) for e in samples]))
        stats["tool_errors_mean"] = float(np.mean([_count(e.metadata.get("tool_errors")) for e in samples]))
        stats["environment_s_mean"] = float(np.mean([e.timing.get("environment_s", 0.0) for e in samples]))
    stats.update(x.returns.filter_stats)
    return stats


def _count(value: object) -> int:
    """A count a server reported in a sample's metadata (anything else: 0)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else 0
