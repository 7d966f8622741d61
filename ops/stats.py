"""Step statistics of a batch from the statistics of its parts (micro-batches, row subsets).

A trainer that splits a batch into parts (by rows) gets one stats dict per part from
``ops.importance_weights`` and ``ops.ppo_policy_loss``. The numbers it reports for the step must be
those of the whole batch, not of the last part, so each stat is combined as its definition requires,
given the count ``n_k`` of tokens part k counted (``mask != 0`` of the mask the stat was taken over):

- a mean over counted tokens (the default: ``clip_fraction``, ``approx_kl``, ``ratio_mean``,
  ``is_weight_mean``, ``mismatch_kl``, the ``*_fraction`` stats, ...):  Σ_k n_k·s_k / Σ_k n_k;
- a maximum / minimum over counted tokens (``ratio_max``, ``is_weight_max``, ...): the max / min over
  the parts that counted a token;
- ``is_ess_ratio`` = (Σw)²/(n·Σw²): each part's sums come back from its mean weight m_k and ratio
  e_k, Σw = n_k·m_k and Σw² = n_k·m_k²/e_k (e_k ≥ 1/n_k > 0 by Cauchy–Schwarz), then the ratio of
  the totals.

Parts that counted nothing are left out (their stats are the empty defaults); when no part counted
anything the first part's stats are returned as they are.

The losses and ``ops.importance_weights`` return their statistics as 0-dim tensors, so that a
trainer pays one device read for all of them (:func:`read_tensors`), not one per statistic and
micro-batch: each such read waits for the device to finish everything queued before it.
:func:`merge_stats` reads its parts first (once, if any tensor is left in them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["STAT_REDUCTIONS", "merge_stats", "read_tensors"]


def read_tensors(tree: Any) -> Any:
    """``tree`` (dicts, lists and tuples of tensors and plain values) with every tensor replaced by
    its value as a Python float (0-dim tensors only), read from the device in one transfer.

    Exactly ``float(t)`` for each (float64 holds every float32, float16, bfloat16 and integer
    count exactly), so statistics read this way equal those read one by one.
    """
    leaves: list[torch.Tensor] = []

    def collect(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            leaves.append(x)
        elif isinstance(x, Mapping):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)

    collect(tree)
    if not leaves:
        return tree
    device = leaves[0].device
    values = iter(torch.stack([t.detach().reshape(()).to(device=device, dtype=torch.float64)
                               for t in leaves]).tolist())

    def rebuild(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return next(values)
        if isinstance(x, Mapping):
            return {k: rebuild(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rebuild(v) for v in x]
        if isinstance(x, tuple):
            return tuple(rebuild(v) for v in x)
        return x

    return rebuild(tree)

STAT_REDUCTIONS: dict[str, str] = {
    "ratio_max": "max",
    "ratio_min": "min",
    "is_weight_max": "max",
    "is_weight_min": "min",
    "is_ess_ratio": "ess",
}
"""How a stat combines over parts, where it is not a token mean ("max", "min", "ess")."""


def merge_stats(parts: Sequence[tuple[Mapping[str, float], float]]) -> dict[str, float]:
    """[(stats_k, n_k), ...] -> the stats of the whole batch (see the module docstring).

    Every part must have the same keys. ``n_k`` is the count of tokens part k counted (for the
    ``is_*`` stats the mask given to ``importance_weights``, for the PPO stats the mask given to
    ``ppo_policy_loss``). ``is_ess_ratio`` needs ``is_weight_mean`` in the same dict.
    """
    if not parts:
        raise ValueError("merge_stats needs at least one part")
    parts = read_tensors(list(parts))
    keys = list(parts[0][0])
    for stats, _ in parts:
        if list(stats) != keys:
            raise ValueError(f"merge_stats: parts have different keys: {sorted(stats)} vs {sorted(keys)}")
    counted = [(s, float(n)) for s, n in parts if n > 0]
    if not counted:
        return {k: float(v) for k, v in parts[0][0].items()}
    total = sum(n for _, n in counted)
    out: dict[str, float] = {}
    for k in keys:
        how = STAT_REDUCTIONS.get(k, "mean")
        if how == "max":
            out[k] = max(float(s[k]) for s, _ in counted)
        elif how == "min":
            out[k] = min(float(s[k]) for s, _ in counted)
        elif how == "ess":
            sum_w = sum(n * s["is_weight_mean"] for s, n in counted)
            sum_w2 = sum(n * s["is_weight_mean"] ** 2 / s[k] for s, n in counted)
            out[k] = sum_w * sum_w / (total * sum_w2) if sum_w2 > 0 else 1.0
        else:
            out[k] = sum(n * float(s[k]) for s, n in counted) / total
    return out
