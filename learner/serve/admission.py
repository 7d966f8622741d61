"""Admission: which rollout server gets which work, and when (docs/design.md §3, §6).

Servers. A server joins with ``Hello`` (declaring ``max_concurrency``, the samples it can generate
at once) and is known by its ZeroMQ identity from then on. Hello is idempotent: a known server
saying Hello again (a reconnect, or one Hello per queued heartbeat after an ``unknown_server``)
keeps its state — credits, leases — and is welcomed again; nothing is added. A server is lost when
nothing arrived from it for ``server_timeout_s``, or when a message to it cannot be queued (it is
gone, or so slow that its queue is full: the learner never waits on one server, see
:mod:`learner.serve.router`). A lost server's leases are re-issued; if it was alive after all, its next
heartbeat is answered ``unknown_server`` and it says Hello again.

Credits. ``WorkRequest(credits)`` says "I can take this many more samples". A server's credits
are capped at what it declared::

    credits + outstanding <= max_concurrency     outstanding = samples of the leases it holds

so a request for 10¹² credits, or the same request repeated after every Hello, adds at most what
the server can really take; the rest is refused and counted (``slipstream_credits_refused_total``).

Allowance. What a server declares is not what it delivers: an identity that takes work and never
returns it would hold the staleness gate's whole capacity until its leases time out. So the work
a server may hold unreturned is bounded by what it has returned, like TCP's slow start::

    outstanding + group_size <= allowance
    allowance = min(max_concurrency, initial_allowance + group_size · completed)

``completed`` = leases it completed (since its last pre-emption), so the allowance doubles with
each round of work returned and a proven server reaches its ``max_concurrency`` in a few rounds;
``initial_allowance`` 0 turns this off (the declared ``max_concurrency`` from the start), and the
trial budget below with it. A lone server is not bound: it takes no one's work, and its first
batch goes out at once, so that a one-server run with fixed seeds repeats exactly (the demo); the
allowance binds once a second server is known.

Trials. A server is *proven* once it completed a lease (since its last pre-emption). While a
proven server is known, the unproven ones together hold at most the trial budget::

    Σ outstanding(unproven) + group_size <= trial_budget
    trial_budget = max(group_size, trial_share · gate size, whole groups)
    gate size    = (max_staleness + 1) · batch_samples   (or max_inflight, if smaller)

so a fleet of identities that never return work can take a quarter of the gate (by default), not
all of it, and a server joining a running fleet still gets its first work at once (round-robin:
the least recently served goes first). While no server is proven (a run's start) there is no
budget: every server is on trial.

Silent servers. A server holding leases that has returned nothing — no result extending or
completing one — for ``silent_factor`` × its expected completion time (the mean issue → completion
time of its own leases, or of every server's while it has completed none, or ``silent_min_s``
while no server has; at least ``silent_min_s``) while another server waits for work
(credits for a group, eligible, and nothing to give it) loses its leases. An unproven holder's
threshold is shared with the idle servers waiting for a trial: × H / (H + W) for H unproven
holders and W idle waiting servers (still at least ``silent_min_s``), so that a whole rotation of
trials takes about one threshold however many identities wait, instead of one threshold per
round of H (20 identities holding the gate ahead of an honest server starved it for minutes
otherwise). They are re-issued at
once (``slipstream_leases_preempted_total``, a ``leases_preempted`` event), preferably to a
server that has returned work, the first ``max_attempts`` times without using up an attempt
(``RolloutBuffer.preempt_holder``: a late result of its own still counts, the first copy of every
sample wins). Its allowance starts again from ``initial_allowance`` and it gets no new
work for a probation of that threshold, doubling with every pre-emption in a row without a lease
completed (at most ``lease_timeout_s``). So a fleet of identities that hold work and heartbeat
but never return it cannot starve the run for longer than a threshold, and each then holds at most
one allowance for ever shorter shares of the time. Without servers waiting nothing is taken:
a slow server that keeps the others busy is left alone until ``lease_timeout_s``.

Identities. At most ``max_servers`` servers are known at once; a Hello from another identity is
answered ``Error(code="too_many_servers")`` and counted
(``slipstream_rollout_servers_refused_total{reason}``; a refused ``duplicate_server_id`` too).

Dispatch. Credits become assignments (one group of ``group_size`` samples each) in round-robin
order — the server given work least recently (or never) goes first — while:

- the server has ``group_size`` credits left;
- the server is not lagging: ``learner_version − server_version <= max_staleness``. What a
  lagging server would generate is over the staleness limit before it is sent, so it gets no new
  work until it applies newer weights (``WeightsApplied`` or a heartbeat with its new version);
- for new work, the buffer's staleness gate has room for a whole group (``capacity(v) >=
  group_size``). Leases waiting for re-issue go first, and need no room: their samples are still
  counted in flight;
- an unproven server, while the trial budget has room for a group (see Trials).

Restarts. A server puts a per-process ``session`` in its Hello's metadata. A Hello from a known
identity with another session is a restarted process (same ``server_id``): its old leases are
released for re-issue at once and it joins as new capacity, instead of its work waiting for the
leases to expire.

Runs. A server that says Hello with a version above the learner's comes from another run (this
learner was started without ``--resume``): the mismatch is logged, the server gets no work while
its version is above the learner's (its tokens would be refused), and the newest manifest is
announced to it (the learner publishes version 0 at start, so there is always one); the server
fetches it, re-tags, and works from then on.

Circuit breaker. A server reporting ``Error(code="weights_failed")`` ``weights_failure_limit``
times in a row (fetch or update failed, manifest refused) is dropped from dispatch with a
``server_dropped`` event: it would otherwise keep generating with weights ever more stale. It
keeps its connection and its leases, gets the manifest re-announced, and re-joins dispatch
(``server_readmitted``) once it applies a published version.

Wrong weights. A server whose ``WeightsApplied`` names a version with a checksum that is not the
published one (its weights are not the learner's: a corrupted fetch it did not catch, another
run's file, a bug or a lie) gets no work until it applies the newest published version with the
right checksum (``server_verified``). At the mismatch its leases are released for re-issue, the
event ``checksum_mismatch`` says so and ``slipstream_weights_checksum_mismatch_total`` counts it;
the version is remembered (:meth:`Admission.distrusted`) and the intake refuses, as
``unverified_weights``, every sample of that server with a token of such a version, whenever it
arrives.

Re-issue. Leases that expire (``RolloutBuffer.expire``, checked by :meth:`Admission.tick`) or whose
holder was lost go to the next eligible server, same assignment id, attempt + 1, stamped with the
current version. The buffer keeps the first copy of every sample and answers later ones
``duplicate``: nothing lost, nothing trained twice.

Refusals. A server that cannot take an assignment (its limits: prompt length, vocabulary,
group size) answers ``Error(code="assignment_refused", ref_id=assignment_id)``; the lease is
released at once (:meth:`Admission.refused`) and re-issued, at most ``max_attempts`` times in all.
A sample the learner refuses (acked ``invalid``: its reward beyond ``max_abs_reward``, ...) will
not come again either, so its lease is released the same way (:meth:`Admission.release_invalid`,
called by the intake) instead of waiting for its deadline.

Weights. :meth:`Admission.announce` sends each new manifest to every server; a server that
rejoins, or is still behind the newest version ``reannounce_s`` after it was announced to it,
gets it again (with its next heartbeat).

Evaluation. ``side_work`` (a :class:`SideWork`: :class:`learner.data.evaluation.Evaluation`) is
work outside the gate: its assignments have their own ids and leases (the same
:class:`buffer.leases.LeaseTable` kind, a table of its own), but take server credits, so
:meth:`outstanding` counts them and :meth:`dispatch` hands them out first, one credit each, to
the eligible server holding fewest of them that ``side_work.wants`` (it has applied the round's
version): ``side_work.take(server)`` leases the next one, Admission charges the credit and sends
it. Refusals, lost servers and expiry reach it too.

Everything here is driven by calls — no socket, no task, no clock of its own: it is handed a
``send(identity, message) -> bool`` coroutine, a clock, and a factory of new assignments.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import protocol
from buffer import Lease, LeaseState, RolloutBuffer
from learner.config import ServersSettings
from learner.metrics import LearnerMetrics
from protocol.plumbing.sockets import endpoint_problem

KEEP_CHECKSUMS = 8        # checksums of recent versions kept to check WeightsApplied against
KEEP_DISTRUSTED = 64      # versions remembered per server whose weights it applied wrongly
REFUSAL_LOG_EVERY_S = 1.0  # at most one server_refused event a second (a Hello flood), the rest counted


@dataclass
class ServerState:
    """What the learner knows about one connected rollout server."""

    server_id: str
    identity: bytes
    max_concurrency: int
    version: int = 0                   # weights version the server reports as applied
    credits: int = 0                   # samples it asked for and has not been given yet
    last_seen: float = 0.0
    announced: int = -1                # newest manifest version queued to it
    announced_at: float = float("-inf")
    served: int = -1                   # dispatch sequence number of its last assignment
    session: str = ""                  # per-process id from its Hello (a restart changes it)
    weights_failures: int = 0          # weights_failed reports in a row
    dropped: bool = False              # circuit breaker open: no dispatch until it applies weights
    idle_ratio: float = math.nan       # its engine's idle fraction, from its last Heartbeat (none yet: NaN)
    completed_mark: int = 0            # its completed leases at its last pre-emption (allowance grows past it)
    preempted: int = 0                 # pre-emptions in a row without a lease completed since
    hold_until: float = float("-inf")  # probation after a pre-emption: no new work before this
    unverified: bool = False           # applied weights with a wrong checksum: no work until verified
    relay: protocol.WeightsSource | None = None   # where it serves weight chunks to peers (Hello)


def _served(srv: ServerState) -> int:
    return srv.served


class Sender(Protocol):
    """Where messages to rollout servers go (the rollout socket: learner.serve.router.RolloutLink)."""

    async def send(self, identity: bytes, message: protocol.Message) -> bool:
        """Queue ``message`` to the server at ``identity``; False if it could not be queued."""
        ...


class Offers(Protocol):
    """What the learner hands rollout servers (learner.serve.offers.LearnerOffers)."""

    def welcome(self) -> protocol.Welcome:
        """The ``Welcome`` that answers a Hello."""
        ...

    def next_assignment(self) -> protocol.Assignment | None:
        """The next fresh assignment (next prompt, new id, current version); None when the
        prompts are used up."""
        ...


class SideWork(Protocol):
    """Work outside the staleness gate that takes server credits (evaluation rounds)."""

    def owns(self, assignment_id: str) -> bool: ...

    def outstanding(self, server_id: str) -> int:
        """Samples of its assignments ``server_id`` holds."""
        ...

    def wants(self, server_version: int) -> bool:
        """It has work a server at ``server_version`` may take."""
        ...

    def take(self, server_id: str) -> protocol.Assignment | None:
        """Lease its next assignment to ``server_id`` (None: nothing waits)."""
        ...

    def refused(self, server_id: str, assignment_id: str) -> None: ...

    def release_holder(self, server_id: str) -> None: ...

    def expire(self) -> None: ...


class Admission:
    """Servers, credits, dispatch, re-issue, expiry and the lag rule (see the module docstring).

    Args:
        buffer: the run's RolloutBuffer (the gate, the leases).
        link: the :class:`Sender` port (the rollout socket).
        offers: the :class:`Offers` port (the Welcome, fresh assignments).
        version: the learner's policy version now.
        servers: the ``learner.servers`` section (learner.config.sections.ServersSettings): read
            at use time, so ``ctl set servers.max_inflight_per_server`` applies at the next
            dispatch. Among its keys: ``server_timeout_s`` (silence after which a server is
            lost), ``reannounce_s`` (see the module docstring), ``max_servers`` (servers known at
            once; another identity's Hello is refused), ``initial_allowance`` (samples a server
            may hold before it returned any; 0: no allowance), ``silent_factor`` and
            ``silent_min_s`` (when a server holding work counts as silent), ``trial_share``
            (share of the gate the unproven servers hold at most, see Trials).
        clock: monotonic seconds (tests pass a fake one; give the buffer the same one).
    """

    def __init__(self, buffer: RolloutBuffer, link: Sender, offers: Offers, *, version: Callable[[], int],
                 servers: ServersSettings, metrics: LearnerMetrics,
                 log: Callable[..., None] = lambda event, **fields: None,
                 clock: Callable[[], float] = time.monotonic, relay_fanout: int = 0,
                 delta_ratio: Callable[[], float | None] = lambda: None):
        self.buffer, self.link, self.offers, self.settings = buffer, link, offers, servers
        self.relay_fanout = relay_fanout          # learner.weights.relay_fanout (0: no relay plan)
        # WeightsServer.delta_ratio: the size of the last deltas the learner made over the raw
        # chunks (None: none made yet); the plan sends deltas straight when they are that small.
        self.delta_ratio = delta_ratio
        self.previous: int | None = None          # the version announced before the latest
        self.version, self.metrics, self.log, self.clock = version, metrics, log, clock
        self._refusal_logged, self._refusals_suppressed = float("-inf"), 0
        self.paused = False                       # ctl pause: no new or re-issued work until resume
        self.servers: dict[bytes, ServerState] = {}
        self._dispatched = 0
        self.reissue: deque[Lease] = deque()
        self.latest: protocol.WeightsAvailable | None = None
        self._checksums: OrderedDict[int, str] = OrderedDict()
        self._distrusted: dict[str, set[int]] = {}   # server_id -> versions applied with a wrong checksum
        self.closed = False
        self.versions_changed = asyncio.Event()   # set whenever a server's version changes or it leaves
        # Work outside the staleness gate (learner.data.evaluation): its own leases and namespace, but
        # it takes server credits, so it is counted in outstanding() and dispatched first.
        self.side_work: SideWork | None = None

    def pause(self, paused: bool) -> None:
        """``ctl pause`` / ``resume``: no new or re-issued work while paused."""
        self.paused = paused

    # -- queries ----------------------------------------------------------------------------------

    def outstanding(self, srv: ServerState) -> int:
        """Samples of the leases ``srv`` holds (it was asked to generate them and has not finished)."""
        held = self.buffer.leases.held_samples(srv.server_id)
        return held + (self.side_work.outstanding(srv.server_id) if self.side_work is not None else 0)

    def allowance(self, srv: ServerState) -> int:
        """Samples ``srv`` may hold unreturned (see the module docstring: Allowance)."""
        if not self.settings.initial_allowance or len(self.servers) <= 1:
            return srv.max_concurrency        # a lone server starves no one (and runs repeat)
        g = self.buffer.group_size
        completed = self.buffer.leases.delivery(srv.server_id).completed - srv.completed_mark
        return min(srv.max_concurrency, max(g, self.settings.initial_allowance) + g * max(0, completed))

    def proven(self, srv: ServerState) -> bool:
        """``srv`` completed a lease since its last pre-emption (see the module docstring: Trials)."""
        return self.buffer.leases.delivery(srv.server_id).completed > srv.completed_mark

    def trial_budget(self) -> int:
        """Samples the unproven servers may hold together while a proven one is known."""
        g, gate = self.buffer.group_size, self.buffer.gate
        size = (gate.max_staleness + 1) * gate.batch_samples
        if gate.max_inflight is not None:
            size = min(size, gate.max_inflight)
        return max(g, int(self.settings.trial_share * size) // g * g)

    def _trials_open(self) -> bool:
        """An unproven server may get another group now (the trial budget has room for one, or
        there is no budget: the allowance is off, or no server is proven yet)."""
        if not self.settings.initial_allowance or len(self.servers) <= 1:
            return True
        unproven = [s for s in self.servers.values() if not self.proven(s)]
        if len(unproven) == len(self.servers):
            return True
        held = sum(self.outstanding(s) for s in unproven)
        return held + self.buffer.group_size <= self.trial_budget()

    def rollout_idle_ratio(self) -> float:
        """Mean idle ratio the connected servers last reported; NaN while none has reported (a
        server that has sent no Heartbeat yet is left out: it is unknown, not busy)."""
        ratios = [s.idle_ratio for s in self.servers.values() if not math.isnan(s.idle_ratio)]
        return sum(ratios) / len(ratios) if ratios else math.nan

    def lagging(self, srv: ServerState) -> bool:
        """The lag rule: more than ``max_staleness`` versions behind gets no new work."""
        return self.version() - srv.version > self.buffer.max_staleness

    def eligible(self, srv: ServerState) -> bool:
        """May get new work: not lagging, not ahead of the learner (another run's weights), its
        circuit breaker closed, and under the operator's ``max_inflight_per_server`` cap."""
        if srv.dropped or srv.unverified or self.lagging(srv) or srv.version > self.version():
            return False
        if srv.hold_until > self.clock():
            return False                          # on probation after a pre-emption
        # The operator's cap, and the allowance where it binds (below what the server declared:
        # its credits bound it there, and a server declaring less than a group still gets side work).
        limits = [n for n in (self.settings.max_inflight_per_server, self.allowance(srv)) if 0 < n < srv.max_concurrency]
        if self.settings.max_inflight_per_server:
            limits.append(self.settings.max_inflight_per_server)
        return not limits or self.outstanding(srv) + self.buffer.group_size <= min(limits)

    def touch(self, identity: bytes) -> ServerState | None:
        """The server behind ``identity``, marked alive now; None if it has not said Hello."""
        srv = self.servers.get(identity)
        if srv is not None:
            srv.last_seen = self.clock()
        return srv

    def status(self) -> dict[str, dict[str, Any]]:
        now = self.clock()
        return {s.server_id: {"version": s.version, "credits": s.credits,
                              "outstanding": self.outstanding(s), "max_concurrency": s.max_concurrency,
                              "allowance": self.allowance(s),
                              "completed": self.buffer.leases.delivery(s.server_id).completed,
                              "probation_s": round(max(0.0, s.hold_until - now), 3),
                              "lagging": self.lagging(s), "dropped": s.dropped, "unverified": s.unverified,
                              "weights_failures": s.weights_failures}
                for s in self.servers.values()}

    def all_at(self, version: int) -> bool:
        """True when every connected server reports ``version`` or newer."""
        return all(s.version >= version for s in self.servers.values())

    # -- messages from servers --------------------------------------------------------------------

    async def hello(self, identity: bytes, msg: protocol.Hello) -> None:
        """Join, or rejoin without change (idempotent); answer Welcome (+ the newest manifest)."""
        now = self.clock()
        taken = next((s for s in self.servers.values()
                      if s.server_id == msg.server_id and s.identity != identity), None)
        if taken is not None:
            await self._refuse(identity, msg, "duplicate_server_id",
                               f"server_id {msg.server_id!r} is connected from another socket; give "
                               "each rollout server its own server_id")
            return
        srv = self.servers.get(identity)
        session = msg.metadata.get("session")
        session = session if isinstance(session, str) else ""
        if srv is not None and session and srv.session and session != srv.session:
            self.lose(srv, "restarted")           # its leases are re-issued now, not at expiry
            srv = None
        if srv is None and len(self.servers) >= self.settings.max_servers:
            await self._refuse(identity, msg, "too_many_servers",
                               f"this learner serves at most {self.settings.max_servers} rollout servers "
                               "(learner.servers.max_servers)")
            return
        if srv is None:
            srv = self.servers[identity] = ServerState(msg.server_id, identity, msg.max_concurrency,
                                                       session=session)
            self.metrics.servers.set(len(self.servers))
            self.log("server_joined", server=msg.server_id, server_version=msg.version,
                     max_concurrency=msg.max_concurrency)
            if msg.max_concurrency < self.buffer.group_size:
                self.log("server_too_small", server=msg.server_id, max_concurrency=msg.max_concurrency,
                         group_size=self.buffer.group_size,
                         hint="a server gets whole groups: raise its max_concurrency to >= group_size")
        else:
            # A server grants all its free slots after every Welcome: credits carried over from
            # before the Hello would be counted twice.
            srv.max_concurrency = msg.max_concurrency
            srv.credits = 0
            self.log("server_rejoined", server=msg.server_id, server_version=msg.version,
                     credits=srv.credits)
        srv.last_seen = now
        srv.relay = None
        if msg.relay is not None:
            problem = endpoint_problem(msg.relay.endpoint)
            if problem is None:
                srv.relay = msg.relay
            else:
                self.log("relay_refused", level="warning", server=msg.server_id,
                         endpoint=msg.relay.endpoint[:200], reason=problem)
        srv.announced = -1            # it may have missed a manifest while away
        self._set_version(srv, msg.version, force=True)
        if msg.version > self.version():
            self.log("server_version_mismatch", level="warning", server=msg.server_id,
                     server_version=msg.version, learner_version=self.version(),
                     hint="the server holds weights of another run, or of steps after the checkpoint "
                          "this learner resumed from: no work until it applies this run's weights")
        if not await self._send(srv, self.offers.welcome()):
            return
        if self.latest is not None and self.latest.version != srv.version:
            if not await self._announce_to(srv, self.latest):
                return
        await self.dispatch()

    async def _refuse(self, identity: bytes, msg: protocol.Hello, code: str, message: str) -> None:
        """Refuse a Hello: counted by reason, answered ``Error(code)``, logged at most once a
        second (a flood of identities must not flood the log)."""
        self.metrics.servers_refused.labels(reason=code).inc()
        now = self.clock()
        if now - self._refusal_logged >= REFUSAL_LOG_EVERY_S:
            self.log("server_refused", level="warning", server=msg.server_id[:200], reason=code,
                     suppressed=self._refusals_suppressed)
            self._refusal_logged, self._refusals_suppressed = now, 0
        else:
            self._refusals_suppressed += 1
        await self.link.send(identity, protocol.Error(code=code, message=message))

    async def work_request(self, srv: ServerState, msg: protocol.WorkRequest) -> None:
        room = max(0, srv.max_concurrency - self.outstanding(srv) - srv.credits)
        granted = min(msg.credits, room)
        if granted < msg.credits:
            self.metrics.credits_refused.inc(msg.credits - granted)
        srv.credits += granted
        await self.dispatch()

    async def heartbeat(self, srv: ServerState, msg: protocol.Heartbeat) -> None:
        srv.idle_ratio = msg.idle_ratio
        changed = self._set_version(srv, msg.version)
        latest = self.latest
        if (latest is not None and srv.version != latest.version
                and (srv.announced < latest.version or self.clock() - srv.announced_at >= self.settings.reannounce_s)):
            if not await self._announce_to(srv, latest):
                return
        if changed:
            await self.dispatch()

    async def weights_applied(self, srv: ServerState, msg: protocol.WeightsApplied) -> bool:
        """Record the server's new version; False if its checksum is not the published one (the
        server then gets no work until it applies the newest version rightly: module docstring,
        Wrong weights)."""
        self._set_version(srv, msg.version)
        expected = self._checksums.get(msg.version)
        ok = expected is None or expected == msg.checksum
        if not ok:
            self._distrust(srv, msg.version, msg.checksum, expected)
        else:
            srv.weights_failures = 0
            if srv.dropped:
                srv.dropped = False
                self.log("server_readmitted", server=srv.server_id, server_version=msg.version)
            if srv.unverified and expected is not None and (
                    self.latest is None or msg.version >= self.latest.version):
                srv.unverified = False
                self._count_unverified()
                self.log("server_verified", server=srv.server_id, server_version=msg.version)
        await self.dispatch()
        return ok

    def _distrust(self, srv: ServerState, version: int, checksum: str, expected: str) -> None:
        """``srv`` applied ``version`` with weights that are not the published ones."""
        bad = self._distrusted.setdefault(srv.server_id, set())
        bad.add(version)
        while len(bad) > KEEP_DISTRUSTED:
            bad.discard(min(bad))
        released = self.buffer.release_holder(srv.server_id)
        self.reissue.extend(released)
        if released:
            self.metrics.leases_released.labels(reason="unverified_weights").inc(len(released))
        if self.side_work is not None:
            self.side_work.release_holder(srv.server_id)
        srv.unverified = True
        self.metrics.weights_checksum_mismatch.inc()
        self._count_unverified()
        self.log("checksum_mismatch", level="warning", server=srv.server_id, server_version=version,
                 checksum=str(checksum)[:100], expected=expected, released_assignments=len(released),
                 hint="no work for this server until it applies the newest version with the published "
                      "checksum; its samples of this version are refused")

    def distrusted(self, server_id: str) -> set[int] | None:
        """The versions ``server_id`` applied with a wrong checksum (its tokens of them are not
        the learner's policy's), or None."""
        return self._distrusted.get(server_id)

    async def weights_failed(self, srv: ServerState, message: str) -> None:
        """``srv`` could not fetch or apply announced weights; the circuit breaker counts it."""
        srv.weights_failures += 1
        if srv.weights_failures >= self.settings.weights_failure_limit and not srv.dropped:
            srv.dropped = True
            self.metrics.servers_dropped.inc()
            self.log("server_dropped", level="warning", server=srv.server_id, reason="weights",
                     failures=srv.weights_failures, last_error=message[:500],
                     hint="no new work until it applies a published version")

    async def refused(self, srv: ServerState, assignment_id: str, reason: str) -> None:
        """``srv`` refused an assignment (``Error(code="assignment_refused")``): its lease goes back
        for re-issue at once instead of waiting for its deadline (after ``max_attempts`` refusals
        the assignment is given up and counted failed); the credits it used are not returned."""
        if self.side_work is not None and self.side_work.owns(assignment_id):
            self.side_work.refused(srv.server_id, assignment_id)
            self.log("assignment_refused", server=srv.server_id, assignment_id=assignment_id[:200],
                     reason=reason[:500], reissued=True)
            await self.dispatch()
            return
        released = self.buffer.release(assignment_id, srv.server_id)
        self.reissue.extend(released)
        self.metrics.leases_released.labels(reason="assignment_refused").inc(len(released))
        self.log("assignment_refused", server=srv.server_id, assignment_id=assignment_id[:200],
                 reason=reason[:500], reissued=bool(released))
        await self.dispatch()

    def release_invalid(self, server_id: str, assignment_id: str) -> bool:
        """The learner refused a sample of ``assignment_id`` from ``server_id`` (acked invalid, so
        it will not come again): the lease goes back for re-issue now, if ``server_id`` holds it
        (``max_attempts`` bounds the tries; then the assignment is given up, counted failed). The
        caller dispatches (after the Acks). True when a lease was released."""
        released = self.buffer.release(assignment_id, server_id)
        self.reissue.extend(released)
        if released:
            self.metrics.leases_released.labels(reason="invalid").inc(len(released))
        return bool(released)

    def _set_version(self, srv: ServerState, version: int, force: bool = False) -> bool:
        changed = version != srv.version
        srv.version = version
        if changed or force:
            self.metrics.server_version.labels(server=srv.server_id).set(version)
            self._skew()
            self.versions_changed.set()
        return changed

    def _count_unverified(self) -> None:
        """``slipstream_rollout_servers_unverified``: the servers held for wrong weights."""
        self.metrics.servers_unverified.set(sum(s.unverified for s in self.servers.values()))

    def _skew(self) -> None:
        """``slipstream_rollout_version_skew``: newest minus oldest applied version of the fleet."""
        versions = [s.version for s in self.servers.values()]
        self.metrics.version_skew.set(max(versions) - min(versions) if versions else 0)

    # -- weights ----------------------------------------------------------------------------------

    async def announce(self, manifest: protocol.WeightsAvailable) -> None:
        """A new version is published: tell every server."""
        if self.latest is not None and self.latest.version != manifest.version:
            self.previous = self.latest.version
        self.latest = manifest
        self._checksums[manifest.version] = manifest.checksum
        while len(self._checksums) > KEEP_CHECKSUMS:
            self._checksums.popitem(last=False)
        for srv in list(self.servers.values()):
            if srv.identity in self.servers:
                await self._announce_to(srv, manifest)

    def sources(self, srv: ServerState, manifest: protocol.WeightsAvailable) -> list[protocol.WeightsSource]:
        """The relay plan's answer for ``srv`` (docs/design.md §5, Relay): the peer it fetches
        ``manifest`` from first ([]: the learner). A server that already applied this version
        with the right checksum serves one that joins or comes late; at a publish, when none
        has it yet, the relaying servers form a tree of ``relay_fanout`` children per node in
        the order they joined (the first fetches from the learner), and a server that relays
        nothing hangs off them in turn. The learner sends each version about once. Except:
        servers holding the version before get its deltas from the learner when all of them
        together cost at most one model (:meth:`_direct_deltas`)."""
        if self.relay_fanout <= 0 or self._direct_deltas(srv, manifest):
            return []
        relays = [s for s in self.servers.values() if s.relay is not None and not s.dropped and not s.unverified]
        holders = [s for s in relays if s is not srv and s.version == manifest.version]
        position = list(self.servers).index(srv.identity) if srv.identity in self.servers else 0
        if holders:
            return [holders[position % len(holders)].relay]
        if srv in relays:
            j = relays.index(srv)
            return [] if j == 0 else [relays[(j - 1) // self.relay_fanout].relay]
        return [relays[position % len(relays)].relay] if relays else []

    def _direct_deltas(self, srv: ServerState, manifest: protocol.WeightsAvailable) -> bool:
        """``srv`` holds the version announced before ``manifest`` and the learner's deltas are
        small enough that sending one to every server holding it costs at most one model
        (the last deltas' ratio x those servers <= 1): it fetches them from the learner, the
        fastest way (a relay makes its own deltas again at every hop)."""
        ratio = self.delta_ratio()
        if ratio is None or manifest.kind != "full" or self.previous is None or srv.version != self.previous:
            return False
        holding = sum(1 for s in self.servers.values() if s.version == self.previous and not s.unverified)
        return ratio * holding <= 1.0

    async def _announce_to(self, srv: ServerState, manifest: protocol.WeightsAvailable) -> bool:
        sources = self.sources(srv, manifest)
        if sources:
            manifest = dataclasses.replace(manifest, sources=sources)
        if not await self._send(srv, manifest):
            return False
        srv.announced, srv.announced_at = manifest.version, self.clock()
        return True

    async def broadcast(self, message: protocol.Message) -> None:
        """Send ``message`` to every server (failures lose the server, as any send)."""
        for srv in list(self.servers.values()):
            if srv.identity in self.servers:
                await self._send(srv, message)

    # -- dispatch ---------------------------------------------------------------------------------

    async def dispatch(self) -> None:
        """Turn credits into assignments while the rules above allow (see the module docstring)."""
        if self.side_work is not None:
            await self._dispatch_side_work(self.side_work)
        g = self.buffer.group_size
        planned: list[tuple[ServerState, protocol.Assignment]] = []
        while True:
            eligible = [s for s in self.servers.values() if s.credits >= g and self.eligible(s)]
            if eligible and not self._trials_open():
                eligible = [s for s in eligible if self.proven(s)]
            if not eligible:
                break
            # Work taken back from a silent server goes to one that has returned work first.
            srv = min(eligible, key=self._reissue_order if self.reissue else _served)
            assignment = self._next_work(srv)
            if assignment is None:
                break
            srv.credits -= g
            self._dispatched += 1
            srv.served = self._dispatched
            planned.append((srv, assignment))
        # Each server hears how many more of this burst follow (Assignment.burst_left), so it
        # starts generating on the last one instead of waiting out its batch window (5 ms a
        # cycle at max_staleness 0, where every batch is dispatched at once).
        left = collections.Counter(srv.identity for srv, _ in planned)
        for srv, assignment in planned:
            left[srv.identity] -= 1
            if self.servers.get(srv.identity) is not srv:
                continue                          # lost by an earlier send: its leases re-issue
            assignment.burst_left = left[srv.identity]
            await self._send(srv, assignment)      # not queued: srv is lost, the lease re-issued

    async def _dispatch_side_work(self, side: SideWork) -> None:
        """Side work first, a credit each, to the eligible server holding fewest of it (also after
        :meth:`close`: the last version's evaluation round still runs; not while paused)."""
        while not self.paused:
            ready = [s for s in self.servers.values()
                     if s.credits >= 1 and self.eligible(s) and side.wants(s.version)]
            if not ready:
                return
            srv = min(ready, key=lambda s: side.outstanding(s.server_id))
            assignment = side.take(srv.server_id)
            if assignment is None:
                return
            srv.credits -= 1
            await self._send(srv, assignment)      # not queued: srv is lost, the lease re-issued

    def _reissue_order(self, srv: ServerState) -> tuple[bool, int]:
        return not self.proven(srv), srv.served

    def _next_work(self, srv: ServerState) -> protocol.Assignment | None:
        if self.closed or self.paused:
            return None
        while self.reissue and not self._reissuable(self.reissue[0]):
            self.reissue.popleft()               # finished meanwhile by its first holder
        if self.reissue:
            lease = self.buffer.reissue(self.reissue.popleft(), srv.server_id)
            return dataclasses.replace(lease.payload, version=self.version(), attempt=lease.attempt)
        if self.buffer.capacity(self.version()) < self.buffer.group_size:
            return None
        assignment = self.offers.next_assignment()
        if assignment is None:
            return None                          # the prompts are used up (a finite dataset)
        self.buffer.issue(assignment.assignment_id, srv.server_id, self.buffer.group_size,
                          payload=assignment)
        return assignment

    def _reissuable(self, lease: Lease) -> bool:
        return self.buffer.leases.get(lease.assignment_id) is lease and lease.state is LeaseState.EXPIRED

    def close(self) -> None:
        """The run is over: no new work, no re-issue (servers stay known, for the final sync)."""
        self.closed = True

    # -- time -------------------------------------------------------------------------------------

    async def tick(self) -> None:
        """Lose silent servers, expire overdue leases, and hand out what that freed."""
        now = self.clock()
        for srv in list(self.servers.values()):
            if now - srv.last_seen > self.settings.server_timeout_s:
                self.lose(srv, "timeout")
        self.reissue.extend(self.buffer.expire())
        if self.side_work is not None:
            self.side_work.expire()
        await self.dispatch()
        if self._preempt_silent(now):
            await self.dispatch()

    def silence(self, srv: ServerState, now: float, oldest_issue: float | None,
                share: float = 1.0) -> tuple[float, float]:
        """``(silent_s, threshold_s)`` of ``srv``: how long it has returned nothing while holding
        work (0 without leases), and how long it may; ``share`` scales the threshold (an unproven
        holder's H / (H + W), see the module docstring: Silent servers)."""
        if oldest_issue is None:
            return 0.0, math.inf
        leases = self.buffer.leases
        d = leases.delivery(srv.server_id)
        expected = d.mean_s if not math.isnan(d.mean_s) else leases.mean_completion_s
        if math.isnan(expected):              # nothing completed anywhere yet (a run's start)
            expected = self.settings.silent_min_s
        threshold = max(self.settings.silent_min_s, self.settings.silent_factor * expected * share)
        return now - max(d.last_s, oldest_issue), threshold

    def _preempt_silent(self, now: float) -> bool:
        """Take the leases of silent servers while others wait for work (module docstring:
        Silent servers). True when something was taken."""
        if self.closed or self.paused or len(self.servers) < 2:
            return False
        oldest = self.buffer.leases.oldest_issue_by_holder()
        g = self.buffer.group_size
        wanting = [s for s in self.servers.values() if s.credits >= g and self.eligible(s)]
        if not wanting:
            return False
        unproven = sum(1 for s in self.servers.values() if s.server_id in oldest and not self.proven(s))
        idle = sum(1 for s in wanting if s.server_id not in oldest)
        share = unproven / (unproven + idle) if unproven else 1.0
        silent = []
        for srv in self.servers.values():
            silent_s, threshold = self.silence(srv, now, oldest.get(srv.server_id),
                                               1.0 if self.proven(srv) else share)
            if silent_s > threshold:
                silent.append((srv, silent_s, threshold))
        if not silent:
            return False
        quiet = {srv.identity for srv, _, _ in silent}
        waiting = sum(1 for s in wanting if s.identity not in quiet)
        if not waiting:
            return False
        for srv, silent_s, threshold in silent:
            self._preempt(srv, now, silent_s, threshold, waiting)
        return True

    def _preempt(self, srv: ServerState, now: float, silent_s: float, threshold: float,
                 waiting: int) -> None:
        taken = self.buffer.preempt_holder(srv.server_id)
        if self.side_work is not None:
            self.side_work.release_holder(srv.server_id)
        self.reissue.extend(taken)
        completed = self.buffer.leases.delivery(srv.server_id).completed
        if completed > srv.completed_mark:
            srv.preempted = 0                 # it completed work since its last pre-emption
        srv.preempted += 1
        srv.completed_mark = completed        # the allowance starts again from initial_allowance
        probation = min(self.buffer.leases.timeout_s, threshold * 2 ** (srv.preempted - 1))
        srv.hold_until = now + probation
        self.metrics.leases_preempted.inc(len(taken))
        self.log("leases_preempted", level="warning", server=srv.server_id, leases=len(taken),
                 silent_s=round(silent_s, 3), threshold_s=round(threshold, 3),
                 waiting_servers=waiting, probation_s=round(probation, 3),
                 hint="it holds work and returns nothing while other servers wait: re-issued")

    def lose(self, srv: ServerState, reason: str) -> None:
        """Forget ``srv``; its leases wait for re-issue (to any server, itself after a new Hello)."""
        if self.servers.get(srv.identity) is not srv:
            return
        del self.servers[srv.identity]
        released = self.buffer.release_holder(srv.server_id)
        self.buffer.leases.forget(srv.server_id)
        self.reissue.extend(released)
        if self.side_work is not None:
            self.side_work.release_holder(srv.server_id)
        try:
            self.metrics.server_version.remove(srv.server_id)
        except KeyError:
            pass
        self.metrics.servers.set(len(self.servers))
        self._count_unverified()
        self._skew()
        self.metrics.servers_lost.labels(reason=reason).inc()
        self.versions_changed.set()
        self.log("server_lost", server=srv.server_id, reason=reason,
                 released_assignments=len(released))

    async def _send(self, srv: ServerState, message: protocol.Message) -> bool:
        if await self.link.send(srv.identity, message):
            return True
        self.lose(srv, "unreachable")
        return False
