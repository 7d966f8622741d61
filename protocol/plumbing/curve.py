"""CURVE encryption and client authentication for the learner's sockets (docs/design.md §6).

Off by default; everything binds to 127.0.0.1 unless configured otherwise, so an unconfigured run
is reachable only from its own machine. Once a learner listens beyond loopback, any process that
reaches its ports could push results, fetch the weights, or ``ctl stop`` the run: CURVE closes
that. With it on:

- every learner socket (rollout, weights, control) is a CURVE *server* with the learner's key
  pair: traffic is encrypted, and a client must know the learner's public key to connect at all;
- every client (a rollout server, ``slipstream ctl``) has its own key pair, and the learner's
  ZAP handler (pyzmq's :class:`zmq.auth.asyncio.AsyncioAuthenticator`, on the learner's event
  loop) accepts a connection only when the client's public key is in the allow-list directory of
  that socket's ZAP domain. The control socket may have its own directory (operators), so a
  rollout server's key cannot stop the run or change its settings.

A refused client never gets a connection: libzmq drops it during the handshake, before any of
its messages is read, so nothing it sends is decoded, counted as a result, or answered. Each
refusal is counted by the learner (``slipstream_auth_denied_total{socket}``).

Keys are files, so they can be mounted from Kubernetes Secrets: a key file is either a ZeroMQ
certificate (what ``slipstream keys`` and :func:`zmq.auth.create_certificates` write:
``public-key = "..."`` and, in the ``.key_secret`` file, ``secret-key = "..."``) or the bare
40-character Z85 key on one line. An allow-list directory holds public keys as ``*.key`` files; it
is read again whenever its listing or a file's modification time changes, so a key added to
(or removed from) a mounted Secret takes effect at the next connection, without a restart.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from protocol.errors import StartupError

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
_Z85_KEY = re.compile(rb"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


@dataclass(frozen=True)
class CurveServer:
    """CURVE options of a bound socket: the learner's key pair and the socket's ZAP domain (the
    allow-list its clients are checked against)."""

    public_key: bytes
    secret_key: bytes
    domain: str


@dataclass(frozen=True)
class CurveClient:
    """CURVE options of a connecting socket: its own key pair and the server's public key."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes


def apply_curve(sock: zmq.Socket, curve: CurveServer | CurveClient) -> None:
    """Set the CURVE options on ``sock`` (before it binds or connects)."""
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
    if isinstance(curve, CurveServer):
        sock.setsockopt(zmq.ZAP_DOMAIN, curve.domain.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)


# ---- key files ----------------------------------------------------------------------------------

def _valid_key(key: bytes | None) -> bool:
    if key is None or not _Z85_KEY.match(key):
        return False
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        return False


def _read_key_file(path: str | os.PathLike, what: str) -> tuple[bytes | None, bytes | None, bool]:
    """``(public, secret, bare)`` as found in ``path``: a certificate's keys (either may be None),
    or, for a bare key (``bare`` True), the key as ``public``; a StartupError when the file cannot
    be read or holds neither."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise StartupError(f"{what}: cannot read key file {p}: {e.strerror or e} "
                           "(create keys with `slipstream keys DIR`)") from None
    bare = data.strip()
    if _Z85_KEY.match(bare):
        return bare, None, True      # a bare key: the caller says which kind it is
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (OSError, ValueError):
        public, secret = None, None
    if public is None and secret is None:
        raise StartupError(f"{what}: {p} holds no CURVE key (expected a certificate written by "
                           "`slipstream keys`, or a 40-character Z85 key)")
    return public, secret, False


def load_public_key(path: str | os.PathLike, what: str) -> bytes:
    """The Z85 public key in ``path`` (a ``.key`` certificate or a bare key)."""
    public, _, _ = _read_key_file(path, what)
    if not _valid_key(public):
        raise StartupError(f"{what}: {path} does not hold a valid CURVE public key (40 Z85 characters)")
    return public


def load_key_pair(path: str | os.PathLike, what: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85 keys from a secret key file (a ``.key_secret`` certificate, or the
    bare secret key, whose public key is derived from it)."""
    public, secret, bare = _read_key_file(path, what)
    if bare:
        secret, public = public, None          # a bare key in a secret key file is the secret
    if not _valid_key(secret):
        raise StartupError(f"{what}: {path} holds no CURVE secret key (pass the .key_secret file, "
                           "not the public .key)")
    derived = zmq.curve_public(secret)
    if public is not None and public != derived:
        raise StartupError(f"{what}: {path}: its public key does not belong to its secret key")
    return derived, secret


def create_key_pair(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (secret, mode 0600) into ``directory``.

    Refuses to overwrite: a replaced key silently locks out everyone holding the old one."""
    d = Path(directory)
    public, secret = d / f"{name}{PUBLIC_SUFFIX}", d / f"{name}{SECRET_SUFFIX}"
    for p in (public, secret):
        if p.exists():
            raise StartupError(f"{p} exists; remove it first (or choose another name): replacing "
                               "a key locks out everyone who holds the old one")
    d.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)
    try:
        pub, sec = zmq.auth.create_certificates(d, name)
    finally:
        os.umask(old)
    os.chmod(sec, 0o600)
    os.chmod(pub, 0o644)
    return Path(pub), Path(sec)


# ---- allow-lists and the authenticator ----------------------------------------------------------

class AllowList:
    """The public keys in ``directory`` (``*.key`` files), re-read when the directory changes.

    A ZAP credentials provider (``callback(domain, key) -> bool``, as
    :meth:`zmq.auth.Authenticator.configure_curve_callback` expects); ``on_denied(domain)`` is
    called for every refused key.
    """

    def __init__(self, directory: str | os.PathLike, what: str,
                 on_denied: Callable[[str], None] = lambda domain: None):
        self.directory = Path(directory)
        self.what = what
        self.on_denied = on_denied
        self._signature: tuple | None = None
        self._keys: frozenset[bytes] = frozenset()
        if not self.directory.is_dir():
            raise StartupError(f"{what}: allow-list directory {self.directory} does not exist "
                               "(it holds the *.key public keys of the clients to accept)")
        if not self.keys():
            raise StartupError(f"{what}: allow-list directory {self.directory} holds no *.key "
                               "public key: no client could connect")

    def _scan(self) -> tuple:
        try:
            entries = sorted(self.directory.glob(f"*{PUBLIC_SUFFIX}"))
            return tuple((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in entries)
        except OSError:
            return ()

    def keys(self) -> frozenset[bytes]:
        """The keys allowed now (read again when the directory changed)."""
        signature = self._scan()
        if signature != self._signature:
            keys = set()
            for name, _, _ in signature:
                try:
                    public, _, _ = _read_key_file(self.directory / name, self.what)
                except StartupError:
                    continue                   # one unreadable file does not lock out the rest
                if _valid_key(public):
                    keys.add(public)
            self._keys, self._signature = frozenset(keys), signature
        return self._keys

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys():
            return True
        self.on_denied(domain)
        return False


class Authenticator:
    """One ZAP handler on ``ctx`` (the asyncio one, on the running loop), one allow-list per ZAP
    domain. Start it before the sockets bind; a CURVE socket whose domain has no allow-list
    refuses every client."""

    def __init__(self, ctx: zmq.Context, allow_lists: dict[str, AllowList]):
        from zmq.auth.asyncio import AsyncioAuthenticator

        self.allow_lists = dict(allow_lists)
        self._auth = AsyncioAuthenticator(ctx)
        self._auth.start()
        for domain, allow in self.allow_lists.items():
            self._auth.configure_curve_callback(domain, allow)

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
