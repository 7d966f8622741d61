"""The names of the choices ``ops`` offers (estimators, modes, kinds), without torch: configs and
command lines validate against them without paying torch's import (seconds) at start-up."""

from __future__ import annotations

GROUP_ADVANTAGE_METHODS = ("grpo", "dr_grpo", "rloo")
"""Estimators that need only the scores of each group (``group_advantages``)."""
ADVANTAGE_METHODS = (*GROUP_ADVANTAGE_METHODS, "gae", "reinforce_pp")
"""Every advantage estimator a trainer offers: the group ones, ``gae`` (with a critic) and
``reinforce_pp`` (``reinforce_pp_advantages``, no critic, no groups)."""
IS_MODES = ("none", "tis", "mis", "seq_tis", "seq_mis", "geo_mis", "icepop")
"""Behavior importance weighting modes (``importance_weights``)."""
CLIP_ANCHORS = ("proximal", "behavior")
"""Where the PPO clip's ratio is anchored: π_prox (decoupled PPO) or the behavior policy μ
(``behavior_anchored_weights``)."""
KL_KINDS = ("k1", "k2", "k3")
"""KL estimators (``kl_estimate``)."""
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
"""Loss aggregations (``aggregate_loss``)."""
POLICY_LOSSES = ("ppo", "gspo", "cispo")
"""Policy losses (``ppo_policy_loss``, ``gspo_policy_loss``, ``cispo_policy_loss``)."""
PF_PPO_METHODS = ("pow", "max_min", "max_random")
"""PF-PPO reweighting methods (``pf_ppo_weights``)."""
