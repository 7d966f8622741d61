"""Named tensors <-> one flat byte buffer (the layout of a weights publish, DESIGN.md §5).

Pure tensor code: tensors are laid end to end in the given order; a spec per tensor records its
name, dtype, shape, byte offset and byte size. Works for any dtype, bf16 included (bytes are
reinterpreted, never converted).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def flatten_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[dict]]:
    """Copy tensors into one uint8 buffer ``[total_bytes]``; return it and the per-tensor specs."""
    items = [(name, t.detach()) for name, t in named]
    specs, offset = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        specs.append({"name": name, "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                      "offset": offset, "nbytes": nbytes})
        offset += nbytes
    flat = torch.empty(offset, dtype=torch.uint8)
    for (_, t), spec in zip(items, specs):
        if spec["nbytes"]:
            flat[spec["offset"]:spec["offset"] + spec["nbytes"]].copy_(
                t.contiguous().cpu().reshape(-1).view(torch.uint8))
    return flat, specs


def unflatten_tensors(buffer: bytes | bytearray | memoryview, specs: Iterable[dict]) -> dict[str, torch.Tensor]:
    """Views of ``buffer`` as named tensors (no copy; the buffer must stay alive and writable)."""
    view = memoryview(buffer)
    out = {}
    for spec in specs:
        dtype = dtype_from_name(spec["dtype"])
        nbytes = spec["nbytes"]
        if nbytes == 0:
            out[spec["name"]] = torch.empty(spec["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=spec["offset"])
        out[spec["name"]] = raw.view(dtype).reshape(spec["shape"])
    return out
