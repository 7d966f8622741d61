"""Prometheus metrics of a rollout server (names ``slipstream_rollout_*`` + the shared version).

Served by :class:`protocol.plumbing.http.HttpEndpoint` (``/metrics`` and ``/healthz``) through
:meth:`RolloutMetrics.render`. The registry also re-exports the process-wide default registry, so
vLLM's ``vllm:*`` metrics and prometheus-client's ``process_*`` ones stay reachable.

``slipstream_rollout_errors_total{kind}`` counts every refusal and failure, one bounded label:

======================== =========================================================================
kind                     counted when
======================== =========================================================================
reward                   a reward function raised or returned a non-finite value (sample failed)
reward_timeout           a reward call took longer than ``reward_timeout_s`` (sample failed)
generate                 the engine raised for a batch (its samples are reported failed)
assignment_group_size    an assignment wants more completions than ``max_concurrency``
assignment_over_credit   an assignment beyond the credits this server granted
assignment_max_new_tokens  ``sampling.max_new_tokens`` above ``max_new_tokens_limit``
assignment_prompt        an empty or too long prompt, or token ids outside the vocabulary
unknown_ack              an Ack naming a sample this server never sent (or not a sample id)
unexpected_message       a message type the learner should not send to a server
weights_manifest         a manifest refused (too large, no weights endpoint, chunks too big)
weights_version          a manifest older than the version served or announced
weights_chunk            a chunk reply that is not the chunk asked for (index, version, size)
weights_checksum         a chunk whose bytes fail their checksum (fetched again)
weights_delta            a delta chunk that does not decode, names a version this server does not
                         hold, or makes bytes that fail their checksum (that chunk fetched raw)
weights_timeout          no chunk within ``chunk_timeout_s`` (the fetch fails)
weights                  a fetch that failed for another reason, or an update the engine refused
learner_handshake        the learner refused the CURVE handshake (a key not allowed, CURVE mismatch;
                         counted once per kind of failure)
http_request             a malformed request or a method other than GET/HEAD on /metrics, /healthz
weights_behind           a batch generated with weights older than the version its assignments
                         were issued at, because they did not arrive within ``weights_wait_s``
                         (its samples may be over the staleness limit when trained)
new_run                  a Welcome from another run (a learner restarted without --resume): leases
                         and unacknowledged results of the old run dropped, its weights fetched
agent_request            a request to the agents' OpenAI-compatible endpoint refused (malformed,
                         no such episode, a rewritten history; rollout_server/agents.py)
======================== =========================================================================

Messages that do not decode at all are ``slipstream_protocol_errors_total``, and so is a Welcome
whose weights endpoint no socket could connect to (``welcome_refused``).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

import protocol
from rollout_server.episodes import EPISODE_FAILURES

ERROR_KINDS = (
    "reward",
    "reward_timeout",
    "generate",
    "assignment_group_size",
    "assignment_over_credit",
    "assignment_max_new_tokens",
    "assignment_prompt",
    "unknown_ack",
    "unexpected_message",
    "weights_manifest",
    "weights_version",
    "weights_chunk",
    "weights_checksum",
    "weights_delta",
    "weights_timeout",
    "weights",
    "learner_handshake",
    "http_request",
    "weights_behind",
    "new_run",
    "agent_request",
)
"""The ``kind`` label's values, the module docstring's table (tests/rollout_server/test_metrics_kinds.py)."""


class _Forward:
    """A collector that re-exports another registry: the process-wide default one, where vLLM
    registers its ``vllm:*`` metrics and prometheus-client its ``process_*``/``python_*`` ones,
    so one scrape of a rollout server sees slipstream's, the engine's and the process's metrics."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        yield from self.registry.collect()


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
        self.weights_received_bytes = Counter(
            "slipstream_weights_received_bytes", "Weight chunk bytes this server received and "
            "verified, by source (learner: the learner's weights socket; peer: another server's "
            "relay)", ["source"], registry=r)
        for source in ("learner", "peer"):
            self.weights_received_bytes.labels(source=source)
        self.weights_relayed_bytes = Counter(
            "slipstream_weights_relayed_bytes", "Weight chunk bytes this server's relay socket sent to "
            "its peers (rollout_server/relay.py)", registry=r)
        self.relay_failures = Counter(
            "slipstream_weights_relay_failures", "Peers skipped during a weights fetch, by reason "
            "(connect, timeout, refused: it did not hold the chunk in time, bad_chunk: a reply "
            "that failed its checks); their chunks came from the next source", ["reason"], registry=r)
        for reason in ("connect", "timeout", "refused", "bad_chunk"):
            self.relay_failures.labels(reason=reason)
        self.weight_chunks_received = Counter(
            "slipstream_weight_chunks_received", "Weight chunks this server received and verified, by "
            "encoding (raw, or delta: xor-zstd against the version it held)", ["encoding"], registry=r)
        for encoding in ("raw", "delta"):
            self.weight_chunks_received.labels(encoding=encoding)
        self.weight_update_seconds = Histogram(
            "slipstream_rollout_weight_update_seconds", "Seconds from WeightsAvailable to applied",
            registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.reward = Histogram("slipstream_rollout_reward", "Total reward per sample", registry=r,
                                buckets=(-1, -0.5, 0, 0.25, 0.5, 0.75, 1, 2, 5))
        self.errors = Counter("slipstream_rollout_errors", "Refusals and failures by kind", ["kind"],
                              registry=r)
        for kind in ERROR_KINDS:              # at 0 from the start: panels show 0, not "No data"
            self.errors.labels(kind=kind)
        self.protocol_errors = Counter("slipstream_protocol_errors",
                                       "Messages refused with ProtocolError", registry=r)
        self.connections_cut = Counter(
            "slipstream_connections_cut", "Connections to the learner this server ended because "
            "a message from it stayed unfinished too large (too_large) or too long (open_too_long), "
            "protocol.plumbing.unfinished", ["socket", "reason"], registry=r)
        for socket in ("learner", "weights"):
            for reason in ("too_large", "open_too_long"):
                self.connections_cut.labels(socket=socket, reason=reason)
        self.send_retries = Counter("slipstream_rollout_send_retries",
                                    "Results re-sent because no ack arrived", registry=r)
        self.reconnects = Counter("slipstream_rollout_reconnects",
                                  "Hellos repeated (learner restarted or link re-established)",
                                  registry=r)
        self.acks = Counter("slipstream_rollout_acks", "Acknowledged samples by status", ["status"],
                            registry=r)
        for status in protocol.ACK_STATUSES:
            self.acks.labels(status=status)
        self.idle_ratio = Gauge("slipstream_rollout_idle_ratio",
                                "Fraction of the last heartbeat interval the engine was not generating "
                                "(waiting for work or weights)", registry=r)
        self.learner_connected = Gauge("slipstream_rollout_learner_connected",
                                       "1 while the learner link is up and welcomed (as /healthz)",
                                       registry=r)
        # The watchdog's view (protocol.plumbing.watchdog): 0 unless stalled.
        self.stalled_seconds = Gauge(
            "slipstream_stalled_seconds", "Seconds without progress while the watchdog counts the "
            "process stalled (0 otherwise)", ["process"], registry=r)
        self.waiting_on = Gauge(
            "slipstream_waiting_on", "1 for what a stalled process waits on (reason), 0 for the "
            "rest", ["process", "reason"], registry=r)
        # Multi-turn episodes (rollout_server/episodes.py).
        self.episodes_failed = Counter(
            "slipstream_episodes_failed", "Episodes ended by their environment or a turn's generation, "
            "by reason (rollout_server.episodes.EPISODE_FAILURES)", ["reason"], registry=r)
        for reason in EPISODE_FAILURES:
            self.episodes_failed.labels(reason=reason)
        self.episode_groups_reissued = Counter(
            "slipstream_episode_groups_reissued", "Groups with a failed episode given back to the learner "
            "for re-issue (rollout.environment.on_failure: reissue)", registry=r)
        self.episodes_truncated = Counter(
            "slipstream_episodes_truncated", "Episodes cut by max_turns or max_episode_tokens while "
            "their environment wanted more", registry=r)
        self.episode_turns = Histogram("slipstream_episode_turns", "Model turns per episode", registry=r,
                                       buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64))
        self.environment_seconds = Histogram(
            "slipstream_environment_seconds", "Seconds an episode spent in its environment (reset, "
            "steps)", registry=r, buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300))
        self.tool_calls = Counter("slipstream_tool_calls", "Tool calls environments reported "
                                  "(step info tool_calls)", registry=r)
        self.tool_errors = Counter("slipstream_tool_errors", "Tool calls that failed, as environments "
                                   "reported them (step info tool_errors)", registry=r)
        r.register(_Forward(REGISTRY))

    def count(self, kind: str, n: int = 1) -> None:
        """``slipstream_rollout_errors_total{kind}`` += n (kinds: the module docstring)."""
        self.errors.labels(kind=kind).inc(n)

    def error_count(self, kind: str) -> float:
        """Current value of one error kind (0 when never counted)."""
        return self.registry.get_sample_value("slipstream_rollout_errors_total", {"kind": kind}) or 0.0

    def render(self) -> tuple[bytes, str]:
        """The Prometheus exposition for :class:`protocol.plumbing.http.HttpEndpoint`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
