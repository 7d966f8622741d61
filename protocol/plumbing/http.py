"""The HTTP endpoint every process serves: Prometheus ``/metrics`` and ``/healthz`` (docs/design.md §7).

Standard library only (a threaded WSGI server in a daemon thread), so it lives beside the other
process plumbing without importing prometheus-client: the caller passes ``render_metrics``
(returning the exposition bytes and content type) and ``health`` (returning ``(ok, info)``).
``/healthz`` answers JSON, 200 when ok and 503 otherwise; any other GET path gets the metrics.
Nothing here changes state: every other method is refused with 405.

Hostile clients: a malformed request (not HTTP, an over-long request line, too many headers, a
bad version) is answered by the standard library's 4xx/5xx before any of our code runs; each
refusal, and each 405, is reported to ``on_error(status)`` (the processes count them in
``slipstream_protocol_errors_total``). Every connection has its own daemon thread and a socket
timeout of ``REQUEST_TIMEOUT_S``, so a client that never finishes its request holds one thread
for that long and blocks nobody.
"""

from __future__ import annotations

import errno
import json
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from protocol.errors import StartupError

MetricsRenderer = Callable[[], tuple[bytes, str]]
HealthCheck = Callable[[], tuple[bool, dict]]
ErrorHook = Callable[[int], None]
REQUEST_TIMEOUT_S = 10.0


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S
    on_error: ErrorHook | None = None

    def log_message(self, format, *args):  # noqa: A002 - no access log on stderr
        pass

    def send_error(self, code, message=None, explain=None):
        if self.on_error is not None:
            self.on_error(code)
        super().send_error(code, message, explain)


def make_app(render_metrics: MetricsRenderer, health: HealthCheck | None,
             on_error: ErrorHook | None = None):
    def app(environ, start_response):
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            if on_error is not None:
                on_error(405)
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Length", "0")])
            return [b""]
        if environ.get("PATH_INFO") == "/healthz":
            ok, info = health() if health else (True, {})
            body = json.dumps({"ok": ok, **info}, default=str).encode()
            status, ctype = ("200 OK" if ok else "503 Service Unavailable"), "application/json"
        else:
            body, ctype = render_metrics()
            status = "200 OK"
        start_response(status, [("Content-Type", ctype), ("Content-Length", str(len(body)))])
        return [body]

    return app


class HttpEndpoint:
    """``/metrics`` + ``/healthz`` on ``host:port`` (0 = any free port)."""

    def __init__(self, render_metrics: MetricsRenderer, health: HealthCheck | None = None,
                 on_error: ErrorHook | None = None):
        self.app = make_app(render_metrics, health, on_error)
        self._handler = type("Handler", (_QuietHandler,), {"on_error": staticmethod(on_error)}
                             if on_error is not None else {})
        self._server: WSGIServer | None = None

    def serve(self, host: str, port: int, what: str = "metrics_port") -> int:
        """Start serving in a daemon thread; returns the bound port. A taken port is a
        :class:`StartupError` naming ``what``."""
        try:
            self._server = make_server(host, port, self.app, server_class=_Server,
                                       handler_class=self._handler)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise StartupError(f"{what}: port {port} on {host} is already in use; set {what} "
                                   "to a free port, or 0 for any free port") from None
            raise StartupError(f"{what}: cannot listen on {host}:{port}: {e}") from None
        threading.Thread(target=self._server.serve_forever, daemon=True, name="http-metrics").start()
        return self._server.server_port

    @property
    def port(self) -> int | None:
        return self._server.server_port if self._server else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
