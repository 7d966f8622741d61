"""What the buffer hands out: the status of a put, a training batch, and the names of its counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from protocol import ACK_STATUSES, Sample


class AckStatus(str, Enum):
    """Per-sample answer to a result, sent back in ``protocol.Ack`` (values = ``ACK_STATUSES``).

    Every status is final: the server forgets the sample and never re-sends it.
    """

    ACCEPTED = "accepted"    # buffered (or, for a failed sample, counted as failed)
    DUPLICATE = "duplicate"  # already have it, or its assignment is finished
    STALE = "stale"          # over max_staleness under stale_policy="drop": discarded, counted
    INVALID = "invalid"      # fails a check protocol cannot make (unknown assignment, ...)

    def __str__(self) -> str:
        return self.value


assert tuple(s.value for s in AckStatus) == ACK_STATUSES


@dataclass(slots=True)
class Batch:
    """One training batch: whole groups, each contiguous and in ``group_index`` order.

    ``staleness[i]`` is ``version − min(token_versions)`` of ``samples[i]`` (0 for a sample
    without tokens); ``needs_correction[i]`` is True when that exceeds ``max_staleness`` (only
    possible under ``stale_policy="correct"``): the learner trains it with importance correction.
    """

    samples: list[Sample]
    version: int
    staleness: list[int] = field(default_factory=list)
    needs_correction: list[bool] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    uniform_dropped: int = 0
    """Groups dynamic sampling dropped (every reward equal) since the batch before this one."""

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def groups(self) -> list[list[Sample]]:
        """The samples cut into their groups."""
        out, i = [], 0
        for n in self.group_sizes:
            out.append(self.samples[i:i + n])
            i += n
        return out

    @property
    def num_tokens(self) -> int:
        """Prompt plus completion tokens over the batch."""
        return sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in self.samples)


COUNTER_NAMES = ("issued", "reissued", "accepted", "duplicate", "stale", "invalid", "expired",
                 "released", "preempted", "failed", "cancelled", "abandoned", "dropped_stale",
                 "dropped_incomplete", "dropped_uniform", "consumed", "corrected", "batches", "stale_late",
                 "failed_reported")
"""The counters of :attr:`buffer.RolloutBuffer.counters` (a copy; all in samples but ``batches``)::

    issued, reissued         samples handed out / handed out again
    accepted, duplicate,     acknowledgements, one per put (accepted includes failed samples)
      stale, invalid
    expired, released        samples whose lease was lost to its deadline (or a learner
                             restart) / because its holder left or gave it back (it refused
                             the assignment, or the learner refused a sample of it)
    preempted                samples whose lease was taken from a silent holder for re-issue
                             (no attempt used up: LeaseTable.preempt_holder)
    failed                   samples reported failed + samples never returned after the last attempt
    cancelled                in-flight samples of assignments cancelled by the caller
    abandoned                in-flight samples whose group was dropped before they arrived
    dropped_stale            accepted samples later dropped for staleness
    dropped_incomplete       accepted samples dropped because their group cannot complete
    dropped_uniform          accepted samples of complete groups whose rewards were all equal,
                             dropped by dynamic sampling (``drop_uniform_groups``)
    consumed, corrected      samples trained / trained with needs_correction
    batches                  batches handed out
    stale_late               stale acks for samples of a group already dropped for staleness
                             (their slots were counted abandoned when it was dropped)
    failed_reported          samples a server reported failed (also in accepted and failed)

``counters`` adds ``stale_dropped`` = stale + dropped_stale (every sample discarded for staleness).

Conservation: ``accepted == consumed + pending_samples + dropped_stale + dropped_incomplete +
dropped_uniform``;
and every issued slot ends once: ``issued == accepted + (stale - stale_late) + abandoned +
(failed - failed_reported) + cancelled + inflight_samples`` (re-issues move no slot).
"""
