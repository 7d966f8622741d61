"""Bounds on a peer's unfinished ZeroMQ message (issue 31 item 2): its bytes and how long it is open.

libzmq checks ``ZMQ_MAXMSGSIZE`` per *frame*, and its high-water marks count *complete*
messages, so the frames of a message whose last frame has not come (``MORE`` set on each) pile up
in the socket's pipe, invisible to the application, for as long as the peer keeps sending or
simply waits: 25 frames of 60 MiB took a learner from 483 to 1,983 MB. libzmq has no option for
it, so each guarded socket has an :class:`UnfinishedGuard` that compares, per TCP connection, the
bytes the kernel received on it (``TCP_INFO``'s ``tcpi_bytes_received``, read on the connection's
file descriptor) with the bytes of the complete messages the application received from it (each
message's ``ZMQ_SRCFD`` names its connection; its size on the wire is exact, :func:`wire_bytes`).
What is left over is the unfinished message (plus the handshake and heartbeats, see ``floor``).

A connection is cut (``shutdown`` of its socket with ``SO_LINGER`` 0: libzmq drops the
connection and frees the unfinished frames, the kernel resets it; a DEALER reconnects, a ROUTER
forgets the peer) when

- its unfinished message is over ``max_bytes`` on two checks in a row (the socket's
  ``max_message_bytes``: a message's frames together may be no larger than one frame may be;
  two checks, because a complete message that arrives between the drained socket and the reading
  of the counter looks unfinished once; the second comes :data:`FOLLOW_UP_S` after the first), or
- an unfinished message over :data:`SMALL_BYTES` has been open ``open_s`` seconds with nothing
  delivered from that connection meanwhile (a stream is ordered: nothing after an unfinished
  message can be delivered, so a peer that sends and waits is seen; a connection that delivers
  is never cut by this rule).

Checks run every ``interval_s`` (50 ms; :meth:`UnfinishedGuard.run`, on the socket's own event
loop), every :data:`FOLLOW_UP_S` while a connection has an unfinished message over
:data:`SMALL_BYTES`; the byte rule only while the socket has no complete message waiting (queued
messages would count as unfinished). What it does not bound: what a fast peer sends before the
check that sees it (at loopback speed, tens of MB in 50 ms), and memory per byte: libzmq keeps 64 bytes per frame, so a
message of empty frames (2 bytes each on plain TCP, 35 under CURVE) costs up to 32x its wire size
without CURVE, 2x with it. CURVE, on by default, keeps unauthenticated peers out altogether.

Heartbeats (ZMTP ``PING``/``PONG``) and the handshake reach the kernel counter but no message:
``floor`` follows that slow drift (at most :data:`DRIFT_BYTES_PER_S`), never a fast rise.
Only TCP connections are guarded (ipc and inproc have no counter). Linux only; elsewhere the
guard does nothing. Torch-free, like all of :mod:`protocol`.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zmq

__all__ = ["MONITOR_EVENTS", "Cut", "UnfinishedGuard", "wire_bytes"]

SMALL_BYTES = 64 << 10
"""Unfinished bytes that never count as an open message: a handshake (plain ~110 B, CURVE
~570 B, more with a peer's metadata) and heartbeats."""
DRIFT_BYTES_PER_S = 4 << 10
"""How fast bytes that belong to no message (heartbeats) may accumulate: ``floor`` rises at most
this fast. A ZMTP PING is 9 bytes (42 under CURVE) per heartbeat interval (2 s by default)."""
FOLLOW_UP_S = 0.01
"""How soon a connection seen over ``max_bytes`` is looked at again (and a cut's memory trimmed)."""
TRIM_CHECKS = 5
"""Checks after a cut that give freed heap back to the system: libzmq frees the connection's
frames once its I/O thread and the socket's owner have both let go of them."""
CURVE_OVERHEAD = 33
"""Bytes CURVE adds to each frame: the MESSAGE command name (8), a short nonce (8), the box's
MAC (16) and its flags byte (1)."""
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_BYTES_RECEIVED_AT = 128      # struct tcp_info: tcpi_bytes_received, a __u64, Linux >= 4.1
_INFO_SIZE = _BYTES_RECEIVED_AT + 8
_SRCFD = int(zmq.SRCFD)
_LINUX = sys.platform.startswith("linux")
_MONITORS = itertools.count()
_CONNECTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED
_ENDS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
MONITOR_EVENTS = _CONNECTS | _ENDS
"""The monitor events the guard follows (value: the connection's file descriptor)."""


def wire_bytes(sizes: Iterable[int], curve: bool) -> int:
    """Bytes on the wire (ZMTP 3) of a message whose frames have ``sizes``: a flags byte and a
    1-byte (under 256) or 8-byte length per frame; under CURVE each frame is a MESSAGE command of
    the frame plus :data:`CURVE_OVERHEAD`."""
    extra = CURVE_OVERHEAD if curve else 0
    total = 0
    for n in sizes:
        n += extra
        total += n + (2 if n < 256 else 9)
    return total


def tcp_bytes_received(fd: int) -> int | None:
    """``tcpi_bytes_received`` of the TCP socket ``fd`` (None: not a TCP socket, or closed)."""
    try:
        s = socket.socket(fileno=fd)       # no dup, no close: detached below
    except OSError:
        return None
    try:
        if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        info = s.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _INFO_SIZE)
    except OSError:
        return None
    finally:
        s.detach()
    if len(info) < _INFO_SIZE:
        return None
    return struct.unpack_from("Q", info, _BYTES_RECEIVED_AT)[0]


def peer_of(fd: int) -> str | None:
    """``host:port`` of the peer of TCP socket ``fd``, or None."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        host, port = s.getpeername()[:2]
        return f"{host}:{port}"
    except (OSError, ValueError, TypeError):
        return None
    finally:
        s.detach()


def cut_connection(fd: int, peer: str | None) -> bool:
    """Shut down the TCP connection on ``fd`` if its peer is still ``peer`` (a closed descriptor's
    number may already name another connection). libzmq sees the connection end and frees it."""
    try:
        s = socket.socket(fileno=fd)
        dup = s.dup()                       # holds the connection while it is checked
        s.detach()
    except OSError:
        return False
    try:
        host, port = dup.getpeername()[:2]
        if peer is not None and f"{host}:{port}" != peer:
            return False
        # Linger 0: when libzmq closes its descriptor the kernel resets the connection at once.
        # A plain close would leave the peer writing into a zero window until FIN_WAIT2 times
        # out (60 s), its sends blocked, none of it ever read.
        dup.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        dup.shutdown(socket.SHUT_RDWR)
        return True
    except (OSError, ValueError, TypeError):
        return False
    finally:
        dup.close()


def _trim_heap() -> None:
    """Give freed heap back to the system (glibc keeps small freed blocks, such as the frames of
    a message libzmq just dropped)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class Cut:
    """A connection the guard ended: its peer (``host:port``), why, and its unfinished bytes."""

    socket: str
    peer: str
    reason: str          # "too_large" or "open_too_long"
    unfinished_bytes: int
    detail: str


class _Link:
    __slots__ = ("delivered", "delivered_at_check", "floor", "peer", "over", "hot", "open_since", "checked_at")

    def __init__(self, now: float):
        self.delivered = 0
        self.delivered_at_check = 0
        self.floor = 0
        self.peer: str | None = None
        self.over = False
        self.hot = False
        self.open_since: float | None = None
        self.checked_at = now


class UnfinishedGuard:
    """The guard of one socket ``name`` (``sock``: a ``zmq.Socket`` or ``zmq.asyncio.Socket``).

    The socket's receive path calls :meth:`received` with every complete message's frames as
    ``zmq.Frame`` (``copy=False``; a ROUTER's identity frame first, ``router=True``, as it is not
    on the wire); :meth:`check` (or the task :meth:`run`) does the rest. ``on_cut(cut)`` hears of
    each connection ended. libzmq allows one monitor per socket: a socket whose owner monitors
    it already passes ``own_monitor=False`` and hands each event of :data:`MONITOR_EVENTS` to
    :meth:`connection_event`.
    """

    def __init__(self, sock: zmq.Socket, name: str, *, max_bytes: int, open_s: float,
                 curve: bool, router: bool, on_cut: Callable[[Cut], None] = lambda cut: None,
                 interval_s: float = 0.05, clock: Callable[[], float] = time.monotonic,
                 own_monitor: bool = True):
        self.name = name
        self.max_bytes = int(max_bytes)
        self.open_s = float(open_s)
        self.curve = bool(curve)
        self.skip = 1 if router else 0
        self.on_cut = on_cut
        self.interval_s = interval_s
        self.clock = clock
        self.links: dict[int, _Link] = {}
        self._carry: dict[int, int] = {}
        self._trim = 0
        self.waiting = False
        """True while the owner waits in :meth:`receive` (the queue is empty): :meth:`run`'s
        checks apply the byte rule only then."""
        self.enabled = _LINUX
        self._sock = zmq.Socket.shadow(sock.underlying)
        self._monitor: zmq.Socket | None = None
        if self.enabled and own_monitor:
            address = f"inproc://slipstream-unfinished-{os.getpid()}-{next(_MONITORS)}"
            self._sock.monitor(address, MONITOR_EVENTS)
            # Made by the socket's own context object, so that its destroy() closes this one
            # too: a guard whose owner never closed it must not hang the context's term().
            self._monitor = sock.context.socket(zmq.PAIR, socket_class=zmq.Socket)
            self._monitor.setsockopt(zmq.LINGER, 0)
            self._monitor.connect(address)

    # -- the receive path --------------------------------------------------------------------

    def received(self, frames: list) -> None:
        """Count one complete message (its frames as received, ``zmq.Frame``)."""
        if not self.enabled or len(frames) <= self.skip:
            return
        first = frames[self.skip]
        try:
            fd = first.get(_SRCFD)
        except (zmq.ZMQError, AttributeError):
            return
        self.received_sizes(fd, [len(f) for f in frames[self.skip:]])

    async def receive(self, sock) -> list:
        """``sock.recv_multipart(copy=False)`` (the owner's ``zmq.asyncio`` socket), counted; while
        it waits, :attr:`waiting` says the queue is empty (never ``EVENTS`` from another task: that
        can lose the owner's wake-up)."""
        self.waiting = True
        try:
            frames = await sock.recv_multipart(copy=False)
        finally:
            self.waiting = False
        self.received(frames)
        return frames

    def received_sizes(self, fd: int, sizes: Iterable[int]) -> None:
        """Count a complete message of frames of ``sizes`` bytes from the connection on ``fd``."""
        link = self.links.get(fd)
        if link is None:
            link = self.links[fd] = _Link(self.clock())
        link.delivered += wire_bytes(sizes, self.curve)

    # -- checks --------------------------------------------------------------------------------

    def connection_event(self, event: int, fd: int) -> None:
        """A monitor event of the socket (``event``, its value ``fd``), in the order libzmq sent it.

        A descriptor's number is reused at once by the next connection; messages the application
        received from the new connection before its open was seen here were counted on the old
        one. The new link takes over what the old one delivered since the last check (an upper
        bound of it: unfinished bytes may be undercounted by one interval's messages, never
        overcounted, so no connection is cut for it)."""
        if event & _ENDS:
            link = self.links.pop(fd, None)
            if link is not None:
                self._carry[fd] = link.delivered - link.delivered_at_check
        elif event & _CONNECTS:
            old = self.links.get(fd)
            link = self.links[fd] = _Link(self.clock())
            link.delivered = self._carry.pop(fd, 0) + (old.delivered if old is not None else 0)
            link.peer = peer_of(fd)

    def _events(self) -> None:
        """Read the guard's own monitor (when it has one) up to now."""
        monitor = self._monitor
        while monitor is not None:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) >= 2 and len(frames[0]) == 6:
                self.connection_event(*struct.unpack("=HI", frames[0]))

    def check(self, drained: bool) -> list[Cut]:
        """Look at every connection once; cut the ones over a bound. ``drained``: the socket's
        owner knows its queue holds no complete message it has not received (the byte rule
        applies only then). The owner knows, not the guard: reading ``EVENTS`` on a
        ``zmq.asyncio`` socket from another task can lose the owner's wake-up."""
        if not self.enabled:
            return []
        self._events()
        now = self.clock()
        cuts = []
        for fd, link in list(self.links.items()):
            cut = self._check_link(fd, link, now, drained)
            if cut is not None:
                cuts.append(cut)
        self._carry.clear()
        if self._trim:      # libzmq frees a cut connection's frames later, in its own time
            _trim_heap()
            self._trim -= 1
        if cuts:
            self._trim = TRIM_CHECKS
        return cuts

    def urgent(self) -> bool:
        """True when the next check should come soon (:data:`FOLLOW_UP_S`): a connection has an
        unfinished message over :data:`SMALL_BYTES` (one over ``max_bytes`` is cut on the next
        look, before much more arrives), or one was cut (its memory is given back over the next
        :data:`TRIM_CHECKS` checks)."""
        return bool(self._trim) or any(link.hot for link in self.links.values())

    def _check_link(self, fd: int, link: _Link, now: float, drained: bool) -> Cut | None:
        rx = tcp_bytes_received(fd)
        if rx is None:                       # not TCP, or closed (its end event comes next)
            return None
        if link.peer is None:
            link.peer = peer_of(fd)
        dt, link.checked_at = max(0.0, now - link.checked_at), now
        delivered_since = link.delivered - link.delivered_at_check
        link.delivered_at_check = link.delivered
        gap = rx - link.delivered
        if gap < 0:                           # counted more than arrived (see _events): start over
            link.delivered, gap = rx, 0
        link.floor = min(gap, link.floor + int(DRIFT_BYTES_PER_S * dt))
        unfinished = gap - link.floor
        link.hot = unfinished > SMALL_BYTES
        cut = None
        if drained:
            was_over, link.over = link.over, unfinished > self.max_bytes
            if was_over and link.over:
                cut = ("too_large", f"an unfinished message of {unfinished} bytes is over the "
                       f"{self.max_bytes}-byte limit of a message on this socket")
        if unfinished <= SMALL_BYTES or delivered_since:
            link.open_since = None
        elif link.open_since is None:
            link.open_since = now
        elif now - link.open_since > self.open_s and cut is None:
            cut = ("open_too_long", f"a message unfinished for {now - link.open_since:.0f} s "
                   f"({unfinished} bytes so far; the limit is {self.open_s:g} s)")
        if cut is None:
            return None
        if not cut_connection(fd, link.peer):
            return None
        self.links.pop(fd, None)
        result = Cut(self.name, link.peer or "?", cut[0], unfinished, cut[1])
        self.on_cut(result)
        return result

    async def run(self) -> None:
        """Check every ``interval_s`` until cancelled."""
        if not self.enabled:
            await asyncio.Future()          # nothing to check here; a task that ends is a crash
        while True:
            await asyncio.sleep(FOLLOW_UP_S if self.urgent() else self.interval_s)
            self.check(drained=self.waiting)

    def close(self) -> None:
        if self._monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None
