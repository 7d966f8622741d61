"""A real rollout server (RolloutService, tiny HF model) whose learner leaves messages unfinished
(issue 31 item 2, the server's side): a raw ZMTP ROUTER (tests/zmtp_kit.py) answers the server's
handshake, then sends frames with MORE set and never the last one. The server cuts the
connection once the message passes ``learner_max_message_bytes``, and one held open past
``unfinished_timeout_s``; it counts both, stays up and connects again each time."""

from __future__ import annotations

import asyncio
import socket
import threading

from zmtp_kit import frame, raw_router, send_unfinished

from rollout_server.config import RolloutConfig
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
    cfg = RolloutConfig(learner=f"tcp://127.0.0.1:{port}", server_id="victim", metrics_port=0,
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
