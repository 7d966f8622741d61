"""slipstream ``ops``: the RL math as pure functions over torch tensors (torch only; no I/O, no config,
no globals, no device assumptions).

Conventions: per-token tensors are ``[B, T]``; ``mask`` is ``[B, T]`` bool/float, 1 for a completion
token that counts — padding never changes a result. Losses return ``(loss, stats)`` with a 0-dim loss
that carries grad and a dict of detached 0-dim tensors (``read_tensors`` reads a step's at once;
``merge_stats`` combines the dicts of micro-batches).
Low-precision inputs are reduced in float32.

The functions load on first use (``ops.<name>``, ``from ops import <name>``: PEP 562), so what
only needs the names of the choices (configs, ``ops.names``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .names import (
    ADVANTAGE_METHODS,
    CLIP_ANCHORS,
    GROUP_ADVANTAGE_METHODS,
    IS_MODES,
    KL_KINDS,
    LOSS_AGG_MODES,
    PF_PPO_METHODS,
    POLICY_LOSSES,
)

_WHERE = {
    "AdaptiveKLController": "controllers",
    "FixedKLController": "controllers",
    "RunningMoments": "shaping",
    "STAT_REDUCTIONS": "stats",
    "aggregate_loss": "masked",
    "batch_normalize": "shaping",
    "behavior_anchored_weights": "importance",
    "cispo_policy_loss": "losses",
    "clip_rewards": "shaping",
    "cpu_facts": "precision",
    "discounted_reverse_cumsum": "advantages",
    "dpo_loss": "losses",
    "entropy_from_hidden": "logprobs",
    "entropy_from_logits": "logprobs",
    "entropy_loss": "losses",
    "gae": "advantages",
    "group_advantages": "advantages",
    "gspo_policy_loss": "losses",
    "importance_weights": "importance",
    "kl_estimate": "kl",
    "kl_loss": "losses",
    "last_token_index": "shaping",
    "length_penalty": "shaping",
    "loss_normalizer": "masked",
    "m2po_mask": "m2po",
    "masked_mean": "masked",
    "masked_sum": "masked",
    "masked_var": "masked",
    "masked_whiten": "masked",
    "merge_stats": "stats",
    "native_bfloat16": "precision",
    "overlong_penalty": "shaping",
    "pf_ppo_resample": "filtration",
    "pf_ppo_weights": "filtration",
    "ppo_policy_loss": "losses",
    "read_tensors": "stats",
    "reinforce_pp_advantages": "advantages",
    "returns_to_go": "advantages",
    "shape_token_rewards": "shaping",
    "token_logprobs": "logprobs",
    "token_logprobs_from_hidden": "logprobs",
    "value_loss": "losses",
    "vtrace": "advantages",
    "weights_finite": "health",
}
"""Each public function or class -> the submodule that defines it."""


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ops' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value                 # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ADVANTAGE_METHODS",
    "CLIP_ANCHORS",
    "GROUP_ADVANTAGE_METHODS",
    "IS_MODES",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "PF_PPO_METHODS",
    "POLICY_LOSSES",
    "STAT_REDUCTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "RunningMoments",
    "aggregate_loss",
    "batch_normalize",
    "behavior_anchored_weights",
    "cispo_policy_loss",
    "clip_rewards",
    "cpu_facts",
    "discounted_reverse_cumsum",
    "dpo_loss",
    "entropy_from_hidden",
    "entropy_from_logits",
    "entropy_loss",
    "gae",
    "group_advantages",
    "gspo_policy_loss",
    "importance_weights",
    "kl_estimate",
    "kl_loss",
    "last_token_index",
    "length_penalty",
    "loss_normalizer",
    "m2po_mask",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "merge_stats",
    "native_bfloat16",
    "overlong_penalty",
    "pf_ppo_resample",
    "pf_ppo_weights",
    "ppo_policy_loss",
    "read_tensors",
    "reinforce_pp_advantages",
    "returns_to_go",
    "shape_token_rewards",
    "token_logprobs",
    "token_logprobs_from_hidden",
    "value_loss",
    "vtrace",
    "weights_finite",
]
