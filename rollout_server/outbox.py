"""The outbox: results sent and not yet acknowledged (docs/design.md §6, delivery).

Every ``RolloutResult`` (one per assignment) stays here until the learner's ``Ack`` has named
each of its samples. It is sent again after every (re)connect (:meth:`Outbox.resend_all`, on
``Welcome``) and whenever ``ack_timeout_s`` passes without its acks (:meth:`Outbox.resend_due`);
the learner de-duplicates by sample id, so a result sent twice is trained once, and a result lost
with a connection is sent again: nothing lost, nothing trained twice.

Acks are matched through :func:`protocol.parse_sample_id`. An ack repeated for a sample already
acknowledged (the learner answers every copy it receives) is expected after a re-send and only
counted by status; an ack for a sample this server never sent, or for something that is not a
sample id, is counted as ``unknown_ack`` and otherwise ignored.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import protocol
from rollout_server.metrics import RolloutMetrics

RECENT_RESULTS = 4096     # fully acknowledged assignments remembered (to recognise repeated acks)


@dataclass
class _Pending:
    frames: list
    indices: frozenset[int]       # group indices this result carries
    remaining: set[int]           # ... not acknowledged yet
    sent_at: float


class Outbox:
    """Pending results keyed by assignment id; ``send(frames)`` puts frames on the wire."""

    def __init__(self, send: Callable[[list], Awaitable[None]], metrics: RolloutMetrics,
                 ack_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[], None] = lambda: None):
        self.send, self.metrics, self.ack_timeout_s, self.clock = send, metrics, ack_timeout_s, clock
        self.on_change = on_change
        self.pending: dict[str, _Pending] = {}
        self._recent: OrderedDict[str, frozenset[int]] = OrderedDict()   # acked: aid -> indices

    def __len__(self) -> int:
        return len(self.pending)

    @property
    def samples(self) -> int:
        """Samples sent and not acknowledged."""
        return sum(len(p.remaining) for p in self.pending.values())

    async def put(self, result: protocol.RolloutResult) -> None:
        """Send ``result`` (the samples of one assignment) and keep it until acknowledged."""
        if not result.samples:
            return
        aid = result.samples[0].assignment_id
        if any(s.assignment_id != aid for s in result.samples):
            raise ValueError("Outbox.put: one result per assignment")
        frames = protocol.encode(result)
        indices = frozenset(s.group_index for s in result.samples)
        self.pending[aid] = _Pending(frames, indices, set(indices), self.clock())
        self._recent.pop(aid, None)
        await self.send(frames)
        self.on_change()

    def ack(self, msg: protocol.Ack) -> int:
        """Apply one Ack; returns how many samples it newly acknowledged."""
        newly = 0
        for sid, status in zip(msg.sample_ids, msg.statuses):
            self.metrics.acks.labels(status=status).inc()
            try:
                aid, index = protocol.parse_sample_id(sid)
            except protocol.ProtocolError:
                self.metrics.count("unknown_ack")
                continue
            p = self.pending.get(aid)
            if p is not None and index in p.remaining:
                p.remaining.discard(index)
                newly += 1
                if not p.remaining:
                    del self.pending[aid]
                    self._remember(aid, p.indices)
            elif index not in (p.indices if p is not None else self._recent.get(aid, ())):
                self.metrics.count("unknown_ack")
        if newly:
            self.on_change()
        return newly

    def clear(self) -> int:
        """Forget every unacknowledged result (a new learner run cannot take them); returns how
        many samples were dropped."""
        n = self.samples
        self.pending.clear()
        self._recent.clear()
        self.on_change()
        return n

    def _remember(self, aid: str, indices: frozenset[int]) -> None:
        self._recent[aid] = indices
        while len(self._recent) > RECENT_RESULTS:
            self._recent.popitem(last=False)

    async def resend_all(self) -> int:
        """Send every pending result again (after a Welcome: the link may have lost them)."""
        return await self._resend(list(self.pending.values()))

    async def resend_due(self) -> int:
        """Send again the results whose acks are ``ack_timeout_s`` overdue."""
        now = self.clock()
        return await self._resend([p for p in self.pending.values()
                                   if now - p.sent_at > self.ack_timeout_s])

    async def _resend(self, due: list[_Pending]) -> int:
        for p in due:
            self.metrics.send_retries.inc()
            p.sent_at = self.clock()
            await self.send(p.frames)
        return len(due)
