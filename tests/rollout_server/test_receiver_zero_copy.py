"""The receiving side's copies: chunks are received zero-copy (views of the zmq.Frame), copied once
into the version's buffer, unflattened as views of it, and the buffer is reused for the next
version only when the engine kept no tensor of it. Real ZeroMQ sockets, the learner's real
weights socket loop and WeightsServer."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import numpy as np
import torch
import zmq
import zmq.asyncio

import protocol
from learner.metrics import LearnerMetrics
from learner.serve.router import RouterSocket
from learner.serve.weights_server import WeightsServer
from protocol.plumbing.sockets import make_socket
from rollout_server.metrics import RolloutMetrics
from rollout_server.receiver import CHUNK_FRAME_SLACK_BYTES, WeightsReceiver, ZmqChunkChannel
from rollout_server.weights import unflatten, unflatten_chunks


def _address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def test_unflatten_returns_views_of_the_buffer_in_any_dtype():
    tensors = [("a", torch.randn(7)), ("b", torch.randn(3, 5).to(torch.bfloat16)),
               ("c", torch.arange(4, dtype=torch.int64)), ("z", torch.empty(0))]
    ws = WeightsServer(chunk_bytes=1 << 20)
    m = ws.publish(1, tensors)
    buf = bytearray(ws.chunk(1, 0).data)
    view = memoryview(buf)
    before = sys.getrefcount(view)
    out = unflatten(view, m.tensors)
    base = _address(buf)
    for spec in m.tensors:
        if spec.nbytes:
            assert out[spec.name].data_ptr() == base + spec.offset, spec.name   # no copy
    buf[0:4] = np.float32(42.0).tobytes()                                     # the same bytes
    assert out["a"][0].item() == 42.0
    assert torch.equal(out["b"].view(torch.int16), tensors[1][1].view(torch.int16))
    # Each tensor holds a reference to the buffer object: the receiver's test for "all dropped".
    assert sys.getrefcount(view) > before
    kept = out["b"].reshape(-1)                   # a view of a view still holds it
    del out
    assert sys.getrefcount(view) > before
    del kept
    assert sys.getrefcount(view) == before


@contextlib.asynccontextmanager
async def weights_socket(ws: WeightsServer):
    """The learner's weights socket loop over a real ROUTER; yields its endpoint."""
    ctx = zmq.asyncio.Context.instance()
    sock = make_socket(ctx, zmq.ROUTER, max_message_bytes=1 << 16, hwm=16)
    router = RouterSocket(sock, "weights", LearnerMetrics(), lambda *a, **k: None)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    task = asyncio.create_task(router.serve(ws.handle))
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.close()


async def test_chunks_are_received_as_views_of_the_frame():
    ws = WeightsServer(chunk_bytes=256 << 10)
    m = ws.publish(1, [("w", torch.randn(100_000))])
    async with weights_socket(ws) as endpoint:
        ch = ZmqChunkChannel(zmq.asyncio.Context.instance(), endpoint,
                             m.chunk_bytes + CHUNK_FRAME_SLACK_BYTES)
        try:
            await ch.request(1, 0)
            reply = await ch.receive(30)
        finally:
            ch.close()
    assert isinstance(reply, protocol.WeightChunk) and reply.index == 0
    assert isinstance(reply.data, memoryview) and isinstance(reply.data.obj, zmq.Frame)
    assert reply.data.nbytes == m.chunk_bytes and reply.checksum == m.chunk_checksums[0]


class Engine:
    """Applies an update by copying it (as the HF and vLLM engines do), or keeps its tensors."""

    def __init__(self, keep: bool):
        self.keep, self.version, self.kept, self.seen_ptrs = keep, 0, [], []

    async def apply(self, update) -> float:
        self.seen_ptrs.append(update.tensors["w"].data_ptr())
        if self.keep:
            self.kept.append(update.tensors)
        else:
            self.params = {k: v.clone() for k, v in update.tensors.items()}
        self.version = update.version
        return 0.0


async def _two_versions(keep: bool) -> Engine:
    ws = WeightsServer(chunk_bytes=64 << 10)
    engine = Engine(keep)

    async def report(msg):
        pass

    async with weights_socket(ws) as endpoint:
        r = WeightsReceiver(connect=lambda ep, n: ZmqChunkChannel(zmq.asyncio.Context.instance(), ep, n),
                            apply=engine.apply, report=report, version=lambda: engine.version,
                            server_id="s", metrics=RolloutMetrics(), log=lambda *a, **k: None,
                            max_weights_bytes=1 << 24, chunk_timeout_s=30.0)
        r.welcome(endpoint)
        for v in (1, 2):
            m = ws.publish(v, [("w", torch.full((50_000,), float(v)))])
            assert r.offer(m) and await asyncio.wait_for(r.receive(m), 60)
    return engine


async def test_the_engine_gets_every_version_and_one_it_kept_stays_intact():
    engine = await _two_versions(keep=False)
    assert engine.version == 2 and torch.equal(engine.params["w"], torch.full((50_000,), 2.0))
    engine = await _two_versions(keep=True)          # its tensors are views of version 1's frames
    assert torch.equal(engine.kept[0]["w"], torch.full((50_000,), 1.0))
    assert torch.equal(engine.kept[1]["w"], torch.full((50_000,), 2.0))


def test_unflatten_chunks_views_inside_a_chunk_and_copies_across_chunks():
    g = torch.Generator().manual_seed(1)
    tensors = [("a", torch.randn(10, generator=g)), ("b", torch.randn(100, generator=g).to(torch.bfloat16)),
               ("c", torch.randn(7, generator=g)), ("e", torch.empty(0)), ("d", torch.arange(3))]
    ws = WeightsServer(chunk_bytes=64)
    m = ws.publish(1, tensors)
    chunks = [bytearray(ws.chunk(1, i).data) for i in range(m.num_chunks)]
    out = unflatten_chunks(chunks, m.chunk_bytes, m.tensors)
    for name, t in tensors:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name].view(torch.uint8), t.view(torch.uint8)), name      # bit-exact
    spec = {s.name: s for s in m.tensors}
    a = spec["a"]                                      # bytes 0..40: inside chunk 0, a view
    assert a.offset + a.nbytes <= 64 and out["a"].data_ptr() == _address(chunks[0]) + a.offset
    assert spec["b"].nbytes > 64                       # across chunks: its own copy
    assert not any(_address(c) <= out["b"].data_ptr() < _address(c) + len(c) for c in chunks)
    ro = unflatten_chunks([bytes(c) for c in chunks], m.chunk_bytes, m.tensors)    # read-only: copies
    assert torch.equal(ro["a"], tensors[0][1])
