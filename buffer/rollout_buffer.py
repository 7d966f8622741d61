"""RolloutBuffer: assignments out, results in, whole groups out as training batches.

It ties together the staleness gate (:mod:`buffer.gate`), the lease table (:mod:`buffer.leases`)
and a bounded de-duplication memory (:mod:`buffer.dedupe`). One asyncio loop owns it; only
:meth:`RolloutBuffer.put` and :meth:`RolloutBuffer.next_batch` are coroutines, and they share one
``asyncio.Condition`` (notified when a group completes).

Delivery argument — nothing lost, nothing trained twice (docs/design.md §6):

- every sample slot ``(assignment_id, group_index)`` is filled at most once: the first result
  wins, every later copy (a re-send after reconnect, or the other server's answer to a re-issued
  assignment) is acknowledged ``duplicate``; sample ids are remembered too, and after a group is
  trained or dropped its assignment id is remembered, both for ``dedupe_window`` entries;
- every acknowledgement is final, so a server never re-sends an acknowledged sample;
- a lease that expires or whose holder leaves is re-issued (``max_attempts`` in all), so work is
  not lost to a dead server; a lease out of attempts is given up and counted ``failed``;
- the gate counts every slot exactly once as in flight, and releases it exactly once (accepted,
  failed, stale, or given up with its group): the gate cannot drift.

Groups (:mod:`buffer.groups`): a group is the ``group_size`` samples of one assignment, never
split; it leaves the buffer as a whole, trained or dropped (a member over the staleness limit
under ``drop``; a member reported ``failed``, acknowledged ``accepted`` and counted in
``failed``; its lease out of attempts; cancelled).

Staleness (docs/design.md §3): the staleness of a sample at learner version ``v`` is
``v − min(token_versions)`` (0 for a sample without tokens); a group's staleness is that of its
oldest member. Under ``stale_policy="drop"`` a group over the limit is dropped as soon as that
is known — when one of its results arrives, at the first ``capacity``/``next_batch`` call of a
new version, when η shrinks or the policy becomes ``drop`` — and its capacity returned; under
``"correct"`` it is kept and trained with ``needs_correction`` set on the samples over the limit.
Versions passed in only grow; a token newer than the learner's version makes a sample invalid.

Resume: :meth:`RolloutBuffer.state_dict` holds everything buffered, as plain data
(:mod:`buffer.plain`): the gate totals, the buffered samples, the leases and their payloads, the
de-duplication windows, the counters and the staleness histogram. The saved run's leases are lost
at a restart and reported by the next :meth:`RolloutBuffer.expire` (capacity kept for reissue,
or returned when out of attempts), so the gate neither leaks nor double-counts; a load checks
that the leases, the open groups and the gate's buffered count agree.
A buffer that sees a learner past version 0 without a checkpoint starts its gate with the history
of that many trained batches.

Counters: :data:`buffer.records.COUNTER_NAMES` says what each counts, in samples, and the
conservation equations they keep.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from buffer.dedupe import RecentKeys
from buffer.gate import StalenessGate
from buffer.groups import NO_TOKENS, Group, assemble_batch, select_bucket, select_groups
from buffer.leases import Lease, LeaseTable
from buffer.plain import from_plain, pack_payload, to_plain, unpack_payload
from buffer.records import COUNTER_NAMES, AckStatus, Batch
from buffer.staleness import StalenessLimit
from protocol import BUCKET_KEY, Sample

STATE_FORMAT = 2         # the checkpoint's layout; 2: samples stored in protocol 2.0 wire form

STALE_POLICIES = ("drop", "correct")
BUCKET_REPOLL_S = 1.0
"""With length buckets, a waiting ``next_batch`` looks again this often: the buckets can get stuck
(``RolloutBuffer._bucket_stuck``) without a group completing, when a failure closes one."""

_min = np.minimum.reduce         # ndarray.min without its Python-level wrapper (hot path)

_ACCEPTED, _DUPLICATE, _STALE, _INVALID = (AckStatus.ACCEPTED, AckStatus.DUPLICATE, AckStatus.STALE,
                                           AckStatus.INVALID)


class RolloutBuffer:
    """Staleness gate + leases + group assembly + batching, for one learner (see module doc).

    Args:
        batch_samples: samples per training batch (B of the gate rule); a multiple of group_size.
        group_size: completions per prompt; every assignment asks for exactly this many.
        max_staleness: η, in policy steps (0 = strict on-policy), or its owner
            (:class:`buffer.staleness.StalenessLimit`, which the learner shares with ctl and
            the adaptive controller); set it there.
        stale_policy: "drop" (default) or "correct".
        max_inflight: optional cap on samples in flight at once (any number of servers).
        lease_timeout_s: seconds without a result before a lease is lost and re-issued.
        max_attempts: issues of one assignment before it is given up and counted failed.
        dedupe_window: sample ids and finished assignment ids remembered (each); make it larger
            than the samples buffered plus in flight.
        length_bucketing: when more than a batch is ready, pick groups of similar length, the
            urgent and the oldest first (:func:`buffer.groups.select_groups`).
        drop_uniform_groups: DAPO's dynamic sampling: a group that completes with every reward
            equal (its group advantages are all 0: it teaches nothing) is dropped, its capacity
            returned, so more work is issued in its place (``dropped_uniform``; settable at
            runtime).
        clock: monotonic seconds, for lease deadlines.
    """

    def __init__(self, batch_samples: int, group_size: int, max_staleness: int | StalenessLimit = 1,
                 stale_policy: str = "drop", max_inflight: int | None = None,
                 lease_timeout_s: float = 600.0, max_attempts: int = 3, dedupe_window: int = 100_000,
                 length_bucketing: bool = False, drop_uniform_groups: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        if type(group_size) is not int or group_size < 1:
            raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
        if type(batch_samples) is not int or batch_samples < 1 or batch_samples % group_size:
            raise ValueError(f"batch_samples must be a positive multiple of group_size {group_size} "
                             f"(groups are never split), got {batch_samples!r}")
        self.batch_samples = batch_samples
        self.group_size = group_size
        self.length_bucketing = bool(length_bucketing)
        self.drop_uniform_groups = bool(drop_uniform_groups)
        self.uniform_streak = 0
        """Groups dropped as uniform since the last batch (dynamic sampling)."""
        self.gate = StalenessGate(batch_samples, max_staleness, max_inflight)
        self.gate.staleness.subscribe(self._eta_changed)
        self.leases = LeaseTable(lease_timeout_s, max_attempts, clock)
        self._policy = self._check_policy(stale_policy)
        self._seen = RecentKeys(dedupe_window)       # sample ids accepted
        self._closed = RecentKeys(dedupe_window)     # assignment id -> why it left the buffer
        self._groups: dict[str, Group] = {}          # open (being generated) and ready groups
        self._ready: deque[Group] = deque()          # complete groups, in completion order
        self._ready_samples = 0
        self._pending = 0                            # samples buffered (open + ready groups)
        self._n = dict.fromkeys(COUNTER_NAMES, 0)
        self._hist: dict[int, int] = {}
        self._version = 0
        self._started = False                        # a version was seen or state loaded
        self._swept: tuple[int, int, str] | None = None
        self._cond = asyncio.Condition()
        self._waiting = 0
        self._buckets_seen = False                   # an assignment carried a length bucket
        self.last_invalid_reason = ""

    # -- configuration at runtime -----------------------------------------------------------------

    @staticmethod
    def _check_policy(policy: str) -> str:
        if policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy must be one of {STALE_POLICIES}, got {policy!r}")
        return policy

    @property
    def max_staleness(self) -> int:
        return self.gate.max_staleness

    @property
    def stale_policy(self) -> str:
        return self._policy

    @property
    def staleness(self) -> StalenessLimit:
        """η's owner (buffer.staleness), shared with the gate: set η there."""
        return self.gate.staleness

    def _eta_changed(self, previous: int, eta: int, reason: str) -> None:
        """η changed (its owner says so): the gate uses it at once; under ``drop`` buffered groups
        now over the limit are dropped at once (at the last version seen), under ``correct`` they
        get flagged."""
        self._sweep(self._version)

    def set_stale_policy(self, policy: str) -> None:
        """Switch ``drop``/``correct`` now; switching to ``drop`` drops what is over the limit."""
        self._policy = self._check_policy(policy)
        self._sweep(self._version)

    # -- gauges -----------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The newest learner version seen (by capacity, put, next_batch or a checkpoint)."""
        return self._version

    @property
    def pending_samples(self) -> int:
        """Samples buffered and not yet trained (complete and incomplete groups)."""
        return self._pending

    @property
    def ready_samples(self) -> int:
        """Samples in complete groups, waiting for a batch."""
        return self._ready_samples

    @property
    def inflight_samples(self) -> int:
        """Samples issued and not yet returned (including leases waiting for reissue)."""
        return self.gate.in_flight

    @property
    def waiting(self) -> int:
        """Callers blocked in :meth:`next_batch`."""
        return self._waiting

    @property
    def counters(self) -> dict[str, int]:
        out = dict(self._n)
        out["stale_dropped"] = out["stale"] + out["dropped_stale"]
        return out

    @property
    def staleness_histogram(self) -> dict[int, int]:
        """Staleness of trained samples: {staleness: count}."""
        return dict(sorted(self._hist.items()))

    def remaining(self, assignment_id: str) -> int:
        """Samples of an open assignment still in flight (0 when not open)."""
        g = self._groups.get(assignment_id)
        return 0 if g is None or g.ready else g.size - g.resolved

    def is_open(self, assignment_id: str) -> bool:
        """True while the assignment is being generated (it has a lease)."""
        return assignment_id in self.leases

    # -- version ----------------------------------------------------------------------------------

    def _observe(self, version: int) -> None:
        if version == self._version and self._started:
            return
        if type(version) is not int or version < 0:
            raise ValueError(f"version must be an integer >= 0, got {version!r}")
        if version < self._version:
            raise ValueError(f"policy versions only grow: got {version} after {self._version}")
        if not self._started:
            self._started = True
            if version > 0 and not (self.gate.accepted_total or self.gate.in_flight):
                # No history but a learner past version 0 (resumed without buffer state):
                # count its batches as trained, or the gate would let generation run v batches
                # ahead (AReaL's recovery bug).
                self.gate.start_at(version)
        self._version = version

    # -- gate and leases --------------------------------------------------------------------------

    def capacity(self, version: int) -> int:
        """Samples that may be issued now (the gate rule; see :mod:`buffer.gate`)."""
        self._observe(version)
        self._sweep(version)
        return self.gate.capacity(version)

    def issue(self, assignment_id: str, holder: str, n_samples: int | None = None,
              payload: Any = None, *, force: bool = False) -> Lease:
        """Lease a new assignment of ``n_samples`` (= group_size) samples to ``holder``.

        Raises ``ValueError`` when the id was used before, when ``n_samples`` is not the group
        size, or when it exceeds ``capacity(version)`` at the last version seen (pass
        ``force=True`` to override the gate knowingly).
        """
        n = self.group_size if n_samples is None else n_samples
        if n != self.group_size:
            raise ValueError(f"n_samples {n} != group_size {self.group_size}: an assignment is one "
                             "whole group")
        if assignment_id in self._groups or assignment_id in self._closed:
            raise ValueError(f"assignment id {assignment_id!r} was used before")
        if not force:
            room = self.capacity(self._version)
            if n > room:
                raise ValueError(f"issue({assignment_id!r}): {n} samples exceed the gate's capacity "
                                 f"{room} at version {self._version}; check capacity(version) first")
        lease = self.leases.issue(assignment_id, holder, n, payload, self._version)
        bucket = getattr(payload, "metadata", None)
        bucket = bucket.get(BUCKET_KEY) if isinstance(bucket, dict) else None
        self._groups[assignment_id] = Group(assignment_id, n, bucket if type(bucket) is int else None)
        if bucket is not None:
            self._buckets_seen = True
        self.gate.on_issued(n)
        self._n["issued"] += n
        return lease

    def expire(self) -> list[Lease]:
        """Lose the leases past their deadline (and those of a restored checkpoint).

        Returns the ones to :meth:`reissue`; their capacity stays reserved until then (call
        :meth:`cancel` to give one up). Leases out of attempts are given up here: their missing
        samples count as failed, their capacity is returned, their buffered samples dropped.
        """
        return self._lost(*self.leases.expire(), "expired")

    def release_holder(self, holder: str) -> list[Lease]:
        """``holder`` is gone: its leases are lost now. Returns those to :meth:`reissue`."""
        return self._lost(*self.leases.release_holder(holder), "released")

    def release(self, assignment_id: str, holder: str) -> list[Lease]:
        """``holder`` gave one assignment back (it refused it, or the learner refused a sample of
        it: that sample will not come again): its lease is lost now (a no-op unless ``holder``
        holds it). Returns it for :meth:`reissue`, or nothing when it is out of attempts."""
        return self._lost(*self.leases.release(assignment_id, holder), "released")

    def preempt_holder(self, holder: str) -> list[Lease]:
        """``holder`` went silent while others wait for work: its leases are taken for
        :meth:`reissue` elsewhere, the first few times without using up an attempt
        (:meth:`LeaseTable.preempt_holder`; a late result of the holder's is still accepted, the
        first copy of each sample wins). Returns the leases to re-issue."""
        return self._lost(*self.leases.preempt_holder(holder), "preempted")

    def _lost(self, retry: list[Lease], exhausted: list[Lease], counter: str) -> list[Lease]:
        """Count the missing samples of lost leases in ``counter``; give up the exhausted ones."""
        for lease in retry:
            self._n[counter] += self.remaining(lease.assignment_id)
        for lease in exhausted:
            g = self._groups[lease.assignment_id]
            self._n[counter] += g.size - g.resolved
            self._close(g, "exhausted")
        return retry

    def reissue(self, lease: Lease, holder: str) -> Lease:
        """Hand an expired lease to ``holder`` (same assignment id, attempt + 1, new deadline).

        The server is asked for the whole group again; slots already filled keep their first
        result and the new copies are duplicates. Raises ``KeyError`` if the assignment finished
        (or was given up) since :meth:`expire` returned it — a late result from the first holder
        completes it: a caller that keeps expired leases across awaits checks :meth:`is_open`.
        """
        self.leases.reissue(lease, holder, self._version)
        self._n["reissued"] += self.remaining(lease.assignment_id)
        return lease

    def untrained(self, batch: Batch) -> None:
        """``batch`` (from :meth:`next_batch`) was not trained: the step applied nothing (a
        non-finite loss). Its capacity goes back to the gate (else, under ``max_staleness`` 0, the
        gate would never open again); the counters still say ``consumed`` (the samples left the
        buffer and are not trained again)."""
        self.gate.on_untrained(len(batch.samples))

    def cancel(self, assignment_id: str) -> bool:
        """Give up an open assignment: capacity returned, buffered members dropped."""
        g = self._groups.get(assignment_id)
        if g is None or g.ready:
            return False
        self._close(g, "cancelled")
        return True

    async def restore_group(self, samples: list[Sample], version: int,
                            holder: str = "rollout_log") -> list[AckStatus]:
        """Put back a whole group accepted in an earlier life of the run (``learner.rollout_log``):
        issued (past the gate, ``force``: it was generated already, and counts in the gate from
        now on as accepted work does) and then put like any result, so every check, counter and
        the staleness rule apply. Raises ``ValueError`` when the assignment id is known to the
        buffer (open or finished) or the samples are not one whole group."""
        aid = samples[0].assignment_id if samples else None
        if (len(samples) != self.group_size or any(s.assignment_id != aid for s in samples)
                or sorted(s.group_index for s in samples) != list(range(self.group_size))):
            raise ValueError("restore_group: not one whole group of one assignment")
        self._observe(version)
        self.issue(aid, holder, force=True)
        return [await self.put(s, version) for s in sorted(samples, key=lambda s: s.group_index)]

    # -- results ----------------------------------------------------------------------------------

    async def put(self, sample: Sample, version: int, sender: str | None = None) -> AckStatus:
        """Take one result at learner version ``version``; the returned status is final.

        A token tagged with a version newer than ``version`` makes the sample ``invalid``: the
        learner must advance its version before it publishes the new weights. ``sender``: the
        server it came from, when known; only the lease's holder is credited with its delivery
        (:meth:`buffer.leases.LeaseTable.complete`).
        """
        status, completed = self._put(sample, version, sender=sender)
        if completed:
            await self.wake()
        return status

    def put_nowait(self, sample: Sample, version: int, min_version: int | None = None,
                   sender: str | None = None) -> tuple[AckStatus, bool]:
        """:meth:`put` without waking the batch waiters: ``(status, completed)``, ``completed``
        when the sample completed its group. A caller that puts several samples in a row (one
        result's) awaits :meth:`wake` once after them if any completed a group; until it does, a
        waiting ``next_batch`` does not see the new group. ``min_version``: the sample's oldest
        token version, when the caller has computed it (exactly ``token_versions.min()``; one
        pass over a result's samples instead of one a sample, learner.serve.intake); ``sender``
        as for :meth:`put`."""
        return self._put(sample, version, min_version, sender)

    def put_group_nowait(self, samples: list[Sample], version: int,
                         min_versions: list[int], sender: str | None = None) -> bool:
        """All the samples of one group at once, when that is what they are: every slot of an
        open group, still empty, filled by ``samples`` (one each, in any order), none seen, none
        failed, no token newer than ``version`` and the group within the staleness limit;
        ``min_versions``: each sample's oldest token version (exactly, -1 without tokens). True
        when they were put (each one ``accepted``, the group complete: :meth:`wake` next); False,
        with nothing changed, otherwise, and :meth:`put_nowait` of each in turn decides. Ends in
        the state of those ``put_nowait`` calls, without the per-sample bookkeeping of a group
        still open (lease extensions, gate and counter updates) that the last one makes moot."""
        if version != self._version or not self._started:
            self._observe(version)
        aid = samples[0].assignment_id
        g = self._groups.get(aid)
        if g is None or g.filled or len(samples) != g.size:
            return False
        seen = self._seen
        size = g.size
        taken = 0                                   # bit i: group_index i is in samples
        gmin = g.min_version
        for s, mv in zip(samples, min_versions):
            gi = s.group_index
            tv = s.token_versions
            if (s.assignment_id != aid or s.group_size != size or type(gi) is not int
                    or not 0 <= gi < size or taken >> gi & 1 or s.sample_id in seen
                    or s.failed is not None or type(tv) is not np.ndarray
                    or (len(tv) and (tv.item(-1) > version or mv > version))):
                return False
            taken |= 1 << gi
            if 0 <= mv < gmin:
                gmin = mv
        if (self._policy == "drop" and gmin != NO_TOKENS
                and version - gmin > self.gate.max_staleness):
            return False                            # one of them would close it stale
        if len({s.sample_id for s in samples}) != size:
            return False                            # a repeated id: the second is a duplicate
        for s, mv in zip(samples, min_versions):
            g.fill(s.group_index, s, mv)
            seen.add(s.sample_id)
        g.resolved += size
        self._pending += size
        self.gate.on_accepted(size)
        self._n["accepted"] += size
        self.leases.complete(aid, by=sender)
        self._completed(g)
        return True

    async def wake(self) -> None:
        """Wake the ``next_batch`` waiters (after :meth:`put_nowait` completed a group) if a
        batch is ready: a waiter woken before would only find none and wait again (its own
        ``poll_batch`` can only drop groups, never make one ready), at the cost of a task switch
        per completed group instead of one per batch."""
        if self._waiting and self._batch_ready():
            async with self._cond:
                self._cond.notify_all()

    def _invalid(self, reason: str) -> AckStatus:
        self.last_invalid_reason = reason
        self._n["invalid"] += 1
        return _INVALID

    def _put(self, s: Sample, version: int, mv: int | None = None,
             sender: str | None = None) -> tuple[AckStatus, bool]:
        if version != self._version or not self._started:
            self._observe(version)
        n = self._n
        aid = s.assignment_id
        g = self._groups.get(aid)
        if g is None:
            why = self._closed.get(aid)
            if why is None:
                return self._invalid(f"unknown assignment {aid!r}"), False
            if why == "stale" and s.sample_id not in self._seen:
                n["stale"] += 1
                n["stale_late"] += 1
                return _STALE, False
            n["duplicate"] += 1
            return _DUPLICATE, False
        gi = s.group_index
        if s.group_size != g.size or not 0 <= gi < g.size:
            return self._invalid(f"sample {s.sample_id!r}: group_index {gi} / group_size "
                                 f"{s.group_size} do not fit assignment {aid!r} of {g.size}"), False
        if g.slots[gi] is not None or s.sample_id in self._seen:
            n["duplicate"] += 1
            return _DUPLICATE, False
        tv = s.token_versions
        if len(tv):
            if mv is None:
                # argmin + item costs a third of min() on 1k tokens (bench_ingress.py profile)
                mv = int(tv.item(tv.argmin())) if type(tv) is np.ndarray else int(_min(tv))
            # Versions never decrease along a completion, so the last token is the newest.
            newest = int(tv.item(-1)) if type(tv) is np.ndarray else int(tv[-1])
            if newest > version or mv > version:
                return self._invalid(f"sample {s.sample_id!r}: token version {max(newest, mv)} is "
                                     f"newer than the learner's {version}"), False
        else:
            mv = -1
        if s.failed is not None:
            self._seen.add(s.sample_id)
            n["accepted"] += 1
            n["failed"] += 1
            n["failed_reported"] += 1
            n["dropped_incomplete"] += 1
            g.resolved += 1
            self.gate.on_failed(1)
            self._close(g, "failed")
            return _ACCEPTED, False
        gmin = mv if 0 <= mv < g.min_version else g.min_version
        if (self._policy == "drop" and gmin != NO_TOKENS
                and version - gmin > self.gate.max_staleness):
            n["stale"] += 1
            g.resolved += 1
            self.gate.on_failed(1)
            self._close(g, "stale")
            return _STALE, False
        # Accepted: fill the slot.
        g.fill(gi, s, mv)
        g.resolved += 1
        self._pending += 1
        self._seen.add(s.sample_id)
        self.gate.on_accepted(1)
        n["accepted"] += 1
        if g.filled < g.size:
            self.leases.extend(aid, by=sender)
            return _ACCEPTED, False
        self.leases.complete(aid, by=sender)
        return _ACCEPTED, self._completed(g)

    def _completed(self, g: Group) -> bool:
        """``g`` has all its samples: queue it for a batch -> True; or, under dynamic sampling,
        drop it when its rewards are all equal -> False."""
        if self.drop_uniform_groups and g.size > 1:
            first = g.slots[0].reward
            if all(x.reward == first for x in g.slots):
                self.uniform_streak += 1
                self._close(g, "uniform")
                return False
        self._set_ready(g)
        return True

    def _set_ready(self, g: Group) -> None:
        """``g`` has all its samples: queue it for a batch."""
        g.ready = True
        self._ready.append(g)
        self._ready_samples += g.size

    def _close(self, g: Group, reason: str, unlink: bool = True) -> None:
        """Remove a group that will not be trained; return its capacity.

        ``reason``: "stale", "failed" (a member failed), "exhausted" (out of attempts),
        "cancelled" or "uniform" (complete, every reward equal: dynamic sampling). With
        ``unlink=False`` the caller removes it from the ready queue.
        """
        rem = g.size - g.resolved
        if rem:
            self.gate.on_failed(rem)
            g.resolved = g.size
            self._n[{"exhausted": "failed", "cancelled": "cancelled"}.get(reason, "abandoned")] += rem
        if g.filled:
            self.gate.on_dropped(g.filled)
            self._n[{"stale": "dropped_stale", "uniform": "dropped_uniform"}.get(reason, "dropped_incomplete")] += g.filled
            self._pending -= g.filled
        if g.ready:
            self._ready_samples -= g.size
            if unlink:
                self._ready.remove(g)
        self.leases.complete(g.assignment_id)
        del self._groups[g.assignment_id]
        self._closed.add(g.assignment_id, reason if reason in ("stale", "cancelled", "uniform") else "failed")

    def _sweep(self, version: int) -> None:
        """Apply the staleness limit to everything buffered, once per (version, η, policy)."""
        key = (version, self.gate.max_staleness, self._policy)
        if key == self._swept:
            return
        self._swept = key
        if self._policy != "drop":
            return
        eta = self.gate.max_staleness
        stale = [g for g in self._groups.values() if g.staleness(version) > eta]
        if not stale:
            return
        for g in stale:
            self._close(g, "stale", unlink=False)
        self._ready = deque(g for g in self._ready if g.assignment_id in self._groups)

    # -- batches ----------------------------------------------------------------------------------

    def _batch_ready(self) -> bool:
        return self._ready_samples >= self.batch_samples

    def poll_batch(self, version: int) -> Batch | None:
        """A batch for learner version ``version`` if one is ready now, else None (never waits)."""
        self._observe(version)
        self._sweep(version)
        if not self._batch_ready():
            return None
        k, eta = self.batch_samples // self.group_size, self.gate.max_staleness
        groups = select_bucket(self._ready, version, eta, k) if self._buckets_seen else None
        if groups is None:
            if self._buckets_seen and not self._bucket_stuck(version, k):
                return None                  # a bucket can still fill: wait for it
            groups = select_groups(self._ready, version, eta, k, self.length_bucketing or self._buckets_seen)
        batch = assemble_batch(groups, version, self.gate.max_staleness)
        batch.uniform_dropped, self.uniform_streak = self.uniform_streak, 0
        hist = self._hist
        for st in batch.staleness:
            hist[st] = hist.get(st, 0) + 1
        closed = self._closed
        for g in groups:
            del self._groups[g.assignment_id]
            closed.add(g.assignment_id, "consumed")
        n = len(batch.samples)
        self._ready_samples -= n
        self._pending -= n
        self.gate.on_consumed(n)
        self._n["consumed"] += n
        self._n["corrected"] += sum(batch.needs_correction)
        self._n["batches"] += 1
        return batch

    def _bucket_stuck(self, version: int, k: int) -> bool:
        """No length bucket can fill a batch: none has ``k`` groups ready and in flight together,
        and the gate cannot issue a group. Then the batch is the ready groups of nearest lengths
        (as ``length_bucketing``), so a run whose buckets came apart (dropped or failed groups,
        replaced from other buckets) never waits forever."""
        if self.gate.capacity(version) >= self.group_size:
            return False
        count: dict[int | None, int] = {}
        for g in self._groups.values():
            count[g.bucket] = count.get(g.bucket, 0) + 1
        return all(n < k for n in count.values())

    async def next_batch(self, version: int, max_wait_s: float | None = None) -> Batch:
        """Wait for and return the next batch at learner version ``version``.

        Wakes as soon as the batch is complete. Raises ``TimeoutError`` (``asyncio.TimeoutError``)
        after ``max_wait_s`` seconds without one. Cancellation-safe: a batch is taken from the
        buffer in the same step that returns it, so a cancelled or timed-out call takes nothing.
        Training counts as done when the batch is returned (``consumed``, the histogram and the
        gate's ``consumed_total`` move here).
        """
        batch = self.poll_batch(version)
        if batch is not None:
            return batch
        if max_wait_s is None:
            return await self._wait_batch(version)
        if hasattr(asyncio, "timeout"):                      # Python >= 3.11
            async with asyncio.timeout(max_wait_s):
                return await self._wait_batch(version)
        return await asyncio.wait_for(self._wait_batch(version), max_wait_s)  # pragma: no cover

    async def _wait_batch(self, version: int) -> Batch:
        async with self._cond:
            self._waiting += 1
            try:
                while True:
                    batch = self.poll_batch(version)
                    if batch is not None:
                        return batch
                    if self._buckets_seen:   # a bucket may get stuck without a group completing
                        try:
                            await asyncio.wait_for(self._cond.wait(), BUCKET_REPOLL_S)
                        except asyncio.TimeoutError:
                            pass
                    else:
                        await self._cond.wait()
            finally:
                self._waiting -= 1

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self, binary: bool = True) -> dict[str, Any]:
        """Everything needed to resume, as plain data (buffered samples included); ``binary=False``
        makes it JSON-able. Lease payloads: plain data or a ``protocol.Message``."""
        groups = [g for g in self._groups.values() if not g.ready] + list(self._ready)
        return {
            "format": STATE_FORMAT,
            "version": self._version,
            "batch_samples": self.batch_samples,
            "group_size": self.group_size,
            "max_staleness": self.gate.max_staleness,
            "stale_policy": self._policy,
            "gate": self.gate.state_dict(),
            "leases": self.leases.state_dict(lambda p: pack_payload(p, binary)),
            "groups": [{"assignment_id": g.assignment_id, "size": g.size, "bucket": g.bucket,
                        "samples": [to_plain(s.to_wire(), binary) for s in g.slots if s is not None]}
                       for g in groups],
            "seen": [k for k, _ in self._seen.items()],
            "closed": [[k, v] for k, v in self._closed.items()],
            "counters": dict(self._n),
            "staleness_histogram": [[k, v] for k, v in sorted(self._hist.items())],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`, into a buffer built with the same group_size.

        η and the stale policy come from the checkpoint (they may have been changed at runtime; call
        the setters afterwards to override). Leases of the saved run are lost — their servers are gone
        or will reconnect — and the next ``expire`` reports them: for reissue (their capacity stays
        reserved, so the gate is exact), or, out of attempts, as failed with their capacity returned.
        Results that servers re-send for them in the meantime are accepted as usual.
        """
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"buffer state format {state.get('format')!r}, expected {STATE_FORMAT}")
        if state["group_size"] != self.group_size:
            raise ValueError(f"checkpoint group_size {state['group_size']} != {self.group_size}: "
                             "buffered groups cannot be re-cut")
        self.gate.load_state_dict(state["gate"])
        self._policy = self._check_policy(state["stale_policy"])
        self.leases.load_state_dict(state["leases"], unpack_payload)
        self._groups, self._ready = {}, deque()
        self._ready_samples = self._pending = 0
        in_flight = 0
        for gd in state["groups"]:
            bucket = gd.get("bucket")
            g = Group(gd["assignment_id"], int(gd["size"]), bucket if type(bucket) is int else None)
            self._buckets_seen |= g.bucket is not None
            for w in gd["samples"]:
                s = Sample.from_wire(from_plain(w), "buffer state sample")
                tv = s.token_versions
                g.fill(s.group_index, s, int(tv.min()) if len(tv) else -1)
            g.resolved = g.filled
            self._groups[g.assignment_id] = g
            self._pending += g.filled
            if g.filled == g.size:
                self._set_ready(g)
            else:
                if g.assignment_id not in self.leases:
                    raise ValueError(f"buffer state: open group {g.assignment_id!r} has no lease")
                in_flight += g.size - g.filled
        if len(self.leases) != len(self._groups) - len(self._ready):
            raise ValueError("buffer state: leases and open groups differ")
        if self.gate.buffered != self._pending:
            raise ValueError(f"buffer state: gate counts {self.gate.buffered} buffered samples, "
                             f"the checkpoint holds {self._pending}")
        self.gate.in_flight = in_flight
        self._seen = RecentKeys(self._seen.capacity)
        self._seen.update((k, None) for k in state["seen"])
        self._closed = RecentKeys(self._closed.capacity)
        self._closed.update((k, v) for k, v in state["closed"])
        self._n = dict.fromkeys(COUNTER_NAMES, 0)
        self._n.update({k: int(v) for k, v in state["counters"].items() if k in self._n})
        self._hist = {int(k): int(v) for k, v in state["staleness_histogram"]}
        self._version = int(state["version"])
        self._started = True
        self._swept = None

    def __repr__(self) -> str:
        return (f"RolloutBuffer(version={self._version}, eta={self.max_staleness}, "
                f"policy={self._policy!r}, pending={self._pending}, ready={self._ready_samples}, "
                f"in_flight={self.gate.in_flight}, leases={len(self.leases)})")
