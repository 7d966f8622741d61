"""Offline DPO: the learner's policy trained on preference pairs instead of rewards
(``slipstream replay --dpo``; deploy/replay.py builds the pairs from a rollout log).

Direct Preference Optimization (Rafailov et al. 2023), the loss ``ops.dpo_loss``:

    log π(y | x) = Σ_t log π(y_t | x, y_<t)                      over the completion's tokens
    u_i  = β·((log π(c_i) − log π(r_i)) − (log π_ref(c_i) − log π_ref(r_i)))
    loss = mean_i −log σ(u_i)                                    (c: chosen, r: rejected)

Shared with :class:`learner.train.trainer.Trainer`, so a DPO step and a policy step see one policy
through one function:

- the policy: :func:`learner.train.policy_io.load_policy` (``learner.runtime``: device, dtype,
  autocast, attention, dropout off, gradient checkpointing; ``learner.lora``: PEFT, only the adapter
  trained and saved), :func:`~learner.train.policy_io.adamw` with ``optimizer.weight_decay``,
  gradients clipped to ``optimizer.max_grad_norm``;
- token log-probs: :class:`learner.models.forward.LogprobForward` over
  :func:`~learner.train.batching.collate`'s right-padded rows (no ``[B, T, V]`` logits);
- micro-batches: :func:`~learner.train.batching.plan_updates` over pairs. ``batch.micro_batch_samples``
  and ``batch.micro_batch_tokens`` count rows, two per pair: a pair's rows share a micro-batch,
  since its loss term needs both.

Different: log-probs at τ = 1 (the policy's own distribution, as DPO defines it, whatever
temperature a completion was sampled at); the reference is the initial policy, its sequence
log-probs computed once at construction (no grad, eval mode, the micro-batches of the updates),
so no second model is kept (under LoRA the adapter is still the identity then: the reference is
the base); each :meth:`DPOTrainer.step` is one optimizer step over every pair, micro-batch losses
weighted n_m / N so that their gradients sum to the full batch's.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

import ops
from learner.config import TrainerConfig
from learner.models.forward import LogprobForward
from learner.train.batching import BatchTensors, collate, plan_updates
from learner.train.devices import resolve_runtime
from learner.train.policy_io import adamw, load_policy
from protocol import Sample

__all__ = ["DPOTrainer", "best_and_worst", "sequence_logprobs"]

STATS = ("dpo_loss", "reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected")
"""What a step returns besides ``grad_norm`` and ``applied``: means over every pair."""


def best_and_worst(groups: list[list[Sample]]) -> list[tuple[Sample, Sample]]:
    """(chosen, rejected): each group's highest- and lowest-reward completion, failed ones left out;
    a group whose rewards are all equal says nothing about preference and gives no pair."""
    pairs = []
    for group in groups:
        ok = [s for s in group if s.failed is None]
        if len(ok) < 2:
            continue
        best = max(ok, key=lambda s: s.reward)
        worst = min(ok, key=lambda s: s.reward)
        if best.reward > worst.reward:
            pairs.append((best, worst))
    return pairs


def sequence_logprobs(forward: LogprobForward, bt: BatchTensors) -> torch.Tensor:
    """log π(y | x) of each row, the sum of its completion's token log-probs -> (b,) (float32 or wider);
    gradients flow when enabled."""
    lp, _ = forward(bt.input_ids, bt.attention_mask, bt.targets, bt.temperatures)   # (b, L-1)
    return ops.masked_sum(lp, bt.mask, dim=-1)                                      # (b,)


class DPOTrainer:
    """The policy of ``model_path`` under ``cfg`` (the learner's config), trained by DPO on
    ``pairs`` of (chosen, rejected) samples of one prompt each; ``lr`` replaces
    ``cfg.optimizer.lr`` when given, ``label_smoothing`` is ``ops.dpo_loss``'s ε."""

    def __init__(self, cfg: TrainerConfig, model_path: str, pairs: list[tuple[Sample, Sample]], *,
                 beta: float = 0.1, lr: float | None = None, label_smoothing: float = 0.0):
        if not pairs:
            raise ValueError("DPOTrainer: no preference pairs")
        self.cfg, self.beta, self.label_smoothing = cfg, beta, label_smoothing
        runtime = resolve_runtime(cfg.runtime)           # as the Trainer's
        self.device, dtype, self.autocast = runtime.device, runtime.dtype, runtime.autocast
        torch.manual_seed(cfg.seed)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.tokenizer, self.model, self.lora_config = load_policy(cfg, model_path, dtype, self.device)
        self.model.train()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = adamw(self.trainable, lr=cfg.optimizer.lr if lr is None else lr,
                               weight_decay=cfg.optimizer.weight_decay)
        self.forward = LogprobForward(self.model, autocast=self.autocast)
        pad_id = self.tokenizer.pad_token_id
        self.pad_id = self.tokenizer.eos_token_id if pad_id is None else pad_id

        self.n_pairs = N = len(pairs)
        bt = collate([c for c, _ in pairs] + [r for _, r in pairs], self.pad_id)   # rows: N chosen, N rejected
        vocab = self.model.get_input_embeddings().num_embeddings
        if int(bt.input_ids.min()) < 0 or int(bt.input_ids.max()) >= vocab:
            raise ValueError(f"DPOTrainer: a token id outside the model's vocabulary [0, {vocab})")
        pair_lens = torch.maximum(bt.seq_lens[:N], bt.seq_lens[N:])                 # (N,)
        self.micro_batches = plan_updates(
            N, 1, 0, max(1, cfg.batch.micro_batch_samples // 2), torch.Generator().manual_seed(cfg.seed),
            pair_lens, (cfg.batch.micro_batch_tokens + 1) // 2)[0][0]               # pair indices each
        self.bt = dataclasses.replace(bt, temperatures=torch.ones_like(bt.temperatures)).to(self.device)
        self.ref_chosen, self.ref_rejected = self.sequence_logprobs()              # the initial policy, (N,) each

    def _rows(self, pair_idx: torch.Tensor) -> torch.Tensor:
        """The batch rows of some pairs: their chosen rows, then their rejected rows."""
        return torch.cat([pair_idx, pair_idx + self.n_pairs])

    @torch.no_grad()
    def sequence_logprobs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log π(c) (N,), log π(r) (N,)) at the current weights: no grad, eval mode, by the
        micro-batches of the updates (so at the initial weights a step's forward computes the same
        numbers, and its loss is exactly log 2)."""
        out = torch.zeros(2 * self.n_pairs, dtype=torch.float32, device=self.device)
        self.model.eval()
        try:
            for idx in self.micro_batches:
                rows = self._rows(idx)
                out[rows] = sequence_logprobs(self.forward, self.bt.rows(rows))
        finally:
            self.model.train()
        return out[:self.n_pairs], out[self.n_pairs:]

    def step(self) -> dict[str, float]:
        """One optimizer step on every pair -> :data:`STATS`, ``grad_norm`` (before clipping) and
        ``applied`` (0.0 when the loss or the gradient norm is not finite: the weights are kept)."""
        N = self.n_pairs
        self.optimizer.zero_grad(set_to_none=True)
        totals = dict.fromkeys(STATS, 0.0)
        parts = []
        for idx in self.micro_batches:
            n = len(idx)
            seq = sequence_logprobs(self.forward, self.bt.rows(self._rows(idx)))     # (2n,)
            loss, stats = ops.dpo_loss(seq[:n], seq[n:], self.ref_chosen[idx], self.ref_rejected[idx],
                                       beta=self.beta, label_smoothing=self.label_smoothing)
            (loss * (n / N)).backward()                     # the micro-batches sum to the batch mean
            parts.append((n, {"dpo_loss": loss.detach(), **stats}))
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.optimizer.max_grad_norm)
        parts, gn = ops.read_tensors((parts, norm))          # one device read for the step
        for n, stats in parts:
            for k, v in stats.items():
                totals[k] += v * n / N
        applied = math.isfinite(totals["dpo_loss"]) and math.isfinite(gn)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**totals, "grad_norm": gn, "applied": float(applied)}

    def save_policy(self, path: str | Path) -> Path:
        """``save_pretrained`` of the policy (the full model, or the PEFT adapter) and the tokenizer,
        as :meth:`learner.train.trainer.Trainer.save_policy` writes them."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return path
