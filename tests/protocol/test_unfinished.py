"""The unfinished-message guard (protocol.plumbing.unfinished) on real sockets and connections.

A raw ZMTP peer (tests/zmtp_kit.py) leaves messages unfinished, as no libzmq socket would; libzmq
peers send what the application really receives. Each test reads the guard's own bookkeeping
(bytes on the wire against bytes delivered) and the connection's fate: cut or not.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from zmtp_kit import closed_by_peer, frame, raw_dealer, rss_bytes, send_unfinished

from protocol.plumbing.curve import CurveClient, CurveServer, apply_curve
from protocol.plumbing.unfinished import (
    FOLLOW_UP_S,
    SMALL_BYTES,
    TRIM_CHECKS,
    UnfinishedGuard,
    tcp_bytes_received,
    wire_bytes,
)

pytestmark = pytest.mark.skipif(not hasattr(zmq, "SRCFD"), reason="libzmq without ZMQ_SRCFD")


class Router:
    """A bound ROUTER with its guard; ``pump()`` receives what is queued (counting it) and checks."""

    def __init__(self, max_bytes: int = 1 << 20, open_s: float = 30.0, curve: CurveServer | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        if curve is not None:
            apply_curve(self.sock, curve)
        self.cuts = []
        self.guard = UnfinishedGuard(self.sock, "test", max_bytes=max_bytes, open_s=open_s,
                                     curve=curve is not None, router=True, on_cut=self.cuts.append)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.messages = []

    def pump(self) -> list:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self.guard.received(frames)
            self.messages.append([f.bytes for f in frames[1:]])
        return self.guard.check(drained=True)          # the queue was just emptied

    def pump_until(self, done, timeout_s: float = 20.0) -> None:
        """Receive and check as :meth:`UnfinishedGuard.run` would, until ``done()``."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"not done in {timeout_s} s; cuts {self.cuts}"
            self.sock.poll(FOLLOW_UP_S * 1000 if self.guard.urgent() else self.guard.interval_s * 1000)
            self.pump()

    def unfinished(self) -> dict[int, int]:
        """Per connection: bytes received and not delivered (handshake and unfinished message)."""
        return {fd: tcp_bytes_received(fd) - link.delivered for fd, link in self.guard.links.items()}

    def close(self) -> None:
        self.guard.close()
        self.sock.close(0)
        self.ctx.destroy(linger=0)


@pytest.fixture
def router(request):
    r = Router(**getattr(request, "param", {}))
    yield r
    r.close()


def test_wire_bytes_frame_headers():
    assert wire_bytes([0], curve=False) == 2
    assert wire_bytes([255], curve=False) == 257
    assert wire_bytes([256], curve=False) == 265
    assert wire_bytes([0, 300], curve=False) == 2 + 309
    assert wire_bytes([0], curve=True) == 35
    assert wire_bytes([222], curve=True) == 222 + 33 + 2
    assert wire_bytes([223], curve=True) == 223 + 33 + 9


@pytest.mark.parametrize("use_curve", [False, True], ids=["plain", "curve"])
def test_complete_messages_are_counted_to_the_byte(use_curve):
    """After every kind of message a libzmq DEALER sends, what the kernel received and what the
    application received differ by the handshake alone: the accounting is exact (a wrong frame
    header size would drift by bytes per frame)."""
    server_keys = zmq.curve_keypair()
    client_keys = zmq.curve_keypair()
    curve = CurveServer(server_keys[0], server_keys[1], "test") if use_curve else None
    r = Router(max_bytes=1 << 20, curve=curve)
    dealer = r.ctx.socket(zmq.DEALER)
    try:
        dealer.setsockopt(zmq.LINGER, 0)
        if use_curve:
            apply_curve(dealer, CurveClient(client_keys[0], client_keys[1], server_keys[0]))
        dealer.connect(r.endpoint)
        dealer.send(b"hello")
        r.pump_until(lambda: len(r.messages) == 1)
        (handshake,) = r.unfinished().values()
        assert 0 < handshake < 1024
        sizes = [0, 1, 32, 33, 200, 222, 223, 255, 256, 1000, 70_000, 300_000]
        for n in sizes:
            dealer.send_multipart([b"h", bytes(n)])
            dealer.send(bytes(n))
        r.pump_until(lambda: len(r.messages) == 1 + 2 * len(sizes))
        assert r.unfinished() == {next(iter(r.guard.links)): handshake}
        assert r.cuts == []
    finally:
        dealer.close(0)
        r.close()


def test_an_unfinished_message_over_the_limit_is_cut_and_freed(router):
    """A peer sends 512 KiB frames (each within ZMQ_MAXMSGSIZE) with MORE set, never the last
    one: past max_bytes (1 MiB) for the whole message on two checks, its connection is cut; the
    frames libzmq held are freed; the socket goes on."""
    peer = raw_dealer(router.endpoint)
    before = rss_bytes()
    sender = threading.Thread(target=send_unfinished, args=(peer, 320, 512 << 10), daemon=True)
    sender.start()
    router.pump_until(lambda: router.cuts)
    (cut,) = router.cuts
    assert cut.reason == "too_large" and cut.unfinished_bytes > 1 << 20
    assert cut.peer.startswith("127.0.0.1:")
    assert closed_by_peer(peer, 10)
    sender.join(10)
    for _ in range(TRIM_CHECKS):                     # the checks after a cut give the heap back
        time.sleep(FOLLOW_UP_S)
        router.pump()
    assert rss_bytes() - before < 32 << 20      # not the 160 MiB it would send
    peer.close()
    ok = router.ctx.socket(zmq.DEALER)
    ok.connect(router.endpoint)
    ok.send(b"still here")
    router.pump_until(lambda: [b"still here"] in router.messages)
    ok.close(0)


def test_many_empty_frames_are_cut(router):
    """Empty frames cost 2 bytes on the wire and 64 in libzmq each: 1.5 M of them (3 MB sent,
    ~96 MB held) pass the 1 MiB limit and are cut."""
    peer = raw_dealer(router.endpoint)
    sender = threading.Thread(target=lambda: peer.sendall(frame(b"", more=True) * 1_500_000), daemon=True)
    sender.start()
    router.pump_until(lambda: router.cuts)
    assert router.cuts[0].reason == "too_large"
    assert closed_by_peer(peer, 10)
    peer.close()


@pytest.mark.parametrize("router", [{"open_s": 1.0}], indirect=True)
def test_a_message_left_open_is_cut_after_open_s(router):
    """A peer sends 200 KiB of a message and waits: below max_bytes, but after open_s (1 s) with
    nothing delivered from it the connection is cut. A peer that is merely idle is not."""
    idle = router.ctx.socket(zmq.DEALER)
    idle.setsockopt(zmq.LINGER, 0)
    idle.setsockopt(zmq.HEARTBEAT_IVL, 20)       # pings reach the counter, never a message
    idle.connect(router.endpoint)
    idle.send(b"hi")
    router.pump_until(lambda: router.messages)
    peer = raw_dealer(router.endpoint)
    peer.sendall(frame(bytes(200 << 10), more=True))
    started = time.monotonic()
    router.pump_until(lambda: router.cuts)
    (cut,) = router.cuts
    assert cut.reason == "open_too_long" and 190 << 10 <= cut.unfinished_bytes < 210 << 10   # less the drift allowed
    assert time.monotonic() - started >= 1.0
    assert closed_by_peer(peer, 10)
    peer.close()
    time.sleep(1.5)
    assert router.pump() == [] and len(router.guard.links) == 1   # the idle one stays
    idle.close(0)


def test_a_big_message_in_flight_is_not_cut(router):
    """A message within the limit that takes several checks to arrive is delivered, not cut: a
    raw peer writes a 900 KiB frame in pieces, 0.3 s apart, then finishes it."""
    peer = raw_dealer(router.endpoint)
    data = frame(bytes(900 << 10), more=False)
    for i in range(0, len(data), 200 << 10):
        peer.sendall(data[i:i + (200 << 10)])
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            router.sock.poll(50)
            assert router.pump() == []
    router.pump_until(lambda: router.messages)
    assert len(router.messages[0][0]) == 900 << 10 and router.cuts == []
    assert max(router.unfinished().values()) < SMALL_BYTES
    peer.close()


def test_reused_descriptors_never_count_against_the_next_connection(router):
    """Connections that come and go reuse descriptor numbers at once; messages the application
    received from a new one before its monitor event was read are carried over, so the next
    connection's count starts right: 200 short connections, no cut, nothing left unfinished."""
    for i in range(200):
        d = router.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(router.endpoint)
        d.send_multipart([b"x", bytes(5000)])
        router.pump_until(lambda n=i + 1: len(router.messages) == n)
        d.close(0)
        if i % 7 == 0:
            router.pump()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        router.sock.poll(50)
        assert router.pump() == []
    assert all(v < 1024 for v in router.unfinished().values())
