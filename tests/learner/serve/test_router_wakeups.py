"""The learner's ROUTER loop over real sockets: it reads queued messages with non-blocking calls on
a shadow of the socket and sends replies from the handler there too, while a send from another
task (an Assignment pushed by admission, a WeightsAvailable announcement) goes through zmq.asyncio
when the loop waits. Either way no message may be left unread: a lost wake-up would hang a
learner whose servers are still sending."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import zmq
import zmq.asyncio

import protocol
from learner.metrics import LearnerMetrics
from learner.serve.router import _VIEW_BYTES, BURST, RouterSocket

TIMEOUT_S = 10.0


async def _until(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT_S
    while not predicate():
        assert loop.time() < deadline, f"{what} not reached within {TIMEOUT_S} s"
        await asyncio.sleep(0.001)


async def _recv(client: zmq.asyncio.Socket) -> protocol.Message:
    frames = await asyncio.wait_for(client.recv_multipart(copy=True), TIMEOUT_S)
    return protocol.decode(frames)


@contextlib.asynccontextmanager
async def _serving(socket_name: str, handler, metrics: LearnerMetrics | None = None):
    """A RouterSocket loop on a fresh ROUTER serving ``handler``, and a DEALER connected to it;
    everything stopped and closed afterwards."""
    ctx = zmq.asyncio.Context()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    router = RouterSocket(server, socket_name, metrics or LearnerMetrics(), lambda *a, **k: None)
    task = asyncio.create_task(router.serve(handler))
    client = ctx.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield router, client
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        client.close(0)
        router.close()
        ctx.term()


async def test_pushes_from_other_tasks_and_requests_interleave_without_a_lost_message():
    handled: list[int] = []
    identities: list[bytes] = []

    async def handler(identity: bytes, msg: protocol.Message) -> protocol.Message:
        identities.append(identity)
        handled.append(int(msg.args["i"]))
        await asyncio.sleep(0)                 # handlers await (buffer.put, admission)
        return protocol.ControlReply(ok=True, result={"i": msg.args["i"]})

    async with _serving("control", handler) as (router, client):
        await client.send_multipart(protocol.encode(protocol.ControlRequest(command="status", args={"i": -1})))
        assert (await _recv(client)).result == {"i": -1}
        identity = identities[0]
        # 1. While the loop waits in its asyncio recv: a push from another task, then at once a
        #    request. Both must arrive: the push's send must not take the wake-up the recv needs.
        for i in range(300):
            await _until(lambda: router._receiving, "the loop waiting")
            assert await router.send(identity, protocol.ControlReply(ok=True, result={"push": i}))
            await client.send_multipart(protocol.encode(protocol.ControlRequest(command="status", args={"i": i})))
            got = [await _recv(client), await _recv(client)]
            assert sorted(map(str, (m.result for m in got))) == sorted(map(str, ({"push": i}, {"i": i})))
        # 2. A burst several times BURST long, queued before the loop reads it (replies sent from
        #    the handler on the shadow socket), with pushes from another task in the middle.
        n = 5 * BURST + 7
        for i in range(n):
            await client.send_multipart(protocol.encode(protocol.ControlRequest(command="status", args={"i": 1000 + i})))

        async def pusher():
            for k in range(50):
                assert await router.send(identity, protocol.ControlReply(ok=True, result={"push": 1000 + k}))
                await asyncio.sleep(0)
        push_task = asyncio.create_task(pusher())
        replies, pushes = [], []
        for _ in range(n + 50):
            m = await _recv(client)
            (pushes if "push" in m.result else replies).append(next(iter(m.result.values())))
        await push_task
        assert replies == list(range(1000, 1000 + n))          # every request, in order
        assert pushes == list(range(1000, 1050))
        assert handled == [-1, *range(300), *range(1000, 1000 + n)]
        # 3. And the loop still wakes up for the next request after all of it.
        await _until(lambda: router._receiving, "the loop waiting")
        await client.send_multipart(protocol.encode(protocol.ControlRequest(command="status", args={"i": 7})))
        assert (await _recv(client)).result == {"i": 7}


async def test_frames_of_every_size_and_count_arrive_whole_or_are_refused():
    """The loop reads frames as ``zmq.Frame`` and hands large ones on as views: results whose
    body is below, at and above that size decode to what was sent; messages of many frames,
    empty frames and large garbage frames are refused with an Error, counted, and the loop goes
    on (the next request is answered)."""
    metrics = LearnerMetrics()
    got: list[protocol.Message] = []

    async def handler(identity: bytes, msg: protocol.Message) -> protocol.Message:
        got.append(msg)
        return protocol.ControlReply(ok=True)

    async with _serving("rollout", handler, metrics) as (_, client):
        sent = []
        for tokens in (1, (_VIEW_BYTES - 700) // 12, _VIEW_BYTES // 12, 3 * _VIEW_BYTES):
            msg = protocol.RolloutResult("srv", [protocol.Sample(
                "a/0", "a", 0, 1, np.arange(3, dtype=np.int32), np.arange(tokens, dtype=np.int32),
                np.full(tokens, -0.5, np.float32), np.zeros(tokens, np.int32), 0.25)])
            sent.append(msg)
            await client.send_multipart(protocol.encode(msg))
        for _ in sent:
            assert isinstance(await _recv(client), protocol.ControlReply)
        assert [len(m.samples[0].completion_token_ids) for m in got] == \
            [len(m.samples[0].completion_token_ids) for m in sent]
        for a, b in zip(got, sent):
            assert np.array_equal(a.samples[0].completion_token_ids, b.samples[0].completion_token_ids)
            assert a.samples[0].reward == 0.25
        frames = protocol.encode(sent[-1])
        bad = [[b""] * 20, [b"", b""], [frames[0], b"\xc1" * (2 * _VIEW_BYTES)],
               [frames[0], frames[1], b"x" * _VIEW_BYTES], [b"\x00" * (2 * _VIEW_BYTES), frames[1]]]
        for frames_ in bad:
            await client.send_multipart(frames_)
            reply = await _recv(client)
            assert isinstance(reply, protocol.Error) and reply.code == "protocol_error"
        assert metrics.value("slipstream_protocol_errors_total", {"socket": "rollout"}) == len(bad)
        await client.send_multipart(protocol.encode(protocol.ControlRequest(command="status")))
        assert isinstance(await _recv(client), protocol.ControlReply)
