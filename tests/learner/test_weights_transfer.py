"""Weights publish -> chunked fetch over real ZeroMQ -> checksum verification (and refetch)."""

from __future__ import annotations

import asyncio

import pytest
import torch
import zmq
import zmq.asyncio

import protocol
from learner.publisher import WeightPublisher
from ops.tensor_bytes import flatten_tensors, unflatten_tensors


def test_flatten_roundtrip_all_dtypes():
    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)),
             ("c", torch.arange(7, dtype=torch.int64)), ("empty", torch.zeros(0, 2))]
    flat, specs = flatten_tensors(named)
    assert flat.dtype == torch.uint8 and flat.numel() == sum(s["nbytes"] for s in specs)
    out = unflatten_tensors(bytearray(flat.numpy().tobytes()), specs)
    for name, t in named:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)


async def _serve_chunks(sock, publisher, corrupt_first: set, stop: asyncio.Event):
    while not stop.is_set():
        if not await sock.poll(50):
            continue
        ident, *frames = await sock.recv_multipart()
        req = protocol.decode(frames)
        reply = publisher.chunk(req.version, req.index)
        if req.index in corrupt_first:
            corrupt_first.discard(req.index)
            data = bytearray(reply.data)
            data[0] ^= 0xFF
            reply = protocol.WeightChunk(version=reply.version, index=reply.index,
                                         checksum=reply.checksum, data=bytes(data))
        await sock.send_multipart([ident, *protocol.encode(reply)])


@pytest.mark.parametrize("corrupt", [set(), {0, 2}])
async def test_fetch_verifies_and_refetches_corrupted_chunks(tiny_model_dir, corrupt):
    from rollout_server.config import RolloutConfig
    from rollout_server.service import RolloutService

    named = [("w", torch.randn(1000)), ("v", torch.randn(10, 10).to(torch.bfloat16))]
    pub = WeightPublisher(chunk_bytes=1024)
    manifest = pub.publish(1, named)
    assert manifest.num_chunks == 5
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = asyncio.Event()
    server_task = asyncio.create_task(_serve_chunks(router, pub, set(corrupt), stop))
    svc = RolloutService(RolloutConfig(metrics_port=0), tiny_model_dir)
    svc.weights_endpoint = f"tcp://127.0.0.1:{port}"
    try:
        buf = await svc.fetch_weights(protocol.decode(protocol.encode(manifest)))
        specs = [{"name": t.name, "dtype": t.dtype, "shape": t.shape, "offset": t.offset,
                  "nbytes": t.nbytes} for t in manifest.tensors]
        got = unflatten_tensors(buf, specs)
        assert torch.equal(got["w"], named[0][1]) and torch.equal(got["v"], named[1][1])
        checksum_errors = svc.metrics.registry.get_sample_value(
            "slipstream_rollout_errors_total", {"kind": "weights_checksum"})
        assert (checksum_errors or 0) == len(corrupt)
    finally:
        stop.set()
        await server_task
        router.close(0)


def test_publisher_keeps_recent_versions_only():
    pub = WeightPublisher(chunk_bytes=4096, keep=2)
    for v in (1, 2, 3):
        pub.publish(v, [("w", torch.full((10,), float(v)))])
    assert list(pub.versions) == [2, 3]
    assert isinstance(pub.chunk(1, 0), protocol.Error)
    assert isinstance(pub.chunk(3, 5), protocol.Error)
    assert isinstance(pub.chunk(3, 0), protocol.WeightChunk)
