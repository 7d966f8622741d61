"""Turning dropout off in a transformers model, whatever form its dropout takes.

PPO's ratio at the first mini-batch is 1 only if the proximal pass (eval mode, no dropout) and the
gradient forward (train mode) compute the same function; dropout left on in the gradient forward
makes every ratio noise (the seeds' sanity check catches exactly this). RLHF trainers disable it
(TRL ``disable_dropout_in_model``, verl's actor configs): here both kinds are covered, ``nn.Dropout``
modules and the float ``*dropout*`` attributes a model reads in ``forward`` (Llama's attention
passes ``self.attention_dropout`` to its attention kernel and has no Dropout module).
"""

from __future__ import annotations

import torch

__all__ = ["disable_dropout"]


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability of ``model`` (modules, float attributes, its config) to 0.

    Returns how many were nonzero before.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            changed += module.p != 0
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                changed += value != 0
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for name, value in list(vars(config).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(config, name, 0.0)
    return changed
