"""Groups: the samples of one assignment, and which complete groups make the next batch.

A group is the ``group_size`` samples of one assignment (one prompt); GRPO/RLOO need the whole
group, so groups are never split. A group leaves the buffer as a whole: trained, or dropped when
one member is over the staleness limit under ``drop``, or when it cannot be completed (a member
reported ``failed``, the lease ran out of attempts, or it was cancelled). A failed member drops
the whole group rather than shrinking it: failures are rarely independent of the outcome (a
reward function that times out on long answers removes mostly low-reward samples), and a
group-relative baseline over the survivors would be biased upward; and batches keep a fixed
shape. :class:`buffer.RolloutBuffer` decides when a group closes; this module holds its slots and
chooses batches.

Selection (:func:`select_groups`), over the complete groups in completion order:

- the oldest ``batch_samples / group_size`` groups;
- with ``length_bucketing`` (``learner.batch.length_bucketing``): first the groups that would be over the limit at the next
  version (staleness already == η), oldest first; then the oldest group (so nothing starves);
  then the groups closest to it in length (longest sample, in tokens). The batch keeps them in
  completion order;
- when the prompts carry a length bucket (``learner.data.length_buckets``: the assignment's
  ``protocol.BUCKET_KEY``), :func:`select_bucket`: a batch is the groups of one bucket; the
  buffer waits for one to fill, unless none can (see ``RolloutBuffer.poll_batch``).

Staleness (docs/design.md §3) of a sample in a batch at learner version ``v``:
``v − min(token_versions)``, 0 without tokens; a group's is that of its oldest member.
"""

from __future__ import annotations

import sys
from collections import deque

from buffer.records import Batch
from protocol import Sample

NO_TOKENS = sys.maxsize          # min_version of a group none of whose samples has a token


class Group:
    """The samples of one assignment, by group_index. ``resolved`` slots are no longer in flight."""

    __slots__ = ("assignment_id", "size", "slots", "mins", "filled", "resolved", "min_version",
                 "max_len", "ready", "bucket")

    def __init__(self, assignment_id: str, size: int, bucket: int | None = None):
        self.assignment_id = assignment_id
        self.bucket = bucket                     # its prompt's length bucket (learner.data.length_buckets)
        self.size = size
        self.slots: list[Sample | None] = [None] * size
        self.mins: list[int] = [-1] * size      # min token version per slot (-1: no tokens)
        self.filled = 0
        self.resolved = 0
        self.min_version = NO_TOKENS
        self.max_len = 0                         # longest filled sample, in tokens
        self.ready = False

    def staleness(self, version: int) -> int:
        return 0 if self.min_version == NO_TOKENS else version - self.min_version

    def fill(self, gi: int, s: Sample, mv: int) -> None:
        """Put sample ``s`` (min token version ``mv``, -1 without tokens) in the empty slot ``gi``."""
        self.slots[gi] = s
        self.mins[gi] = mv
        if 0 <= mv < self.min_version:
            self.min_version = mv
        length = len(s.prompt_token_ids) + len(s.token_versions)
        if length > self.max_len:
            self.max_len = length
        self.filled += 1


def select_groups(ready: deque[Group], version: int, eta: int, batch_groups: int,
                  length_bucketing: bool) -> list[Group]:
    """Take one batch's ``batch_groups`` groups out of ``ready`` (complete groups, oldest first),
    in batch order; see the module doc for ``length_bucketing``. The caller checks that a batch
    is ready."""
    k = batch_groups
    if not length_bucketing or len(ready) == k:
        return [ready.popleft() for _ in range(k)]
    groups = list(ready)
    urgent = [i for i, g in enumerate(groups) if g.staleness(version) >= eta]
    take: list[int] = []
    for i in urgent + [0]:
        if len(take) < k and i not in take:
            take.append(i)
    anchor = groups[take[0]].max_len
    rest = sorted((i for i in range(len(groups)) if i not in take),
                  key=lambda i: (abs(groups[i].max_len - anchor), i))
    take += rest[:k - len(take)]
    chosen_set = set(take)
    ready.clear()
    ready.extend(g for i, g in enumerate(groups) if i not in chosen_set)
    return [groups[i] for i in sorted(take)]


def select_bucket(ready: deque[Group], version: int, eta: int, batch_groups: int) -> list[Group] | None:
    """One batch of ``batch_groups`` groups of one length bucket out of ``ready``, or None when no
    bucket has that many ready. The bucket is that of the most urgent ready group (staleness
    already == η) among the buckets that can fill a batch, else that of the oldest such group;
    within it, its urgent groups first, then the oldest. The batch keeps completion order."""
    groups = list(ready)
    members: dict[int | None, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g.bucket, []).append(i)
    full = {b: idx for b, idx in members.items() if len(idx) >= batch_groups}
    if not full:
        return None
    candidates = sorted(i for idx in full.values() for i in idx)
    urgent = [i for i in candidates if groups[i].staleness(version) >= eta]
    bucket = groups[(urgent or candidates)[0]].bucket
    take = sorted(full[bucket], key=lambda i: (groups[i].staleness(version) < eta, i))[:batch_groups]
    chosen = set(take)
    ready.clear()
    ready.extend(g for i, g in enumerate(groups) if i not in chosen)
    return [groups[i] for i in sorted(take)]


def assemble_batch(groups: list[Group], version: int, eta: int) -> Batch:
    """The batch of complete ``groups`` at learner version ``version``: each sample's staleness,
    and ``needs_correction`` where it is over ``eta``."""
    samples: list[Sample] = []
    staleness: list[int] = []
    flags: list[bool] = []
    for g in groups:
        samples.extend(g.slots)  # type: ignore[arg-type]   (a complete group has no empty slot)
        for mv in g.mins:
            st = version - mv if mv >= 0 else 0
            staleness.append(st)
            flags.append(st > eta)
    return Batch(samples, version, staleness, flags, [g.size for g in groups])
