"""One ROUTER socket of the learner: the receive loop and non-blocking sends, written once.

The learner's three sockets (rollout, weights, control) are ROUTERs that rollout servers and
``slipstream ctl`` connect to as DEALERs (docs/design.md §6). Each runs the same loop: receive
``[identity, *frames]``, decode, hand the message to the socket's handler, send its reply. Bad
input — garbage bytes, a wrong message type for the socket, a value the handler refuses — is a
:class:`protocol.ProtocolError`: counted in ``slipstream_protocol_errors_total{socket=...}``,
logged (at most one line per second per socket, with the number suppressed), answered with the
socket's error reply, and the loop goes on.

Sends never wait. A peer that stops reading must not stall the learner's loop (and with it every
other server and the training step), so every send is ``NOBLOCK`` on a socket with
``ROUTER_MANDATORY`` set: a peer whose queue is full (``SNDHWM``) or that has gone away is then an
error the sender sees — instead of a silent drop, or an ``await`` that never returns — and
:meth:`RouterSocket.send` returns False and counts it in ``slipstream_send_dropped_total``.
What a dropped message means is the caller's decision (admission treats that server as lost; a
fetch missing a chunk times out on the server, which fetches the version again when it is
re-announced; a dropped control reply times out at ctl).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

import protocol
from learner.metrics import LearnerMetrics
from protocol.plumbing.unfinished import UnfinishedGuard
from protocol.schema import MAX_LIST_ITEMS

Handler = Callable[[bytes, protocol.Message], Awaitable[protocol.Message | None]]
ErrorReply = Callable[[protocol.ProtocolError, list], protocol.Message | None]
Send = Callable[[bytes, protocol.Message], Awaitable[bool]]

LOG_EVERY_S = 1.0
BURST = 64
"""Messages a socket loop handles back to back before it yields to the event loop."""
MAX_ACK_IDS = MAX_LIST_ITEMS
"""Samples one Ack may name (the protocol's limit on a list)."""
MAX_ACK_CHARS = 1 << 16
"""Characters of sample ids beyond which held Acks are not merged further: a merged Ack stays
small, so the send HWM (in messages) bounds what a peer that stops reading can pile up about as
it did with one Ack per result."""
_NOBLOCK = int(zmq.NOBLOCK)
_VIEW_BYTES = 4096        # received frames this large are handed on as memoryviews, not copied
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)


def protocol_error_reply(error: protocol.ProtocolError, frames: list) -> protocol.Message:
    """The rollout and weights sockets' answer to bad input: an ``Error`` naming what was wrong."""
    return protocol.Error(code="protocol_error", message=str(error), ref_id=protocol.message_id(frames))


class RouterSocket:
    """A bound ROUTER socket named ``name`` ("rollout", "weights", "control")."""

    def __init__(self, sock: zmq.asyncio.Socket, name: str, metrics: LearnerMetrics,
                 log: Callable[..., None], clock: Callable[[], float] = time.monotonic,
                 guard: UnfinishedGuard | None = None):
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock = sock
        # Counts every message received, per connection; serve() runs its checks (a peer's
        # unfinished message over the socket's max message bytes, or open too long, is cut).
        self.guard = guard
        self._guard_at = float("-inf")
        # The same libzmq socket without the asyncio wrapper, for the non-blocking calls of the
        # hot path: a NOBLOCK recv or send through zmq.asyncio builds a Future and flag enums per
        # call (about half the learner's cost per result, bench_ingress.py's profile).
        self.sync = zmq.Socket.shadow(sock.underlying)
        self._recv = self.sync.recv
        self._receiving = False               # serve() awaits the asyncio recv (see send_frames)
        self.name = name
        self.metrics = metrics
        self.log = log
        self.clock = clock
        self._last_log = float("-inf")
        self._suppressed = 0

    async def send(self, identity: bytes, message: protocol.Message) -> bool:
        """Queue ``message`` for ``identity`` without waiting; False if it could not be queued."""
        # An Assignment's message id is its assignment id, so a server's refusal
        # (Error.ref_id) names the lease directly.
        msg_id = message.assignment_id if type(message) is protocol.Assignment else None
        return self.send_frames(identity, protocol.encode(message, msg_id))

    def send_frames(self, identity: bytes, frames: list) -> bool:
        try:
            if self._receiving:
                # Another task sends while serve() waits in the asyncio recv: through the asyncio
                # socket, which re-arms the reader (a send may consume the edge of the socket's
                # FD that the waiting recv needs). With NOBLOCK it sends at once and returns a
                # finished future; its exception (EAGAIN: queue full, EHOSTUNREACH: no such
                # peer) is raised by result().
                self.sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False).result()
                return True
            # From serve()'s handler (no recv waiting; serve() polls before it waits again):
            # the plain socket, int flags. An error on the first frame leaves nothing queued.
            send = self.sync.send
            send(identity, _MORE, copy=False)
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                send(frame, _MORE if i < last else _NOBLOCK, copy=False)
            return True
        except zmq.Again:
            reason = "full"
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            reason = "unreachable"
        self.metrics.send_dropped.labels(socket=self.name, reason=reason).inc()
        return False

    async def serve(self, handler: Handler, error_reply: ErrorReply = protocol_error_reply,
                    idle: Callable[[], Awaitable[None]] | None = None) -> None:
        """Receive, decode, handle, reply — forever (cancel the task to stop).

        ``idle``, when given, is awaited whenever the loop stops reading: the queue is empty,
        or BURST messages were handled back to back (the learner sends the Acks it held for the
        burst there, :class:`PendingAcks`)."""
        guard = asyncio.create_task(self.guard.run(), name=f"{self.name}-unfinished") \
            if self.guard is not None else None
        try:
            await self._serve(handler, error_reply, idle)
        finally:
            if guard is not None:
                guard.cancel()

    async def _serve(self, handler: Handler, error_reply: ErrorReply,
                     idle: Callable[[], Awaitable[None]] | None) -> None:
        recv = self._recv_nowait
        burst = 0
        while True:
            # Drain what is queued with non-blocking reads (no Future per message); wait in the
            # asyncio recv only when the queue is empty, and yield to the loop every BURST
            # messages so the train loop and the other sockets are never starved.
            if burst >= BURST:
                burst = 0
                if idle is not None:
                    await idle()
                await asyncio.sleep(0)        # awaiting a ready recv would not yield
            try:
                identity, frames = recv()
                burst += 1
            except zmq.Again:
                burst = 0
                if self.guard is not None and self.clock() - self._guard_at >= self.guard.interval_s:
                    self._guard_at = self.clock()
                    self.guard.check(drained=True)       # the queue is empty: the byte rule applies
                if idle is not None:
                    await idle()
                self._receiving = True
                try:
                    received = await (self.sock.recv_multipart(copy=False) if self.guard is None
                                      else self.guard.receive(self.sock))
                finally:
                    self._receiving = False
                identity, *frames = [f.bytes for f in received]
            try:
                reply = await handler(identity, protocol.decode(frames))
            except protocol.ProtocolError as e:
                self.refused(e)
                reply = error_reply(e, frames)
            if reply is not None:
                await self.send(identity, reply)
                # A weight chunk is a zero-copy view of its snapshot: held here until the next
                # request, it would keep a dropped version's buffer alive (learner.serve.weights_server).
                reply = None

    def _recv_nowait(self) -> tuple[bytes, list]:
        """One queued message as ``(identity, frames)``; ``zmq.Again`` when there is none.

        Frames are received as ``zmq.Frame`` (``copy=False``), whose ``more`` flag libzmq sets in
        the same call: ``recv_multipart`` asks for ``RCVMORE`` after every frame through
        ``getsockopt``, which builds a ``SocketOption`` enum each time. Small frames become bytes;
        a large one (a result's body) stays a view of the buffer libzmq received it into, which
        msgpack reads without the copy to bytes (``protocol.decode`` takes it as it takes bytes).
        A queued result of 1,024-token samples: 10 -> 5.5 us with one sample, 17 -> 6 us with
        eight (the 100 KB copy), min of 8 runs of 500."""
        recv = self._recv
        f = recv(_NOBLOCK, False)
        identity = f.bytes
        frames = []
        received = [f]
        while f.more:       # the rest of a multipart message is there: it arrives as a whole
            f = recv(_NOBLOCK, False)
            received.append(f)
            frames.append(f.bytes if len(f) < _VIEW_BYTES else f.buffer)
        if self.guard is not None:
            self.guard.received(received)
        return identity, frames

    def refused(self, error: protocol.ProtocolError, **fields: Any) -> None:
        """Count (and, rate-limited, log) one message refused with ``error``."""
        self.metrics.protocol_errors.labels(socket=self.name).inc()
        now = self.clock()
        if now - self._last_log < LOG_EVERY_S:
            self._suppressed += 1
            return
        self.log("protocol_error", socket=self.name, error=str(error)[:500],
                 suppressed=self._suppressed, **fields)
        self._last_log, self._suppressed = now, 0

    def cut(self, cut) -> None:
        """A connection the guard ended (:class:`protocol.plumbing.unfinished.Cut`): counted and logged."""
        self.metrics.connections_cut.labels(socket=self.name, reason=cut.reason).inc()
        self.log("connection_cut", level="warning", socket=self.name, peer=cut.peer,
                 reason=cut.reason, unfinished_bytes=cut.unfinished_bytes, detail=cut.detail)

    def close(self, linger_ms: int = 0) -> None:
        if self.guard is not None:
            self.guard.close()
        self.sock.close(linger_ms)


class RolloutLink:
    """The learner's side of the rollout socket as a port (learner.serve.admission.Sender): what
    admission and the ingress send goes through :meth:`send`; the socket is attached when it is
    bound (``LearnerService._open``). Tests put their spies on :meth:`send`."""

    def __init__(self):
        self.socket: RouterSocket | None = None

    async def send(self, identity: bytes, message: protocol.Message) -> bool:
        """Queue ``message`` for ``identity``; False if it could not be queued (no socket yet,
        a full queue, a peer that is gone)."""
        if self.socket is None:
            return False
        return await self.socket.send(identity, message)


class PendingAcks:
    """The Acks of one burst of results, held and then sent as one Ack per server.

    A server that pushes faster than the learner reads finds several of its results queued; each
    gets its statuses at once (``Intake.receive``), but they leave together, in arrival order, as
    one Ack when the rollout loop stops reading (``RouterSocket.serve``'s ``idle``). A server
    matches acks by sample id (``rollout_server.outbox``), so one Ack naming the samples of several
    results is the same answer as one Ack per result; it costs the learner one encode and one
    send, and the server one receive and one decode, instead of one per result. A learner that
    keeps up (its queue runs empty after every message) sends every Ack at once, as before.
    Nothing is held across an await of the loop's: the learner sends what it holds before it
    handles any other message (``LearnerService.on_rollout``) and before it yields.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        # identity -> segments [server, sample_ids, statuses, id characters]; a new segment
        # when the server object changes, or the Ack would pass MAX_ACK_IDS or MAX_ACK_CHARS
        self._held: dict[bytes, list[list]] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def add(self, identity: bytes, server: Any, ack: protocol.Ack) -> None:
        ids = ack.sample_ids
        chars = sum(map(len, ids))
        segments = self._held.get(identity)
        if segments is None:
            self._held[identity] = [[server, list(ids), list(ack.statuses), chars]]
            return
        last = segments[-1]
        if (last[0] is server and len(last[1]) + len(ids) <= MAX_ACK_IDS
                and last[3] + chars <= MAX_ACK_CHARS):
            last[1].extend(ids)
            last[2].extend(ack.statuses)
            last[3] += chars
        else:
            segments.append([server, list(ids), list(ack.statuses), chars])

    def take(self) -> list[tuple[bytes, Any, protocol.Ack]]:
        """Everything held, as (identity, server, Ack), first identity first; empties the hold."""
        held, self._held = self._held, {}
        return [(identity, server, protocol.Ack(sample_ids=ids, statuses=statuses))
                for identity, segments in held.items() for server, ids, statuses, _ in segments]
