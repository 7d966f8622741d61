"""What the learner writes down about each step: ``metrics.jsonl`` rows (steps and evaluation
rounds), ``trained_ids.jsonl``, the other metric sinks (learner.serve.sinks), the step gauges,
the seeds' sanity check and the adaptive staleness controller's decision.

:class:`StepRecords` is handed the parts it reads (metrics, event log, run state, buffer,
admission) and the ``algorithm`` section (read at use time), never the whole config.

Every row is written whole or not at all (:class:`learner.metrics.JsonlLog`). A row that cannot be
written (a full run-directory disk, ``ENOSPC``) never ends the train loop: the first of a streak
is a ``record_failed`` event, ``on_write_failure`` (when given) decides whether the run stops, and
the first row written again is a ``record_recovered`` event saying how many were lost. A torn
last line an earlier life left is cut off at open, with a ``record_torn`` warning.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from buffer import Batch, RolloutBuffer, StalenessDecision
from learner.metrics import JsonlLog, LearnerMetrics
from learner.serve.sinks import open_sinks
from learner.state.run_state import RunState
from protocol import DATASET_KEY


class StepRecords:
    def __init__(self, *, run: RunState, metrics: LearnerMetrics, log, buffer: RolloutBuffer,
                 admission, algorithm: Any, clock: Callable[[], float],
                 on_write_failure: Callable[[OSError], str] | None = None):
        self.run, self.metrics, self.log, self.buffer, self.admission = run, metrics, log, buffer, admission
        self.algorithm, self.clock = algorithm, clock
        """The ``learner.algorithm`` section: the sanity check's tolerances, read at use."""
        self.jsonl: JsonlLog | None = None
        self.trained_ids: JsonlLog | None = None
        self.sinks: list = []
        self.on_write_failure = on_write_failure
        """Called at the first failed write of a streak; returns what happens now (the event's
        ``action``), e.g. learner.state.learner_checkpoints.LearnerCheckpoints.write_failed,
        which applies ``checkpoint_failure``. None: training goes on."""
        self.lost: dict[str, int] = {}        # file name -> rows lost in its current failing streak
        self._stat_children: dict[str, object] = {}   # slipstream_train_stat{name} children

    def open(self, run_dir: Path, sinks: list[str], config: dict | None = None) -> None:
        self.jsonl = self._open(run_dir / "metrics.jsonl")
        self.sinks = open_sinks(sinks, run_dir, self.run.run_id, config)
        self.trained_ids = self._open(run_dir / "trained_ids.jsonl")

    def _open(self, path: Path) -> JsonlLog:
        f = JsonlLog(path)
        if f.torn:
            self.log("record_torn", level="warning", file=str(path), bytes=len(f.torn),
                     line=f.torn[:80].decode(errors="replace"),
                     action="cut off: a write that never finished (a crash, a kill or a full disk)")
        return f

    def _append(self, f: JsonlLog, record: dict) -> None:
        """One row into ``f``; a failure is an event (the first of a streak), never an error."""
        name = f.path.name
        try:
            f.write(record)
        except OSError as e:
            lost = self.lost.get(name, 0)
            self.lost[name] = lost + 1
            if lost == 0:
                action = (self.on_write_failure(e) if self.on_write_failure is not None
                          else "training goes on without this file's rows until it can be written")
                self.log("record_failed", level="error", file=str(f.path),
                         error=f"{type(e).__name__}: {e}"[:300],
                         errno=errno.errorcode.get(e.errno or -1), action=action,
                         hint="free disk space in the run directory (learner.run_dir)")
            return
        lost = self.lost.pop(name, 0)
        if lost:
            self.log("record_recovered", file=str(f.path), lost=lost)

    def close(self) -> None:
        for f in (self.jsonl, *self.sinks, self.trained_ids):
            if f is not None:
                f.close()
        self.jsonl, self.sinks, self.trained_ids = None, [], None

    # ---- rows ----------------------------------------------------------------------------------
    def eval_round(self, row: dict) -> None:
        """One metrics.jsonl row per complete evaluation round (learner.data.evaluation)."""
        self._append(self.jsonl, {"run_id": self.run.run_id, "kind": "eval", "step": row["eval_version"],
                                  "version": row["eval_version"], "time": self.clock(), **row})

    def control(self, change: dict) -> None:
        """A metrics.jsonl row per live setting changed with ``ctl set`` (the report marks it at
        its step): ``kind: control``, the key, the new and the previous value (none before
        :meth:`open`)."""
        if self.jsonl is None:
            return
        self._append(self.jsonl, {"run_id": self.run.run_id, "kind": "control", "step": self.run.version,
                                  "version": self.run.version, "time": self.clock(),
                                  **{k: change.get(k) for k in ("key", "value", "previous", "takes_effect")}})

    def trained(self, batch: Batch) -> None:
        """trained_ids.jsonl: the sample ids of every applied step, one line per step (an audit
        that nothing was trained twice; a few KiB per step). A line lost to a full disk costs the
        audit only: a resume restores no sample its checkpoint had seen (learner.state.rollout_log),
        and steps past the checkpoint are rolled back anyway."""
        self._append(self.trained_ids, {"run_id": self.run.run_id, "trained_on_version": self.run.version,
                                        "sample_ids": [s.sample_id for s in batch.samples]})

    def skipped(self, batch: Batch, reason: str) -> None:
        """A step that applied nothing (a non-finite loss or gradient): the version stays, nothing
        is published; the step is counted and its samples named in the event log. The samples were
        taken from the buffer but not trained, so their capacity goes back to the staleness gate,
        as dropped work's does (else, with max_staleness 0, the gate would never open again)."""
        self.buffer.untrained(batch)
        self.metrics.skipped_steps.inc()
        self.log("step_skipped", reason=reason, trained_on_version=self.run.version,
                 samples=len(batch.samples), sample_ids=[s.sample_id for s in batch.samples])

    def idle_stats(self, idle_s: float, cycle_s: float) -> dict[str, float]:
        """Where the time went (verl's fully-async idle ratios): the fraction of this step's cycle
        (batch wait + step + publish wait) the train loop waited for samples, and the mean of the
        servers' engine idle fractions from their last heartbeats (waiting for work or weights)."""
        ratio = idle_s / cycle_s if cycle_s > 0 else 0.0
        self.metrics.learner_idle_ratio.set(ratio)
        return {"learner_idle_s": idle_s, "learner_idle_ratio": ratio,
                "rollout_idle_ratio": self.admission.rollout_idle_ratio()}

    def batch_versions(self, batch: Batch) -> dict[str, float]:
        """The version trained on and the oldest and newest token version in ``batch`` (a
        sample without tokens counts as -1 for the oldest, 0 for the newest). One concatenation
        and two reductions: two reductions per sample were 0.6 ms of each step's bookkeeping."""
        versions = [s.token_versions for s in batch.samples]
        every = np.concatenate(versions) if versions else np.zeros(0, np.int32)
        empty = any(len(v) == 0 for v in versions)
        oldest = -1 if empty or not len(every) else int(every.min())
        out = {"trained_on_version": float(self.run.version),
               "token_version_min": float(oldest),
               "token_version_max": float(every.max(initial=0))}
        if self.buffer.drop_uniform_groups:          # dynamic sampling: groups dropped before it
            out["dynamic_sampling_dropped_groups"] = float(batch.uniform_dropped)
        return out

    def batch_datasets(self, batch: Batch) -> dict[str, float]:
        """Per dataset of a mixture (learner.data.datasets; the intake stamps each sample's):
        ``dataset_reward_mean/NAME`` and ``dataset_samples/NAME`` of the batch, and the gauge
        ``slipstream_dataset_reward_mean{dataset}``; nothing without a mixture."""
        rewards: dict[str, list[float]] = {}
        for s in batch.samples:
            name = s.metadata.get(DATASET_KEY) if s.metadata else None
            if name is not None:
                rewards.setdefault(str(name), []).append(s.reward)
        out: dict[str, float] = {}
        for name, values in sorted(rewards.items()):
            mean = float(np.mean(values))
            out[f"dataset_reward_mean/{name}"] = mean
            out[f"dataset_samples/{name}"] = float(len(values))
            self.metrics.dataset_reward_mean.labels(dataset=name).set(mean)
        return out

    def step(self, stats: dict[str, float]) -> None:
        """A trained step: its gauges, the sanity check, the rows and the event."""
        m, version = self.metrics, self.run.version
        m.policy_version.set(version)
        m.step_seconds.observe(stats["step_s"])
        m.reward_mean.set(stats["reward_mean"])
        m.staleness_mean.set(stats["staleness_mean"])
        children = self._stat_children        # labels() takes a lock and builds a key per call
        for k, v in stats.items():
            child = children.get(k)
            if child is None:
                child = children[k] = m.step_stats.labels(name=k)
            child.set(v)
        self.sanity(stats)
        record = {"run_id": self.run.run_id, "step": version, "version": version,
                  "time": self.clock(), **stats,
                  "server_versions": {s.server_id: s.version for s in self.admission.servers.values()}}
        self._append(self.jsonl, record)
        for sink in self.sinks:
            sink.write(record)
        self.log("step", **{k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()
                            if k not in ("version", "time")})

    def staleness_changed(self, decision: StalenessDecision | None, stats: dict[str, float],
                          bound: int) -> None:
        """η's adaptive controller moved η after a step (``staleness.controller: adaptive``,
        buffer.staleness; ``bound``: the operator's max_staleness): an event and a metric."""
        if decision is None:
            return
        self.metrics.staleness_limit.set(decision.eta)
        self.metrics.staleness_changes.labels(reason=decision.reason).inc()
        self.log("staleness_changed", previous=decision.previous, value=decision.eta,
                 reason=decision.reason, is_ess_ratio=stats.get("is_ess_ratio"),
                 mismatch_kl=stats.get("mismatch_kl"), bound=bound)

    def sanity(self, stats: dict[str, float]) -> None:
        """The seeds' sanity check (learner.train.trainer): gauges (NaN when not applicable this
        step) and a warning event when it failed."""
        m = self.metrics
        applicable = bool(stats.get("sanity_applicable")) and "sanity_ratio_dev_max" in stats
        nan = float("nan")
        m.sanity_ratio_dev_mean.set(stats["sanity_ratio_dev_mean"] if applicable else nan)
        m.sanity_ratio_dev_max.set(stats["sanity_ratio_dev_max"] if applicable else nan)
        m.sanity_kl.set(stats["sanity_kl"] if applicable else nan)
        if applicable and stats.get("sanity_failed"):
            m.sanity_failures.inc()
            ratio_tolerance = self.algorithm.sanity_ratio_tolerance
            kl_tolerance = self.algorithm.sanity_kl_tolerance
            self.log("sanity_check_failed", level="warning",
                     ratio_dev_max=stats["sanity_ratio_dev_max"],
                     ratio_dev_mean=stats["sanity_ratio_dev_mean"], kl=stats["sanity_kl"],
                     ratio_tolerance=ratio_tolerance, kl_tolerance=kl_tolerance,
                     hint="the proximal pass and the gradient forward differ: dropout on, or "
                          "padding handled differently")
