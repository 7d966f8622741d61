"""WeightsServer without a socket: chunks, refusals, version window, snapshots freed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import protocol
from learner.serve.weights_server import WeightsServer
from protocol.chunks import chunk_checksum, combine_checksums


def named(v: float, n: int = 1000):
    return [("w", torch.full((n,), v)), ("b", torch.arange(10, dtype=torch.int64))]


def test_chunks_reassemble_to_the_snapshot_and_match_the_manifest():
    ws = WeightsServer(chunk_bytes=1024)
    manifest = ws.publish(1, named(1.0))
    assert manifest.num_chunks == 4 and manifest.total_bytes == 4000 + 80
    protocol.decode(protocol.encode(manifest))                    # the manifest adds up on the wire
    chunks = [ws.chunk(1, i) for i in range(manifest.num_chunks)]
    assert all(isinstance(c, protocol.WeightChunk) for c in chunks)
    data = b"".join(bytes(c.data) for c in chunks)
    assert len(data) == manifest.total_bytes
    assert [chunk_checksum(c.data) for c in chunks] == manifest.chunk_checksums
    assert combine_checksums(manifest.chunk_checksums) == manifest.checksum
    w = torch.frombuffer(bytearray(data[:4000]), dtype=torch.float32)
    assert torch.equal(w, torch.full((1000,), 1.0))


def test_snapshot_is_a_copy():
    t = torch.zeros(300)
    ws = WeightsServer(chunk_bytes=4096)
    ws.publish(1, [("t", t)])
    t += 5                                                        # the next step changes the weights
    assert bytes(ws.chunk(1, 0).data) == bytes(4 * 300)


@pytest.mark.parametrize("index", [4, 5, 10**9])
def test_bad_chunk_index_is_an_error_reply(index):
    ws = WeightsServer(chunk_bytes=1024)
    ws.publish(1, named(1.0))
    reply = ws.chunk(1, index)
    assert isinstance(reply, protocol.Error) and reply.code == "bad_chunk" and "0..3" in reply.message


def test_unknown_and_dropped_versions_are_error_replies():
    ws = WeightsServer(chunk_bytes=4096, keep=2)
    assert ws.chunk(0, 0).code == "unknown_version"
    for v in (1, 2, 3):
        ws.publish(v, named(float(v), 10))
    assert ws.versions == [2, 3] and ws.latest.version == 3
    reply = ws.chunk(1, 0)
    assert reply.code == "unknown_version" and "serving: 2, 3" in reply.message
    assert ws.manifest(1) is None and ws.manifest(3).version == 3


def test_old_snapshots_are_freed():
    ws = WeightsServer(chunk_bytes=4096, keep=2)
    refs = []
    for v in (1, 2, 3, 4):
        snap = ws.prepare(ws.snapshot(v, named(float(v))))
        refs.append(weakref.ref(snap.array))      # what every chunk view keeps alive
        ws.install(snap)
        del snap
    gc.collect()
    assert [r() is None for r in refs] == [True, True, False, False]
    # 1 was dropped when 3 was installed, so 4 reused its buffer; 2's waits in the pool.
    assert ws.buffers.allocated == 3 and ws.buffers.free == 1


def test_versions_only_grow():
    ws = WeightsServer(chunk_bytes=4096)
    ws.publish(2, named(1.0))
    with pytest.raises(ValueError, match="only grow"):
        ws.publish(2, named(1.0))


async def test_handle_serves_requests_and_refuses_other_messages():
    ws = WeightsServer(chunk_bytes=1024)
    ws.publish(1, named(1.0))
    reply = await ws.handle(b"id", protocol.WeightChunkRequest(version=1, index=2))
    assert isinstance(reply, protocol.WeightChunk) and reply.index == 2
    with pytest.raises(protocol.ProtocolError, match="weights socket"):
        await ws.handle(b"id", protocol.Hello(server_id="s", engine="e", model="m", version=0))


async def test_the_egress_bytes_are_the_chunks_sent():
    """issue 28.7: slipstream_weights_egress_bytes_total counts each chunk served (two servers
    fetching one version: twice the model), not the refusals."""
    from learner.metrics import LearnerMetrics

    m = LearnerMetrics()
    ws = WeightsServer(chunk_bytes=1024, metrics=m)
    ws.publish(1, named(1.0))
    manifest = ws.manifest(1)
    for _server in range(2):
        for i in range(manifest.num_chunks):
            await ws.handle(b"id", protocol.WeightChunkRequest(version=1, index=i))
    await ws.handle(b"id", protocol.WeightChunkRequest(version=7, index=0))      # unknown: an Error
    assert m.value("slipstream_weights_egress_bytes_total") == 2 * manifest.total_bytes
