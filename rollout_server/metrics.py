"""Prometheus metrics of a rollout server (names ``slipstream_rollout_*`` + the shared version).

The HTTP endpoint is a small WSGI app in a daemon thread: ``/healthz`` answers JSON (200 while the
server is connected and serving, 503 otherwise), every other path the Prometheus text format.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app


class _Forward:
    """A collector that re-exports another registry: the process-wide default one, where vLLM
    registers its ``vllm:*`` metrics and prometheus-client its ``process_*``/``python_*`` ones,
    so one scrape of a rollout server sees slipstream's, the engine's and the process's metrics."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        yield from self.registry.collect()


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - no access log on stderr
        pass


def health_app(metrics_app, health: Callable[[], tuple[bool, dict]] | None):
    """``/healthz`` -> ``health()`` as JSON (200 ok / 503 not ok); anything else -> metrics."""

    def app(environ, start_response):
        if environ.get("PATH_INFO") == "/healthz":
            ok, info = health() if health else (True, {})
            body = json.dumps({"ok": ok, **info}).encode()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        return metrics_app(environ, start_response)

    return app


class RolloutMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.policy_version = Gauge("slipstream_policy_version",
                                    "Policy version of the weights this server generates with", registry=r)
        self.generated_tokens = Counter("slipstream_rollout_generated_tokens",
                                        "Completion tokens generated", registry=r)
        self.prompt_tokens = Counter("slipstream_rollout_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.samples = Counter("slipstream_rollout_samples", "Samples generated and scored", registry=r)
        self.generation_seconds = Histogram(
            "slipstream_rollout_generation_seconds", "Seconds per engine generate call", registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.requests_inflight = Gauge("slipstream_rollout_requests_inflight",
                                       "Samples being generated or awaiting an ack", registry=r)
        self.weight_update_seconds = Histogram(
            "slipstream_rollout_weight_update_seconds", "Seconds from WeightsAvailable to applied",
            registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.reward = Histogram("slipstream_rollout_reward", "Total reward per sample", registry=r,
                                buckets=(-1, -0.5, 0, 0.25, 0.5, 0.75, 1, 2, 5))
        self.errors = Counter("slipstream_rollout_errors", "Errors by kind", ["kind"], registry=r)
        self.protocol_errors = Counter("slipstream_protocol_errors",
                                       "Messages refused with ProtocolError", registry=r)
        self.send_retries = Counter("slipstream_rollout_send_retries",
                                    "Results re-sent because no ack arrived", registry=r)
        self.reconnects = Counter("slipstream_rollout_reconnects",
                                  "Hellos repeated because the learner did not know this server",
                                  registry=r)
        r.register(_Forward(REGISTRY))
        self._server: WSGIServer | None = None

    def serve(self, host: str, port: int, health: Callable[[], tuple[bool, dict]] | None = None) -> int:
        """Start the /metrics + /healthz HTTP endpoint in a daemon thread; returns the bound port."""
        app = health_app(make_wsgi_app(self.registry), health)
        self._server = make_server(host, port, app, server_class=_Server, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         name="rollout-metrics").start()
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
