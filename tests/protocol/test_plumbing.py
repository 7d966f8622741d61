"""The process plumbing both services share: event lines, sample ids, socket setup (size limits,
port errors, endpoint checks), the /metrics + /healthz endpoint, task supervision."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import zmq

import protocol
from protocol.plumbing.http import HttpEndpoint
from protocol.plumbing.process import EventLog, cancel_all, raise_if_cancelling, supervise, wait_event
from protocol.plumbing.sockets import advertised_host, bind, check_endpoint, make_socket


def test_event_log_line_carries_run_and_version_at_event_time():
    out = io.StringIO()
    state = {"run": "r1", "v": 3}
    log = EventLog("learner", run_id=lambda: state["run"], version=lambda: state["v"], stream=out)
    log("step", loss=0.5)
    state["v"] = 4
    log("ready", path=__import__("pathlib").Path("/x"))
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first == {"proc": "learner", "event": "step", "run_id": "r1", "version": 3, "loss": 0.5}
    assert second["version"] == 4 and second["path"] == "/x"


def test_event_log_lines_are_strict_json_with_non_finite_floats_named():
    """NaN/Infinity are not JSON (jq and most log collectors drop the line): they are written as
    "nan"/"inf"/"-inf", nested too, and float() reads them back (issue 31.8)."""
    import numpy as np

    out = io.StringIO()
    EventLog("learner", stream=out)("step", loss=float("nan"), ratio=np.float64("inf"),
                                    nested={"kl": [1.0, float("-inf")]}, ok=0.25)

    def refuse(name):
        raise AssertionError(f"{name} in an event line")
    ev = json.loads(out.getvalue(), parse_constant=refuse)
    assert (ev["loss"], ev["ratio"], ev["nested"], ev["ok"]) == ("nan", "inf", {"kl": [1.0, "-inf"]}, 0.25)
    assert float(ev["ratio"]) == float("inf")


def test_sample_id_round_trip_and_refusals():
    sid = protocol.sample_id("run-a7/x", 3)
    assert sid == "run-a7/x/3" and protocol.parse_sample_id(sid) == ("run-a7/x", 3)
    for bad in ("nogroup", "/3", "a/", "a/-1", "a/x"):
        with pytest.raises(protocol.ProtocolError, match="is not '<assignment_id>/<group_index>'"):
            protocol.parse_sample_id(bad)


@pytest.mark.parametrize("endpoint", ["localhost:5555", "127.0.0.1", "tcp://127.0.0.1", "tcp://:5",
                                      "tcp://h:99999", "http://h:1", 5555])
def test_check_endpoint_refuses_with_one_line(endpoint):
    with pytest.raises(protocol.StartupError) as e:
        check_endpoint(endpoint, "rollout.learner")
    assert "rollout.learner" in str(e.value) and "\n" not in str(e.value)


def test_check_endpoint_accepts():
    for ok in ("tcp://127.0.0.1:5555", "tcp://[::1]:5", "ipc:///tmp/x", "inproc://a"):
        assert check_endpoint(ok, "x") == ok
    assert advertised_host("0.0.0.0") == "127.0.0.1" and advertised_host("10.1.2.3") == "10.1.2.3"


@pytest.mark.parametrize("advertised, via, expected", [
    # a learner on every interface names its loopback: a server that came from elsewhere uses
    # the address it reached the learner at, with the advertised port
    ("tcp://127.0.0.1:5556", "tcp://198.18.0.1:5555", "tcp://198.18.0.1:5556"),
    ("tcp://localhost:7", "tcp://learner.example:5555", "tcp://learner.example:7"),
    ("tcp://[::1]:5556", "tcp://[fd00::2]:5555", "tcp://[fd00::2]:5556"),
    # anything else stays as the learner said it
    ("tcp://127.0.0.1:5556", "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"),
    ("tcp://10.0.0.5:5556", "tcp://198.18.0.1:5555", "tcp://10.0.0.5:5556"),
    ("ipc:///tmp/w", "tcp://198.18.0.1:5555", "ipc:///tmp/w"),
    ("tcp://127.0.0.1:5556", "ipc:///tmp/r", "tcp://127.0.0.1:5556"),
])
def test_reachable_endpoint(advertised, via, expected):
    from protocol.plumbing.sockets import reachable_endpoint

    assert reachable_endpoint(advertised, via) == expected


def test_bind_port_in_use_is_a_startup_error():
    ctx = zmq.Context()
    a = make_socket(ctx, zmq.ROUTER, max_message_bytes=1024)
    b = make_socket(ctx, zmq.ROUTER, max_message_bytes=1024)
    try:
        port = bind(a, "127.0.0.1", 0, "learner.network.rollout_port")
        with pytest.raises(protocol.StartupError, match=rf"learner\.network\.rollout_port: port {port} on "
                                                         r"127\.0\.0\.1 is already in use"):
            bind(b, "127.0.0.1", port, "learner.network.rollout_port")
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_max_message_size_drops_the_peer_not_the_process():
    """A frame over ZMQ_MAXMSGSIZE never reaches the application: libzmq drops the connection."""
    ctx = zmq.Context()
    server = make_socket(ctx, zmq.ROUTER, max_message_bytes=64 << 10)
    port = bind(server, "127.0.0.1", 0, "port")
    big = ctx.socket(zmq.DEALER)
    good = ctx.socket(zmq.DEALER)
    monitor = server.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        for s in (big, good):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{port}")
        big.send(b"x" * (1 << 20))          # 1 MiB > 64 KiB
        assert monitor.poll(10_000), "the oversize peer was not disconnected"
        good.send(b"hello")
        assert server.poll(10_000)
        frames = server.recv_multipart()
        assert frames[1] == b"hello"
        assert not server.poll(100)          # the 1 MiB frame was never delivered
    finally:
        server.disable_monitor()
        for s in (monitor, big, good, server):
            s.close(0)
        ctx.term()


def _get(url: str, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_http_endpoint_metrics_health_and_read_only():
    healthy = threading.Event()
    ep = HttpEndpoint(lambda: (b"slipstream_x 1\n", "text/plain; version=0.0.4"),
                      lambda: (healthy.is_set(), {"version": 7}))
    port = ep.serve("127.0.0.1", 0)
    try:
        assert _get(f"http://127.0.0.1:{port}/metrics") == (200, b"slipstream_x 1\n")
        code, body = _get(f"http://127.0.0.1:{port}/healthz")
        assert code == 503 and json.loads(body) == {"ok": False, "version": 7}
        healthy.set()
        code, body = _get(f"http://127.0.0.1:{port}/healthz")
        assert code == 200 and json.loads(body)["ok"] is True
        for method in ("POST", "PUT", "DELETE"):
            assert _get(f"http://127.0.0.1:{port}/metrics", method)[0] == 405
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:   # garbage request
            s.sendall(b"\x00\xffNOT HTTP\r\n\r\n")
            s.recv(1024)
        assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 200          # still serving
    finally:
        ep.close()


def test_http_port_in_use_is_a_startup_error():
    first = HttpEndpoint(lambda: (b"", "text/plain"))
    port = first.serve("127.0.0.1", 0)
    try:
        with pytest.raises(protocol.StartupError, match=rf"rollout\.network\.metrics_port: port {port} .* in use"):
            HttpEndpoint(lambda: (b"", "text/plain")).serve("127.0.0.1", port, "rollout.network.metrics_port")
    finally:
        first.close()


async def test_supervise_reports_the_first_crash():
    lines = []
    stop = asyncio.Event()
    gate = asyncio.Event()

    async def crash():
        await gate.wait()
        raise RuntimeError("boom")

    forever = asyncio.create_task(asyncio.Event().wait(), name="forever")
    crasher = asyncio.create_task(crash(), name="crasher")
    gate.set()
    done, error = await supervise([forever, crasher], stop, lambda ev, **f: lines.append((ev, f)))
    assert done == {crasher} and isinstance(error, RuntimeError)
    assert lines == [("crashed", {"task": "crasher", "error": "RuntimeError('boom')"})]
    await cancel_all([forever])
    assert forever.cancelled()


async def test_supervise_returns_on_stop():
    stop = asyncio.Event()
    t = asyncio.create_task(asyncio.Event().wait())
    stop.set()
    done, error = await supervise([t], stop, lambda *a, **k: None)
    assert done == set() and error is None
    await cancel_all([t])


async def _cancelled_as_the_event_is_set(wait) -> str:
    """Cancel a task in the loop turn its event is set: how did it end?"""
    event = asyncio.Event()

    async def waiter():
        await wait(event)
        return "went on"

    task = asyncio.create_task(waiter())
    for _ in range(5):
        await asyncio.sleep(0)          # the task now waits on the event
    event.set()
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


async def test_wait_event_never_loses_a_cancellation():
    """The rollout server's pipeline once waited for ever while its process stopped: Python 3.11's
    wait_for returned the event's result to a task being cancelled. wait_event does not."""
    assert await _cancelled_as_the_event_is_set(lambda e: wait_event(e, 10.0)) == "cancelled"
    if sys.version_info[:2] == (3, 11):   # the bug wait_event avoids (gone in 3.12's wait_for)
        assert await _cancelled_as_the_event_is_set(lambda e: asyncio.wait_for(e.wait(), 10.0)) == "went on"
    event = asyncio.Event()
    t0 = time.monotonic()
    assert await wait_event(event, 0.05) is False and time.monotonic() - t0 >= 0.05
    event.set()
    assert await wait_event(event, 0.0) is True


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is Python 3.11+")
async def test_raise_if_cancelling_ends_a_loop_that_swallowed_its_cancellation():
    async def loop():
        while True:
            raise_if_cancelling()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass                     # swallowed, as a library call can
    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=5)
    assert task in done and task.cancelled()


def test_trace_writes_points_only_when_asked_and_never_fails(tmp_path, monkeypatch):
    from protocol.plumbing import process

    path = tmp_path / "trace.txt"
    monkeypatch.setattr(process, "_trace_file", None)
    monkeypatch.setattr(process, "_trace_path", None)          # $SLIPSTREAM_TRACE unset
    process.trace("learner.step_end")
    assert not path.exists() and process._trace_file is None

    monkeypatch.setattr(process, "_trace_path", str(path))
    before = time.time()
    process.trace("learner.step_end")
    process.trace("rollout.applied")
    after = time.time()
    process._trace_file.close()
    lines = [line.split() for line in path.read_text().splitlines()]
    assert [p for _, _, p in lines] == ["learner.step_end", "rollout.applied"]
    assert all(int(pid) == os.getpid() for _, pid, _ in lines)
    times = [float(t) for t, _, _ in lines]
    assert before - 1e-3 <= times[0] <= times[1] <= after + 1e-3

    # A file that cannot be opened turns tracing off; the caller goes on.
    monkeypatch.setattr(process, "_trace_file", None)
    monkeypatch.setattr(process, "_trace_path", str(tmp_path / "missing-dir" / "trace.txt"))
    process.trace("learner.batch")
    assert process._trace_path is None and process._trace_file is None
