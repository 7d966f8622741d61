"""Leases: who is generating which assignment, until when, and for the how-many-th time.

Lifecycle of one lease (one per assignment id)::

    issue ──► ACTIVE ──(deadline passed / holder gone / learner restarted)──► lost
                ▲                                                           │
                │ reissue (attempt + 1, new holder and deadline)            ├─ attempt < max_attempts
                └────────────────────────── EXPIRED ◄───────────────────────┘   (re-issuable)
                                                                            └─ attempt == max_attempts
    ACTIVE or EXPIRED ──complete──► removed                                     ► exhausted, removed

Every way of losing a lease uses up its attempt, so a prompt that keeps killing servers is given
up after ``max_attempts`` tries. A result for an assignment extends its lease (the server is alive
and making progress) and the last result completes it. A result that arrives for an EXPIRED lease
is accepted as usual — the slow holder was alive after all; whichever copy of a sample arrives
first wins and the other is a duplicate (the buffer decides that, not this table).

The table knows nothing about samples or capacity: :class:`buffer.RolloutBuffer` turns its
outcomes into gate transitions.
"""

from __future__ import annotations

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

    @property
    def active(self) -> bool:
        return self.state is LeaseState.ACTIVE


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

    # -- transitions ------------------------------------------------------------------------------

    def issue(self, assignment_id: str, holder: str, n_samples: int, payload: Any = None,
              version: int = 0) -> Lease:
        if assignment_id in self._leases:
            raise ValueError(f"assignment {assignment_id!r} already has a lease")
        lease = Lease(assignment_id, holder, n_samples, self.clock() + self.timeout_s,
                      payload=payload, version=version)
        self._leases[assignment_id] = lease
        return lease

    def extend(self, assignment_id: str) -> bool:
        """A result arrived: push the deadline of an ACTIVE lease out by a full timeout."""
        lease = self._leases.get(assignment_id)
        if lease is None or lease.state is not LeaseState.ACTIVE:
            return False
        lease.deadline_s = self.clock() + self.timeout_s
        return True

    def complete(self, assignment_id: str) -> Lease | None:
        """The assignment is finished (or given up): forget its lease."""
        return self._leases.pop(assignment_id, None)

    def _lose(self, lease: Lease, retry: list[Lease], exhausted: list[Lease]) -> None:
        if lease.attempt < self.max_attempts:
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
        lease.attempt += 1
        lease.deadline_s = self.clock() + self.timeout_s
        if version is not None:
            lease.version = version
        return lease

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self, pack_payload: Callable[[Any], Any] = lambda p: p) -> list[dict[str, Any]]:
        """Plain data: one entry per lease. Deadlines are not saved (clocks do not survive)."""
        return [{"assignment_id": le.assignment_id, "holder": le.holder, "n_samples": le.n_samples,
                 "attempt": le.attempt, "payload": pack_payload(le.payload), "version": le.version,
                 "state": le.state.value}
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
        for d in state:
            lease = Lease(d["assignment_id"], "", int(d["n_samples"]), float("-inf"),
                          attempt=int(d["attempt"]), payload=unpack_payload(d["payload"]),
                          version=int(d["version"]), state=LeaseState.EXPIRED)
            if lease.assignment_id in self._leases:
                raise ValueError(f"lease state: assignment {lease.assignment_id!r} twice")
            self._leases[lease.assignment_id] = lease
            was_active = d["state"] == LeaseState.ACTIVE.value
            self._lost.append((lease, was_active and lease.attempt >= self.max_attempts))
