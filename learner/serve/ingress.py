"""Results from the rollout socket to the intake, and their Acks back, in bursts.

While the rollout socket's loop keeps reading, results of fewer samples than a group are held
(``held``) and the Acks of what was received wait (``pending_acks``); when the loop stops
reading (its idle callback) or another kind of message comes, :meth:`ResultIngress.flush`
receives what is held and sends the Acks, one per server (learner.serve.router.PendingAcks).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import protocol
from learner.serve.router import PendingAcks
from learner.state.rollout_log import RolloutLogFailed

MERGE_SAMPLES = 256
"""Held results of one server are merged into one of at most this many samples."""


class ResultIngress:
    """``receive(msg) -> Ack`` is the service's intake path (the rollout log included; it raises
    RolloutLogFailed when the result could not be written); ``evaluation()`` the evaluation, if
    any, that takes its own results first; ``hold()`` whether partial results may be held (not
    with a rollout log: there each result is written and acknowledged as it arrives);
    ``send(identity, ack)`` queues an Ack (False: the server is unreachable and ``lose(srv)``
    is called); ``after()`` runs after each reception (the service's gauges) and ``dispatch()``
    once Acks went out."""

    def __init__(self, *, receive: Callable[[protocol.RolloutResult], Awaitable[protocol.Ack]],
                 evaluation: Callable[[], object], group_size: Callable[[], int], hold: Callable[[], bool],
                 send: Callable[[bytes, protocol.Message], Awaitable[bool]], lose: Callable[[object], None],
                 after: Callable[[], None], dispatch: Callable[[], Awaitable[None]]):
        self.receive_result, self.evaluation, self.group_size, self.hold = receive, evaluation, group_size, hold
        self.send, self.lose, self.after, self.dispatch = send, lose, after, dispatch
        self.pending_acks = PendingAcks()     # a burst's Acks, sent when the loop stops reading
        self.held: list[tuple[bytes, object, protocol.RolloutResult]] = []

    def __bool__(self) -> bool:
        """Something is held or waiting to be acknowledged."""
        return bool(self.pending_acks or self.held)

    async def result(self, identity: bytes, srv, msg: protocol.RolloutResult) -> None:
        """One RolloutResult from a known server: held when it is part of a group, else received
        (after what is held, in arrival order). It is the connection's server's, whatever
        ``server_id`` it claims: the intake credits and releases leases by that id."""
        if msg.server_id != srv.server_id:
            msg = protocol.RolloutResult(server_id=srv.server_id, samples=msg.samples)
        if self.hold() and len(msg.samples) < self.group_size():
            self.held.append((identity, srv, msg))      # part of a group: merged
            return
        if self.held:
            await self.receive_held()
        await self._receive(identity, srv, msg)
        self.after()

    async def _receive(self, identity: bytes, srv, msg: protocol.RolloutResult) -> None:
        """Intake (and evaluation) of one result; its Ack held for the burst (none when the
        rollout log could not write it: the server keeps the result)."""
        evaluation = self.evaluation()
        try:
            ack = await (evaluation.receive(msg, self.receive_result) if evaluation
                         else self.receive_result(msg))
        except RolloutLogFailed:
            return
        self.pending_acks.add(identity, srv, ack)

    async def receive_held(self) -> None:
        """The results held during a burst, received: the consecutive results of one server
        (one identity, server and ``server_id``) merged into one, up to MERGE_SAMPLES samples,
        so that the checks of their arrays, the counters and the Ack are made once for all of
        them, and the single samples of one group, streamed one result each, go into the buffer
        as that group at once (``Intake.receive``). The outcome is that of receiving them one
        by one in the same order: samples are checked and put one assignment at a time either
        way, and a server matches its Acks by sample id. A result of a whole group (what
        rollout_server sends) is received at once, after what is held: it gains nothing from
        a merge, and its arrays are still in the cache from its decode."""
        held, self.held = self.held, []
        i = 0
        while i < len(held):
            identity, srv, msg = held[i]
            j, n = i + 1, len(msg.samples)
            while (j < len(held) and held[j][0] == identity and held[j][1] is srv
                   and held[j][2].server_id == msg.server_id
                   and n + len(held[j][2].samples) <= MERGE_SAMPLES):
                n += len(held[j][2].samples)
                j += 1
            if j > i + 1:
                msg = protocol.RolloutResult(server_id=msg.server_id,
                                             samples=[x for h in held[i:j] for x in h[2].samples])
            await self._receive(identity, srv, msg)
            i = j
        self.after()

    async def flush(self) -> None:
        """Receive the held results; send the held Acks, one per server; a server whose Ack
        cannot be queued is lost; then dispatch once, as after each result before."""
        if self.held:
            await self.receive_held()
        if not self.pending_acks:
            return
        sent = False
        for identity, srv, ack in self.pending_acks.take():
            if await self.send(identity, ack):
                sent = True
            else:
                self.lose(srv)
        if sent:
            await self.dispatch()
