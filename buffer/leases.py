"""Leases: who is generating which assignment, until when, and for the how-many-th time.

Lifecycle of one lease (one per assignment id)::

    issue ──► ACTIVE ──(deadline passed / holder gone / learner restarted)──► lost
                ▲                                                           │
                │ reissue (attempt + 1, new holder and deadline)            ├─ attempt < max_attempts
                └────────────────────────── EXPIRED ◄───────────────────────┘   (re-issuable)
                                                                            └─ attempt == max_attempts
    ACTIVE or EXPIRED ──complete──► removed                                     ► exhausted, removed

Every way of losing a lease uses up its attempt, so a prompt that keeps killing servers is given
up after ``max_attempts`` tries — except a *pre-emption* (:meth:`LeaseTable.preempt_holder`): the
caller takes the lease from a holder that has returned nothing for much longer than it should
while other servers wait for work. That is a backup copy, not a failure (the holder may still
deliver, and the first copy of each sample wins), so the first ``max_attempts`` pre-emptions of a
lease use up no attempt; later ones do, like any loss. A result for an assignment extends its lease (the server is alive
and making progress) and the last result completes it. A result that arrives for an EXPIRED lease
is accepted as usual — the slow holder was alive after all; whichever copy of a sample arrives
first wins and the other is a duplicate (the buffer decides that, not this table).

Deliveries. The table records, per holder, what it returned (:class:`Delivery`: leases completed
while it held them, when it last extended or completed one, the mean time from issue to
completion) and the same mean over all holders, so a caller can tell a server's delivered rate
and how long its work should take (:mod:`learner.serve.admission` bounds the work a server may
hold by it).

The table knows nothing about samples or capacity: :class:`buffer.RolloutBuffer` turns its
outcomes into gate transitions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any


class LeaseState(str, Enum):
    ACTIVE = "active"        # a holder is generating it
    EXPIRED = "expired"      # lost, waiting for reissue()

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True, eq=False)
class Lease:
    """One assignment on loan to a rollout server. Owned and mutated by its :class:`LeaseTable`."""

    assignment_id: str
    holder: str                      # server id; "" once lost
    n_samples: int                   # samples (completions) the assignment asks for
    deadline_s: float                # clock reading after which the lease is lost
    attempt: int = 1                 # 1 for the first issue, +1 for every reissue
    payload: Any = None              # the caller's: prompt, Assignment message, ...
    version: int = 0                 # learner version when (re)issued
    state: LeaseState = LeaseState.ACTIVE
    issued_s: float = 0.0            # clock reading when it was (re)issued to its holder
    preemptions: int = 0             # times it was taken from a silent holder (no attempt used)

    @property
    def active(self) -> bool:
        return self.state is LeaseState.ACTIVE


EWMA_WEIGHT = 0.2
"""Weight of the newest completion in the mean completion times (an EWMA: about the last 5)."""


@dataclass(slots=True)
class Delivery:
    """What one holder returned (see the module docstring)."""

    completed: int = 0               # leases it completed while holding them
    last_s: float = -math.inf        # clock reading of its last result (extension or completion)
    mean_s: float = math.nan         # EWMA of issue -> completion seconds (NaN: none yet)


def _ewma(mean: float, x: float) -> float:
    return x if math.isnan(mean) else mean + EWMA_WEIGHT * (x - mean)


class LeaseTable:
    """Every open assignment: holder, deadline, attempt count.

    ``clock`` is any monotonic seconds source (tests pass a fake one).
    """

    def __init__(self, timeout_s: float = 600.0, max_attempts: int = 3,
                 clock: Callable[[], float] = time.monotonic):
        if not timeout_s > 0:
            raise ValueError(f"lease timeout_s must be > 0, got {timeout_s!r}")
        if type(max_attempts) is not int or max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        self.timeout_s = float(timeout_s)
        self.max_attempts = max_attempts
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        # Leases lost at a restart, reported by the next expire(): (lease, out of attempts).
        self._lost: list[tuple[Lease, bool]] = []
        self._deliveries: dict[str, Delivery] = {}
        self.mean_completion_s = math.nan    # EWMA over every holder's completions
        self._held: dict[str, int] = {}      # holder -> samples of its ACTIVE leases

    # -- queries ----------------------------------------------------------------------------------

    def get(self, assignment_id: str) -> Lease | None:
        return self._leases.get(assignment_id)

    def __contains__(self, assignment_id: object) -> bool:
        return assignment_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._leases.values()))

    def held_by(self, holder: str) -> list[Lease]:
        return [lease for lease in self._leases.values() if lease.active and lease.holder == holder]

    def held_samples(self, holder: str) -> int:
        """Samples of the ACTIVE leases ``holder`` holds (kept as leases move: O(1))."""
        return self._held.get(holder, 0)

    def oldest_issue_by_holder(self) -> dict[str, float]:
        """For each holder of an ACTIVE lease, when its oldest one was (re)issued to it."""
        out: dict[str, float] = {}
        for lease in self._leases.values():
            if lease.state is LeaseState.ACTIVE and lease.holder:
                t = out.get(lease.holder)
                if t is None or lease.issued_s < t:
                    out[lease.holder] = lease.issued_s
        return out

    def _hold(self, lease: Lease, sign: int) -> None:
        """``lease`` (ACTIVE, held) joins (+1) or leaves (-1) its holder's count."""
        holder = lease.holder
        if not holder:
            return
        n = self._held.get(holder, 0) + sign * lease.n_samples
        if n > 0:
            self._held[holder] = n
        else:
            self._held.pop(holder, None)

    def delivery(self, holder: str) -> Delivery:
        """What ``holder`` returned so far (a fresh record when nothing yet)."""
        d = self._deliveries.get(holder)
        return d if d is not None else Delivery()

    def forget(self, holder: str) -> None:
        """Drop ``holder``'s delivery record (it left; a new server of that id starts afresh)."""
        self._deliveries.pop(holder, None)

    def _delivered(self, lease: Lease, completed: bool, by: str | None = None) -> None:
        holder = lease.holder
        if not holder or lease.state is not LeaseState.ACTIVE or (by is not None and by != holder):
            return                           # a late copy from an earlier holder: not the holder's work
        d = self._deliveries.get(holder)
        if d is None:
            d = self._deliveries[holder] = Delivery()
        now = self.clock()
        d.last_s = now
        if completed:
            d.completed += 1
            took = max(0.0, now - lease.issued_s)
            d.mean_s = _ewma(d.mean_s, took)
            self.mean_completion_s = _ewma(self.mean_completion_s, took)

    # -- transitions ------------------------------------------------------------------------------

    def issue(self, assignment_id: str, holder: str, n_samples: int, payload: Any = None,
              version: int = 0) -> Lease:
        if assignment_id in self._leases:
            raise ValueError(f"assignment {assignment_id!r} already has a lease")
        now = self.clock()
        lease = Lease(assignment_id, holder, n_samples, now + self.timeout_s,
                      payload=payload, version=version, issued_s=now)
        self._leases[assignment_id] = lease
        self._hold(lease, +1)
        return lease

    def extend(self, assignment_id: str, by: str | None = None) -> bool:
        """A result arrived (from server ``by``, when known): push the deadline of an ACTIVE lease
        out by a full timeout. It counts as the holder's delivery only when ``by`` is the holder
        (or unknown)."""
        lease = self._leases.get(assignment_id)
        if lease is None or lease.state is not LeaseState.ACTIVE:
            return False
        lease.deadline_s = self.clock() + self.timeout_s
        self._delivered(lease, completed=False, by=by)
        return True

    def complete(self, assignment_id: str, by: str | None = None) -> Lease | None:
        """The assignment is finished (or given up): forget its lease. An ACTIVE one counts as
        delivered by its holder, unless the result that finished it came from another server
        (``by``: a pre-empted holder's late copy), which is not the holder's work."""
        lease = self._leases.pop(assignment_id, None)
        if lease is not None and lease.state is LeaseState.ACTIVE:
            self._delivered(lease, completed=True, by=by)
            self._hold(lease, -1)
        return lease

    def _lose(self, lease: Lease, retry: list[Lease], exhausted: list[Lease]) -> None:
        self._hold(lease, -1)
        if lease.attempt - lease.preemptions < self.max_attempts:
            lease.state = LeaseState.EXPIRED
            lease.holder = ""
            retry.append(lease)
        else:
            del self._leases[lease.assignment_id]
            exhausted.append(lease)

    def expire(self) -> tuple[list[Lease], list[Lease]]:
        """Lose every ACTIVE lease past its deadline, and report those lost at a restart.

        Returns ``(retry, exhausted)``: leases now EXPIRED and waiting for :meth:`reissue`, and
        leases out of attempts (already removed).
        """
        retry: list[Lease] = []
        exhausted: list[Lease] = []
        for lease, out_of_attempts in self._lost:
            if self._leases.get(lease.assignment_id) is not lease:
                continue                     # completed or given up since the restart
            if out_of_attempts:
                del self._leases[lease.assignment_id]
                exhausted.append(lease)
            elif lease.state is LeaseState.EXPIRED:
                retry.append(lease)
        self._lost = []
        now = self.clock()
        for lease in list(self._leases.values()):
            if lease.state is LeaseState.ACTIVE and lease.deadline_s <= now:
                self._lose(lease, retry, exhausted)
        return retry, exhausted

    def release_holder(self, holder: str) -> tuple[list[Lease], list[Lease]]:
        """The holder is gone: lose its ACTIVE leases now. Returns ``(retry, exhausted)``."""
        retry: list[Lease] = []
        exhausted: list[Lease] = []
        for lease in self.held_by(holder):
            self._lose(lease, retry, exhausted)
        return retry, exhausted

    def release(self, assignment_id: str, holder: str) -> tuple[list[Lease], list[Lease]]:
        """``holder`` gave one lease back (it refused the assignment): lose it now, if it is
        ACTIVE and held by ``holder``. Returns ``(retry, exhausted)``."""
        retry: list[Lease] = []
        exhausted: list[Lease] = []
        lease = self._leases.get(assignment_id)
        if lease is not None and lease.state is LeaseState.ACTIVE and lease.holder == holder:
            self._lose(lease, retry, exhausted)
        return retry, exhausted

    def preempt_holder(self, holder: str) -> tuple[list[Lease], list[Lease]]:
        """Take ``holder``'s ACTIVE leases for re-issue elsewhere (see the module docstring): the
        first ``max_attempts`` pre-emptions of a lease use up no attempt, later ones do (so a
        lease that no holder finishes is given up in the end). Returns ``(retry, exhausted)``."""
        retry: list[Lease] = []
        exhausted: list[Lease] = []
        for lease in self.held_by(holder):
            if lease.preemptions < self.max_attempts:
                self._hold(lease, -1)
                lease.preemptions += 1
                lease.state = LeaseState.EXPIRED
                lease.holder = ""
                retry.append(lease)
            else:
                self._lose(lease, retry, exhausted)
        return retry, exhausted

    def reissue(self, lease: Lease, holder: str, version: int | None = None) -> Lease:
        """Hand an EXPIRED lease to ``holder``: attempt + 1, a fresh deadline. Returns the lease.

        Raises ``KeyError`` when the assignment is not open any more (it completed or was given up
        since it expired) and ``ValueError`` when the lease is not EXPIRED.
        """
        current = self._leases.get(lease.assignment_id)
        if current is None:
            raise KeyError(f"assignment {lease.assignment_id!r} is not open any more")
        if current is not lease:
            raise ValueError(f"lease of {lease.assignment_id!r} is not the table's current lease")
        if lease.state is not LeaseState.EXPIRED:
            raise ValueError(f"lease of {lease.assignment_id!r} is {lease.state}, not expired")
        lease.state = LeaseState.ACTIVE
        lease.holder = holder
        self._hold(lease, +1)
        lease.attempt += 1
        lease.issued_s = self.clock()
        lease.deadline_s = lease.issued_s + self.timeout_s
        if version is not None:
            lease.version = version
        return lease

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self, pack_payload: Callable[[Any], Any] = lambda p: p) -> list[dict[str, Any]]:
        """Plain data: one entry per lease. Deadlines are not saved (clocks do not survive)."""
        return [{"assignment_id": le.assignment_id, "holder": le.holder, "n_samples": le.n_samples,
                 "attempt": le.attempt, "payload": pack_payload(le.payload), "version": le.version,
                 "state": le.state.value, "preemptions": le.preemptions}
                for le in self._leases.values()]

    def load_state_dict(self, state: list[dict[str, Any]],
                        unpack_payload: Callable[[Any], Any] = lambda p: p) -> None:
        """Restore leases as lost: no holder of the saved run holds anything now.

        Each restored lease counts as lost once more (ACTIVE ones use up their attempt, as for a
        holder that left; EXPIRED ones were lost already) and is reported by the next
        :meth:`expire` — for reissue, or as exhausted.
        """
        self._leases = {}
        self._lost = []
        self._held = {}
        for d in state:
            lease = Lease(d["assignment_id"], "", int(d["n_samples"]), float("-inf"),
                          attempt=int(d["attempt"]), payload=unpack_payload(d["payload"]),
                          version=int(d["version"]), state=LeaseState.EXPIRED,
                          preemptions=int(d.get("preemptions", 0)))
            if lease.assignment_id in self._leases:
                raise ValueError(f"lease state: assignment {lease.assignment_id!r} twice")
            self._leases[lease.assignment_id] = lease
            was_active = d["state"] == LeaseState.ACTIVE.value
            self._lost.append((lease, was_active
                               and lease.attempt - lease.preemptions >= self.max_attempts))
