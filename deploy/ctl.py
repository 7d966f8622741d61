"""``slipstream ctl``: status and live settings of a running learner over its control socket.

Imports only ``protocol`` and pyzmq (no torch): it answers in a fraction of a second. The reply's
result goes to stdout (aligned lines on a terminal, JSON with ``--json``; ``set`` prints only what
it changed); errors go to stderr as one line (exit 2 for a refused request, a value the protocol
cannot carry (an integer past 64 bits) or a bad endpoint, 1 when the learner does not answer).

CURVE (learner.security.curve): ``--secret-key FILE`` (or ``$SLIPSTREAM_CTL_SECRET_KEY``) is this
operator's key pair, whose public key must be in the learner's control allow-list;
``--learner-key FILE`` (or ``$SLIPSTREAM_CTL_LEARNER_KEY``) the learner's public key, by default
the one the learner wrote into ``RUN_DIR/learner.json``. A key the learner refuses is said at once
(exit 2), read from the socket's handshake events rather than waited out. A run that `slipstream
run` secured by itself (launcher.secure) needs neither: ``--run-dir`` finds its operator key in
``RUN_DIR/keys``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import zmq
from zmq.utils.monitor import parse_monitor_message

import protocol
from protocol.plumbing.curve import CurveClient, load_key_pair, load_public_key
from protocol.plumbing.sockets import check_endpoint, make_socket

SECRET_KEY_ENV = "SLIPSTREAM_CTL_SECRET_KEY"
LEARNER_KEY_ENV = "SLIPSTREAM_CTL_LEARNER_KEY"

MAX_REPLY_BYTES = 16 << 20
"""Largest control reply accepted (a status is a few KiB)."""


class Refused(Exception):
    """The learner refused this client's CURVE handshake (key not allowed, or CURVE mismatch)."""


def learner_file(run_dir: str) -> dict:
    path = Path(run_dir) / "learner.json"
    try:
        info = json.loads(path.read_text())
        info["control"]
        return info
    except (OSError, KeyError, ValueError, TypeError):
        raise protocol.StartupError(f"no learner endpoint file {path} (is the learner running with "
                                    f"this --run-dir?); or pass --endpoint tcp://HOST:PORT") from None


def curve_keys(secret_key: str | None, learner_key: str | None,
               learner_public: str | None = None) -> CurveClient | None:
    """ctl's CURVE keys from the flags, the environment, or learner.json; None = plain."""
    secret_key = secret_key or os.environ.get(SECRET_KEY_ENV)
    learner_key = learner_key or os.environ.get(LEARNER_KEY_ENV)
    if not secret_key:
        if learner_key:
            raise protocol.StartupError(f"--learner-key needs --secret-key (or ${SECRET_KEY_ENV}): "
                                        "the operator's own key pair")
        return None
    public, secret = load_key_pair(secret_key, "--secret-key")
    if learner_key:
        server = load_public_key(learner_key, "--learner-key")
    elif learner_public:
        server = learner_public.encode()
    else:
        raise protocol.StartupError(f"--secret-key needs the learner's public key: pass "
                                    f"--learner-key FILE (or ${LEARNER_KEY_ENV}), or --run-dir of a "
                                    "learner that runs with CURVE")
    return CurveClient(public_key=public, secret_key=secret, server_key=server)


_REFUSALS = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the learner refused this key (it is not in the "
                                              "control allow-list)",
             zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "CURVE handshake failed (the learner uses CURVE "
                                                  "and this client does not, or the other way "
                                                  "round; or --learner-key is not the learner's)",
             zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed (CURVE on one side only?)"}


def request(endpoint: str, req: protocol.ControlRequest, timeout_s: float,
            curve: CurveClient | None = None) -> protocol.ControlReply:
    ctx = zmq.Context.instance()
    sock = make_socket(ctx, zmq.DEALER, max_message_bytes=MAX_REPLY_BYTES, curve=curve)
    monitor = sock.get_monitor_socket(sum(_REFUSALS))
    try:
        sock.connect(endpoint)
        sock.send_multipart(protocol.encode(req))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            ready = dict(poller.poll(max(0, left_ms))) if left_ms > 0 else {}
            if sock in ready:
                break
            if monitor in ready:
                event = parse_monitor_message(monitor.recv_multipart())["event"]
                raise Refused(f"{endpoint}: {_REFUSALS.get(event, 'handshake failed')}")
            if left_ms <= 0:
                raise TimeoutError(f"no answer from {endpoint} within {timeout_s}s")
        reply = protocol.decode(sock.recv_multipart())
        if not isinstance(reply, protocol.ControlReply):
            raise protocol.ProtocolError(f"unexpected reply {type(reply).TYPE}")
        return reply
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def _error(message: str, code: int) -> int:
    print(f"slipstream ctl: {message}", file=sys.stderr)
    return code


def parse_value(text: str):
    """A ``set`` value from the command line: JSON when it parses (1, 0.5, null, true), else the
    bare string (tis, correct); the learner validates it against the key's type."""
    try:
        return json.loads(text)
    except ValueError:
        return text


MSGPACK_INT_RANGE = (-(1 << 63), (1 << 64) - 1)
"""The integers the protocol's encoding (msgpack) holds: int64 and uint64."""


def _big_int(value) -> int | None:
    """The first integer in ``value`` (a JSON value: nested lists and maps too) that msgpack
    cannot hold, or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        lo, hi = MSGPACK_INT_RANGE
        return None if lo <= value <= hi else value
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((b for b in map(_big_int, children) if b is not None), None)


def unsendable(req: protocol.ControlRequest) -> str | None:
    """Why ``req`` cannot be sent, as the one line to print (exit 2: the user's value is wrong,
    not the learner), or None. Checked before connecting: an encoding error is not a learner
    that did not answer."""
    big = _big_int(req.args.get("value"))
    if big is not None:
        return (f"{req.command} {req.args.get('key')}: the integer {big} is out of range "
                "(the protocol carries -2**63 .. 2**64-1)")
    try:
        protocol.encode(req)
    except protocol.ProtocolError as e:
        return f"{req.command}: cannot send this request ({e})"
    return None


def human(result: dict, indent: str = "") -> str:
    """A reply as aligned ``key  value`` lines (nested dicts indented), for a terminal."""
    if not result:
        return f"{indent}(empty)"
    width = max(len(str(k)) for k in result)
    lines = []
    for k in sorted(result, key=str):
        v = result[k]
        if isinstance(v, dict) and v:
            lines.append(f"{indent}{k}:")
            lines.append(human(v, indent + "  "))
        else:
            lines.append(f"{indent}{str(k).ljust(width)}  {json.dumps(v) if not isinstance(v, str) else v}")
    return "\n".join(lines)


def changed_line(changed: dict) -> str:
    """What ``set`` changed, as one line: ``algorithm.max_staleness: 4 -> 1 (from the next step)``."""
    when = changed.get("takes_effect")
    when = "from the next step" if when == "next step" else "now" if when == "now" else when
    return (f"{changed.get('key')}: {json.dumps(changed.get('previous'))} -> "
            f"{json.dumps(changed.get('value'))} ({when})")


def ctl(args) -> int:
    learner_public = None
    if args.endpoint:
        endpoint = check_endpoint(args.endpoint, "--endpoint")
    else:
        info = learner_file(args.run_dir)
        endpoint, learner_public = info["control"], info.get("curve_public_key")
    secret_key = getattr(args, "secret_key", None) or os.environ.get(SECRET_KEY_ENV)
    if not secret_key and learner_public and not args.endpoint:
        # `slipstream run`'s own keys (launcher.secure)
        from deploy.curve_keys import run_operator_key

        found = run_operator_key(args.run_dir)
        secret_key = str(found) if found is not None else None
    curve = curve_keys(secret_key, getattr(args, "learner_key", None), learner_public)
    if args.action == "set":
        if args.key is None or args.value is None:
            return _error("usage: slipstream ctl set KEY VALUE (e.g. slipstream ctl set max_staleness 1)", 2)
        req = protocol.ControlRequest(command="set", args={"key": args.key, "value": parse_value(args.value)})
    elif args.action == "get":
        req = protocol.ControlRequest(command="get", args={"key": args.key} if args.key is not None else {})
    else:
        if args.key is not None:
            return _error(f"{args.action} takes no arguments", 2)
        req = protocol.ControlRequest(command=args.action)
    problem = unsendable(req)
    if problem:
        return _error(problem, 2)
    try:
        reply = request(endpoint, req, args.timeout_s, curve)
    except Refused as e:
        return _error(str(e), 2)
    except (TimeoutError, protocol.ProtocolError) as e:
        return _error(str(e), 1)
    if not reply.ok:
        return _error(reply.error, 2)
    if getattr(args, "json", False):
        print(json.dumps(reply.result, indent=2, sort_keys=True))
    elif args.action == "set" and isinstance(reply.result.get("changed"), dict):
        print(changed_line(reply.result["changed"]))
    elif args.action == "get" and args.key is not None and len(reply.result) == 1:
        value = next(iter(reply.result.values()))
        print(value if isinstance(value, str) else json.dumps(value))
    else:
        print(human(reply.result))
    return 0
