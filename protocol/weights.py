"""Checksums and chunking for weight publishing (DESIGN.md §5).

A version's tensors are laid end to end in manifest order (``TensorSpec.offset``) and cut into
chunks of ``chunk_bytes``. Each chunk has a BLAKE2b-128 checksum; the version's checksum is the
BLAKE2b-128 of the chunk checksums in order, so a receiver can verify every chunk on arrival and
report one checksum that proves which bytes it applied.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


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
