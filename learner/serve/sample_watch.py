"""Failed and refused samples: counted, shown, and the run stopped when nothing valid arrives.

A reward that always fails makes every sample of every server arrive ``failed``; a reward out of
range makes every one ``invalid``. Each group then closes untrained, its capacity comes back, new
prompts go out — the learner issues and abandons work at full speed, trains nothing, and without
this module said nothing and never stopped. Here, for every result the intake received
(:meth:`SampleWatch.observe`):

- **counted**: failed samples by the reason their server gave (:func:`failure_reason`: ``reward``,
  ``reward_timeout``, ``generate``, ``other``) in ``slipstream_samples_failed_total{reason}``;
  invalid ones are counted by the intake (``slipstream_samples_invalid_total{reason}``);
- **shown**: a ``samples_refused`` warning event at most every :data:`REPORT_EVERY_S` while bad
  samples keep coming (totals by reason, how many since the last valid one, the bad share of the
  window, the last error); ``ctl status`` (``refused_samples``: :meth:`SampleWatch.status`) and
  the gauge ``slipstream_valid_sample_age_seconds``;
- **stopped**: once no valid sample has arrived for ``no_valid_sample_timeout_s`` while bad ones
  kept arriving, or once more than ``max_refused_share`` of the last ``refused_share_window``
  samples were bad: ``on_stop(reason)`` with a one-line reason (the service logs it as a
  ``no_valid_samples`` error event, prints it on stderr, stops as for ``ctl stop`` and exits with
  :data:`EXIT_NO_VALID_SAMPLES`); also when dynamic sampling (``learner.batch.dynamic_sampling``)
  has dropped ``dynamic_sampling_max_drops`` groups in a row, all rewards equal in each, without a
  batch (:meth:`SampleWatch.uniform`): valid samples, none worth training on.

The time is measured from the first bad sample after the last valid one (or after the start), and
only a bad sample's arrival can end the run: a learner that waits for servers, or whose step
takes long, is waiting, not failing. "Valid" is acked ``accepted`` and not ``failed``; "bad" is
``failed`` or ``invalid``; duplicates and stale samples are neither (they are normal under
re-issue and η).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from learner.metrics import LearnerMetrics

EXIT_NO_VALID_SAMPLES = 5
"""Exit code of a learner stopped because no valid sample arrived (see the module docstring)."""
REPORT_EVERY_S = 5.0
"""At most one ``samples_refused`` event this often."""
FAILURE_REASONS = ("reward", "reward_timeout", "generate", "other")


def failure_reason(failed: str) -> str:
    """The metric label of a ``Sample.failed`` text as rollout servers write it
    (``reward NAME: timed out after ...``, ``reward NAME: TypeError: ...``, ``generate: ...``)."""
    if failed.startswith("reward"):
        return "reward_timeout" if ": timed out after " in failed else "reward"
    if failed.startswith("generate"):
        return "generate"
    return "other"


class SampleWatch:
    """See the module docstring. ``servers``: the ``learner.servers`` section, whose
    ``no_valid_sample_timeout_s``, ``max_refused_share`` and ``refused_share_window`` are read at
    use; ``on_stop(reason)`` is called once."""

    def __init__(self, *, metrics: LearnerMetrics, on_stop: Callable[[str], None],
                 servers: Any, batch: Any = None, log: Callable[..., None] = lambda event, **fields: None,
                 clock: Callable[[], float] = time.monotonic):
        self.metrics, self.on_stop, self.log, self.clock = metrics, on_stop, log, clock
        self.settings = servers
        self.batch = batch                             # learner.batch (dynamic_sampling_max_drops)
        self.failed: Counter[str] = Counter()          # reason -> samples reported failed
        self.invalid = 0                               # samples acked invalid
        self.valid = 0
        self.last_valid: float | None = None           # clock of the last valid sample
        self.bad_since: float | None = None            # first bad sample after the last valid one
        self.bad_streak = 0                            # bad samples since the last valid one
        self.last_error = ""
        # The last refused_share_window outcomes as runs [bad, count], their length and bad count.
        self._runs: deque[list] = deque()
        self._recent = self._recent_bad = 0
        self._reported = float("-inf")
        self._unreported = 0
        self.stopped: str | None = None
        self._children = {r: metrics.samples_failed.labels(reason=r) for r in FAILURE_REASONS}
        metrics.valid_sample_age.set_function(self.valid_age)

    def valid_age(self) -> float:
        """Seconds since the last valid sample (NaN before the first)."""
        return math.nan if self.last_valid is None else self.clock() - self.last_valid

    def observe(self, valid: int, failed: list[str], invalid: int, error: str = "") -> None:
        """One result's outcome: ``valid`` samples, the ``failed`` texts of failed ones, ``invalid``
        refused ones (``error``: why the first was refused)."""
        now = self.clock()
        bad = len(failed) + invalid
        if failed:
            for text in failed:
                self._children[failure_reason(text)].inc()
                self.failed[failure_reason(text)] += 1
            error = error or failed[-1]
        if valid:
            self.valid += valid
            self.last_valid = now
            self.bad_since, self.bad_streak = None, 0
        self._window(valid, bad)
        if not bad:
            return
        self.invalid += invalid
        self.last_error = error[:500] or self.last_error
        if not valid:
            self.bad_streak += bad
            if self.bad_since is None:
                self.bad_since = now
        self._unreported += bad
        if now - self._reported >= REPORT_EVERY_S:
            self._report(now)
        self._check(now)

    def _window(self, valid: int, bad: int) -> None:
        """Keep the last ``refused_share_window`` outcomes (as runs) and their bad count."""
        runs = self._runs
        for flag, n in ((False, valid), (True, bad)):
            if n:
                if runs and runs[-1][0] is flag:
                    runs[-1][1] += n
                else:
                    runs.append([flag, n])
                self._recent += n
                self._recent_bad += n if flag else 0
        excess = self._recent - max(1, int(self.settings.refused_share_window))
        while excess > 0:
            head = runs[0]
            take = min(excess, head[1])
            head[1] -= take
            self._recent -= take
            self._recent_bad -= take if head[0] else 0
            excess -= take
            if not head[1]:
                runs.popleft()

    def share(self) -> float:
        """Bad samples over the samples of the window (0 when empty)."""
        return self._recent_bad / self._recent if self._recent else 0.0

    def _report(self, now: float) -> None:
        self.log("samples_refused", level="warning", new=self._unreported, failed=dict(self.failed),
                 invalid=self.invalid, since_valid=self.bad_streak,
                 share=round(self.share(), 4), last_error=self.last_error,
                 hint="rollout servers return failed or refused samples (their reward?); the run "
                      "stops after learner.servers.no_valid_sample_timeout_s without a valid one")
        self._reported, self._unreported = now, 0

    def _check(self, now: float) -> None:
        if self.stopped is not None:
            return
        timeout, reason = self.settings.no_valid_sample_timeout_s, None
        if timeout and self.bad_since is not None and now - self.bad_since >= timeout:
            reason = (f"no valid sample for {now - self.bad_since:.0f} s "
                      f"(learner.servers.no_valid_sample_timeout_s {timeout:g}): "
                      f"{self.bad_streak} failed or refused since")
        else:
            limit, size = self.settings.max_refused_share, max(1, int(self.settings.refused_share_window))
            if limit < 1 and self._recent >= size and self.share() > limit:
                reason = (f"{self.share():.0%} of the last {size} samples failed or were refused "
                          f"(learner.servers.max_refused_share {limit:g})")
        if reason is None:
            return
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.failed.items()))
        if self.invalid:
            reasons = ", ".join(filter(None, [reasons, f"invalid {self.invalid}"]))
        self.stopped = f"{reason} [{reasons}]; last error: {self.last_error}"
        self._report(now)
        self.on_stop(self.stopped)

    def uniform(self, streak: int) -> None:
        """Dynamic sampling has dropped ``streak`` groups in a row (all rewards equal in each)
        since the last batch: stop at ``learner.batch.dynamic_sampling_max_drops``."""
        limit = 0 if self.batch is None else self.batch.dynamic_sampling_max_drops
        if self.stopped is not None or not limit or streak < limit:
            return
        self.stopped = (f"dynamic sampling dropped {streak} groups in a row without a batch "
                        f"(learner.batch.dynamic_sampling_max_drops {limit}): every completion of each "
                        "prompt got the same reward; check the reward, or set "
                        "learner.batch.dynamic_sampling: false")
        self.log("samples_uniform", level="error", dropped_groups=streak, limit=limit)
        self.on_stop(self.stopped)

    def status(self) -> dict[str, Any]:
        """For ``ctl status``: totals, the streak since the last valid sample, the window's share."""
        age = self.valid_age()
        return {"failed": dict(self.failed), "invalid": self.invalid, "valid": self.valid,
                "since_valid": self.bad_streak,
                "valid_age_s": None if math.isnan(age) else round(age, 3),
                "share": round(self.share(), 4), "last_error": self.last_error,
                "stopped": self.stopped}
