"""What the buffer hands out: the status of a put and a training batch."""

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

    @property
    def max_staleness_seen(self) -> int:
        return max(self.staleness, default=0)
