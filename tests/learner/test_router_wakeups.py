"""The learner's ROUTER loop over real sockets: it reads queued messages with non-blocking calls on
a shadow of the socket and sends replies from the handler there too, while a send from another
task (an Assignment pushed by admission, a WeightsAvailable announcement) goes through zmq.asyncio
when the loop waits. Either way no message may be left unread: a lost wake-up would hang a
learner whose servers are still sending."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

import protocol
from learner.metrics import LearnerMetrics
from learner.router import BURST, RouterSocket

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


async def test_pushes_from_other_tasks_and_requests_interleave_without_a_lost_message():
    ctx = zmq.asyncio.Context()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    router = RouterSocket(server, "control", LearnerMetrics(), lambda *a, **k: None)
    handled: list[int] = []
    identities: list[bytes] = []

    async def handler(identity: bytes, msg: protocol.Message) -> protocol.Message:
        identities.append(identity)
        handled.append(int(msg.args["i"]))
        await asyncio.sleep(0)                 # handlers await (buffer.put, admission)
        return protocol.ControlReply(ok=True, result={"i": msg.args["i"]})

    task = asyncio.create_task(router.serve(handler))
    client = ctx.socket(zmq.DEALER)
    client.connect(f"tcp://127.0.0.1:{port}")
    try:
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
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        client.close(0)
        router.close()
        ctx.term()
