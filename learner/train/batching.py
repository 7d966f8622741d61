"""A batch of samples as tensors, and how a policy step cuts it into updates.

Layout. Samples become right-padded tensors ``[B, L]`` (prompt then completion). Logits at
position t predict token t+1, so every per-token tensor is ``[B, L-1]`` and completion token j of
row i sits at column ``P_i - 1 + j``; ``mask`` marks those columns (an episode's, issue 26: only
the model's tokens, its environment's are holes). Right padding means a row's
real tokens keep their positions whatever the width, so a sub-batch may be cut to its own longest
row (``BatchTensors.rows``) and computes exactly what it would at full width.

Temperatures. Each row keeps the sampling temperature its completion was drawn at
(``temperatures``); the log-prob passes use it row by row (learner.models.forward).

Updates. ``ppo_epochs`` passes over the batch; each pass is a fresh shuffle cut into mini-batches
of ``mini_batch_samples`` rows (one optimizer step each), each cut into micro-batches of
``micro_batch_samples`` rows (one forward/backward each, gradients accumulated), or by a token
budget (``micro_batch_tokens``: rows of like lengths together, :func:`plan_updates`). A step with a
single update keeps the batch's order (groups stay contiguous, no shuffle to draw).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

import protocol

__all__ = ["BatchTensors", "collate", "plan_updates", "sampling_temperature", "take"]


HOST_FIELDS = frozenset({"seq_lens", "temperatures"})
"""Kept on the CPU by :meth:`BatchTensors.to`: a micro-batch's width and the update plan read
``seq_lens``, the forward groups rows by ``temperatures`` (learner.models.forward)."""


@dataclass
class BatchTensors:
    input_ids: torch.Tensor          # (B, L) long, right-padded
    attention_mask: torch.Tensor     # (B, L) long
    targets: torch.Tensor            # (B, L-1) long, input_ids shifted left
    mask: torch.Tensor               # (B, L-1) float, 1 on completion tokens
    behavior_logprobs: torch.Tensor  # (B, L-1) float32, 0 off the mask
    rewards: torch.Tensor            # (B,) float32
    lengths: torch.Tensor            # (B,) float32, completion tokens
    seq_lens: torch.Tensor           # (B,) long, prompt + completion tokens (kept on the CPU)
    temperatures: torch.Tensor       # (B,) float32, the sampling temperature of each row (on the CPU)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def width(self, idx: torch.Tensor) -> int:
        """L of the sub-batch ``idx``: its longest row (at least 2, so L-1 >= 1)."""
        return max(2, int(self.seq_lens[idx].max()))

    def select(self, idx: torch.Tensor) -> BatchTensors:
        """The rows ``idx`` (duplicates allowed) at the batch's full width."""
        return BatchTensors(
            input_ids=self.input_ids[idx], attention_mask=self.attention_mask[idx],
            targets=self.targets[idx], mask=self.mask[idx],
            behavior_logprobs=self.behavior_logprobs[idx], rewards=self.rewards[idx],
            lengths=self.lengths[idx], seq_lens=self.seq_lens[idx], temperatures=self.temperatures[idx])

    def to(self, device: torch.device | str) -> BatchTensors:
        """Every tensor on ``device`` (collated on the CPU, trained where the model is), except
        those the host reads for every micro-batch (:data:`HOST_FIELDS`): a read from the device
        would wait for all the work queued before it."""
        return BatchTensors(**{f.name: getattr(self, f.name) if f.name in HOST_FIELDS else
                               getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    def rows(self, idx: torch.Tensor) -> BatchTensors:
        """The rows ``idx`` (1-D long), cut to their longest row."""
        L = self.width(idx)
        return BatchTensors(
            input_ids=self.input_ids[idx, :L], attention_mask=self.attention_mask[idx, :L],
            targets=self.targets[idx, :L - 1], mask=self.mask[idx, :L - 1],
            behavior_logprobs=self.behavior_logprobs[idx, :L - 1], rewards=self.rewards[idx],
            lengths=self.lengths[idx], seq_lens=self.seq_lens[idx], temperatures=self.temperatures[idx])


def take(x: torch.Tensor, idx: torch.Tensor, width: int) -> torch.Tensor:
    """Rows ``idx`` of a full-batch per-token tensor (B, L-1), cut to sub-batch width L: (b, L-1)."""
    return x[idx, :width - 1]


def sampling_temperature(s: protocol.Sample, default: float) -> float:
    """The temperature ``s`` was sampled at: ``s.sampling_temperature``, which intake stamps with
    the temperature of the assignment the learner issued (overwriting the server's), else
    ``default`` (the run's temperature). Every pass recomputes a row's log-probs at its own
    sampling temperature, so ``ctl set temperature`` is safe while older samples are still
    buffered; the stamp travels with the sample into checkpoints and the rollout log."""
    value = s.sampling_temperature
    return float(default if value is None else value)


def collate(samples: list[protocol.Sample], pad_id: int, temperature: float = 1.0) -> BatchTensors:
    """Right-padded tensors of ``samples``; ``temperature``: the sampling temperature of rows
    without the learner's stamp (:func:`sampling_temperature`)."""
    seq = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples]
    B, L = len(samples), max(2, max(seq))
    ids = np.full((B, L), pad_id, dtype=np.int64)
    attn = np.zeros((B, L), dtype=np.int64)
    mask = np.zeros((B, L - 1), dtype=np.float32)
    behavior = np.zeros((B, L - 1), dtype=np.float32)
    for i, s in enumerate(samples):
        p, t = len(s.prompt_token_ids), len(s.completion_token_ids)
        ids[i, :p] = s.prompt_token_ids
        ids[i, p:p + t] = s.completion_token_ids
        attn[i, :p + t] = 1
        loss_mask = s.loss_mask()          # an episode: the environment's tokens are holes
        mask[i, p - 1:p - 1 + t] = 1.0 if loss_mask is None else loss_mask
        behavior[i, p - 1:p - 1 + t] = s.behavior_logprobs
    ids_t = torch.from_numpy(ids)
    return BatchTensors(
        input_ids=ids_t, attention_mask=torch.from_numpy(attn), targets=ids_t[:, 1:],
        mask=torch.from_numpy(mask), behavior_logprobs=torch.from_numpy(behavior),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        lengths=torch.tensor([len(s.completion_token_ids) for s in samples], dtype=torch.float32),
        seq_lens=torch.tensor(seq, dtype=torch.long),
        temperatures=torch.tensor([sampling_temperature(s, temperature) for s in samples],
                                  dtype=torch.float32))


def _cut(idx: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(torch.split(idx, size)) if size > 0 else [idx]


def plan_updates(batch_rows: int, epochs: int, mini_batch: int, micro_batch: int,
                 generator: torch.Generator, seq_lens: torch.Tensor | None = None,
                 micro_tokens: int = 0) -> list[list[list[torch.Tensor]]]:
    """``plan[epoch][mini_batch]`` = the micro-batches (row index tensors) of one optimizer step.

    ``mini_batch`` 0 (or >= the batch) means the whole batch. With one update in all, rows keep
    their order; otherwise every epoch draws a permutation from ``generator``.

    ``micro_tokens`` > 0 (``learner.batch.micro_batch_tokens``, with ``seq_lens``: each row's prompt +
    completion tokens): each mini-batch's rows are taken longest first and cut into micro-batches
    of at most ``micro_batch`` rows whose padded size (rows × the longest) stays within
    ``micro_tokens`` (a longer row goes alone), so short rows are not padded to the long ones
    (verl's dynamic batch size, by a token budget). The mini-batch, and so the gradient, is the
    same: every micro-batch's loss is divided by the mini-batch's normalizer.
    """
    mini = mini_batch if 0 < mini_batch < batch_rows else batch_rows
    single = epochs == 1 and mini == batch_rows
    lens = seq_lens.cpu() if micro_tokens > 0 and seq_lens is not None else None   # the plan is on the CPU
    plan = []
    for _ in range(epochs):
        order = (torch.arange(batch_rows) if single
                 else torch.randperm(batch_rows, generator=generator))
        plan.append([_pack(mb, lens, micro_batch, micro_tokens) if lens is not None else _cut(mb, micro_batch)
                     for mb in _cut(order, mini)])
    return plan


def _pack(idx: torch.Tensor, seq_lens: torch.Tensor, max_rows: int, max_tokens: int) -> list[torch.Tensor]:
    """``idx`` longest row first, cut greedily into micro-batches of at most ``max_rows`` rows and
    ``max_tokens`` padded tokens (rows × the first row's length; at least one row each)."""
    order = idx[torch.argsort(seq_lens[idx], descending=True, stable=True)]
    widths = seq_lens[order].tolist()
    out, start = [], 0
    while start < len(widths):
        take = max(1, min(max_rows if max_rows > 0 else len(widths), max_tokens // max(2, widths[start])))
        out.append(order[start:start + take])
        start += take
    return out
