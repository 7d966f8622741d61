"""R4 load clients: N protocol-level rollout servers (no model) in one process, each answering
every assignment at once with a valid group and "applying" every announced version at once.

    python load_client.py ENDPOINT CLIENTS DURATION_S OUT_JSON [MAX_CONCURRENCY]

They push as fast as the learner lets them: what bounds them is the credits and leases it grants
(backpressure), never a send that waits. Writes what each client sent and received to OUT_JSON.
Imports only ``protocol``, numpy and pyzmq (no torch), so it starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import protocol  # noqa: E402

TOKENS = 4


def group(a: protocol.Assignment, version: int, tokens: int = TOKENS) -> list[protocol.Sample]:
    """One valid group for ``a``: ``tokens`` completion tokens per sample, tagged ``version``."""
    return [protocol.Sample(
        sample_id=protocol.sample_id(a.assignment_id, i), assignment_id=a.assignment_id,
        group_index=i, group_size=a.group_size, prompt_token_ids=a.prompt_token_ids,
        completion_token_ids=np.arange(4, 4 + tokens, dtype=np.int32),
        behavior_logprobs=np.full(tokens, -1.5, dtype=np.float32),
        token_versions=np.full(tokens, version, dtype=np.int32), reward=float(i % 2))
        for i in range(a.group_size)]


async def client(ctx: zmq.asyncio.Context, endpoint: str, name: str, max_concurrency: int,
                 deadline: float) -> dict:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.connect(endpoint)
    stats = {"results": 0, "samples": 0, "acks": 0, "ack_statuses": {}, "assignments": 0,
             "versions_applied": 0}
    version = 0

    async def send(msg: protocol.Message) -> None:
        await sock.send_multipart(protocol.encode(msg))

    await send(protocol.Hello(server_id=name, engine="load", model="none", version=0,
                              max_concurrency=max_concurrency))
    await send(protocol.WorkRequest(server_id=name, credits=max_concurrency))
    unacked = 0                 # samples sent and not acknowledged
    try:
        # Until the deadline: answer and ask for more. After it: no new work, and wait (bounded)
        # for the acks of what was sent, so the learner never sends to a closed peer and loses
        # results in flight (a real server drains the same way on SIGTERM).
        while time.monotonic() < deadline or (unacked and time.monotonic() < deadline + 10):
            if not await sock.poll(100):
                continue
            msg = protocol.decode(await sock.recv_multipart())
            if isinstance(msg, protocol.Assignment) and time.monotonic() >= deadline:
                continue                      # left unanswered: the learner re-issues the lease
            if isinstance(msg, protocol.Assignment):
                stats["assignments"] += 1
                await send(protocol.RolloutResult(server_id=name, samples=group(msg, version)))
                stats["results"] += 1
                stats["samples"] += msg.group_size
                unacked += msg.group_size
            elif isinstance(msg, protocol.Ack):
                stats["acks"] += 1
                unacked -= len(msg.statuses)      # an Ack may name several results' samples
                for s in msg.statuses:
                    stats["ack_statuses"][s] = stats["ack_statuses"].get(s, 0) + 1
                if time.monotonic() < deadline:
                    await send(protocol.WorkRequest(server_id=name, credits=len(msg.statuses)))
            elif isinstance(msg, protocol.WeightsAvailable) and msg.version > version:
                version = msg.version
                stats["versions_applied"] += 1
                await send(protocol.WeightsApplied(server_id=name, version=version,
                                                   checksum=msg.checksum, seconds=0.0))
    finally:
        sock.close(2000)           # what was sent still leaves (the learner counts it received)
    return stats


async def main(endpoint: str, clients: int, duration_s: float, out: str, max_concurrency: int) -> None:
    ctx = zmq.asyncio.Context()
    deadline = time.monotonic() + duration_s
    start = time.monotonic()
    results = await asyncio.gather(*(client(ctx, endpoint, f"load-{i}", max_concurrency, deadline)
                                     for i in range(clients)))
    elapsed = time.monotonic() - start
    ctx.term()
    Path(out).write_text(json.dumps({"clients": dict(zip((f"load-{i}" for i in range(clients)), results)),
                                     "elapsed_s": elapsed}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4],
                     int(sys.argv[5]) if len(sys.argv) > 5 else 16))
