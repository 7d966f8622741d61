"""Peer relay over real ZeroMQ (issue 28 items 2, 3): a rollout server's relay socket serves the
chunks it holds, even while it is still fetching them; a server told to fetch from it gets the
version bit for bit with the learner sending it once; a relay that sends bad bytes, or none, is
skipped and the learner gives the rest; a relay holding the same base sends deltas."""

from __future__ import annotations

import asyncio
import contextlib

import torch
import zmq
import zmq.asyncio
from weights_kit import step_bf16

import protocol
from learner.metrics import LearnerMetrics
from learner.serve.router import RouterSocket
from learner.serve.weights_server import WeightsServer
from protocol.plumbing.sockets import bind, make_socket
from rollout_server.metrics import RolloutMetrics
from rollout_server.receiver import WeightsReceiver, ZmqChunkChannel
from rollout_server.relay import RelayServer, RelayStore

NAMED = [("a", torch.randn(40000).to(torch.bfloat16)), ("b", torch.randn(3000))]    # 92 kB


@contextlib.asynccontextmanager
async def learner(ws: WeightsServer):
    ctx = zmq.asyncio.Context.instance()
    sock = make_socket(ctx, zmq.ROUTER, max_message_bytes=64 << 10, hwm=64)
    port = bind(sock, "127.0.0.1", 0, "weights")
    router = RouterSocket(sock, "weights", LearnerMetrics(), log=lambda *a, **k: None)
    task = asyncio.create_task(router.serve(ws.handle))
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        router.close()


class Server:
    """A receiver (recording what it applied) and, with ``relay``, its relay socket."""

    def __init__(self, learner_endpoint: str, relay: bool = False, server_cls=RelayServer, **kw):
        ctx = zmq.asyncio.Context.instance()
        self.metrics = RolloutMetrics()
        self.applied: list = []
        self.store = RelayStore() if relay else None
        self.sock = self.task = None
        endpoint = None
        if relay:
            self.sock = make_socket(ctx, zmq.ROUTER, max_message_bytes=64 << 10, hwm=64)
            endpoint = f"tcp://127.0.0.1:{bind(self.sock, '127.0.0.1', 0, 'relay')}"
            self.task = asyncio.create_task(server_cls(self.store, self.sock, wait_s=5.0, metrics=self.metrics,
                                                       log=lambda *a, **k: None).serve())
        self.source = protocol.WeightsSource(endpoint=endpoint) if relay else None

        async def apply(update):
            self.applied.append(update)
            return 0.0

        async def report(msg):
            pass

        self.receiver = WeightsReceiver(
            connect=lambda ep, max_bytes, key=None: ZmqChunkChannel(ctx, ep, max_bytes),
            apply=apply, report=report, version=lambda: 0, server_id="s", metrics=self.metrics,
            log=lambda *a, **k: None, max_weights_bytes=1 << 30, chunk_timeout_s=10.0,
            relay=self.store, relay_endpoint=endpoint, relay_timeout_s=kw.pop("relay_timeout_s", 5.0), **kw)
        self.receiver.welcome(learner_endpoint)

    def value(self, name: str, labels: dict | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {})

    def received(self, source: str) -> float:
        return self.value("slipstream_weights_received_bytes_total", {"source": source})

    async def close(self):
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.sock.close(0)


def exact(update, named) -> bool:
    return all(torch.equal(update.tensors[n].view(torch.uint8), t.view(torch.uint8)) for n, t in named)


def via(m: protocol.WeightsAvailable, *sources) -> protocol.WeightsAvailable:
    import dataclasses

    return dataclasses.replace(m, sources=list(sources))


async def test_a_chain_fetches_through_the_relay_and_the_learner_sends_the_version_once():
    lm = LearnerMetrics()
    ws = WeightsServer(chunk_bytes=8192, metrics=lm)
    m = ws.publish(1, NAMED)
    async with learner(ws) as endpoint:
        a = Server(endpoint, relay=True)
        b = Server(endpoint, relay=True)
        c = Server(endpoint)
        try:
            # All three at once, as at a publish: b waits on a's chunks as a fetches them, c on b's.
            ok = await asyncio.gather(a.receiver.receive(m), b.receiver.receive(via(m, a.source)),
                                      c.receiver.receive(via(m, b.source)))
        finally:
            for s in (a, b, c):
                await s.close()
    assert ok == [True, True, True]
    assert all(exact(s.applied[0], NAMED) for s in (a, b, c))
    assert lm.value("slipstream_weights_egress_bytes_total") == m.total_bytes        # once
    assert (a.received("learner"), a.received("peer")) == (m.total_bytes, 0)
    assert (b.received("learner"), b.received("peer")) == (0, m.total_bytes)
    assert (c.received("learner"), c.received("peer")) == (0, m.total_bytes)
    assert a.value("slipstream_weights_relayed_bytes_total") == m.total_bytes
    assert b.value("slipstream_weights_relayed_bytes_total") == m.total_bytes


class Poisoned(RelayServer):
    """A relay that flips a byte of every chunk it sends after the first."""

    sent = 0

    async def _reply(self, identity, msg):
        if isinstance(msg, protocol.WeightChunk):
            Poisoned.sent += 1
            if Poisoned.sent > 1:
                data = bytearray(msg.data)
                data[0] ^= 0xFF
                msg = protocol.WeightChunk(version=msg.version, index=msg.index, checksum=msg.checksum,
                                           data=bytes(data))
        await super()._reply(identity, msg)


async def test_a_relay_that_sends_bad_bytes_or_nothing_is_skipped_and_the_learner_gives_the_rest():
    ws = WeightsServer(chunk_bytes=8192)
    m = ws.publish(1, NAMED)
    async with learner(ws) as endpoint:
        liar = Server(endpoint, relay=True, server_cls=Poisoned)
        liar.store.put_all(m, [memoryview(bytes(c)) for c in ws._versions[1].chunks])
        b = Server(endpoint, chunk_window=1)
        dead = protocol.WeightsSource(endpoint="tcp://127.0.0.1:9")      # nothing listens there
        c = Server(endpoint, relay_timeout_s=0.5)
        try:
            assert await b.receiver.receive(via(m, liar.source))
            assert await c.receiver.receive(via(m, dead))
        finally:
            for s in (liar, b, c):
                await s.close()
    # b kept the liar's first (good) chunk, refused the poisoned one, got the rest from the learner.
    assert exact(b.applied[0], NAMED) and exact(c.applied[0], NAMED)
    assert b.value("slipstream_weights_relay_failures_total", {"reason": "bad_chunk"}) == 1
    assert b.received("peer") == 8192 and b.received("learner") == m.total_bytes - 8192
    assert c.value("slipstream_weights_relay_failures_total", {"reason": "timeout"}) == 1
    assert c.received("learner") == m.total_bytes


async def test_a_relay_holding_the_same_base_sends_deltas():
    ws = WeightsServer(chunk_bytes=8192)
    m1 = ws.publish(1, NAMED)
    v2 = step_bf16(NAMED, 0.03, seed=5)
    m2 = ws.publish(2, v2)
    async with learner(ws) as endpoint:
        a = Server(endpoint, relay=True)
        b = Server(endpoint)
        try:
            assert await a.receiver.receive(m1) and await b.receiver.receive(via(m1, a.source))
            before = b.received("peer")
            assert await a.receiver.receive(m2) and await b.receiver.receive(via(m2, a.source))
        finally:
            await a.close()
            await b.close()
    assert exact(b.applied[1], v2)
    assert b.value("slipstream_weight_chunks_received_total", {"encoding": "delta"}) == m2.num_chunks
    assert b.received("peer") - before < 0.2 * m2.total_bytes
    assert b.received("learner") == 0
