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
from weights_kit import step_bf16

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
async def served(ws: WeightsServer, corrupt_first: set[int], tamper=None):
    """``ws`` on a real ROUTER; the first reply for each index in ``corrupt_first`` is corrupted;
    ``tamper(reply)``, when given, may replace any reply."""
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
            reply = protocol.WeightChunk(version=reply.version, index=reply.index, base=reply.base,
                                         encoding=reply.encoding, checksum=reply.checksum, data=bytes(data))
        return tamper(reply) if tamper is not None else reply

    task = asyncio.create_task(router.serve(handle))
    try:
        yield f"tcp://127.0.0.1:{port}", metrics
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        router.close()


def receiver(endpoint: str, applied: list | None = None, **kw):
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.receiver import WeightsReceiver, ZmqChunkChannel

    ctx = zmq.asyncio.Context.instance()

    async def nothing(*_):
        return 0.0

    async def apply(update):
        applied.append(update)
        return 0.0

    r = WeightsReceiver(connect=lambda ep, max_bytes: ZmqChunkChannel(ctx, ep, max_bytes),
                        apply=nothing if applied is None else apply, report=nothing, version=lambda: 0,
                        server_id="s", metrics=RolloutMetrics(), log=lambda *a, **k: None,
                        max_weights_bytes=1 << 30, chunk_timeout_s=10.0, **kw)
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


# ---- deltas (protocol 3.7, issue 28 item 1) -------------------------------------------------------
BF16 = [("a", torch.randn(20000).to(torch.bfloat16)), ("b", torch.randn(100, 100).to(torch.bfloat16)),
        ("c", torch.randn(50))]


def chunk_stats(r) -> tuple[float, float, float]:
    value = r.metrics.registry.get_sample_value
    return (value("slipstream_weight_chunks_received_total", {"encoding": "raw"}),
            value("slipstream_weight_chunks_received_total", {"encoding": "delta"}),
            value("slipstream_weights_received_bytes_total", {"source": "learner"}))


async def test_deltas_over_zeromq_make_the_version_bit_for_bit():
    """A server holding version 1 fetches version 2 as deltas: a few percent of the bytes, and
    the tensors it applies are version 2's exactly (each chunk checked against the manifest)."""
    ws = WeightsServer(chunk_bytes=8192, metrics=LearnerMetrics())
    m1 = ws.publish(1, BF16)
    v2 = step_bf16(BF16, 0.03, seed=1)
    m2 = ws.publish(2, v2)
    applied: list = []
    async with served(ws, set()) as (endpoint, _):
        r = receiver(endpoint, applied)
        assert await r.receive(m1)
        raw1, delta1, bytes1 = chunk_stats(r)
        assert (raw1, delta1, bytes1) == (m1.num_chunks, 0, m1.total_bytes)
        assert await r.receive(m2)
        raw2, delta2, bytes2 = chunk_stats(r)
    for name, t in v2:
        assert torch.equal(applied[1].tensors[name].view(torch.uint8), t.view(torch.uint8)), name
    # Every chunk moved (3 % of the elements, spread out), so every chunk came as a delta: the
    # float32 tensor's chunk too, where nothing changed (its XOR is all zero).
    assert raw2 == raw1 and delta2 == m2.num_chunks
    assert bytes2 - bytes1 < 0.15 * m2.total_bytes, (bytes2 - bytes1, m2.total_bytes)
    assert ws.metrics.value("slipstream_weights_chunks_served_total", {"encoding": "delta"}) == m2.num_chunks
    assert ws.delta_ratio() == (bytes2 - bytes1) / m2.total_bytes      # what the relay plan reads


async def test_a_bad_delta_is_fetched_raw_and_a_missing_base_gets_raw_chunks():
    """A delta that does not decode, one that decodes to the wrong bytes, one against a version
    the server does not hold: that chunk is counted (weights_delta) and fetched raw; the version
    is still exact. A learner that no longer keeps the server's version answers raw."""
    import zstandard

    ws = WeightsServer(chunk_bytes=8192)
    m1 = ws.publish(1, BF16)
    v2 = step_bf16(BF16, 0.03, seed=2)
    m2 = ws.publish(2, v2)
    hits = {0: b"not zstd", 1: zstandard.ZstdCompressor().compress(bytes(8192)), 2: "base"}

    def tamper(reply):
        if isinstance(reply, protocol.WeightChunk) and reply.encoding != "raw" and reply.index in hits:
            bad = hits.pop(reply.index)
            if bad == "base":
                return protocol.WeightChunk(version=2, index=2, base=0, encoding="xor-zstd",
                                            checksum=reply.checksum, data=reply.data)
            return protocol.WeightChunk(version=2, index=reply.index, base=1, encoding="xor-zstd",
                                        checksum=reply.checksum, data=bad)
        return reply

    applied: list = []
    async with served(ws, set(), tamper) as (endpoint, _):
        r = receiver(endpoint, applied)
        assert await r.receive(m1) and await r.receive(m2)
        assert r.metrics.error_count("weights_delta") == 3
        raw, delta, _ = chunk_stats(r)
        assert (raw, delta) == (m1.num_chunks + 3, m2.num_chunks - 3)
        for name, t in v2:
            assert torch.equal(applied[1].tensors[name].view(torch.uint8), t.view(torch.uint8)), name

        m3 = ws.publish(3, step_bf16(v2, 0.03, seed=3))
        m4 = ws.publish(4, step_bf16(v2, 0.03, seed=4))      # keep=2: version 2 is gone
        assert ws.versions == [3, 4] and m3.num_chunks
        assert await r.receive(m4)
        raw, delta, _ = chunk_stats(r)
        assert (raw, delta) == (m1.num_chunks + 3 + m4.num_chunks, m2.num_chunks - 3)


async def test_noise_is_sent_raw_and_delta_off_asks_for_none():
    """A delta that is not smaller than its chunk (every byte new: random bits) is not sent;
    rollout.weights.delta false (keep_base) never asks for one."""
    ws = WeightsServer(chunk_bytes=4096, metrics=LearnerMetrics())

    def noise():
        return [("w", torch.randint(-(1 << 62), 1 << 62, (2048,), dtype=torch.int64))]
    named = noise()
    m1 = ws.publish(1, named)
    m2 = ws.publish(2, noise())
    async with served(ws, set()) as (endpoint, _):
        r = receiver(endpoint, [])
        assert await r.receive(m1) and await r.receive(m2)
        assert chunk_stats(r)[:2] == (m1.num_chunks + m2.num_chunks, 0)
        assert ws.metrics.value("slipstream_weights_chunks_served_total", {"encoding": "raw"}) == 2 * m1.num_chunks
        m3 = ws.publish(3, step_bf16(named, 0, 0))                        # unchanged: all zero
        off = receiver(endpoint, [], keep_base=False)
        assert await off.receive(m2) and await off.receive(m3)
        assert off.base is None and chunk_stats(off)[:2] == (2 * m2.num_chunks, 0)
