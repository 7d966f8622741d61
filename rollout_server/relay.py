"""Peer relay (issue 28 item 2): a rollout server serves the weight chunks it holds to its peers,
so the learner sends each version about once, whatever the number of servers.

What a server holds (:class:`RelayStore`): the chunks of the version it is fetching, each put
here once the receiver verified it against the manifest, and of the last version it applied (the
same memory: the receiver keeps those chunks for deltas anyway). The newest ``keep`` versions
are held; older ones are dropped.

The relay socket (:class:`RelayServer`): a ROUTER on ``rollout.relay`` (with CURVE, a CURVE
server with this server's key pair: the learner tells peers its public key in the manifest's
``sources``). It answers ``WeightChunkRequest(version, index)`` with the chunk (``WeightChunk``, the
manifest's checksum: the peer checks it as it would the learner's; a delta when the request
names a ``base`` this server holds too, as the learner's weights socket does) as soon as it
holds it: a chunk this server is still fetching is waited for, up to ``wait_s``; after that,
or for a version it does not hold, an ``Error`` (``not_held``), and the peer fetches that chunk
elsewhere. A request that does not decode is answered with a protocol error and counted; at most
``max_pending`` requests wait at once (more: ``busy``), so peers cannot pile up tasks. Bytes sent
are ``slipstream_weights_relayed_bytes_total`` (this server's egress to peers).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

import protocol
from protocol.chunks import xor_delta


class RelayStore:
    """Verified chunks by version (see the module docstring); ``put`` from the receiver."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._versions: OrderedDict[int, tuple[protocol.WeightsAvailable, dict[int, memoryview]]] = OrderedDict()
        self._changed = asyncio.Event()
        self._deltas: dict[tuple[int, int, int], bytes | None] = {}

    def put(self, m: protocol.WeightsAvailable, index: int, data: memoryview) -> None:
        held = self._versions.get(m.version)
        if held is None:
            held = self._versions[m.version] = (m, {})
            while len(self._versions) > self.keep:
                self._versions.popitem(last=False)
            for key in [k for k in self._deltas if k[0] not in self._versions]:
                del self._deltas[key]
        held[1][index] = data
        self._changed.set()
        self._changed = asyncio.Event()            # the next change wakes the next waiters

    def put_all(self, m: protocol.WeightsAvailable, chunks: list[memoryview]) -> None:
        for i, c in enumerate(chunks):
            self.put(m, i, c)

    async def delta(self, version: int, index: int, base: int) -> bytes | None:
        """Chunk ``index`` of ``version`` as a delta against ``base`` when this server holds both
        with the same layout and the delta is smaller (made on a worker thread once, kept while
        both versions are held); None otherwise: the raw chunk goes."""
        new, old = self._versions.get(version), self._versions.get(base)
        if (new is None or old is None or base >= version or index not in new[1] or index not in old[1]
                or new[0].tensors != old[0].tensors or new[0].chunk_bytes != old[0].chunk_bytes):
            return None
        key = (base, version, index)
        if key not in self._deltas:
            chunk = new[1][index]
            data = await asyncio.to_thread(xor_delta, chunk, old[1][index])
            self._deltas[key] = data if len(data) < chunk.nbytes else None
        return self._deltas.get(key)

    def get(self, version: int, index: int) -> tuple[protocol.WeightsAvailable, memoryview] | None:
        held = self._versions.get(version)
        if held is None or index not in held[1]:
            return None
        return held[0], held[1][index]

    @property
    def versions(self) -> list[int]:
        return list(self._versions)

    async def wait_for(self, version: int, index: int, timeout_s: float):
        """The chunk, waiting up to ``timeout_s`` for it to be put; None when it was not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            hit = self.get(version, index)
            if hit is not None:
                return hit
            left = deadline - loop.time()
            if left <= 0:
                return None
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                return None


class RelayServer:
    """The relay socket's loop: requests in, chunks out (see the module docstring)."""

    def __init__(self, store: RelayStore, sock: zmq.asyncio.Socket, *, wait_s: float, metrics: Any,
                 log: Callable[..., None], max_pending: int = 64):
        self.store, self.sock, self.wait_s = store, sock, wait_s
        self.metrics, self.log, self.max_pending = metrics, log, max_pending
        self._send_lock = asyncio.Lock()
        self._pending: set[asyncio.Task] = set()

    async def serve(self) -> None:
        try:
            while True:
                frames = await self.sock.recv_multipart(copy=False)
                identity, body = frames[0].bytes, [f.bytes for f in frames[1:]]
                if len(self._pending) >= self.max_pending:
                    await self._reply(identity, protocol.Error(code="busy", message="too many requests waiting"))
                    continue
                task = asyncio.create_task(self._answer(identity, body))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)
        finally:
            for task in list(self._pending):
                task.cancel()

    async def _answer(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            msg = protocol.decode(frames)
            if not isinstance(msg, protocol.WeightChunkRequest):
                raise protocol.ProtocolError(f"relay socket: {type(msg).TYPE} is not a "
                                             f"{protocol.WeightChunkRequest.TYPE}")
        except protocol.ProtocolError as e:
            self.metrics.protocol_errors.inc()
            await self._reply(identity, protocol.Error(code="protocol_error", message=str(e)[:500],
                                                       ref_id=protocol.message_id(frames)))
            return
        hit = await self.store.wait_for(msg.version, msg.index, self.wait_s)
        if hit is None:
            await self._reply(identity, protocol.Error(
                code="not_held", message=f"this server does not hold chunk {msg.index} of version "
                                         f"{msg.version} (holds {self.store.versions})"))
            return
        m, data = hit
        checksum = m.chunk_checksums[msg.index] if m.chunk_checksums else ""
        reply = protocol.WeightChunk(version=msg.version, index=msg.index, checksum=checksum, data=data)
        delta = await self.store.delta(msg.version, msg.index, msg.base) if msg.base >= 0 else None
        if delta is not None:
            reply = protocol.WeightChunk(version=msg.version, index=msg.index, checksum=checksum, data=delta,
                                         base=msg.base, encoding="xor-zstd")
        await self._reply(identity, reply)
        self.metrics.weights_relayed_bytes.inc(len(reply.data))

    async def _reply(self, identity: bytes, msg: protocol.Message) -> None:
        async with self._send_lock:
            try:
                await self.sock.send_multipart([identity, *protocol.encode(msg)], copy=False)
            except zmq.ZMQError as e:           # a peer gone, a full queue: its fetch times out
                self.log("relay_send_failed", error=str(e)[:200])
