"""R3 live: a real learner takes seeded garbage on each of its ZeroMQ sockets from a raw DEALER
(and raw TCP bytes that are not ZMTP at all), and malformed HTTP on its metrics port, while a real
rollout server (tiny model) trains with it: every reject is answered and counted in
slipstream_protocol_errors_total{socket}, nothing else moves, and training goes on. Also the
HTTP endpoint's promise (R5): nothing there changes state."""

from __future__ import annotations

import asyncio
import re
import socket
import sys
import urllib.parse
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from config_kit import rollout_config
from learner_testkit import http_get, learner_config, metric, running_learner, wait_until

import protocol
from rollout_server.service import RolloutService

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "protocol"))
from fuzz_inputs import Fuzzer  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:overflow encountered in dot:RuntimeWarning")]

GARBAGE_PER_SOCKET = 300


def must_fail_inputs(seed: int, n: int) -> list[list[bytes]]:
    f, out = Fuzzer(seed, socket_safe=True), []
    while len(out) < n:
        _, frames, must_fail = f.case()
        if must_fail and frames and all(type(x) is bytes for x in frames):
            out.append(frames)
    return out


# Requests in flight per socket. The learner's sends never wait: a reply to a peer whose queue is
# full (SNDHWM; 16 on the weights socket) is dropped and counted, so a flood that reads nothing
# until it has sent everything could lose refusals by design. The window stays under every HWM.
WINDOW = 8


async def flood(endpoint: str, inputs: list[list[bytes]], control: bool) -> None:
    """Send every input from one raw DEALER, at most WINDOW unanswered, and read one refusal each."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for i, frames in enumerate(inputs):
            await sock.send_multipart(frames)
            if i >= WINDOW - 1:
                await read_refusal(sock, endpoint, control)
        for _ in range(min(WINDOW - 1, len(inputs))):
            await read_refusal(sock, endpoint, control)
        assert not await sock.poll(100), f"{endpoint}: more replies than inputs"
    finally:
        sock.close(0)


async def read_refusal(sock, endpoint: str, control: bool) -> None:
    assert await sock.poll(30_000), f"{endpoint}: a refusal was not answered"
    reply = protocol.decode(await sock.recv_multipart())
    if control:
        assert isinstance(reply, protocol.ControlReply) and not reply.ok
    else:
        assert isinstance(reply, protocol.Error) and reply.code == "protocol_error"


def raw_tcp(host_port: tuple[str, int], data: bytes) -> bytes:
    """Send ``data`` on a fresh TCP connection, half-close, read until the peer closes."""
    with socket.create_connection(host_port, timeout=15) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        return b"".join(chunks)


def host_port(url: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(url)
    return u.hostname, u.port


BAD_HTTP = [
    b"garbage\r\n\r\n",
    b"\x00\xff\xfe" * 50 + b"\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",                       # request line > 64 KiB
    b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(150)) + b"\r\n",
    b"POST /metrics HTTP/1.1\r\nContent-Length: 4\r\n\r\nstop",
    b"PUT /healthz HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    b"DELETE / HTTP/1.1\r\n\r\n",
    b"PATCH /metrics HTTP/1.1\r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\n\r\n",
    b"BREW /healthz HTTP/1.1\r\n\r\n",
]


async def test_garbage_on_every_socket_is_counted_while_a_real_server_trains(tmp_path, tiny_model_dir):
    async with running_learner(learner_config(tmp_path, max_staleness=2), tiny_model_dir) as svc:
        server = RolloutService(rollout_config(learner=svc.endpoints["rollout"], server_id="real",
                                              metrics_port=0, threads=1, max_concurrency=4),
                                tiny_model_dir)
        task = asyncio.create_task(server.run())
        try:
            await wait_until(lambda: svc.version >= 1 or task.done(), 240, "first step")
            assert not task.done()
            # Garbage on the three sockets at once, while the server keeps training.
            names = ("rollout", "weights", "control")
            inputs = {n: must_fail_inputs(seed, GARBAGE_PER_SOCKET) for seed, n in enumerate(names)}
            before = {n: metric(svc, "slipstream_protocol_errors_total", socket=n) for n in names}
            await asyncio.gather(*(flood(svc.endpoints[n], inputs[n], n == "control") for n in names))
            for n in names:
                assert metric(svc, "slipstream_protocol_errors_total", socket=n) - before[n] == GARBAGE_PER_SOCKET
            # Raw TCP bytes: libzmq reads a stream that does not start like ZMTP 3 as ZMTP 1.0
            # (length-prefixed frames), so some of it arrives as messages: refused and counted
            # like the rest, and the learner is unaffected.
            for n in names:
                host, port = svc.endpoints[n][len("tcp://"):].rsplit(":", 1)
                for i in range(10):
                    await asyncio.to_thread(raw_tcp, (host, int(port)), bytes([i]) * (1 + 500 * i))
            # Malformed HTTP: every request refused with 4xx/5xx and counted; /healthz unharmed.
            http = host_port(svc.endpoints["metrics"])
            for request in BAD_HTTP:
                answer = await asyncio.to_thread(raw_tcp, http, request)
                # A status line, or (a request without a version is HTTP/0.9) the bare error page.
                found = re.match(rb"HTTP/1\.[01] (\d{3}) ", answer) or re.search(rb"Error code: (\d{3})", answer)
                assert found and found.group(1)[:1] in (b"4", b"5"), (request[:40], answer[:200])
            await wait_until(lambda: metric(svc, "slipstream_protocol_errors_total", socket="http")
                             == len(BAD_HTTP), 10, "every HTTP refusal counted")
            for n in names:
                assert metric(svc, "slipstream_protocol_errors_total", socket=n) - before[n] >= GARBAGE_PER_SOCKET
            status, health = await asyncio.to_thread(http_get, svc.endpoints["healthz"])
            assert status == 200 and health["ok"]
            # Training went on with the real server: two more versions, applied by it too.
            target = svc.version + 2
            await wait_until(lambda: server.engine.version >= target or task.done(), 240,
                             f"the server at version {target}")
            assert not task.done() and svc.admission.servers
            assert svc.intake.invalid == {} and svc.buffer.counters["invalid"] == 0
        finally:
            server.stopping.set()
            server.abort.set()
            assert await asyncio.wait_for(task, 60) == 0


GET_PATHS = ["/", "/metrics", "/healthz", "/stop", "/quitquitquit", "/control?command=stop",
             "/set?max_staleness=9", "/../../etc/passwd", "/healthz/../metrics", "/%00", "/" + "x" * 2000]


def http_request(url: str, method: str) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, method=method, data=b"stop" if method in ("POST", "PUT") else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


async def test_the_http_endpoint_changes_nothing(tmp_path, tiny_model_dir):
    """GET of any path changes no state (status, config, metrics); every other method is 405."""
    async with running_learner(learner_config(tmp_path), tiny_model_dir) as svc:
        base = svc.endpoints["metrics"].rsplit("/", 1)[0]

        def snapshot():
            text = svc.metrics.render()[0].decode()
            status = {k: v for k, v in svc.status().items() if k != "watchdog"}   # its clock runs
            return (svc.cfg.model_dump(), status, svc.stopping.is_set(), svc.version,
                    [line for line in text.splitlines() if not line.startswith("#")])
        before = snapshot()
        for path in GET_PATHS:
            for method in ("GET", "HEAD"):
                status = await asyncio.to_thread(http_request, base + path, method)
                assert status in (200, 503), (method, path, status)
        assert snapshot() == before
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            for path in ("/metrics", "/healthz", "/stop"):
                assert await asyncio.to_thread(http_request, base + path, method) == 405
        after = snapshot()
        assert after[:4] == before[:4]
        assert metric(svc, "slipstream_protocol_errors_total", socket="http") == 12
