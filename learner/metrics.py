"""Prometheus metrics of the learner, and the metrics.jsonl log of every policy step.

Served by :class:`protocol.plumbing.http.HttpEndpoint` (``/metrics`` and ``/healthz``) from the learner's
own registry. Labels are bounded: socket names, ack statuses, refusal reasons, server ids.

Every metric the learner process exposes is defined here, in :class:`LearnerMetrics` (one home:
names, help texts, labels and buckets in one place); the components take this object and update
its metrics (``tests/test_metrics_home.py`` fails on a definition anywhere else in ``learner/``).
"""

from __future__ import annotations

import itertools
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

from protocol import ACK_STATUSES

SOCKETS = ("rollout", "weights", "control")
"""The learner's ZeroMQ sockets (the ``socket`` label)."""
SERVER_ERROR_CODES = ("assignment_refused", "protocol_error", "weights_failed")
"""Errors a rollout server reports to the learner (``slipstream_server_errors_total{code}``)."""


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
        self.connections_cut = Counter(
            "slipstream_connections_cut", "Connections the learner ended because a peer's "
            "unfinished message was over the socket's max message bytes (too_large) or open too "
            "long (open_too_long), protocol.plumbing.unfinished", ["socket", "reason"], registry=r)
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
        self.weights_checksum_mismatch = Counter(
            "slipstream_weights_checksum_mismatch", "WeightsApplied reports whose checksum was not the "
            "published one (the server gets no work until it applies the newest version rightly)",
            registry=r)
        self.servers_unverified = Gauge(
            "slipstream_rollout_servers_unverified", "Rollout servers held from dispatch since they "
            "reported weights with a wrong checksum", registry=r)
        self.servers_lost = Counter("slipstream_rollout_servers_lost",
                                    "Rollout servers dropped (timed out or unreachable)", ["reason"],
                                    registry=r)
        # ---- fleets and failing rewards (learner.serve.admission, learner.serve.sample_watch) ----
        self.servers_refused = Counter(
            "slipstream_rollout_servers_refused", "Hellos refused (too_many_servers: "
            "servers.max_servers reached; duplicate_server_id), by reason", ["reason"], registry=r)
        self.leases_preempted = Counter(
            "slipstream_leases_preempted", "Leases taken from a rollout server that returned nothing "
            "for silent_factor x its expected completion time while others waited for work "
            "(re-issued without using an attempt)", registry=r)
        self.leases_released = Counter(
            "slipstream_leases_released", "Leases released for re-issue at once (invalid: the "
            "learner refused a sample of it; assignment_refused: the server refused it), by reason",
            ["reason"], registry=r)
        self.samples_failed = Counter(
            "slipstream_samples_failed", "Samples the rollout servers reported failed (reward: the "
            "reward raised or returned a non-finite value; reward_timeout; generate; other), by reason",
            ["reason"], registry=r)
        self.valid_sample_age = Gauge(
            "slipstream_valid_sample_age_seconds", "Seconds since the last valid sample arrived "
            "(accepted, not failed; NaN before the first)", registry=r)
        # The watchdog's view (protocol.plumbing.watchdog): 0 unless stalled.
        self.stalled_seconds = Gauge(
            "slipstream_stalled_seconds", "Seconds without progress while the watchdog counts the "
            "process stalled (0 otherwise)", ["process"], registry=r)
        self.waiting_on = Gauge(
            "slipstream_waiting_on", "1 for what a stalled process waits on (reason), 0 for the "
            "rest", ["process", "reason"], registry=r)
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
        self.dataset_reward_mean = Gauge(
            "slipstream_dataset_reward_mean", "Mean reward of the last batch's samples of each dataset "
            "of a mixture (learner.data.datasets; datasets without samples in it keep their value)",
            ["dataset"], registry=r)
        self.staleness_mean = Gauge("slipstream_staleness_mean",
                                    "Mean staleness (policy steps) of the last batch", registry=r)
        self.staleness_limit = Gauge("slipstream_max_staleness", "Current staleness limit eta", registry=r)
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
        self.version_skew = Gauge(
            "slipstream_rollout_version_skew", "Newest minus oldest version the connected rollout "
            "servers report as applied (0 with one server or none)", registry=r)
        self.weights_egress_bytes = Counter(
            "slipstream_weights_egress_bytes", "Weight chunk bytes the learner's weights socket "
            "sent (every server's fetches of every version)", registry=r)
        self.weights_chunks_served = Counter(
            "slipstream_weights_chunks_served", "Weight chunks the learner's weights socket sent, by "
            "encoding (raw: the chunk; delta: xor-zstd against the version the server holds)",
            ["encoding"], registry=r)
        for encoding in ("raw", "delta"):
            self.weights_chunks_served.labels(encoding=encoding)
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
        # The label sets known in advance are exposed at 0 from the start: a dashboard panel or
        # an alert on a counter that has not fired yet shows 0 (and rate() works), not "No data".
        for counter, labels in ((self.samples, {"status": ACK_STATUSES}),
                                (self.protocol_errors, {"socket": SOCKETS + ("http",)}),
                                (self.send_dropped, {"socket": SOCKETS, "reason": ("full", "unreachable")}),
                                (self.connections_cut, {"socket": SOCKETS, "reason": ("too_large", "open_too_long")}),
                                (self.server_errors, {"code": SERVER_ERROR_CODES}),
                                (self.servers_lost, {"reason": ("timeout", "unreachable", "restarted")})):
            for values in itertools.product(*labels.values()):
                counter.labels(**dict(zip(labels, values, strict=True)))

    # What components are handed to count with (bound methods, so no one passes a lambda).
    def watch_buffer(self, buffer) -> None:
        """The buffered and in-flight gauges read ``buffer`` at each scrape (setting them after
        every result would take two locks per message)."""
        self.buffered.set_function(lambda: buffer.pending_samples)
        self.inflight.set_function(lambda: buffer.inflight_samples)

    def http_error(self, status: int) -> None:
        """A malformed request on the /metrics + /healthz endpoint."""
        self.protocol_errors.labels(socket="http").inc()

    def denied(self, socket: str) -> None:
        """A client key CURVE refused on ``socket``."""
        self.auth_denied.labels(socket=socket).inc()

    def prompt_skipped(self, reason: str, n: int) -> None:
        """``n`` prompts left out of the stream (learner.data.prompts)."""
        self.prompts_skipped.labels(reason=reason).inc(n)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus exposition of this registry (what ``/metrics`` answers)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (0 when it was never set): for status replies and tests."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0


class JsonlLog:
    """An append-only file of JSON objects, one a line (``metrics.jsonl``, ``trained_ids.jsonl``):
    every record is on disk whole or not at all.

    Why (issue 31): a buffered text write cut short by a full disk, a kill or a crash left a torn
    line, and the next row was appended to it (one merged line, not JSON). So a record is built
    as one line first and handed to the kernel in one ``write`` on an unbuffered ``O_APPEND``
    file; a write that fails or stops short (``ENOSPC``) is cut back to the size before it and
    raised, for the caller to decide (learner.serve.step_records: an event, then go on or stop). The
    torn last line an earlier life left (not a JSON object: a crash mid-write, zeros after a power
    loss) is cut off at open, so it never ends up in the middle: :attr:`torn` holds its bytes.
    :meth:`read` skips a torn last line the same way and refuses a bad line anywhere else.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "ab", buffering=0)   # O_APPEND, one write(2) per write()
        self.size = self.file.seek(0, 2)
        self._cut_failed = False
        self.torn = self._repair_tail()
        """The torn last line cut off at open (b"" when the file ended with a whole record)."""

    def write(self, record: dict) -> None:
        """Append ``record`` whole; OSError (the file is as before) when it cannot be."""
        line = (json.dumps(record) + "\n").encode()
        if self._cut_failed:                  # a failed write's tail is still there: not after it
            self._cut_back()
        done = 0
        try:
            while done < len(line):           # a short write is continued once: it raises ENOSPC
                n = self.file.write(memoryview(line)[done:])
                if not n:
                    raise OSError(f"{self.path}: the write took no bytes")
                done += n
        except OSError:
            self._cut_failed = True
            self._cut_back(quiet=True)
            raise
        self.size += done

    def close(self) -> None:
        self.file.close()

    def _cut_back(self, quiet: bool = False) -> None:
        """Truncate to the size after the last whole record (a full disk frees what it took)."""
        try:
            self.file.truncate(self.size)
        except OSError:
            if not quiet:
                raise
        else:
            self._cut_failed = False

    def _repair_tail(self) -> bytes:
        start, last = self._last_line(self.path, self.size)
        if not last or (self._parse(last) is not None and last.endswith(b"\n")):
            return b""
        if self._parse(last) is not None:     # a whole object short of its newline: end it
            try:
                self.file.write(b"\n")
                self.size += 1
                return b""
            except OSError:
                pass
        self.size = start
        self.file.truncate(start)
        return last

    @staticmethod
    def _last_line(path: Path, size: int, chunk: int = 1 << 16) -> tuple[int, bytes]:
        """(offset, bytes) of the last line of the first ``size`` bytes (its newline included)."""
        with open(path, "rb") as f:
            lo = size - 1                     # the last line's own newline is not its start
            while lo > 0:
                lo = max(0, lo - chunk)
                f.seek(lo)
                found = f.read(size - 1 - lo).rfind(b"\n")
                if found >= 0:
                    lo += found + 1
                    break
            lo = max(lo, 0)
            f.seek(lo)
            return lo, f.read(size - lo)

    @staticmethod
    def _parse(line: bytes) -> dict | None:
        try:
            record = json.loads(line)
        except ValueError:                    # (UnicodeDecodeError too)
            return None
        return record if isinstance(record, dict) else None

    @classmethod
    def read(cls, path: Path) -> tuple[list[dict], bytes]:
        """The records of ``path`` and its torn last line (b"" when none): a last line that is not
        a JSON object is left out (a write that never finished); ValueError naming the line for
        one anywhere else (the file was damaged, or merged by a writer before issue 31)."""
        lines = Path(path).read_bytes().split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()                       # the newline that ends the last record
        records = []
        for n, line in enumerate(lines, 1):
            record = cls._parse(line)
            if record is None:
                if n == len(lines):
                    return records, line
                raise ValueError(f"line {n} of {len(lines)} is not a JSON object "
                                 f"({line[:60]!r}{'...' if len(line) > 60 else ''})")
            records.append(record)
        return records, b""
