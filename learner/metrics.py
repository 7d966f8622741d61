"""Prometheus metrics of the learner, and the metrics.jsonl log of every policy step.

Served by :class:`protocol.plumbing.http.HttpEndpoint` (``/metrics`` and ``/healthz``) from the learner's
own registry. Labels are bounded: socket names, ack statuses, refusal reasons, server ids.

Every metric the learner process exposes is defined here, in :class:`LearnerMetrics` (one home:
names, help texts, labels and buckets in one place); the components take this object and update
its metrics (``tests/test_metrics_home.py`` fails on a definition anywhere else in ``learner/``).
"""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)


class LearnerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.policy_version = Gauge("slipstream_policy_version", "Learner policy version", registry=r)
        self.rollouts_received = Counter("slipstream_rollouts_received",
                                         "Samples received from rollout servers", registry=r)
        self.samples = Counter("slipstream_samples", "Received samples by ack status", ["status"],
                               registry=r)
        self.samples_invalid = Counter(
            "slipstream_samples_invalid", "Samples refused by the learner's checks against the run "
            "(acked invalid, never buffered), by reason", ["reason"], registry=r)
        self.protocol_errors = Counter("slipstream_protocol_errors",
                                       "Messages refused with ProtocolError", ["socket"], registry=r)
        self.send_dropped = Counter(
            "slipstream_send_dropped", "Messages not sent because the peer's queue was full or the "
            "peer was gone (the learner never waits on a peer)", ["socket", "reason"], registry=r)
        self.credits_refused = Counter(
            "slipstream_credits_refused", "Credits asked for beyond a server's declared "
            "max_concurrency (ignored), in samples", registry=r)
        self.server_errors = Counter(
            "slipstream_server_errors", "Errors rollout servers reported (assignment_refused: a "
            "server's limits refused an assignment, which is re-issued)", ["code"], registry=r)
        self.auth_denied = Counter(
            "slipstream_auth_denied", "Client keys refused by CURVE authentication (not in the "
            "socket's allow-list), by socket", ["socket"], registry=r)
        self.servers_dropped = Counter(
            "slipstream_rollout_servers_dropped", "Rollout servers dropped from dispatch by the "
            "circuit breaker (weights failed weights_failure_limit times in a row)", registry=r)
        self.servers_lost = Counter("slipstream_rollout_servers_lost",
                                    "Rollout servers dropped (timed out or unreachable)", ["reason"],
                                    registry=r)
        self.step_seconds = Histogram("slipstream_train_step_seconds", "Seconds per policy step",
                                      registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.publish_seconds = Histogram(
            "slipstream_weights_publish_seconds", "Seconds from a version's snapshot to its "
            "announcement (snapshot, checksums, install; off the train loop after the snapshot)",
            registry=r, buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))
        self.publish_wait_seconds = Histogram(
            "slipstream_publish_wait_seconds", "Seconds the train loop waited on publishing a "
            "version (the snapshot copy only; checksums and serving run beside the next step)",
            registry=r, buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5))
        self.publish_superseded = Counter(
            "slipstream_weights_superseded", "Versions never announced: a newer snapshot arrived "
            "while they waited for the one being prepared", registry=r)
        self.reward_mean = Gauge("slipstream_reward_mean", "Mean reward of the last batch", registry=r)
        self.staleness_mean = Gauge("slipstream_staleness_mean",
                                    "Mean staleness (policy steps) of the last batch", registry=r)
        self.max_staleness = Gauge("slipstream_max_staleness", "Current staleness limit eta", registry=r)
        self.setting = Gauge("slipstream_setting", "Current value of each runtime setting (ctl set)",
                             ["key"], registry=r)
        self.control_changes = Counter("slipstream_control_changes",
                                       "Runtime settings changed through ctl set", ["key"], registry=r)
        self.paused = Gauge("slipstream_paused", "1 while the run is paused (ctl pause)", registry=r)
        self.learner_idle_ratio = Gauge("slipstream_learner_idle_ratio",
                                        "Fraction of the last step's cycle the train loop waited for "
                                        "samples", registry=r)
        self.staleness_changes = Counter("slipstream_staleness_changes",
                                         "Changes of eta by the adaptive staleness controller",
                                         ["reason"], registry=r)
        self.buffered = Gauge("slipstream_buffer_samples", "Samples buffered, not yet trained", registry=r)
        self.inflight = Gauge("slipstream_inflight_samples", "Samples issued, not yet returned", registry=r)
        self.servers = Gauge("slipstream_rollout_servers", "Rollout servers connected", registry=r)
        self.server_version = Gauge("slipstream_server_policy_version",
                                    "Version each rollout server reports as applied", ["server"],
                                    registry=r)
        self.step_stats = Gauge("slipstream_train_stat", "Last step's training statistics", ["name"],
                                registry=r)
        self.skipped_steps = Counter(
            "slipstream_skipped_steps", "Policy steps skipped: a loss or gradient was not finite, "
            "nothing was applied or published, the version did not move", registry=r)
        self.sanity_ratio_dev_mean = Gauge(
            "slipstream_sanity_ratio_deviation_mean", "Mean |ratio - 1| at the first mini-batch of "
            "the last step, before any update (NaN: not applicable, no separate proximal pass)",
            registry=r)
        self.sanity_ratio_dev_max = Gauge(
            "slipstream_sanity_ratio_deviation_max", "Max |ratio - 1| at the first mini-batch of the "
            "last step, before any update (NaN: not applicable)", registry=r)
        self.sanity_kl = Gauge(
            "slipstream_sanity_kl", "KL(current || proximal) per token at the first mini-batch of "
            "the last step, before any update (NaN: not applicable)", registry=r)
        self.sanity_failures = Counter(
            "slipstream_sanity_check_failures", "Steps whose first-mini-batch ratio or KL exceeded "
            "the sanity tolerance", registry=r)
        # ---- prompts and held-out evaluation (learner.data.prompts, learner.data.evaluation) ----
        self.prompts_skipped = Counter(
            "slipstream_prompts_skipped", "Prompts left out of the stream (too_long: over "
            "max_prompt_tokens), by reason", ["reason"], registry=r)
        self.eval_reward_mean = Gauge(
            "slipstream_eval_reward_mean", "Mean reward of the last complete held-out evaluation "
            "(NaN before the first)", registry=r)
        self.eval_accuracy = Gauge(
            "slipstream_eval_accuracy", "Fraction of the last evaluation's samples with reward >= "
            "eval_correct_threshold, 0-1 (NaN before the first)", registry=r)
        self.eval_version = Gauge(
            "slipstream_eval_policy_version", "Policy version the last complete evaluation asked for "
            "(-1 before the first)", registry=r)
        self.eval_rounds = Counter(
            "slipstream_eval_rounds", "Evaluation rounds by outcome (complete; skipped: the previous "
            "one was still running)", ["outcome"], registry=r)
        self.eval_samples = Counter(
            "slipstream_eval_samples", "Evaluation samples received, by ack status (never buffered "
            "or trained)", ["status"], registry=r)
        # ---- checkpoints (learner.state.learner_checkpoints.LearnerCheckpoints) ----
        self.checkpoint_seconds = Histogram("slipstream_checkpoint_seconds", "Seconds to write a checkpoint",
                                            registry=r, buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.checkpoint_version = Gauge("slipstream_checkpoint_version",
                                        "Policy version of the last complete checkpoint", registry=r)
        self.checkpoint_failures = Counter("slipstream_checkpoint_failures",
                                           "Checkpoints that could not be written (disk full, not writable)",
                                           registry=r)
        self.checkpoint_pause_seconds = Gauge(
            "slipstream_checkpoint_pause_seconds", "Seconds the last checkpoint held up training (policy "
            "saved, the other tensors copied to host memory; the rest is written beside training)",
            registry=r)
        self.checkpoint_load_seconds = Gauge("slipstream_checkpoint_load_seconds",
                                             "Seconds the resume took to verify and apply its checkpoint",
                                             registry=r)
        # ---- rollout log (learner.state.rollout_log.LearnerRolloutLog; 0 when there is none) ----
        self.rollout_log_bytes = Counter("slipstream_rollout_log_bytes", "Bytes appended to the rollout log",
                                         registry=r)
        self.rollout_log_failures = Counter(
            "slipstream_rollout_log_failures", "Results not acknowledged because the rollout log write failed",
            registry=r)
        self.rollout_log_restored = Counter(
            "slipstream_rollout_log_restored_samples",
            "Samples put back into the buffer from the rollout log at a resume", registry=r)
        self.eval_reward_mean.set(float("nan"))
        self.eval_accuracy.set(float("nan"))
        self.eval_version.set(-1)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus exposition of this registry (what ``/metrics`` answers)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (0 when it was never set): for status replies and tests."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0


class JsonlLog:
    """Append one JSON object per line (flushed) to ``run_dir/metrics.jsonl``."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()
