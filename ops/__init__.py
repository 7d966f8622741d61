"""slipstream ``ops``: the RL math as pure functions over torch tensors (torch only; no I/O, no config,
no globals, no device assumptions).

Conventions: per-token tensors are ``[B, T]``; ``mask`` is ``[B, T]`` bool/float, 1 for a completion
token that counts — padding never changes a result. Losses return ``(loss, stats)`` with a 0-dim loss
that carries grad and a dict of plain floats (``merge_stats`` combines the dicts of micro-batches).
Low-precision inputs are reduced in float32.
"""

from .advantages import (
    ADVANTAGE_METHODS,
    GROUP_ADVANTAGE_METHODS,
    discounted_reverse_cumsum,
    gae,
    group_advantages,
    reinforce_pp_advantages,
    returns_to_go,
    vtrace,
)
from .controllers import AdaptiveKLController, FixedKLController
from .filtration import PF_PPO_METHODS, pf_ppo_resample, pf_ppo_weights
from .importance import IS_MODES, importance_weights
from .kl import KL_KINDS, kl_estimate
from .logprobs import entropy_from_hidden, entropy_from_logits, token_logprobs, token_logprobs_from_hidden
from .losses import dpo_loss, entropy_loss, kl_loss, ppo_policy_loss, value_loss
from .m2po import m2po_mask
from .masked import (
    LOSS_AGG_MODES,
    aggregate_loss,
    loss_normalizer,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from .rewards import (
    RunningMoments,
    batch_normalize,
    clip_rewards,
    last_token_index,
    length_penalty,
    shape_token_rewards,
)
from .stats import STAT_REDUCTIONS, merge_stats

__all__ = [
    "ADVANTAGE_METHODS",
    "GROUP_ADVANTAGE_METHODS",
    "IS_MODES",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "PF_PPO_METHODS",
    "STAT_REDUCTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "RunningMoments",
    "aggregate_loss",
    "batch_normalize",
    "clip_rewards",
    "discounted_reverse_cumsum",
    "dpo_loss",
    "entropy_from_hidden",
    "entropy_from_logits",
    "entropy_loss",
    "gae",
    "group_advantages",
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
    "pf_ppo_resample",
    "pf_ppo_weights",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "returns_to_go",
    "shape_token_rewards",
    "token_logprobs",
    "token_logprobs_from_hidden",
    "value_loss",
    "vtrace",
]
