"""A raw ZMTP 3.0 peer (NULL mechanism) for tests: what a libzmq socket never sends.

libzmq queues a multipart message until its last frame and sends it whole, so a peer that leaves
a message unfinished, or announces a frame larger than it sends, has to speak ZMTP itself:
greeting, READY, then frames written by hand (:func:`frame`).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
from collections.abc import Callable, Iterable

GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
MORE, LONG, COMMAND = 0x01, 0x02, 0x04


def ready(socket_type: bytes) -> bytes:
    """A ZMTP 3.0 READY command (NULL mechanism) declaring ``socket_type``."""
    name = b"Socket-Type"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(socket_type)) + socket_type
    return b"\x04" + bytes([len(body)]) + body


def frame(data: bytes, more: bool) -> bytes:
    """One message frame on the wire (``more``: another frame of the same message follows)."""
    flags = MORE if more else 0
    if len(data) < 256:
        return bytes([flags, len(data)]) + data
    return bytes([flags | LONG]) + struct.pack(">Q", len(data)) + data


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError("the peer closed during the handshake")
        out += got
    return out


def _handshake(sock: socket.socket, socket_type: bytes) -> None:
    sock.sendall(GREETING)
    greeting = _read_exactly(sock, 64)
    assert greeting[0] == 0xFF and greeting[10] == 3, greeting
    sock.sendall(ready(socket_type))
    flags, size = _read_exactly(sock, 2)
    assert flags == COMMAND and _read_exactly(sock, size).startswith(b"\x05READY")


def raw_dealer(endpoint: str, timeout_s: float = 10) -> socket.socket:
    """A blocking TCP socket through the handshake as a DEALER connected to ``endpoint``."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    _handshake(sock, b"DEALER")
    return sock


def raw_router(listener: socket.socket, timeout_s: float = 10) -> socket.socket:
    """Accept one connection on ``listener`` and answer its handshake as a ROUTER (a learner that
    speaks ZMTP by hand, for a rollout server's DEALER)."""
    listener.settimeout(timeout_s)
    sock, _ = listener.accept()
    sock.settimeout(timeout_s)
    _handshake(sock, b"ROUTER")
    return sock


def send_until_closed(sock: socket.socket, pieces: Iterable[bytes]) -> int:
    """Write ``pieces`` in turn until the peer resets or closes the connection; returns the bytes
    written (all of them if it never did). A socket timeout is raised: a peer that merely stops
    reading has not refused anything."""
    written = 0
    try:
        for piece in pieces:
            sock.sendall(piece)
            written += len(piece)
    except ConnectionError:
        pass
    return written


def send_unfinished(sock: socket.socket, frames: int, size: int) -> int:
    """Write ``frames`` frames of ``size`` bytes, each with MORE set (a message never finished);
    returns the bytes written before the peer hung up (all of them if it never did)."""
    return send_until_closed(sock, itertools.repeat(frame(bytes(size), more=True), frames))


def send_huge_frame(sock: socket.socket, claimed: int, limit: int) -> int:
    """One frame announced as ``claimed`` bytes (a ZMTP long frame), its body written in 1 MiB
    pieces up to ``limit`` bytes; returns the bytes written before the peer hung up."""
    head = bytes([LONG]) + struct.pack(">Q", claimed)
    return send_until_closed(sock, itertools.chain([head], itertools.repeat(bytes(1 << 20), limit >> 20)))


async def send_as_dealer(endpoint: str, send: Callable[..., int], *args) -> int:
    """``send(sock, *args)`` on a raw DEALER connected to ``endpoint``, in a thread (the peer may
    be served by this event loop); the connection is closed afterwards."""
    sock = await asyncio.to_thread(raw_dealer, endpoint, 30)
    try:
        return await asyncio.to_thread(send, sock, *args)
    finally:
        sock.close()


def rss_bytes() -> int:
    """This process's resident memory (what a peer's bytes cost the process under test)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """True once the peer has closed (or reset) the connection within ``timeout_s``."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionError, OSError) as e:
        return not isinstance(e, socket.timeout)


async def zmtp_dealer(endpoint: str):
    """A raw TCP connection through the ZMTP 3.0 handshake as a DEALER (asyncio streams), in lock
    step as libzmq expects: greeting, the peer's greeting, READY, the peer's READY."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(GREETING)
    greeting = await asyncio.wait_for(reader.readexactly(64), 10)
    assert greeting[0] == 0xFF and greeting[10] == 3, greeting
    writer.write(ready(b"DEALER"))
    flags, size = await asyncio.wait_for(reader.readexactly(2), 10)
    assert flags == COMMAND and (await reader.readexactly(size)).startswith(b"\x05READY")
    return reader, writer
