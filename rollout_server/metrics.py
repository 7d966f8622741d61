"""Prometheus metrics of a rollout server (names ``slipstream_rollout_*`` + the shared version)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


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

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint; returns the bound port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
