"""One flat byte buffer in the publish layout -> named tensor views (the learner's side is
:mod:`learner.weights`; the layout is :func:`protocol.weights.tensor_layout`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

import protocol


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ``ValueError`` for a name that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def unflatten(buffer: bytes | bytearray | memoryview,
              specs: Iterable[protocol.TensorSpec]) -> dict[str, torch.Tensor]:
    """Views of ``buffer`` as named tensors (no copy; the buffer must stay alive and writable)."""
    view = memoryview(buffer)
    out = {}
    for spec in specs:
        dtype = torch_dtype(spec.dtype)
        if spec.nbytes == 0:
            out[spec.name] = torch.empty(spec.shape, dtype=dtype)
            continue
        if spec.offset + spec.nbytes > view.nbytes:
            raise ValueError(f"tensor {spec.name!r} ends at byte {spec.offset + spec.nbytes}, "
                             f"past the {view.nbytes} bytes received")
        raw = torch.frombuffer(view, dtype=torch.uint8, count=spec.nbytes, offset=spec.offset)
        out[spec.name] = raw.view(dtype).reshape(spec.shape)
    return out
