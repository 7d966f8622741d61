"""``slipstream ctl``: status and live settings of a running learner over its control socket.

Imports only ``protocol`` and pyzmq (no torch): it answers in a fraction of a second. The reply's
result goes to stdout as JSON; errors go to stderr as one line (exit 2 for a refused request or
a bad endpoint, 1 when the learner does not answer).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import zmq

import protocol
from protocol.sockets import check_endpoint, make_socket

MAX_REPLY_BYTES = 16 << 20
"""Largest control reply accepted (a status is a few KiB)."""


def control_endpoint(run_dir: str) -> str:
    path = Path(run_dir) / "learner.json"
    try:
        return json.loads(path.read_text())["control"]
    except (OSError, KeyError, ValueError):
        raise protocol.StartupError(f"no learner endpoint file {path} (is the learner running with "
                                    f"this --run-dir?); or pass --endpoint tcp://HOST:PORT") from None


def request(endpoint: str, req: protocol.ControlRequest, timeout_s: float) -> protocol.ControlReply:
    ctx = zmq.Context.instance()
    sock = make_socket(ctx, zmq.DEALER, max_message_bytes=MAX_REPLY_BYTES)
    try:
        sock.connect(endpoint)
        sock.send_multipart(protocol.encode(req))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from {endpoint} within {timeout_s}s")
        reply = protocol.decode(sock.recv_multipart())
        if not isinstance(reply, protocol.ControlReply):
            raise protocol.ProtocolError(f"unexpected reply {type(reply).TYPE}")
        return reply
    finally:
        sock.close(0)


def _error(message: str, code: int) -> int:
    print(f"slipstream ctl: {message}", file=sys.stderr)
    return code


def ctl(args) -> int:
    if args.endpoint:
        endpoint = check_endpoint(args.endpoint, "--endpoint")
    else:
        endpoint = control_endpoint(args.run_dir)
    if args.action == "set":
        if args.key is None or args.value is None:
            return _error("usage: slipstream ctl set KEY VALUE (e.g. slipstream ctl set max_staleness 1)", 2)
        req = protocol.ControlRequest(command="set", args={"key": args.key, "value": args.value})
    else:
        req = protocol.ControlRequest(command=args.action)
    try:
        reply = request(endpoint, req, args.timeout_s)
    except (TimeoutError, protocol.ProtocolError) as e:
        return _error(str(e), 1)
    if not reply.ok:
        return _error(reply.error, 2)
    print(json.dumps(reply.result, indent=2, sort_keys=True))
    return 0
