"""``slipstream ctl``: status and live settings of a running learner over its control socket."""

from __future__ import annotations

import json
from pathlib import Path

import zmq

import protocol


def control_endpoint(run_dir: str) -> str:
    path = Path(run_dir) / "learner.json"
    try:
        return json.loads(path.read_text())["control"]
    except (OSError, KeyError, ValueError):
        raise FileNotFoundError(f"no learner endpoint file {path}; pass --endpoint tcp://HOST:PORT") from None


def request(endpoint: str, req: protocol.ControlRequest, timeout_s: float) -> protocol.ControlReply:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
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


def ctl(args) -> int:
    endpoint = args.endpoint or control_endpoint(args.run_dir)
    if args.action == "set":
        if args.key is None or args.value is None:
            print("slipstream ctl set KEY VALUE (e.g. slipstream ctl set max_staleness 1)")
            return 2
        req = protocol.ControlRequest(command="set", args={"key": args.key, "value": args.value})
    else:
        req = protocol.ControlRequest(command=args.action)
    try:
        reply = request(endpoint, req, args.timeout_s)
    except TimeoutError as e:
        print(f"slipstream ctl: {e}")
        return 1
    if not reply.ok:
        print(f"slipstream ctl: {reply.error}")
        return 2
    print(json.dumps(reply.result, indent=2, sort_keys=True))
    return 0
