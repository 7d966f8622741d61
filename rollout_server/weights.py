"""One flat byte buffer in the publish layout -> named tensor views (the learner's side is
:mod:`learner.train.weights`; the layout is :func:`protocol.chunks.tensor_layout`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

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
    """Views of ``buffer`` as named tensors: no copy, any dtype (bf16 included: bytes are
    reinterpreted). ``buffer`` must be writable; every tensor (and every view of one) holds a
    reference to it (``torch.frombuffer``), so it stays alive as long as they do, and its
    reference count tells a caller when none is left."""
    nbytes = memoryview(buffer).nbytes
    out = {}
    for spec in specs:
        dtype = torch_dtype(spec.dtype)
        if spec.nbytes == 0:
            out[spec.name] = torch.empty(spec.shape, dtype=dtype)
            continue
        if spec.offset + spec.nbytes > nbytes:
            raise ValueError(f"tensor {spec.name!r} ends at byte {spec.offset + spec.nbytes}, "
                             f"past the {nbytes} bytes received")
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=spec.nbytes, offset=spec.offset)
        out[spec.name] = raw.view(dtype).reshape(spec.shape)
    return out


def unflatten_chunks(chunks: Sequence[bytes | bytearray | memoryview], chunk_bytes: int,
                     specs: Iterable[protocol.TensorSpec]) -> dict[str, torch.Tensor]:
    """Named tensors from the chunks of a publish, without joining them first.

    A tensor that lies inside one writable chunk is a view of that chunk (no copy; the chunk stays
    alive as long as the tensor does); one cut by a chunk boundary (or in a read-only chunk, such
    as ``bytes``) is copied, once, into a tensor of its own. Received chunks are frames libzmq already allocated, so this
    saves the full copy into one buffer that :func:`unflatten` needs.
    """
    out = {}
    for spec in specs:
        dtype = torch_dtype(spec.dtype)
        if spec.nbytes == 0:
            out[spec.name] = torch.empty(spec.shape, dtype=dtype)
            continue
        end = spec.offset + spec.nbytes
        first, last = spec.offset // chunk_bytes, (end - 1) // chunk_bytes
        if last >= len(chunks) or end > (last * chunk_bytes + memoryview(chunks[last]).nbytes):
            raise ValueError(f"tensor {spec.name!r} ends at byte {end}, past the chunks received")
        if first == last and not memoryview(chunks[first]).readonly:
            raw = torch.frombuffer(chunks[first], dtype=torch.uint8, count=spec.nbytes,
                                   offset=spec.offset - first * chunk_bytes)
        else:
            raw = torch.empty(spec.nbytes, dtype=torch.uint8)
            dst = memoryview(raw.numpy())
            for i in range(first, last + 1):
                lo, hi = max(spec.offset, i * chunk_bytes), min(end, (i + 1) * chunk_bytes)
                dst[lo - spec.offset:hi - spec.offset] = memoryview(chunks[i])[lo - i * chunk_bytes:hi - i * chunk_bytes]
        out[spec.name] = raw.view(dtype).reshape(spec.shape)
    return out


WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
FALLBACK_WEIGHTS_LIMIT_BYTES = 64 << 30


def default_weights_limit(model_path: str | None) -> int:
    """``rollout.weights.max_bytes: 0``: twice the model's weight files (a full update in a dtype
    twice as wide still fits), plus 64 MiB for small models; 64 GiB when there are no files to
    measure. A manifest announcing more is refused before its buffer is allocated."""
    if not model_path or not Path(model_path).is_dir():
        return FALLBACK_WEIGHTS_LIMIT_BYTES
    size = sum(f.stat().st_size for f in Path(model_path).rglob("*")
               if f.is_file() and f.name.endswith(WEIGHT_FILE_SUFFIXES))
    return 2 * size + (64 << 20) if size else FALLBACK_WEIGHTS_LIMIT_BYTES
