"""Checksums and chunking for weight publishing (DESIGN.md §5).

A version's tensors are laid end to end in manifest order (``TensorSpec.offset``) and cut into
chunks of ``chunk_bytes``. Each chunk has a BLAKE2b-128 checksum; the version's checksum is the
BLAKE2b-128 of the chunk checksums in order, so a receiver can verify every chunk on arrival and
report one checksum that proves which bytes it applied.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

# Bytes per element of every dtype a weights manifest may name (torch dtype names).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
               "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def tensor_layout(items: Iterable[tuple[str, str, Sequence[int]]]):
    """The byte layout of a publish: ``(name, dtype, shape)`` laid end to end in order.

    Returns the manifest's ``TensorSpec`` list (offsets and byte sizes). The one definition of the
    layout: the learner flattens into it, a server unflattens from it.
    """
    from protocol.messages import TensorSpec

    specs, offset = [], 0
    for name, dtype, shape in items:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} cannot be published")
        nbytes = DTYPE_BYTES[dtype] * math.prod(shape)
        specs.append(TensorSpec(name=name, dtype=dtype, shape=[int(d) for d in shape],
                                offset=offset, nbytes=nbytes))
        offset += nbytes
    return specs


def chunk_checksum(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def combine_checksums(chunk_checksums: Iterable[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for c in chunk_checksums:
        h.update(c.encode("ascii"))
    return h.hexdigest()


def split_chunks(data: bytes | memoryview, chunk_bytes: int) -> list[memoryview]:
    """Zero-copy views of consecutive ``chunk_bytes`` pieces (the last may be shorter)."""
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be >= 1")
    view = memoryview(data).cast("B")
    return [view[i:i + chunk_bytes] for i in range(0, view.nbytes, chunk_bytes)]
