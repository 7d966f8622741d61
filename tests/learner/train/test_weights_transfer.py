"""Weights end to end without a model: learner.train.weights.flatten -> WeightsServer served on a real
ROUTER (the learner's RouterSocket loop) -> the rollout server's WeightsReceiver over real ZeroMQ
-> rollout_server.weights.unflatten; corrupted chunks are fetched again."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
import zmq
import zmq.asyncio

import protocol
from learner.metrics import LearnerMetrics
from learner.serve.router import RouterSocket
from learner.serve.weights_server import WeightsServer
from learner.train.weights import flatten
from protocol.plumbing.sockets import bind, make_socket
from rollout_server.weights import unflatten

NAMED = [("w", torch.randn(1000)), ("v", torch.randn(10, 10).to(torch.bfloat16)),
         ("i", torch.arange(7, dtype=torch.int64)), ("empty", torch.zeros(0, 2))]


def test_flatten_unflatten_roundtrip_all_dtypes():
    flat, specs = flatten(NAMED)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(s.nbytes for s in specs)
    assert all(isinstance(s, protocol.TensorSpec) for s in specs)
    out = unflatten(bytearray(flat.numpy().tobytes()), specs)
    for name, t in NAMED:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)


@contextlib.asynccontextmanager
async def served(ws: WeightsServer, corrupt_first: set[int]):
    """``ws`` on a real ROUTER; the first reply for each index in ``corrupt_first`` is corrupted."""
    ctx = zmq.asyncio.Context.instance()
    metrics = LearnerMetrics()
    sock = make_socket(ctx, zmq.ROUTER, max_message_bytes=64 << 10, hwm=16)
    port = bind(sock, "127.0.0.1", 0, "learner.network.weights_port")
    router = RouterSocket(sock, "weights", metrics, log=lambda *a, **k: None)

    async def handle(identity, msg):
        reply = await ws.handle(identity, msg)
        if isinstance(reply, protocol.WeightChunk) and reply.index in corrupt_first:
            corrupt_first.discard(reply.index)
            data = bytearray(reply.data)
            data[0] ^= 0xFF
            reply = protocol.WeightChunk(version=reply.version, index=reply.index,
                                         checksum=reply.checksum, data=bytes(data))
        return reply

    task = asyncio.create_task(router.serve(handle))
    try:
        yield f"tcp://127.0.0.1:{port}", metrics
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        router.close()


def receiver(endpoint: str):
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.receiver import WeightsReceiver, ZmqChunkChannel

    ctx = zmq.asyncio.Context.instance()

    async def nothing(*_):
        return 0.0

    r = WeightsReceiver(connect=lambda ep, max_bytes: ZmqChunkChannel(ctx, ep, max_bytes),
                        apply=nothing, report=nothing, version=lambda: 0, server_id="s",
                        metrics=RolloutMetrics(), log=lambda *a, **k: None,
                        max_weights_bytes=1 << 30, chunk_timeout_s=10.0)
    r.welcome(endpoint)
    return r


@pytest.mark.parametrize("corrupt", [set(), {0, 2}])
async def test_fetch_over_zeromq_verifies_and_refetches_corrupted_chunks(corrupt):
    ws = WeightsServer(chunk_bytes=1024)
    manifest = ws.publish(1, NAMED)
    assert manifest.num_chunks == 5                      # 4000 + 200 + 56 + 0 bytes
    async with served(ws, set(corrupt)) as (endpoint, _):
        r = receiver(endpoint)
        buf = await r.fetch(protocol.decode(protocol.encode(manifest)))
        got = unflatten(buf, manifest.tensors)
        for name, t in NAMED:
            assert torch.equal(got[name], t)
        assert r.metrics.error_count("weights_checksum") == len(corrupt)


async def test_bad_requests_on_the_weights_socket_are_answered_and_counted():
    ws = WeightsServer(chunk_bytes=1024)
    ws.publish(1, NAMED)
    async with served(ws, set()) as (endpoint, metrics):
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            replies = []
            for frames in (protocol.encode(protocol.WeightChunkRequest(version=1, index=99)),
                           protocol.encode(protocol.WeightChunkRequest(version=7, index=0)),
                           [b"\x00garbage"],
                           protocol.encode(protocol.Heartbeat(sender_id="x", version=0)),
                           protocol.encode(protocol.WeightChunkRequest(version=1, index=4))):
                await sock.send_multipart(frames)
                assert await sock.poll(10_000)
                replies.append(protocol.decode(await sock.recv_multipart()))
        finally:
            sock.close(0)
    assert [getattr(r, "code", type(r).__name__) for r in replies] == [
        "bad_chunk", "unknown_version", "protocol_error", "protocol_error", "WeightChunk"]
    assert metrics.value("slipstream_protocol_errors_total", {"socket": "weights"}) == 2
