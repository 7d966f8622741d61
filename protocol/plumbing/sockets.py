"""ZeroMQ socket setup, written once for both processes (docs/design.md §6).

Every socket gets ``LINGER 0`` (a closing process never hangs on unsent messages), send and
receive high-water marks (a slow peer queues at most ``hwm`` messages, then sends block or the
ROUTER drops for that peer only; credits keep the rollout traffic far below it), and
``ZMQ_MAXMSGSIZE``: libzmq disconnects a peer whose *frame* is larger, before it is buffered, so
a hostile 2 GiB frame costs nothing. Binding errors become a one-line :class:`StartupError`.
With ``curve`` (:mod:`protocol.plumbing.curve`) the socket encrypts, and a bound one authenticates its
clients through the ZAP domain named there; the options are set before any bind or connect.
"""

from __future__ import annotations

import errno

import zmq

from protocol.errors import StartupError
from protocol.messages import ENDPOINT_SCHEMES
from protocol.plumbing.curve import CurveClient, CurveServer, apply_curve

DEFAULT_HWM = 1000


def make_socket(ctx: zmq.Context, kind: int, *, max_message_bytes: int, hwm: int = DEFAULT_HWM,
                identity: bytes | None = None,
                curve: CurveServer | CurveClient | None = None) -> zmq.Socket:
    """A socket of ``kind`` with the options above (``max_message_bytes``: largest inbound frame;
    ``curve``: CURVE keys, None = plain TCP)."""
    sock = ctx.socket(kind)
    if curve is not None:
        try:
            apply_curve(sock, curve)
        except BaseException:
            sock.close(0)
            raise
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_message_bytes))
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    return sock


def bind(sock: zmq.Socket, host: str, port: int, what: str) -> int:
    """Bind ``sock`` to ``tcp://host:port`` (0 = a free port); returns the port.

    Raises :class:`StartupError` naming ``what`` (the config key) when the port is taken.
    """
    try:
        if port:
            sock.bind(f"tcp://{host}:{port}")
            return port
        return sock.bind_to_random_port(f"tcp://{host}")
    except zmq.ZMQError as e:
        if e.errno == errno.EADDRINUSE:
            raise StartupError(f"{what}: port {port} on {host} is already in use (another run? "
                               f"set {what} to a free port, or 0 for any free port)") from None
        raise StartupError(f"{what}: cannot bind tcp://{host}:{port}: {e}") from None


def check_endpoint(endpoint: str, what: str) -> str:
    """``endpoint`` if it is a ZeroMQ address with a scheme; else a :class:`StartupError`."""
    if not isinstance(endpoint, str) or not endpoint.startswith(ENDPOINT_SCHEMES):
        raise StartupError(f"{what}: {endpoint!r} is not a ZeroMQ endpoint; write it with its "
                           f"scheme, e.g. tcp://127.0.0.1:5555")
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StartupError(f"{what}: {endpoint!r} needs a host and a port, "
                               f"e.g. tcp://127.0.0.1:5555")
    return endpoint


def advertised_host(bind_host: str) -> str:
    """The host to tell peers for a socket bound to ``bind_host`` (a wildcard means loopback here)."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "*", "", "::") else bind_host
