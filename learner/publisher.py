"""Weight publisher: one flat buffer per version, announced by manifest, served in chunks.

The learner keeps the newest ``keep`` versions in memory so a server that is still fetching
version v when v+1 is published can finish; chunks are zero-copy views of the version's buffer.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

import protocol
from ops.tensor_bytes import flatten_tensors
from protocol.weights import chunk_checksum, combine_checksums, split_chunks


class WeightPublisher:
    def __init__(self, chunk_bytes: int, kind: str = "full", keep: int = 2):
        self.chunk_bytes = chunk_bytes
        self.kind = kind
        self.keep = keep
        self.versions: OrderedDict[int, tuple[protocol.WeightsAvailable, list[memoryview], torch.Tensor]] = OrderedDict()

    def publish(self, version: int, named_tensors) -> protocol.WeightsAvailable:
        flat, specs = flatten_tensors(named_tensors)
        chunks = split_chunks(flat.numpy().data, self.chunk_bytes)
        sums = [chunk_checksum(c) for c in chunks]
        manifest = protocol.WeightsAvailable(
            version=version, kind=self.kind, tensors=[protocol.TensorSpec(**s) for s in specs],
            total_bytes=flat.numel(), chunk_bytes=self.chunk_bytes, num_chunks=len(chunks),
            checksum=combine_checksums(sums), chunk_checksums=sums)
        self.versions[version] = (manifest, chunks, flat)
        while len(self.versions) > self.keep:
            self.versions.popitem(last=False)
        return manifest

    @property
    def latest(self) -> protocol.WeightsAvailable | None:
        return next(reversed(self.versions.values()))[0] if self.versions else None

    def chunk(self, version: int, index: int) -> protocol.Message:
        entry = self.versions.get(version)
        if entry is None:
            return protocol.Error(code="unknown_version",
                                  message=f"version {version} is not (or no longer) published")
        manifest, chunks, _ = entry
        if index >= len(chunks):
            return protocol.Error(code="bad_chunk", message=f"chunk {index} >= {len(chunks)}")
        return protocol.WeightChunk(version=version, index=index,
                                    checksum=manifest.chunk_checksums[index], data=chunks[index])
