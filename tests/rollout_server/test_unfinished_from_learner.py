"""A real rollout server (RolloutService, tiny HF model) whose learner leaves messages unfinished
(issue 31 item 2, the server's side): a raw ZMTP ROUTER (tests/zmtp_kit.py) answers the server's
handshake, then sends frames with MORE set and never the last one. The server cuts the
connection once the message passes ``learner_max_message_bytes``, and one held open past
``unfinished_timeout_s``; it counts both, stays up and connects again each time."""

from __future__ import annotations

import asyncio
import socket
import threading

import zmq.asyncio
from config_kit import rollout_config
from zmtp_kit import frame, raw_router, send_unfinished

import protocol
from rollout_server.receiver import ZmqChunkChannel
from rollout_server.service import RolloutService


def cut_count(svc: RolloutService, reason: str) -> float:
    return svc.metrics.registry.get_sample_value(
        "slipstream_connections_cut_total", {"socket": "learner", "reason": reason})


async def accept(listener: socket.socket) -> socket.socket:
    """The server's next connection, through the handshake (in a thread: the server runs here)."""
    return await asyncio.to_thread(raw_router, listener, 30)


async def wait_for(condition, what: str, timeout_s: float = 30) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.05)
    try:
        await asyncio.wait_for(poll(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout_s} s") from None


async def test_a_learner_that_never_finishes_a_message_is_cut(tiny_model_dir):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    cfg = rollout_config(learner=f"tcp://127.0.0.1:{port}", server_id="victim", metrics_port=0,
                        threads=1, learner_timeout_s=120.0, reconnect_ivl_s=0.1,
                        learner_max_message_bytes=4 << 20, unfinished_timeout_s=1.0)
    svc = RolloutService(cfg, tiny_model_dir)
    run = asyncio.create_task(svc.run())
    conns = []
    try:
        # Too large: 256 KiB frames, each within the limit, past 4 MiB together.
        conns.append(await accept(listener))
        sender = threading.Thread(target=send_unfinished, args=(conns[-1], 4096, 256 << 10), daemon=True)
        sender.start()
        await wait_for(lambda: cut_count(svc, "too_large") == 1, "the too-large message cut")
        await asyncio.to_thread(sender.join, 30)
        assert not sender.is_alive(), "the sender was never told the connection ended"
        # Held open: 200 KiB of a message, then nothing; the server reconnects first.
        conns.append(await accept(listener))
        conns[-1].sendall(frame(bytes(200 << 10), more=True))
        await wait_for(lambda: cut_count(svc, "open_too_long") == 1, "the held message cut")
        conns.append(await accept(listener))          # and it connects again
        assert not run.done()
    finally:
        svc.stopping.set()
        for c in conns:
            c.close()
        listener.close()
        await asyncio.wait_for(run, 60)


async def test_a_weights_socket_that_never_finishes_a_chunk_is_cut():
    """The weights fetch channel (rollout_server.receiver.ZmqChunkChannel) against a weights
    ROUTER that answers a chunk request with a message it never finishes: cut past its bound
    (the frame limit + 1 MiB for a chunk's header and body), and one held open past
    ``unfinished_timeout_s``; the channel reconnects and the same receive() still takes the
    chunk a third connection sends whole."""
    listener = socket.create_server(("127.0.0.1", 0))
    ctx = zmq.asyncio.Context()
    cuts = []
    channel = ZmqChunkChannel(ctx, f"tcp://127.0.0.1:{listener.getsockname()[1]}", max_frame_bytes=1 << 20,
                              unfinished_timeout_s=1.0, on_cut=cuts.append)
    conns = []
    try:
        conns.append(await accept(listener))
        await channel.request(3, 0)
        reply = asyncio.create_task(channel.receive(60))
        sender = threading.Thread(target=send_unfinished, args=(conns[-1], 4096, 256 << 10), daemon=True)
        sender.start()
        await wait_for(lambda: [c.reason for c in cuts] == ["too_large"], "the too-large chunk cut")
        # Past the 2 MiB bound, and far below the 1 GiB offered: what loopback delivers between
        # two checks (the guard runs between receive()'s poll slices, 50 ms, then 10 ms apart).
        assert 2 << 20 <= cuts[0].unfinished_bytes < 256 << 20, cuts
        await asyncio.to_thread(sender.join, 30)
        assert not sender.is_alive(), "the sender was never told the connection ended"
        conns.append(await accept(listener))
        conns[-1].sendall(frame(bytes(200 << 10), more=True))
        await wait_for(lambda: [c.reason for c in cuts] == ["too_large", "open_too_long"],
                       "the held chunk cut")
        assert not reply.done()
        conns.append(await accept(listener))
        frames = protocol.encode(protocol.WeightChunk(version=3, index=0, checksum="c", data=b"w" * 1000))
        conns[-1].sendall(b"".join(frame(bytes(f), more=i < len(frames) - 1) for i, f in enumerate(frames)))
        got = await asyncio.wait_for(reply, 30)
        assert isinstance(got, protocol.WeightChunk) and bytes(got.data) == b"w" * 1000, got
        assert all(c.socket == "weights" for c in cuts)
    finally:
        channel.close()
        for c in conns:
            c.close()
        listener.close()
        ctx.term()
