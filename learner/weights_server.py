"""The weights server: one snapshot per published version, announced by manifest, served in chunks.

Publishing a version (DESIGN.md §5) copies the tensors into one flat buffer in the layout of
:func:`learner.weights.flatten` — a snapshot, so the next policy step may change the parameters
while servers are still fetching — and cuts it into ``chunk_bytes`` chunks with a checksum each
(:mod:`protocol.weights`). Chunks go out as zero-copy views of the snapshot.

The newest ``keep`` versions stay: a server still fetching version v when v + 1 is published can
finish. An older snapshot is dropped from the table at once; its memory is freed as soon as no
chunk of it is still queued in ZeroMQ (a queued zero-copy frame holds a reference to its bytes).

Two steps, so the copy runs off the event loop and the table changes only on it:
``prepare`` (pure: flatten + checksums; call it in a worker thread) and ``install`` (on the loop).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

import protocol
from learner.weights import flatten
from protocol.weights import chunk_checksum, combine_checksums, split_chunks


@dataclass(frozen=True)
class Snapshot:
    """One published version: its manifest, its bytes, and the chunk views of those bytes."""

    manifest: protocol.WeightsAvailable
    flat: torch.Tensor                 # uint8 [total_bytes], owned by this snapshot
    chunks: list[memoryview]


class WeightsServer:
    """Published versions (newest ``keep``) and the answer to every ``WeightChunkRequest``."""

    def __init__(self, chunk_bytes: int, kind: str = "full", keep: int = 2,
                 metadata: dict[str, Any] | None = None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep!r}")
        self.chunk_bytes = chunk_bytes
        self.kind = kind
        self.keep = keep
        self.metadata = dict(metadata or {})
        self._versions: OrderedDict[int, Snapshot] = OrderedDict()

    def prepare(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Snapshot:
        """Copy the tensors into a new snapshot of ``version`` (thread-safe: touches no state)."""
        flat, specs = flatten(named_tensors)
        chunks = split_chunks(flat.numpy().data, self.chunk_bytes)
        sums = [chunk_checksum(c) for c in chunks]
        manifest = protocol.WeightsAvailable(
            version=version, kind=self.kind, tensors=specs, total_bytes=flat.numel(),
            chunk_bytes=self.chunk_bytes, num_chunks=len(chunks), checksum=combine_checksums(sums),
            chunk_checksums=sums, metadata=dict(self.metadata))
        return Snapshot(manifest, flat, chunks)

    def install(self, snapshot: Snapshot) -> protocol.WeightsAvailable:
        """Serve ``snapshot`` from now on (versions only grow); forget versions beyond ``keep``."""
        version = snapshot.manifest.version
        if self._versions and version <= next(reversed(self._versions)):
            raise ValueError(f"weights version {version} published after "
                             f"{next(reversed(self._versions))}: versions only grow")
        self._versions[version] = snapshot
        while len(self._versions) > self.keep:
            self._versions.popitem(last=False)
        return snapshot.manifest

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> protocol.WeightsAvailable:
        """``install(prepare(...))`` in one call (on the loop; for tests and small models)."""
        return self.install(self.prepare(version, named_tensors))

    @property
    def versions(self) -> list[int]:
        """Versions being served, oldest first."""
        return list(self._versions)

    @property
    def latest(self) -> protocol.WeightsAvailable | None:
        return self._versions[next(reversed(self._versions))].manifest if self._versions else None

    def manifest(self, version: int) -> protocol.WeightsAvailable | None:
        snap = self._versions.get(version)
        return snap.manifest if snap is not None else None

    def chunk(self, version: int, index: int) -> protocol.WeightChunk | protocol.Error:
        """Chunk ``index`` of ``version``, or an ``Error`` saying why there is none.

        An unknown (or no longer kept) version and an index past the last chunk are answers, not
        protocol errors: a slow server asking for a version just dropped is normal, and it should
        hear why (it fetches the newest version instead).
        """
        snap = self._versions.get(version)
        if snap is None:
            kept = ", ".join(map(str, self._versions)) or "none yet"
            return protocol.Error(code="unknown_version",
                                  message=f"version {version} is not (or no longer) published; "
                                          f"serving: {kept}")
        n = len(snap.chunks)
        if not 0 <= index < n:
            return protocol.Error(code="bad_chunk",
                                  message=f"version {version} has chunks 0..{n - 1}, not {index}")
        return protocol.WeightChunk(version=version, index=index,
                                    checksum=snap.manifest.chunk_checksums[index], data=snap.chunks[index])

    async def handle(self, identity: bytes, msg: protocol.Message) -> protocol.Message:
        """The weights socket's handler: a ``WeightChunkRequest`` in, a chunk or an Error out."""
        if not isinstance(msg, protocol.WeightChunkRequest):
            raise protocol.ProtocolError(f"weights socket: {type(msg).TYPE} is not a "
                                         f"{protocol.WeightChunkRequest.TYPE}")
        return self.chunk(msg.version, msg.index)
