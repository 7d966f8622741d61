"""The policy and one policy step: recompute, correct, GRPO loss, optimizer step (DESIGN.md §4).

A batch of samples becomes right-padded tensors ``[B, L]`` (prompt then completion). Logits at
position t predict token t+1, so every per-token tensor is ``[B, L-1]`` and completion token j of
row i sits at column ``P_i - 1 + j``; ``mask`` marks those columns.

With one optimizer step per batch (the default) the proximal policy *is* the current weights, so
the proximal log-probs are the detached log-probs of the gradient forward — the same numbers a
separate no-grad recompute pass would give, for half the forwards. ``recompute_logprobs: false``
uses the behavior log-probs instead (w = 1), except for samples flagged ``needs_correction``, which
are always weighed against the current weights (see :meth:`Trainer.step`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

import ops
import protocol
from buffer import Batch
from learner.config import LearnerConfig

FLAGGED_IS_MODE = "tis"
"""Importance-weight mode of samples flagged ``needs_correction`` when ``is_mode`` is ``none``."""


@dataclass
class BatchTensors:
    input_ids: torch.Tensor          # (B, L) long, right-padded
    attention_mask: torch.Tensor     # (B, L) long
    targets: torch.Tensor            # (B, L-1) long, input_ids shifted left
    mask: torch.Tensor               # (B, L-1) float, 1 on completion tokens
    behavior_logprobs: torch.Tensor  # (B, L-1) float32, 0 off the mask
    rewards: torch.Tensor            # (B,) float32


def collate(samples: list[protocol.Sample], pad_id: int) -> BatchTensors:
    lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples]
    B, L = len(samples), max(lengths)
    ids = np.full((B, L), pad_id, dtype=np.int64)
    attn = np.zeros((B, L), dtype=np.int64)
    mask = np.zeros((B, L - 1), dtype=np.float32)
    behavior = np.zeros((B, L - 1), dtype=np.float32)
    for i, s in enumerate(samples):
        p, t = len(s.prompt_token_ids), len(s.completion_token_ids)
        ids[i, :p] = s.prompt_token_ids
        ids[i, p:p + t] = s.completion_token_ids
        attn[i, :p + t] = 1
        mask[i, p - 1:p - 1 + t] = 1.0
        behavior[i, p - 1:p - 1 + t] = s.behavior_logprobs
    ids_t = torch.from_numpy(ids)
    return BatchTensors(
        input_ids=ids_t, attention_mask=torch.from_numpy(attn), targets=ids_t[:, 1:],
        mask=torch.from_numpy(mask), behavior_logprobs=torch.from_numpy(behavior),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32))


class Trainer:
    """Owns the policy model, its tokenizer and optimizer."""

    def __init__(self, cfg: LearnerConfig, model_path: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr,
                                           weight_decay=cfg.weight_decay)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        # Rows of the input embedding: every token id of a trained sample must be below it (the
        # learner validates results against it before accepting them).
        self.vocab_size: int = self.model.get_input_embeddings().num_embeddings

    def encode_prompt(self, text: str) -> np.ndarray:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return np.asarray(ids, dtype=np.int32)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What a full-weights publish sends (tied parameters once)."""
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def _logits(self, bt: BatchTensors, rows: slice) -> torch.Tensor:
        out = self.model(input_ids=bt.input_ids[rows], attention_mask=bt.attention_mask[rows],
                         use_cache=False)
        return out.logits[:, :-1]                                                  # (b, L-1, V)

    def _importance(self, proximal: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor,
                    flagged: torch.Tensor) -> tuple[torch.Tensor, list[tuple[dict, int]]]:
        """Behavior weights of one micro-batch -> (weights (b, L-1), [(is_stats, tokens), ...]).

        Rows flagged ``needs_correction`` under ``is_mode: none`` get ``FLAGGED_IS_MODE`` with
        ``is_cap``; every other row gets ``is_mode``. Each row is weighed once; every mode is
        row-local, so weighing the two sets of rows apart gives each row what the whole micro-batch
        would. Tokens that ``mis`` / ``seq_mis`` reject have weight 0.
        """
        cfg = self.cfg
        if cfg.is_mode != "none" or not bool(flagged.any()):
            w, _, st = ops.importance_weights(proximal, behavior, mask, mode=cfg.is_mode, cap=cfg.is_cap)
            return w, [(st, int((mask != 0).sum()))]
        weights = torch.zeros_like(proximal)                                       # (b, L-1)
        parts = []
        for rows, mode in ((~flagged, "none"), (flagged, FLAGGED_IS_MODE)):
            if not bool(rows.any()):
                continue
            w, _, st = ops.importance_weights(proximal[rows], behavior[rows], mask[rows], mode=mode,
                                              cap=cfg.is_cap)
            weights[rows] = w.to(weights.dtype)
            parts.append((st, int((mask[rows] != 0).sum())))
        return weights, parts

    def step(self, batch: Batch) -> dict[str, float]:
        """One policy step (one optimizer step) on a batch whose groups are contiguous and complete.

        Micro-batches of ``micro_batch_samples`` rows accumulate gradients; each micro-batch loss is
        divided by ``ops.loss_normalizer`` of the whole batch's mask, so their sum is the
        full-batch loss and the gradients do not depend on the split. Tokens that ``mis`` /
        ``seq_mis`` reject get weight 0 and keep their place in every denominator (the token count,
        the per-row means), as in AReaL's decoupled loss: a rejected token is not trained, and does
        not raise the weight of the others. (The denominator is thus known before the forwards
        whose log-probs decide the rejections.) The step is one ``ops.ppo_policy_loss`` over the
        whole batch, with the completion mask and these weights.

        Correction of samples flagged ``needs_correction`` (over ``max_staleness`` under
        ``stale_policy: correct``): they always get behavior importance weights w = π_prox/μ —
        ``is_mode`` when it is not ``none``, and ``tis`` capped at ``is_cap`` when it is (a sample the
        operator asked to correct is corrected; truncation rather than masking keeps every one of
        its tokens in the batch, as the flag promises to train it). Their proximal log-probs are
        always the current weights' (the detached gradient-forward log-probs), even under
        ``recompute_logprobs: false``, since π_prox := μ would make every weight 1. Unflagged
        samples train exactly as without the flag.

        Importance weights are computed once per micro-batch; every statistic (``pg_*``,
        ``is_*``, ``mismatch_kl``, entropy) is that of the whole batch, combined over the
        micro-batches by ``ops.merge_stats`` (token-weighted means, max of maxima, ...).
        """
        cfg = self.cfg
        start = time.monotonic()
        samples = batch.samples
        B = len(samples)
        if B == 0:
            raise ValueError("Trainer.step: empty batch")
        flags = list(batch.needs_correction) or [False] * B
        if len(flags) != B:
            raise ValueError(f"Trainer.step: {len(flags)} needs_correction flags for {B} samples")
        bt = collate(samples, self.pad_id)
        low, top = int(bt.input_ids.min()), int(bt.input_ids.max())
        if low < 0 or top >= self.vocab_size:   # the learner refuses such results; never index past
            bad = low if low < 0 else top
            raise ValueError(f"Trainer.step: token id {bad} outside the vocabulary [0, {self.vocab_size})")
        flagged = torch.tensor(flags, dtype=torch.bool)                             # (B,)
        adv = ops.group_advantages(bt.rewards, cfg.group_size, cfg.advantage)       # (B,)
        advantages = adv[:, None] * bt.mask                                        # (B, L-1)
        normalizer = ops.loss_normalizer(bt.mask, cfg.loss_agg)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, entropy_sum = 0.0, 0.0
        pg_parts: list[tuple[dict, int]] = []
        is_parts: list[tuple[dict, int]] = []
        for lo in range(0, B, cfg.micro_batch_samples):
            rows = slice(lo, min(B, lo + cfg.micro_batch_samples))
            logits = self._logits(bt, rows)
            logprobs = ops.token_logprobs(logits, bt.targets[rows], temperature=cfg.temperature)
            mask = bt.mask[rows]
            with torch.no_grad():
                entropy = ops.entropy_from_logits(logits.detach(), temperature=cfg.temperature)
                entropy_sum += float(ops.masked_sum(entropy, mask))
            behavior = bt.behavior_logprobs[rows]
            current = logprobs.detach()
            if cfg.recompute_logprobs:
                proximal = current
            else:
                proximal = torch.where(flagged[rows, None], current, behavior)
            weights, parts = self._importance(proximal, behavior, mask, flagged[rows])
            loss, pg_stats = ops.ppo_policy_loss(
                logprobs, proximal, advantages[rows], mask, clip_low=cfg.clip_low,
                clip_high=cfg.clip_high, is_weights=weights, agg=cfg.loss_agg, normalizer=normalizer)
            loss.backward()
            loss_sum += float(loss.detach())
            pg_parts.append((pg_stats, int((mask != 0).sum())))
            is_parts.extend(parts)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
        self.optimizer.step()
        staleness = batch.staleness
        lengths = bt.mask.sum(dim=1)
        stats = {
            "loss": loss_sum,
            "reward_mean": float(bt.rewards.mean()),
            "reward_std": float(bt.rewards.std()) if B > 1 else 0.0,
            "advantage_abs_mean": float(adv.abs().mean()),
            "entropy": entropy_sum / max(1.0, float(bt.mask.sum())),
            "grad_norm": grad_norm,
            "completion_tokens_mean": float(lengths.mean()),
            "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
            "staleness_max": float(max(staleness)) if staleness else 0.0,
            "corrected_samples": float(flagged.sum()),
            "samples": float(B),
            "step_s": time.monotonic() - start,
        }
        stats.update({f"pg_{k}": v for k, v in ops.merge_stats(pg_parts).items()})
        stats.update(ops.merge_stats(is_parts))       # is_weight_*, is_ess_ratio, mismatch_kl, ...
        return stats
