"""Is a model still a model after an update: a check of its weights cheap enough for every step.

``weights_finite(tensors)`` is true when every tensor's float32 L2 norm is finite. One norm per
tensor (``torch._foreach_norm``: a fused kernel per device and dtype, no copy of the weights): a NaN
or an infinity anywhere makes its tensor's norm non-finite, and so does a weight past ~1.8e19,
whose square overflows float32 — an update with a learning rate of 1e30 leaves weights that are
finite one by one and useless together (logits of 1e30, softmax of inf - inf). A real model's
weights are orders of magnitude below that bound.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["weights_finite"]


@torch.no_grad()
def weights_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True when every tensor of ``tensors`` has a finite float32 L2 norm (an empty list: True)."""
    tensors = [t.detach() for t in tensors if t.numel()]
    if not tensors:
        return True
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for n in torch._foreach_norm(tensors, 2, dtype=torch.float32):   # fp16/bf16: float32 sums, no copy
        by_device.setdefault(n.device, []).append(n.float())
    return all(bool(torch.isfinite(torch.stack(norms)).all()) for norms in by_device.values())
