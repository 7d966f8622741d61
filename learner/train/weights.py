"""Named tensors -> one flat byte buffer in the publish layout of :func:`protocol.chunks.tensor_layout`.

Tensors are laid end to end in the given order; the manifest's ``TensorSpec`` list records name,
dtype, shape, byte offset and byte size. Works for any dtype, bf16 included (bytes are
reinterpreted, never converted). The receiving side is :mod:`rollout_server.weights`.

Two steps so that a publisher can copy into a buffer it reuses (:mod:`learner.serve.weights_server`):
:func:`layout` (names, dtypes, shapes -> specs; nothing copied) and :func:`copy_into` (one copy
per tensor into the caller's buffer; from CUDA into pinned memory it is asynchronous).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

import protocol
from protocol.chunks import tensor_layout


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the manifest's dtype names)."""
    return str(dtype).removeprefix("torch.")


def layout(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[torch.Tensor], list[protocol.TensorSpec]]:
    """The tensors (detached) and their specs in the publish layout; raises ``ValueError`` for a
    dtype that cannot be published."""
    items = [(name, t.detach()) for name, t in named]
    specs = tensor_layout((name, dtype_name(t.dtype), tuple(t.shape)) for name, t in items)
    return [t for _, t in items], specs


def copy_into(tensors: list[torch.Tensor], specs: list[protocol.TensorSpec], flat: torch.Tensor,
              non_blocking: bool = False) -> None:
    """Copy each tensor's bytes to its spec's place in ``flat`` (uint8, on the CPU).

    ``non_blocking`` makes copies from CUDA into pinned ``flat`` asynchronous on the current
    stream: the caller records an event and waits on it before reading ``flat``. Later work on
    that stream (the next optimizer step) runs after the copies, so it cannot change what they
    read.
    """
    host = flat.numpy()
    for t, spec in zip(tensors, specs):
        if not spec.nbytes:
            continue
        src = t.contiguous().reshape(-1).view(torch.uint8)
        if src.device.type == "cpu":
            # numpy's copy is one memcpy on this thread; torch's copy_ goes through its intra-op
            # thread pool, whose barrier costs more than the copy on a loaded machine.
            host[spec.offset:spec.offset + spec.nbytes] = src.resolve_conj().resolve_neg().numpy()
        else:
            flat[spec.offset:spec.offset + spec.nbytes].copy_(src, non_blocking=non_blocking)


def flatten(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[protocol.TensorSpec]]:
    """Copy tensors into one new uint8 buffer ``[total_bytes]``; return it and the manifest's specs."""
    tensors, specs = layout(named)
    flat = torch.empty(sum(s.nbytes for s in specs), dtype=torch.uint8)
    copy_into(tensors, specs, flat)
    return flat, specs
