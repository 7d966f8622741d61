"""The policy and one policy step: recompute, correct, GRPO loss, optimizer step (DESIGN.md §4).

A batch of samples becomes right-padded tensors ``[B, L]`` (prompt then completion). Logits at
position t predict token t+1, so every per-token tensor is ``[B, L-1]`` and completion token j of
row i sits at column ``P_i - 1 + j``; ``mask`` marks those columns.

With one optimizer step per batch (the default) the proximal policy *is* the current weights, so
the proximal log-probs are the detached log-probs of the gradient forward — the same numbers a
separate no-grad recompute pass would give, for half the forwards. ``recompute_logprobs: false``
uses the behavior log-probs instead (w = 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

import ops
import protocol
from learner.config import LearnerConfig


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

    def step(self, samples: list[protocol.Sample], staleness: list[int]) -> dict[str, float]:
        """One policy step on a batch whose groups are contiguous and complete."""
        cfg = self.cfg
        start = time.monotonic()
        bt = collate(samples, self.pad_id)
        B = len(samples)
        adv = ops.group_advantages(bt.rewards, cfg.group_size, cfg.advantage)       # (B,)
        advantages = adv[:, None] * bt.mask                                        # (B, L-1)
        proximal_all = torch.zeros_like(bt.mask)
        entropy_all = torch.zeros_like(bt.mask)
        # Global denominator, so that the micro-batch losses add up to the full-batch loss.
        if cfg.loss_agg == "token_mean":
            normalizer = max(1.0, float(bt.mask.sum()))
        else:
            normalizer = max(1.0, float((bt.mask.sum(dim=1) > 0).sum()))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, pg_stats = 0.0, {}
        for lo in range(0, B, cfg.micro_batch_samples):
            rows = slice(lo, min(B, lo + cfg.micro_batch_samples))
            logits = self._logits(bt, rows)
            logprobs = ops.token_logprobs(logits, bt.targets[rows], temperature=cfg.temperature)
            with torch.no_grad():
                entropy_all[rows] = ops.entropy_from_logits(logits.detach(), temperature=cfg.temperature)
            mask = bt.mask[rows]
            behavior = bt.behavior_logprobs[rows]
            proximal = logprobs.detach() if cfg.recompute_logprobs else behavior
            proximal_all[rows] = proximal
            weights, loss_mask, _ = ops.importance_weights(proximal, behavior, mask, mode=cfg.is_mode,
                                                           cap=cfg.is_cap)
            loss, pg_stats = ops.ppo_policy_loss(
                logprobs, proximal, advantages[rows], loss_mask, clip_low=cfg.clip_low,
                clip_high=cfg.clip_high, is_weights=weights, agg=cfg.loss_agg, normalizer=normalizer)
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
        self.optimizer.step()
        _, _, is_stats = ops.importance_weights(proximal_all, bt.behavior_logprobs, bt.mask,
                                                mode=cfg.is_mode, cap=cfg.is_cap)
        lengths = bt.mask.sum(dim=1)
        stats = {
            "loss": loss_sum,
            "reward_mean": float(bt.rewards.mean()),
            "reward_std": float(bt.rewards.std()) if B > 1 else 0.0,
            "advantage_abs_mean": float(adv.abs().mean()),
            "entropy": float(ops.masked_mean(entropy_all, bt.mask)),
            "grad_norm": grad_norm,
            "completion_tokens_mean": float(lengths.mean()),
            "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
            "staleness_max": float(max(staleness)) if staleness else 0.0,
            "samples": float(B),
            "step_s": time.monotonic() - start,
        }
        stats.update({f"pg_{k}": float(v) for k, v in pg_stats.items()})
        stats.update({k: float(v) for k, v in is_stats.items()})      # is_weight_*, mismatch_kl, ...
        return stats
