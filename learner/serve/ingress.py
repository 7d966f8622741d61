"""Results from the rollout socket to the intake, and their Acks back, in bursts.

While the rollout socket's loop keeps reading, results of fewer samples than a group are held
(``held``) and the Acks of what was received wait (``pending_acks``); when the loop stops
reading (its idle callback) or another kind of message comes, :meth:`ResultIngress.flush`
receives what is held and sends the Acks, one per server (learner.serve.router.PendingAcks).
"""

from __future__ import annotations

from typing import Any, Protocol

import protocol
from learner.serve.admission import Sender
from learner.serve.router import PendingAcks
from learner.state.rollout_log import RolloutLogFailed
from protocol.plumbing.process import trace

MERGE_SAMPLES = 256
"""Held results of one server are merged into one of at most this many samples."""


class ResultReceiver(Protocol):
    """Where a result goes into the run (:class:`IntakePath`)."""

    async def receive(self, msg: protocol.RolloutResult) -> protocol.Ack: ...


class IntakePath:
    """A result into the run: the intake's checks and the buffer (learner.serve.intake.Intake),
    then, with a rollout log, the accepted samples on disk before the Ack may leave;
    RolloutLogFailed when that write failed."""

    def __init__(self, intake: Any, rollout_log: Any = None):
        self.intake, self.rollout_log = intake, rollout_log

    async def receive(self, msg: protocol.RolloutResult) -> protocol.Ack:
        trace("learner.result")
        ack = await self.intake.receive(msg)
        if self.rollout_log is not None and not await self.rollout_log.receive(msg, ack):
            raise RolloutLogFailed(msg.server_id)
        return ack


class ResultIngress:
    """``receiver``: the intake path (:class:`ResultReceiver`: the rollout log included; it raises
    RolloutLogFailed when the result could not be written); ``evaluation``: the evaluation, if
    any, that takes its own results first; ``hold``: whether partial results may be held (not
    with a rollout log: there each result is written and acknowledged as it arrives);
    ``link``: where the Acks go (:class:`learner.serve.admission.Sender`); ``admission``: loses a
    server whose Ack cannot be queued and dispatches once Acks went out; ``batches``: told after
    each reception (a finite dataset may be used up, learner.loop.Batches.check); ``batch``: the
    ``learner.batch`` section (``group_size``)."""

    def __init__(self, *, receiver: ResultReceiver, link: Sender, admission: Any, batches: Any,
                 batch: Any, evaluation: Any = None, hold: bool = True):
        self.receiver, self.link, self.admission, self.batches = receiver, link, admission, batches
        self.batch, self.evaluation, self.hold = batch, evaluation, hold
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
        if self.hold and len(msg.samples) < self.batch.group_size:
            self.held.append((identity, srv, msg))      # part of a group: merged
            return
        if self.held:
            await self.receive_held()
        await self._receive(identity, srv, msg)
        self.batches.check()

    async def _receive(self, identity: bytes, srv, msg: protocol.RolloutResult) -> None:
        """Intake (and evaluation) of one result; its Ack held for the burst (none when the
        rollout log could not write it: the server keeps the result)."""
        evaluation, receive = self.evaluation, self.receiver.receive
        try:
            ack = await (evaluation.receive(msg, receive) if evaluation else receive(msg))
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
        self.batches.check()

    async def flush(self) -> None:
        """Receive the held results; send the held Acks, one per server; a server whose Ack
        cannot be queued is lost; then dispatch once, as after each result before."""
        if self.held:
            await self.receive_held()
        if not self.pending_acks:
            return
        sent = False
        for identity, srv, ack in self.pending_acks.take():
            if await self.link.send(identity, ack):
                sent = True
            else:
                self.admission.lose(srv, "unreachable")
        if sent:
            await self.admission.dispatch()
