"""Publishing off the train loop's critical path (learner.serve.weights_server.Publisher): the caller
waits for the snapshot only; prepare (checksums) runs beside the next step; versions are announced
in order, a waiting one is superseded by a newer one; buffers are reused and freed; several real
receivers fetching at once over real ZeroMQ share one snapshot; bf16 round-trips bit-exact.
Slow prepares are made slow with events (a gate the test opens), never with timing."""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from types import SimpleNamespace

import pytest
import torch
import zmq
import zmq.asyncio
from learner_testkit import HonestServer, learner_config, metric, running_learner, wait_until

import protocol
from learner.metrics import LearnerMetrics
from learner.serve.router import RouterSocket
from learner.serve.weights_server import Publisher, WeightsServer
from protocol.plumbing.sockets import make_socket
from rollout_server.metrics import RolloutMetrics
from rollout_server.receiver import WeightsReceiver, ZmqChunkChannel
from rollout_server.weights import unflatten


def named(v: float, n: int = 1000):
    return [("w", torch.full((n,), v)), ("b", torch.arange(10, dtype=torch.int64))]


class GatedWeights(WeightsServer):
    """The real WeightsServer, whose prepare first waits until the test opens ``gate``."""

    def __init__(self, *args, fail_version: int | None = None, **kw):
        super().__init__(*args, **kw)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.prepared: list[int] = []
        self.fail_version = fail_version

    def prepare(self, snap):
        self.entered.set()
        if not self.gate.wait(60):
            raise TimeoutError("the test never opened the gate")
        if snap.version == self.fail_version:
            raise RuntimeError(f"prepare of {snap.version} failed")
        self.prepared.append(snap.version)
        return super().prepare(snap)


async def test_publish_returns_before_prepare_and_versions_are_announced_in_order():
    ws = GatedWeights(chunk_bytes=1024)
    announced = []

    async def announce(m):
        announced.append(m.version)

    pub = Publisher(ws, SimpleNamespace(announce=announce))
    try:
        await pub.publish(1, named(1.0))
        assert await asyncio.to_thread(ws.entered.wait, 30)
        # Version 1 is still being prepared: the next steps publish 2, then 3 (2 is superseded).
        assert pub.preparing == 1 and announced == [] and ws.versions == []
        await pub.publish(2, named(2.0))
        assert pub.waiting == 2
        await pub.publish(3, named(3.0))
        assert pub.waiting == 3 and pub.superseded == 1 and announced == []
        ws.gate.set()
        await asyncio.wait_for(pub.drain(), 30)
    finally:
        ws.gate.set()
    assert announced == [1, 3] and ws.prepared == [1, 3] and ws.versions == [1, 3]
    chunk = ws.chunk(3, 0)
    assert torch.equal(torch.frombuffer(bytearray(chunk.data), dtype=torch.float32),
                       torch.full((256,), 3.0))
    # Three snapshots, three buffers; the superseded one's is back in the pool and is reused.
    assert ws.buffers.allocated == 3 and ws.buffers.free == 1
    await pub.publish(4, named(4.0))
    await asyncio.wait_for(pub.drain(), 30)
    assert ws.buffers.allocated == 3 and announced == [1, 3, 4]


async def test_a_failed_prepare_is_raised_by_the_next_publish():
    ws = GatedWeights(chunk_bytes=1024, fail_version=1)
    ws.gate.set()

    async def announce(m):
        pass

    pub = Publisher(ws, SimpleNamespace(announce=announce))
    await pub.publish(1, named(1.0))
    with pytest.raises(RuntimeError, match="prepare of 1 failed"):
        await asyncio.wait_for(pub.drain(), 30)
    with pytest.raises(ValueError, match="cannot be published"):     # refused in the snapshot
        await pub.publish(2, [("c", torch.zeros(3, dtype=torch.complex64))])


async def test_nothing_is_announced_once_stopped():
    ws = GatedWeights(chunk_bytes=1024)
    stopped, announced = False, []

    async def announce(m):
        announced.append(m.version)

    pub = Publisher(ws, SimpleNamespace(announce=announce), stopped=lambda: stopped)
    await pub.publish(1, named(1.0))
    stopped = True
    ws.gate.set()
    await asyncio.wait_for(pub.drain(), 30)
    assert announced == [] and ws.versions == []


def test_bfloat16_round_trips_bit_exact_through_chunks_and_the_codec():
    g = torch.Generator().manual_seed(0)
    odd_bits = torch.tensor([0x7FC1, -0x005B, 0x0001, -0x8000], dtype=torch.int16)  # NaN payloads, -0
    tensors = [("w", torch.randn(333, 7, generator=g).to(torch.bfloat16)),
               ("special", torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40],
                                        dtype=torch.bfloat16)),
               ("bits", odd_bits.view(torch.bfloat16)),
               ("scalar", torch.tensor(3.5, dtype=torch.bfloat16)),
               ("empty", torch.empty(0, 4, dtype=torch.bfloat16)),
               ("f32", torch.randn(5, generator=g))]
    ws = WeightsServer(chunk_bytes=1001)           # odd: elements straddle chunk boundaries
    m = protocol.decode(protocol.encode(ws.publish(1, tensors)))
    buf = bytearray(m.total_bytes)
    for i in range(m.num_chunks):
        chunk = protocol.decode(protocol.encode(ws.chunk(1, i)))
        buf[i * m.chunk_bytes:i * m.chunk_bytes + len(chunk.data)] = chunk.data
    out = unflatten(buf, m.tensors)
    for name, t in tensors:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        if t.element_size() == 2:
            assert torch.equal(out[name].view(torch.int16), t.view(torch.int16)), name
        else:
            assert torch.equal(out[name], t), name


class CopyingEngine:
    """What an engine does with an update: copy it into its own tensors, keep nothing of it."""

    def __init__(self):
        self.version, self.params = 0, {}

    async def apply(self, update) -> float:
        self.params = {k: v.clone() for k, v in update.tensors.items()}
        self.version = update.version
        return 0.0


async def test_concurrent_fetches_by_several_servers_share_one_snapshot():
    ctx = zmq.asyncio.Context.instance()
    ws = WeightsServer(chunk_bytes=64 << 10, keep=2)
    tensors = [("w", torch.randn(100_000)), ("h", torch.randn(300, 100).to(torch.bfloat16))]
    metrics = LearnerMetrics()
    sock = make_socket(ctx, zmq.ROUTER, max_message_bytes=1 << 16, hwm=16)
    router = RouterSocket(sock, "weights", metrics, lambda *a, **k: None)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    serving = asyncio.create_task(router.serve(ws.handle))
    engines, receivers = [], []
    for i in range(3):
        engine = CopyingEngine()

        async def report(msg):
            pass

        r = WeightsReceiver(connect=lambda ep, n: ZmqChunkChannel(ctx, ep, n), apply=engine.apply,
                            report=report, version=lambda e=engine: e.version, server_id=f"s{i}",
                            metrics=RolloutMetrics(), log=lambda *a, **k: None,
                            max_weights_bytes=1 << 24, chunk_timeout_s=30.0, chunk_window=2)
        r.welcome(f"tcp://127.0.0.1:{port}")
        engines.append(engine)
        receivers.append(r)
    try:
        m = ws.publish(1, tensors)
        assert m.num_chunks > 6 and ws.buffers.allocated == 1
        first = weakref.ref(ws._versions[1].array)
        assert all(r.offer(m) for r in receivers)
        assert all(await asyncio.wait_for(asyncio.gather(*(r.receive(m) for r in receivers)), 60))
        assert ws.buffers.allocated == 1                      # three fetches, one snapshot
        for e in engines:
            assert torch.equal(e.params["w"], tensors[0][1])
            assert torch.equal(e.params["h"].view(torch.int16), tensors[1][1].view(torch.int16))
        # Versions 2 and 3: 1 is dropped; its buffer is freed once pyzmq released its frames.
        ws.publish(2, tensors)
        ws.publish(3, tensors)
        # (the weakref is cleared before the finalizer, on pyzmq's gc thread, gives the buffer back)
        await wait_until(lambda: first() is None and ws.buffers.free == 1, 30,
                         "version 1's snapshot freed and its buffer given back")
        ws.publish(4, tensors)
        assert ws.buffers.allocated == 3                      # 4 reused version 1's buffer
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        router.close()


async def test_the_train_loop_steps_on_while_a_version_is_being_prepared(tmp_path, tiny_model_dir):
    gate, entered = threading.Event(), threading.Event()
    async with running_learner(learner_config(tmp_path, max_staleness=1), tiny_model_dir) as svc:
        assert svc.weights.versions == [0]                   # the first version is announced at start
        real = svc.weights.prepare

        def slow(snap):                                      # version 1's checksums take "forever"
            if snap.version == 1:
                entered.set()
                gate.wait(60)
            return real(snap)

        svc.weights.prepare = slow
        announced, announce = [], svc.admission.announce

        def record(m):
            announced.append(m.version)
            return announce(m)
        svc.admission.announce = record
        try:
            async with HonestServer(svc.endpoints["rollout"]) as good:
                # Step 2 ran and snapshotted version 2 while version 1 was still being prepared.
                await wait_until(lambda: svc.publisher.waiting is not None and entered.is_set(), 60,
                                 "version 2 snapshotted")
                assert svc.publisher.preparing == 1 and not gate.is_set()
                assert svc.weights.versions == [0] and svc.publisher.waiting >= 2
                gate.set()
                await good.wait_version(2)
                # Version 1, then the newest snapshot (2, or 3 when step 3 replaced it meanwhile).
                distinct = sorted(set(announced))
                assert distinct[0] == 1 and distinct[1] >= 2 and announced == sorted(announced), announced
        finally:
            gate.set()
        assert metric(svc, "slipstream_publish_wait_seconds_count") >= 3
        assert metric(svc, "slipstream_weights_publish_seconds_count") >= 3
        rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "publish_wait_s" in r]
        assert len(steps) >= 2 and all(r["publish_wait_s"] >= 0 and "publish_s" not in r for r in steps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_cuda_snapshot_is_an_async_copy_into_pinned_memory():
    w = torch.randn(1 << 20, device="cuda").to(torch.bfloat16)
    expected = w.cpu()
    ws = WeightsServer(chunk_bytes=1 << 20)
    announced = []

    async def announce(m):
        announced.append(m)

    pub = Publisher(ws, SimpleNamespace(announce=announce))
    await pub.publish(1, [("w", w)])
    w.add_(1.0)                      # the next step: queued after the copy on the same stream
    await asyncio.wait_for(pub.drain(), 60)
    (m,) = announced
    snap = ws._versions[1]
    assert snap.flat.is_pinned() and len(snap.events) == 1
    data = b"".join(bytes(ws.chunk(1, i).data) for i in range(m.num_chunks))
    got = torch.frombuffer(bytearray(data), dtype=torch.bfloat16)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
