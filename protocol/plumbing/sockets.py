"""ZeroMQ socket setup, written once for both processes (docs/design.md §6).

Every socket gets ``LINGER 0`` (a closing process never hangs on unsent messages), send and
receive high-water marks (a slow peer queues at most ``hwm`` messages, then sends block or the
ROUTER drops for that peer only; credits keep the rollout traffic far below it), and
``ZMQ_MAXMSGSIZE``: libzmq disconnects a peer whose *frame* is larger, before it is buffered, so
a hostile 2 GiB frame costs nothing. Binding errors become a one-line :class:`StartupError`.
Endpoints to connect to, the ones a user writes and the ones a peer sends, are checked by one
function (:func:`endpoint_problem`) before any socket sees them.
With ``curve`` (:mod:`protocol.plumbing.curve`) the socket encrypts, and a bound one authenticates its
clients through the ZAP domain named there; the options are set before any bind or connect.
"""

from __future__ import annotations

import errno
import ipaddress
import re

import zmq

from protocol.errors import ProtocolError, StartupError
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


MAX_ENDPOINT_CHARS = 1024
MAX_IPC_PATH_BYTES = 107             # sun_path holds 108 bytes with its NUL (Linux)
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def _tcp_problem(address: str) -> str | None:
    """Why ``host:port`` (after ``tcp://``) cannot be connected to, or None."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "needs a host and a port (1..65535), e.g. tcp://127.0.0.1:5555"
    if ":" in host or host.startswith("["):       # IPv6, in brackets or not (libzmq takes both)
        try:
            ipaddress.IPv6Address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
        except ValueError:
            return f"has no valid IPv6 address in {host!r}"
        return None
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in name.split(".")):
        return f"has no valid host name or address in {host!r} (letters, digits, '-', '_', '.')"
    return None


def endpoint_problem(endpoint: object) -> str | None:
    """Why ``endpoint`` is not a ZeroMQ address this process can connect to, or None.

    One checker for the endpoints the user writes (``rollout.learner``, ``ctl --endpoint``) and
    the ones a peer sends (a Welcome's ``weights_endpoint``): a scheme of
    :data:`protocol.messages.ENDPOINT_SCHEMES`, no whitespace or control characters, and then
    ``tcp://`` a host name, an IPv4 or IPv6 address and a port in 1..65535; ``ipc://`` a path
    that fits a socket address; ``inproc://`` a name. libzmq refuses some of the rest only when
    ``connect()`` is called (an exception in whatever task connects) and accepts others (port
    99999, an empty host) to retry them forever, so both are refused here, before any socket.
    """
    if not isinstance(endpoint, str) or not endpoint.startswith(ENDPOINT_SCHEMES):
        return "is not a ZeroMQ endpoint; write it with its scheme, e.g. tcp://127.0.0.1:5555"
    if len(endpoint) > MAX_ENDPOINT_CHARS:
        return f"is longer than {MAX_ENDPOINT_CHARS} characters"
    if any(c.isspace() or not c.isprintable() for c in endpoint):
        return "holds whitespace or control characters"
    scheme, _, address = endpoint.partition("://")
    if scheme == "tcp":
        return _tcp_problem(address)
    if not address:
        return f"names no {'path' if scheme == 'ipc' else 'socket'} after {scheme}://"
    if scheme == "ipc" and len(address.encode()) > MAX_IPC_PATH_BYTES:
        return f"has an ipc path longer than {MAX_IPC_PATH_BYTES} bytes"
    return None


def check_endpoint(endpoint: str, what: str) -> str:
    """``endpoint`` if :func:`endpoint_problem` finds none; else a one-line :class:`StartupError`
    naming ``what`` (the setting or option)."""
    problem = endpoint_problem(endpoint)
    if problem is not None:
        raise StartupError(f"{what}: {endpoint!r} {problem}")
    return endpoint


def check_peer_endpoint(endpoint: str, what: str) -> str:
    """``endpoint`` if :func:`endpoint_problem` finds none; else a :class:`ProtocolError`
    naming ``what`` (the message field): an endpoint a peer sent is bad input, not a bad start."""
    problem = endpoint_problem(endpoint)
    if problem is not None:
        raise ProtocolError(f"{what}: {str(endpoint)[:200]!r} {problem}")
    return endpoint


def advertised_host(bind_host: str) -> str:
    """The host to tell peers for a socket bound to ``bind_host`` (a wildcard means loopback here;
    a peer on another host reads that with :func:`reachable_endpoint`)."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "*", "", "::") else bind_host


def _tcp_host_port(endpoint: str) -> tuple[str, str] | None:
    scheme, _, address = endpoint.partition("://")
    if scheme != "tcp" or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def _loopback(host: str) -> bool:
    return host == "localhost" or host == "::1" or host.startswith("127.")


def reachable_endpoint(advertised: str, via: str) -> str:
    """``advertised``, an endpoint a learner named (its weights socket), as a peer that reached the
    learner at ``via`` must connect to it: a loopback host there is the learner's own loopback, so
    when ``via`` is not loopback (the peer is, or may be, on another host) it is ``via``'s host
    with the advertised port. Anything else is ``advertised`` unchanged."""
    adv, by = _tcp_host_port(advertised), _tcp_host_port(via)
    if adv is None or by is None or not _loopback(adv[0]) or _loopback(by[0]):
        return advertised
    host = f"[{by[0]}]" if ":" in by[0] else by[0]
    return f"tcp://{host}:{adv[1]}"


def route_address(endpoint: str) -> str:
    """This host's address on the route to ``endpoint``'s host (what a peer on that network
    reaches this host at): the local address of a UDP socket connected there (nothing is sent);
    127.0.0.1 for a loopback, an ipc or an unresolvable endpoint."""
    import socket

    hp = _tcp_host_port(endpoint)
    if hp is None or _loopback(hp[0]):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in hp[0] else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((hp[0], int(hp[1]) if hp[1].isdigit() else 9))
            host = s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
