"""``slipstream ctl``: status and live settings of a running learner over its control socket.

Imports only ``protocol`` and pyzmq (no torch): it answers in a fraction of a second. The reply's
result goes to stdout as JSON; errors go to stderr as one line (exit 2 for a refused request or
a bad endpoint, 1 when the learner does not answer).

CURVE (learner.security.curve): ``--secret-key FILE`` (or ``$SLIPSTREAM_CTL_SECRET_KEY``) is this
operator's key pair, whose public key must be in the learner's control allow-list;
``--learner-key FILE`` (or ``$SLIPSTREAM_CTL_LEARNER_KEY``) the learner's public key, by default
the one the learner wrote into ``RUN_DIR/learner.json``. A key the learner refuses is said at once
(exit 2), read from the socket's handshake events rather than waited out.
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


def ctl(args) -> int:
    learner_public = None
    if args.endpoint:
        endpoint = check_endpoint(args.endpoint, "--endpoint")
    else:
        info = learner_file(args.run_dir)
        endpoint, learner_public = info["control"], info.get("curve_public_key")
    curve = curve_keys(getattr(args, "secret_key", None), getattr(args, "learner_key", None),
                       learner_public)
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
    elif args.action == "get" and args.key is not None and len(reply.result) == 1:
        value = next(iter(reply.result.values()))
        print(value if isinstance(value, str) else json.dumps(value))
    else:
        print(human(reply.result))
    return 0
