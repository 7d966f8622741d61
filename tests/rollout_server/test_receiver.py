"""WeightsReceiver without a model: fetch with a window, verify, refetch corrupted chunks, refuse
manifests and replies that do not add up, time out on a dead endpoint — in memory, and once over
real ZeroMQ sockets."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
import zmq
import zmq.asyncio
from fake_learner import chunk_reply, publish

import protocol
from rollout_server.metrics import RolloutMetrics
from rollout_server.receiver import CHUNK_FRAME_SLACK_BYTES, WeightsReceiver, ZmqChunkChannel

NAMED = [("w", torch.randn(1000)), ("v", torch.randn(10, 10).to(torch.bfloat16))]   # 4200 bytes


class MemoryChannel:
    """Answers chunk requests from memory, through the codec; ``tamper(n, index, reply)`` may
    replace the n-th reply by a list of frame lists (zero or more replies)."""

    def __init__(self, manifest, chunks, tamper=None, silent=False):
        self.manifest, self.chunks, self.tamper, self.silent = manifest, chunks, tamper, silent
        self.requests: list[tuple[int, int]] = []
        self.replies: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self.max_frame_bytes = None

    async def request(self, version: int, index: int, base: int = -1) -> None:
        self.requests.append((version, index))
        if self.silent:
            return
        reply = chunk_reply(self.manifest, self.chunks, index) if version == self.manifest.version \
            else protocol.Error(code="unknown_version", message="gone")
        frames = [protocol.encode(reply)]
        if self.tamper is not None:
            frames = self.tamper(len(self.requests), index, reply)
        for f in frames:
            self.replies.put_nowait(f)

    async def receive(self, timeout_s: float):
        try:
            frames = await asyncio.wait_for(self.replies.get(), timeout_s)
        except TimeoutError:
            return None
        return protocol.decode(frames)

    def close(self) -> None:
        self.closed = True


class Harness:
    """A receiver wired to recorders: what it applied, what it reported, what it counted."""

    def __init__(self, channel_factory, version: int = 0, max_weights_bytes: int = 1 << 20, **kw):
        self.metrics = RolloutMetrics()
        self.applied, self.reported, self.events, self.channels = [], [], [], []
        self.version = version

        def connect(endpoint, max_frame_bytes):
            ch = channel_factory()
            ch.max_frame_bytes = max_frame_bytes
            self.channels.append(ch)
            return ch

        async def apply(update):
            self.applied.append(update)
            self.version = update.version
            return 0.0

        async def report(msg):
            self.reported.append(msg)

        self.receiver = WeightsReceiver(
            connect=connect, apply=apply, report=report, version=lambda: self.version,
            server_id="s", metrics=self.metrics, log=lambda event, **f: self.events.append((event, f)),
            max_weights_bytes=max_weights_bytes, chunk_timeout_s=kw.pop("chunk_timeout_s", 5.0), **kw)
        self.receiver.welcome("tcp://learner:1")

    def count(self, kind: str) -> float:
        return self.metrics.error_count(kind)


def _check_applied(h: Harness, manifest) -> None:
    (update,) = h.applied
    assert update.version == manifest.version and update.kind == "full"
    assert torch.equal(update.tensors["w"], NAMED[0][1]) and torch.equal(update.tensors["v"], NAMED[1][1])
    (report,) = h.reported
    assert (report.version, report.checksum, report.server_id) == (manifest.version, manifest.checksum, "s")
    assert h.metrics.registry.get_sample_value("slipstream_policy_version") == manifest.version


async def test_fetch_applies_and_reports_with_a_window():
    manifest, chunks = publish(1, NAMED, chunk_bytes=1024)
    assert manifest.num_chunks == 5
    h = Harness(lambda: MemoryChannel(manifest, chunks), chunk_window=2)
    assert h.receiver.offer(manifest) and h.receiver.pending
    assert await h.receiver.receive(manifest)
    _check_applied(h, manifest)
    (ch,) = h.channels
    assert sorted(i for _, i in ch.requests) == [0, 1, 2, 3, 4] and ch.closed
    assert ch.max_frame_bytes == 1024 + CHUNK_FRAME_SLACK_BYTES
    assert not h.receiver.pending and await h.receiver.wait_settled(0)


@pytest.mark.parametrize("corrupt", [{0, 2}, {4}])
async def test_corrupted_chunks_are_fetched_again(corrupt):
    manifest, chunks = publish(1, NAMED, chunk_bytes=1024)
    todo = set(corrupt)

    def tamper(n, index, reply):
        if index in todo:
            todo.discard(index)
            data = bytearray(reply.data)
            data[0] ^= 0xFF
            reply = dataclasses.replace(reply, data=bytes(data))
        return [protocol.encode(reply)]

    h = Harness(lambda: MemoryChannel(manifest, chunks, tamper))
    h.receiver.offer(manifest)
    assert await h.receiver.receive(manifest)
    _check_applied(h, manifest)
    assert h.count("weights_checksum") == len(corrupt)
    assert len(h.channels[0].requests) == 5 + len(corrupt)
    # issue 28.7: the bytes received and verified, once each (a corrupted copy is not counted).
    assert h.metrics.registry.get_sample_value("slipstream_weights_received_bytes_total",
                                               {"source": "learner"}) == manifest.total_bytes


async def test_replies_that_are_not_the_chunk_asked_for_are_counted_and_asked_again():
    manifest, chunks = publish(1, NAMED, chunk_bytes=1024)
    other, _ = publish(7, NAMED, chunk_bytes=1024)

    def tamper(n, index, reply):
        bad = {
            1: [protocol.encode(dataclasses.replace(reply, index=99))],                  # out of range
            2: [protocol.encode(dataclasses.replace(reply, version=7,
                                                    checksum=other.chunk_checksums[index]))],
            3: [protocol.encode(dataclasses.replace(reply, data=reply.data[:-8]))],      # wrong size
            4: [protocol.encode(protocol.Ack(sample_ids=[], statuses=[]))],              # wrong type
            5: [[b"garbage", b"\x00"]],                                                  # undecodable
            6: [protocol.encode(reply), protocol.encode(reply)],                        # a duplicate
        }
        return bad.get(n, [protocol.encode(reply)])

    h = Harness(lambda: MemoryChannel(manifest, chunks, tamper), chunk_window=1, chunk_retries=3)
    h.receiver.offer(manifest)
    assert await h.receiver.receive(manifest)
    _check_applied(h, manifest)
    # Requests 1..5 each got a wrong answer; request 6's second copy is a 6th.
    assert h.count("weights_chunk") == 6
    assert h.metrics.registry.get_sample_value("slipstream_protocol_errors_total") == 1
    assert h.count("weights") == 0


async def test_a_chunk_that_never_comes_right_fails_the_fetch_and_keeps_the_old_version():
    manifest, chunks = publish(1, NAMED, chunk_bytes=1024)

    def tamper(n, index, reply):
        if index == 3:
            return [protocol.encode(dataclasses.replace(reply, checksum="0" * 32,
                                                        data=b"\x00" * len(reply.data)))]
        return [protocol.encode(reply)]

    h = Harness(lambda: MemoryChannel(manifest, chunks, tamper), chunk_retries=3)
    h.receiver.offer(manifest)
    assert not await h.receiver.receive(manifest)
    assert h.applied == [] and h.reported == [] and h.version == 0
    assert h.count("weights_checksum") == 3 and h.count("weights") == 1
    assert not h.receiver.pending                      # generation is not held back for it
    assert any(e == "weights_failed" for e, _ in h.events)


async def test_a_silent_endpoint_times_out_and_a_reannouncement_fetches_again():
    manifest, chunks = publish(1, NAMED, chunk_bytes=1024)
    silent = [True]
    h = Harness(lambda: MemoryChannel(manifest, chunks, silent=silent.pop(0)), chunk_timeout_s=0.05)
    assert h.receiver.offer(manifest)
    assert not h.receiver.offer(manifest)               # while it is pending: a repeat
    assert not await h.receiver.receive(manifest)
    assert h.count("weights_timeout") == 1 and h.applied == []
    assert h.channels[0].closed
    silent.append(False)
    assert h.receiver.offer(manifest)                   # the learner announces it again
    assert await h.receiver.receive(manifest)
    _check_applied(h, manifest)
    assert not h.receiver.offer(manifest)               # served now: a repeat
    assert h.count("weights_version") == 0


async def test_an_error_reply_fails_at_once():
    manifest, chunks = publish(1, NAMED, chunk_bytes=1024)
    h = Harness(lambda: MemoryChannel(dataclasses.replace(manifest, version=2), chunks))
    h.receiver.offer(manifest)
    assert not await h.receiver.receive(manifest)
    assert h.count("weights") == 1 and h.applied == []


async def test_an_engine_refusal_keeps_the_old_version():
    manifest, chunks = publish(1, NAMED, chunk_bytes=1024)
    h = Harness(lambda: MemoryChannel(manifest, chunks))

    async def refuse(update):
        raise ValueError("weights do not match the model")

    h.receiver.apply = refuse
    h.receiver.offer(manifest)
    assert not await h.receiver.receive(manifest)
    assert h.count("weights") == 1 and h.reported == []


def test_manifests_are_refused_before_anything_is_allocated():
    manifest, chunks = publish(3, NAMED, chunk_bytes=1024)
    h = Harness(lambda: pytest.fail("must not connect"), version=2, max_weights_bytes=4096)
    r = h.receiver
    assert not r.offer(manifest) and h.count("weights_manifest") == 1        # 4200 > 4096 bytes
    # 1 TiB that adds up: refused on its size, never allocated.
    huge = [protocol.TensorSpec(name="w", dtype="uint8", shape=[1 << 40], offset=0, nbytes=1 << 40)]
    tib = dataclasses.replace(manifest, tensors=huge, total_bytes=1 << 40, chunk_bytes=1 << 30,
                              num_chunks=1 << 10, chunk_checksums=[])
    assert not r.offer(tib) and h.count("weights_manifest") == 2
    # Sizes that do not add up (built in-process, past the codec's checks).
    short = dataclasses.replace(manifest, total_bytes=manifest.total_bytes - 1)
    assert not r.offer(short) and h.count("weights_manifest") == 3
    with pytest.raises(protocol.ProtocolError, match="total_bytes"):
        protocol.decode(protocol.encode(short))
    # Older than the version served, and the version served itself (a repeat: not counted).
    assert not r.offer(dataclasses.replace(manifest, version=1)) and h.count("weights_version") == 1
    assert not r.offer(dataclasses.replace(manifest, version=2)) and h.count("weights_version") == 1
    # No weights endpoint yet.
    r.endpoint = None
    assert not r.offer(dataclasses.replace(manifest, version=9, tensors=NAMED_SPECS_SMALL,
                                           total_bytes=8, chunk_bytes=8, num_chunks=1,
                                           chunk_checksums=["0" * 32]))
    assert h.count("weights_manifest") == 4
    assert not r.pending and h.channels == []


NAMED_SPECS_SMALL = [protocol.TensorSpec(name="w", dtype="float32", shape=[2], offset=0, nbytes=8)]


async def test_newer_announcements_win_and_older_ones_are_refused():
    m2, c2 = publish(2, NAMED, chunk_bytes=2048)
    m3, c3 = publish(3, NAMED, chunk_bytes=2048)
    served = {2: (m2, c2), 3: (m3, c3)}
    h = Harness(lambda: MemoryChannel(*served[h.receiver.announced.version]))
    r = h.receiver
    assert r.offer(m2) and r.offer(m3)                  # 3 replaces 2 before its fetch starts
    assert not r.offer(m2) and h.count("weights_version") == 1
    task = asyncio.create_task(r.run())
    try:
        assert await r.wait_settled(10)
    finally:
        task.cancel()
    assert [u.version for u in h.applied] == [3]
    # A new learner session compares afresh, but never below the version served.
    r.welcome("tcp://learner:2")
    assert not r.offer(m2) and h.count("weights_version") == 2


# ---- over real ZeroMQ sockets ------------------------------------------------------------------

async def _serve(router, manifest, chunks, stop: asyncio.Event, oversize: bool = False):
    while not stop.is_set():
        if not await router.poll(20):
            continue
        ident, *frames = await router.recv_multipart()
        req = protocol.decode(frames)
        reply = chunk_reply(manifest, chunks, req.index)
        if oversize:          # a frame far over chunk_bytes + slack: libzmq drops the link
            reply = dataclasses.replace(reply, data=bytes(len(reply.data) + (1 << 20)))
        await router.send_multipart([ident, *protocol.encode(reply)])


@pytest.mark.parametrize("oversize", [False, True])
async def test_fetch_over_zeromq(oversize):
    manifest, chunks = publish(1, NAMED, chunk_bytes=1024)
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = asyncio.Event()
    server = asyncio.create_task(_serve(router, manifest, chunks, stop, oversize))
    h = Harness(lambda: None, chunk_timeout_s=1.0 if oversize else 10.0)
    h.receiver.connect = lambda endpoint, max_bytes: ZmqChunkChannel(ctx, endpoint, max_bytes)
    h.receiver.welcome(f"tcp://127.0.0.1:{port}")
    try:
        h.receiver.offer(manifest)
        ok = await h.receiver.receive(manifest)
    finally:
        stop.set()
        await server
        router.close(0)
    if oversize:
        assert not ok and h.count("weights_timeout") == 1
    else:
        assert ok
        _check_applied(h, manifest)
