"""Named tensors -> one flat byte buffer in the publish layout of :func:`protocol.weights.tensor_layout`.

Tensors are laid end to end in the given order; the manifest's ``TensorSpec`` list records name,
dtype, shape, byte offset and byte size. Works for any dtype, bf16 included (bytes are
reinterpreted, never converted). The receiving side is :mod:`rollout_server.weights`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

import protocol
from protocol.weights import tensor_layout


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the manifest's dtype names)."""
    return str(dtype).removeprefix("torch.")


def flatten(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[protocol.TensorSpec]]:
    """Copy tensors into one uint8 buffer ``[total_bytes]``; return it and the manifest's specs."""
    items = [(name, t.detach()) for name, t in named]
    specs = tensor_layout((name, dtype_name(t.dtype), tuple(t.shape)) for name, t in items)
    flat = torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8)
    for (_, t), spec in zip(items, specs):
        if spec.nbytes:
            flat[spec.offset:spec.offset + spec.nbytes].copy_(
                t.contiguous().cpu().reshape(-1).view(torch.uint8))
    return flat, specs
