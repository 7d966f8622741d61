"""The weights receiver: ``WeightsAvailable`` -> fetch the chunks -> verify -> apply -> report.

docs/design.md §5: a server reports ``WeightsApplied(version, checksum)`` only for weights it has
applied, and tags new tokens with a version only once the engine serves it.

Accepting a manifest (:meth:`WeightsReceiver.offer`). The codec has already checked that it adds
up (every tensor's bytes = dtype size x shape, offsets end to end, ``total_bytes`` their sum,
``num_chunks = ceil(total_bytes / chunk_bytes)``). Here it is also refused, and counted, when it
is older than the version served or announced (``weights_version``), when its buffer would be
larger than ``max_weights_bytes`` or its chunks larger than a frame may be, or when no Welcome
named the weights endpoint yet (``weights_manifest``). Nothing is allocated before that.
Re-announcing the version being served or fetched is a no-op (a learner does so after a Hello);
re-announcing one whose fetch failed fetches it again.

Fetching (:meth:`WeightsReceiver.fetch_chunks`): one DEALER per fetch (its ``ZMQ_MAXMSGSIZE`` is
the manifest's chunk size plus header slack, so a bigger frame is dropped by libzmq before it is
buffered); up to ``chunk_window`` requests in flight. A chunk stays in the frame libzmq received
it into (``copy=False``) and the tensors handed to the engine are views of those frames
(:func:`rollout_server.weights.unflatten_chunks`), so the engine's copy into its model is the one
pass over the bytes. Every reply is checked before it is kept: a ``WeightChunk`` of this version,
for an index asked for and not yet received, of exactly the size the manifest implies, whose
checksum matches the manifest's. A reply that fails is counted (``weights_chunk`` /
``weights_checksum``) and its chunk asked for again, at most ``chunk_retries`` times in all.
The learner answers each request once; a reply that names no chunk asked for (wrong index or
version, undecodable) still uses up one answer, so once every request has been answered the chunks still missing are asked for again. A second copy of a chunk
already received answers nothing (counted, skipped); more than two replies per request fail the
fetch, so a flood cannot keep it busy. No reply within
``chunk_timeout_s`` fails the fetch (``weights_timeout``: a dead or unreachable endpoint); an
``Error`` reply (the version is gone) fails it at once, and so does an endpoint libzmq refuses
to connect to (the service checks a Welcome's endpoint first; this is the safety net). A failed
fetch keeps the old weights and lets generation go on; the next announcement is fetched
afresh. Every failure and refusal (not a repeat) is reported through ``on_failed(message)``,
which the service sends to the learner as ``Error(code="weights_failed")`` (the learner's
circuit breaker counts them).

A new run (:meth:`WeightsReceiver.rebase`, when a Welcome names another run or a learner version
below the one served): the weights served belong to another run, so the next manifest is
fetched whatever its version number (even a lower one), and until one is applied
:meth:`wait_settled` does not return, so no work runs on another run's weights (``before_batch``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

import zmq

import protocol
from protocol.chunks import apply_xor_delta, chunk_checksum, combine_checksums
from protocol.codec import MAX_FRAME_BYTES
from protocol.plumbing.curve import CurveClient
from protocol.plumbing.process import trace, wait_event
from protocol.plumbing.sockets import endpoint_problem, make_socket
from protocol.plumbing.unfinished import FOLLOW_UP_S, Cut, UnfinishedGuard
from rollout_server.engine import WeightUpdate
from rollout_server.metrics import RolloutMetrics
from rollout_server.relay import RelayStore
from rollout_server.weights import unflatten_chunks

CHUNK_FRAME_SLACK_BYTES = 64 << 10   # header and body frames of a WeightChunk are far smaller
MAX_CHUNKS = 1 << 20                 # per version; bookkeeping stays a few MiB


class ChunkChannel(Protocol):
    """One fetch's link to a weights socket: the learner's, or a peer's relay."""

    async def request(self, version: int, index: int, base: int = -1) -> None: ...

    async def receive(self, timeout_s: float) -> protocol.Message | None:
        """The next reply (``ProtocolError`` if it does not decode), or None after ``timeout_s``."""
        ...

    def close(self) -> None: ...


class ZmqChunkChannel:
    """A DEALER connected to the learner's weights ROUTER (with CURVE keys when ``curve``)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, max_frame_bytes: int,
                 curve: CurveClient | None = None, unfinished_timeout_s: float = 30.0,
                 on_cut: Callable[[Cut], None] = lambda cut: None):
        self.sock = make_socket(ctx, zmq.DEALER, max_message_bytes=max_frame_bytes, curve=curve)
        self.guard = None
        try:
            # A chunk is its header, body and data frames: bounded together like one frame.
            self.guard = UnfinishedGuard(self.sock, "weights", max_bytes=max_frame_bytes + (1 << 20),
                                         open_s=unfinished_timeout_s, curve=curve is not None,
                                         router=False, on_cut=on_cut)
            self.sock.connect(endpoint)
        except BaseException:
            self.close()              # an open socket would hang the context's term() at exit
            raise

    async def request(self, version: int, index: int, base: int = -1) -> None:
        await self.sock.send_multipart(protocol.encode(
            protocol.WeightChunkRequest(version=version, index=index, base=base)))

    async def receive(self, timeout_s: float) -> protocol.Message | None:
        # Waits in slices with the guard's checks between them: a reply that never finishes
        # is cut by size or time (protocol.plumbing.unfinished), not held for the whole timeout.
        deadline = time.monotonic() + timeout_s
        guard = self.guard
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            step = min(left, FOLLOW_UP_S if guard.urgent() else guard.interval_s)
            if await self.sock.poll(step * 1000):
                break
            guard.check(drained=True)
        # copy=False: a chunk's data stays in the buffer libzmq received it into (the decoded
        # WeightChunk.data is a memoryview of that zmq.Frame); the small header and body frames
        # become bytes, for the codec's checks.
        frames = await self.sock.recv_multipart(copy=False)
        guard.received(frames)
        return protocol.decode([f.bytes if i < 2 else f for i, f in enumerate(frames)])

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
        self.sock.close(0)


class FetchError(Exception):
    """A fetch that cannot complete; ``kind`` is the error kind it is counted under."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def chunk_size(m: protocol.WeightsAvailable, index: int) -> int:
    """Bytes of chunk ``index`` of ``m`` (the last one may be shorter)."""
    return min(m.chunk_bytes, m.total_bytes - index * m.chunk_bytes)


class WeightsReceiver:
    """Fetch, verify, apply and report new weights (no socket of its own: ``connect`` makes one).

    ``connect(endpoint, max_frame_bytes)`` opens a :class:`ChunkChannel`; ``apply(update)`` hands
    a :class:`WeightUpdate` to the engine; ``report(msg)`` sends ``WeightsApplied``; ``version()``
    is the version the engine serves.
    """

    def __init__(self, *, connect: Callable[[str, int], ChunkChannel],
                 apply: Callable[[WeightUpdate], Awaitable[float]],
                 report: Callable[[protocol.WeightsApplied], Awaitable[None]],
                 version: Callable[[], int], server_id: str, metrics: RolloutMetrics,
                 log: Callable[..., None], max_weights_bytes: int, chunk_timeout_s: float = 30.0,
                 chunk_window: int = 4, chunk_retries: int = 3,
                 clock: Callable[[], float] = time.monotonic,
                 on_failed: Callable[[str], Awaitable[None]] | None = None, keep_base: bool = True,
                 relay: RelayStore | None = None, relay_endpoint: str | None = None,
                 relay_timeout_s: float = 10.0):
        self.connect, self.apply, self.report, self.version = connect, apply, report, version
        self.keep_base = keep_base
        # Peer relay (rollout_server/relay.py): verified chunks go to ``relay`` for this server's
        # peers; ``relay_endpoint`` is its own (never fetched from); a peer that gives nothing
        # for ``relay_timeout_s`` is skipped.
        self.relay, self.relay_endpoint, self.relay_timeout_s = relay, relay_endpoint, relay_timeout_s
        # The applied full-weights version's manifest and verified chunks, kept (keep_base) so the
        # next fetch can ask for deltas against it.
        self.base: tuple[protocol.WeightsAvailable, list[memoryview]] | None = None
        self.on_failed = on_failed
        self.server_id, self.metrics, self.log, self.clock = server_id, metrics, log, clock
        self.max_weights_bytes = max_weights_bytes
        self.chunk_timeout_s, self.chunk_window, self.chunk_retries = (
            chunk_timeout_s, chunk_window, chunk_retries)
        self.endpoint: str | None = None
        self.announced: protocol.WeightsAvailable | None = None   # newest manifest not yet settled
        self.newest = -1                  # newest version announced since the last Welcome
        self.busy: tuple[int, float] | None = None   # (version, since) while fetching and applying
        self.rebasing = False             # the weights served are another run's (see rebase)
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()   # set while no announced version waits to be applied
        self._settled.set()
        self._reports: set[asyncio.Task] = set()
        self._rebased = asyncio.Event()   # clear while the weights served are another run's
        self._rebased.set()

    # ---- announcements ----------------------------------------------------------------------
    def welcome(self, endpoint: str) -> None:
        """A (new) learner session: its weights endpoint; versions are compared afresh."""
        self.endpoint = endpoint
        self.newest = self.announced.version if self.announced is not None else -1

    def forget_endpoint(self) -> None:
        """The learner's session named no usable weights endpoint (a refused Welcome): refuse
        manifests until a Welcome names one, rather than fetch from the previous session's."""
        self.endpoint = None

    def rebase(self) -> None:
        """A learner of another run welcomed us: fetch its next manifest whatever the version,
        and hold new work until it is applied (see the module docstring)."""
        self.rebasing = True
        self.base = None
        self.announced = None
        self.newest = -1
        self._rebased.clear()

    def offer(self, m: protocol.WeightsAvailable) -> bool:
        """Accept ``m`` for fetching (True) or refuse it (False, counted unless a repeat)."""
        current = -1 if self.rebasing else self.version()
        newest = max(current, self.newest)
        if m.version == current or (self.announced is not None and m.version == self.announced.version):
            return False                                        # a repeat: nothing to do
        try:
            m.cross_check("WeightsAvailable")     # decode did this; a manifest built in-process too
        except protocol.ProtocolError as e:
            return self._refuse("weights_manifest", m, str(e))
        if m.version < newest:
            return self._refuse("weights_version", m, f"version {m.version} is older than "
                                f"{newest} (served or announced)")
        if self.endpoint is None:
            return self._refuse("weights_manifest", m, "no weights endpoint (no Welcome yet)")
        if m.total_bytes > self.max_weights_bytes:
            return self._refuse("weights_manifest", m, f"{m.total_bytes} bytes exceed "
                                f"rollout.weights.max_bytes = {self.max_weights_bytes}")
        if min(m.chunk_bytes, m.total_bytes) > MAX_FRAME_BYTES:
            return self._refuse("weights_manifest", m, f"chunks of {m.chunk_bytes} bytes exceed "
                                f"the {MAX_FRAME_BYTES}-byte frame limit")
        if m.num_chunks > MAX_CHUNKS:
            return self._refuse("weights_manifest", m, f"{m.num_chunks} chunks exceed {MAX_CHUNKS}")
        trace("rollout.manifest")
        self.announced, self.newest = m, m.version
        self._settled.clear()
        self._wake.set()
        return True

    def _refuse(self, kind: str, m: protocol.WeightsAvailable, why: str) -> bool:
        self.metrics.count(kind)
        self.log("weights_refused", weights_version=m.version, kind=kind, reason=why)
        self._report_failure(f"version {m.version} refused: {kind}: {why}")
        return False

    def _report_failure(self, message: str) -> None:
        if self.on_failed is not None:
            # Not awaited here (offer is synchronous): a task that sends one Error.
            task = asyncio.ensure_future(self.on_failed(message[:1000]))
            self._reports.add(task)
            task.add_done_callback(self._reports.discard)

    @property
    def pending(self) -> bool:
        """A newer version is announced and neither applied nor failed yet."""
        return not self._settled.is_set()

    async def wait_settled(self, timeout_s: float) -> bool:
        """Wait (bounded) until no announced version is pending; returns whether none is.

        While rebasing, first wait (unbounded) until this run's weights are applied: another
        run's weights must never generate for this one."""
        if self.rebasing:
            await self._rebased.wait()
        if self._settled.is_set():
            return True
        return await wait_event(self._settled, timeout_s)

    def _settle(self, m: protocol.WeightsAvailable) -> None:
        if self.announced is m:
            self.announced = None
            self._settled.set()

    # ---- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            m = self.announced
            if m is None:
                continue
            if m.version <= self.version() and not self.rebasing:
                self._settle(m)
                continue
            await self.receive(m)

    async def receive(self, m: protocol.WeightsAvailable) -> bool:
        """Fetch, apply and report ``m``; False (counted, logged) if any step fails."""
        start = self.clock()
        self.busy = (m.version, start)
        try:
            try:
                trace("rollout.fetch")
                chunks = await self.fetch_chunks(m)
                trace("rollout.fetched")
            except FetchError as e:
                self.metrics.count(e.kind)
                self.log("weights_failed", weights_version=m.version, kind=e.kind, error=str(e))
                self._report_failure(f"version {m.version}: {e.kind}: {e}")
                return False
            try:
                # Views of the received frames (a tensor cut by a chunk boundary is copied once):
                # the engine's copy into its model is the only full pass over the bytes here.
                update = WeightUpdate(version=m.version, kind=m.kind,
                                      tensors=unflatten_chunks(chunks, m.chunk_bytes, m.tensors),
                                      lora_config={} if m.lora is None else m.lora.peft_kwargs())
                self.base = None                  # the engine's weights change now
                await self.apply(update)
                if self.keep_base and m.kind == "full":
                    self.base = (m, chunks)
                del chunks
                trace("rollout.applied")
            except Exception as e:  # noqa: BLE001 - refused by the engine: keep the old version
                self.metrics.count("weights")
                self.log("weights_failed", weights_version=m.version, kind="weights",
                         error=f"{type(e).__name__}: {e}")
                self._report_failure(f"version {m.version}: weights: {type(e).__name__}: {e}")
                return False
            finally:
                update = None                 # the frames are freed once the engine let go too
            self.rebasing = False
            self._rebased.set()
            seconds = self.clock() - start
            self.metrics.weight_update_seconds.observe(seconds)
            self.metrics.policy_version.set(m.version)
            await self.report(protocol.WeightsApplied(server_id=self.server_id, version=m.version,
                                                      checksum=m.checksum, seconds=seconds))
            self.log("weights_applied", weights_version=m.version, seconds=round(seconds, 4))
            return True
        finally:
            self.busy = None
            self._settle(m)

    # ---- fetch ------------------------------------------------------------------------------
    async def fetch(self, m: protocol.WeightsAvailable) -> bytearray:
        """Every chunk of ``m``, verified, joined in one buffer of ``m.total_bytes``."""
        buffer = bytearray(m.total_bytes)
        into = memoryview(buffer)
        for i, chunk in enumerate(await self.fetch_chunks(m)):
            into[i * m.chunk_bytes:i * m.chunk_bytes + memoryview(chunk).nbytes] = chunk
        into.release()
        return buffer

    async def fetch_chunks(self, m: protocol.WeightsAvailable) -> list[memoryview]:
        """Every chunk of ``m``, verified, in index order: zero-copy views of the frames libzmq
        received them into (``ZmqChunkChannel`` receives with ``copy=False``).

        From the manifest's ``sources`` first (peers relaying the version, in order), then the
        learner for whatever they did not give: a peer that does not answer within
        ``relay_timeout_s``, answers an Error, or sends a chunk that fails its checks is skipped
        for the rest of this fetch (``slipstream_weights_relay_failures_total{reason}``); the
        chunks it gave, each checked against the manifest, are kept."""
        n = m.num_chunks
        if n == 0:
            self._check_total(m, [])
            return []
        if self.endpoint is None:
            raise FetchError("weights_manifest", "no weights endpoint")
        got: list[str | None] = [None] * n
        chunks: list[memoryview | None] = [None] * n
        for src in self._peers(m):
            try:
                await self._fetch_from(m, got, chunks, src)
            except FetchError as e:
                self.metrics.relay_failures.labels(reason=e.kind).inc()
                self.log("weights_relay_skipped", weights_version=m.version, relay=src.endpoint[:200],
                         reason=e.kind, error=str(e)[:300], missing=got.count(None))
            if None not in got:
                break
        if None in got:
            await self._fetch_from(m, got, chunks, None)
        self._check_total(m, got)
        return chunks

    def _peers(self, m: protocol.WeightsAvailable) -> list[protocol.WeightsSource]:
        """The manifest's sources this server may use: not itself, a well-formed endpoint."""
        out = []
        for src in m.sources:
            if src.endpoint == self.relay_endpoint or endpoint_problem(src.endpoint) is not None:
                continue
            out.append(src)
        return out

    async def _fetch_from(self, m: protocol.WeightsAvailable, got: list, chunks: list,
                          src: protocol.WeightsSource | None) -> None:
        """The chunks still missing (``got[i]`` None) from ``src`` (None: the learner), into
        ``got`` / ``chunks``. The learner: retries, then FetchError. A peer: the first problem
        is a FetchError (its kind the relay failure's reason)."""
        n = m.num_chunks
        relay = src is not None
        endpoint = src.endpoint if relay else self.endpoint
        frame_bytes = min(m.chunk_bytes, m.total_bytes) + CHUNK_FRAME_SLACK_BYTES
        try:
            channel = (self.connect(endpoint, frame_bytes, src.public_key or None) if relay
                       else self.connect(endpoint, frame_bytes))
        except (zmq.ZMQError, ValueError) as e:   # the service checks the endpoint; this is the net
            raise FetchError("connect" if relay else "weights", f"cannot connect to {endpoint!r}: {e}") from None
        timeout_s = self.relay_timeout_s if relay else self.chunk_timeout_s
        try:
            base = self._base_for(m)          # a peer holding the same base may send deltas too
            raw_only: set[int] = set()        # chunks whose delta failed: asked for raw
            attempts = [0] * n
            why: dict[int, str] = {}          # index -> the last problem with it
            todo = deque(i for i in range(n) if got[i] is None)
            asked: set[int] = set()           # requested, no good reply yet
            due = 0                           # replies still owed
            sent = replies = 0
            received = self.metrics.weights_received_bytes.labels(source="peer" if relay else "learner")
            while todo or asked:
                while todo and due < self.chunk_window:
                    i = todo.popleft()
                    if attempts[i] >= self.chunk_retries:
                        raise FetchError("weights", f"version {m.version}: chunk {i} failed "
                                         f"{attempts[i]} times (last: {why.get(i, '?')})")
                    attempts[i] += 1
                    await channel.request(m.version, i, base[0] if base and i not in raw_only else -1)
                    asked.add(i)
                    due += 1
                    sent += 1
                try:
                    reply = await channel.receive(timeout_s)
                except protocol.ProtocolError as e:
                    self.metrics.protocol_errors.inc()
                    if relay:
                        raise FetchError("bad_chunk", f"undecodable reply: {e}") from None
                    reply = e
                if reply is None:
                    raise FetchError("timeout" if relay else "weights_timeout",
                                     f"no weight chunk for {timeout_s}s (version {m.version}, endpoint {endpoint})")
                replies += 1
                if replies > 2 * sent + self.chunk_window:
                    raise FetchError("bad_chunk" if relay else "weights",
                                     f"version {m.version}: {replies} replies to {sent} requests")
                if (isinstance(reply, protocol.WeightChunk) and reply.version == m.version
                        and 0 <= reply.index < n and got[reply.index] is not None):
                    # A second copy of a chunk already received answers no request: count it,
                    # keep waiting for the replies still owed.
                    self.metrics.count("weights_chunk")
                    self.log("weights_bad_chunk", weights_version=m.version, kind="weights_chunk",
                             error=f"chunk {reply.index} received twice")
                    continue
                due = max(0, due - 1)
                if isinstance(reply, protocol.Error):
                    raise FetchError("refused" if relay else "weights",
                                     f"{'relay' if relay else 'learner'} refused chunk: {reply.code}: {reply.message}")
                data, problem = await self._decode(m, reply, asked, base)
                if problem is None:
                    i = reply.index
                    chunks[i] = memoryview(data)
                    received.inc(len(reply.data))
                    self.metrics.weight_chunks_received.labels(
                        encoding="raw" if reply.encoding == "raw" else "delta").inc()
                    got[i] = m.chunk_checksums[i] if m.chunk_checksums else reply.checksum
                    asked.discard(i)
                    if self.relay is not None:
                        self.relay.put(m, i, chunks[i])
                else:
                    kind, i, message = problem
                    self.metrics.count(kind)
                    self.log("weights_bad_chunk", weights_version=m.version, kind=kind, error=message,
                             **({"relay": endpoint[:200]} if relay else {}))
                    if relay:                 # a peer that sends bad bytes is not asked again
                        raise FetchError("bad_chunk", message)
                    if isinstance(reply, protocol.WeightChunk) and reply.encoding != "raw" and i is not None:
                        raw_only.add(i)       # a delta that failed: fetch it raw
                    if i is not None:
                        why[i] = kind
                        asked.discard(i)
                        todo.append(i)
                if due == 0 and asked:        # answered, but not with these chunks: ask again
                    todo.extend(sorted(asked))
                    asked.clear()
        finally:
            channel.close()

    def _base_for(self, m: protocol.WeightsAvailable) -> tuple[int, list[memoryview]] | None:
        """The kept version a fetch of ``m`` may ask deltas against: an older full version with
        the same tensors in the same chunks."""
        if self.base is None or m.kind != "full":
            return None
        held, chunks = self.base
        if (held.version >= m.version or held.tensors != m.tensors or held.chunk_bytes != m.chunk_bytes
                or held.num_chunks != m.num_chunks):
            return None
        return held.version, chunks

    async def _decode(self, m: protocol.WeightsAvailable, reply, asked: set[int],
                      base: tuple[int, list[memoryview]] | None):
        """``(the chunk's bytes, None)`` for a good reply to a chunk asked for, else ``(None,
        (kind, index to ask again or None, message))``. A delta is applied (on a worker thread)
        to the kept chunk and checked as the chunk it makes."""
        if isinstance(reply, protocol.ProtocolError):
            return None, ("weights_chunk", None, f"undecodable reply: {reply}")
        if not isinstance(reply, protocol.WeightChunk):
            return None, ("weights_chunk", None, f"unexpected {type(reply).TYPE} on the weights socket")
        if reply.version != m.version:
            return None, ("weights_chunk", None, f"chunk of version {reply.version}, fetching {m.version}")
        i = reply.index
        if i not in asked:
            return None, ("weights_chunk", None, f"chunk {i} not asked for (of {m.num_chunks})")
        data = reply.data
        if reply.encoding != "raw":
            if base is None or reply.base != base[0]:
                return None, ("weights_delta", i, f"chunk {i}: a delta against version {reply.base}, "
                                                  f"which this server does not hold")
            try:
                data = await asyncio.to_thread(apply_xor_delta, reply.data, base[1][i])
            except ValueError as e:
                return None, ("weights_delta", i, f"chunk {i} of version {m.version}: {e}")
        size, want = memoryview(data).nbytes, chunk_size(m, i)
        if size != want:
            return None, ("weights_chunk", i, f"chunk {i} has {size} bytes, the manifest says {want}")
        expected = m.chunk_checksums[i] if m.chunk_checksums else reply.checksum
        if chunk_checksum(data) != expected:
            kind = "weights_checksum" if reply.encoding == "raw" else "weights_delta"
            return None, (kind, i, f"chunk {i} of version {m.version} failed its checksum"
                                   + ("" if reply.encoding == "raw" else f" (a delta against {reply.base})"))
        return data, None

    @staticmethod
    def _check_total(m: protocol.WeightsAvailable, got: list) -> None:
        if combine_checksums(got) != m.checksum:
            raise FetchError("weights_checksum", f"weights version {m.version}: checksum mismatch")
