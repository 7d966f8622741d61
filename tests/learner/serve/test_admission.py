"""Admission without sockets or a model: a recording ``send``, a fake clock, a real RolloutBuffer.

Gate arithmetic in the comments: B = batch_samples, g = group_size, η = max_staleness,
capacity(v) = (v + η + 1)·B − (accepted_total + in_flight).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from learner_testkit import samples_for

import protocol
from buffer import RolloutBuffer
from learner.config import ServersSettings
from learner.metrics import LearnerMetrics
from learner.serve.admission import Admission


class Harness:
    def __init__(self, *, g: int = 2, batch_prompts: int = 2, eta: int = 1, lease_timeout_s: float = 50.0,
                 server_timeout_s: float = 10.0, reannounce_s: float = 5.0, **guards):
        self.now = 1000.0                  # the fake clock, moved by hand: h.now += dt
        self.clock = lambda: self.now
        self.buffer = RolloutBuffer(batch_samples=g * batch_prompts, group_size=g, max_staleness=eta,
                                    lease_timeout_s=lease_timeout_s, clock=self.clock)
        self.metrics = LearnerMetrics()
        self.version = 0
        self.sent: list[tuple[bytes, protocol.Message]] = []
        self.unreachable: set[bytes] = set()
        self.attempts: list[bytes] = []    # every send tried, queued or not
        self.log: list[tuple[str, dict]] = []
        self.n = 0
        # The harness is both ports: the Sender (send) and the Offers (welcome, next_assignment).
        self.servers = ServersSettings(server_timeout_s=server_timeout_s, reannounce_s=reannounce_s, **guards)
        self.adm = Admission(self.buffer, self, self, version=lambda: self.version, servers=self.servers,
                             metrics=self.metrics, log=lambda event, **f: self.log.append((event, f)),
                             clock=self.clock)

    async def send(self, identity: bytes, msg: protocol.Message) -> bool:
        self.attempts.append(identity)
        if identity in self.unreachable:
            return False
        self.sent.append((identity, msg))
        return True

    def next_assignment(self) -> protocol.Assignment:
        self.n += 1
        return protocol.Assignment(assignment_id=f"a{self.n}", prompt_id=f"p{self.n}",
                                   prompt_token_ids=np.array([1, self.n], dtype=np.int32),
                                   group_size=self.buffer.group_size, version=self.version)

    def welcome(self) -> protocol.Welcome:
        return protocol.Welcome(learner_id="L", run_id="run", version=self.version,
                                weights_endpoint="tcp://127.0.0.1:1")

    def of_type(self, cls, identity: bytes | None = None) -> list:
        return [m for i, m in self.sent if isinstance(m, cls) and (identity is None or i == identity)]

    def assigned(self) -> list[tuple[bytes, str]]:
        return [(i, m.assignment_id) for i, m in self.sent if isinstance(m, protocol.Assignment)]

    async def join(self, name: str, max_concurrency: int = 4, version: int = 0, credits: int = 0):
        ident = name.encode()
        await self.adm.hello(ident, protocol.Hello(server_id=name, engine="e", model="m",
                                                   version=version, max_concurrency=max_concurrency))
        srv = self.adm.servers[ident]
        if credits:
            await self.adm.work_request(srv, protocol.WorkRequest(server_id=name, credits=credits))
        return srv

    async def complete(self, a: protocol.Assignment) -> None:
        for s in samples_for(a, version=self.version):
            await self.buffer.put(s, self.version)


async def test_dispatch_is_round_robin_and_stops_at_the_gate():
    h = Harness(g=2, batch_prompts=2, eta=1)           # B = 4; capacity(0) = (0+1+1)·4 − 0 = 8
    a = await h.join("A", credits=4)
    b = await h.join("B", credits=4)
    assert h.assigned() == [(b"A", "a1"), (b"A", "a2"), (b"B", "a3"), (b"B", "a4")]
    assert h.buffer.capacity(0) == 0                   # 8 − (0 + 8): the gate is closed
    for m in h.of_type(protocol.Assignment):
        await h.complete(m)
        await h.adm.work_request(a if m.assignment_id < "a3" else b,
                                 protocol.WorkRequest(server_id="?", credits=2))
    assert (a.credits, b.credits) == (4, 4) and len(h.assigned()) == 4   # 8 − (8 + 0) = 0
    assert h.buffer.poll_batch(0) is not None          # one batch trained: v = 1
    h.version = 1
    await h.adm.dispatch()                             # as the train loop does after a step
    # capacity(1) = (1+1+1)·4 − (8 + 0) = 4: two groups, one each, least recently served first.
    assert h.assigned()[4:] == [(b"A", "a5"), (b"B", "a6")]
    assert h.buffer.capacity(1) == 0 and (a.credits, b.credits) == (2, 2)


async def test_credits_are_capped_at_declared_concurrency():
    h = Harness(g=2, batch_prompts=8, eta=3)           # capacity(0) = 4·16 = 64: the gate is no limit
    srv = await h.join("H", max_concurrency=4, credits=10**12)
    assert len(h.assigned()) == 2                      # 4 samples = 2 groups, not 10¹²
    assert srv.credits == 0 and h.adm.outstanding(srv) == 4
    await h.adm.work_request(srv, protocol.WorkRequest(server_id="H", credits=10**12))
    assert len(h.assigned()) == 2
    assert h.metrics.value("slipstream_credits_refused_total") == 2 * 10**12 - 4
    await h.adm.heartbeat(srv, protocol.Heartbeat(sender_id="H", version=0))
    assert len(h.assigned()) == 2


async def test_the_rollout_idle_ratio_counts_only_servers_that_have_reported():
    """Before any Heartbeat a server's idle ratio is unknown (NaN), not 0 (busy): a step row of
    a run's first seconds must not claim the servers never waited. The mean is over the servers
    that have reported."""
    h = Harness()
    a = await h.join("A")
    b = await h.join("B")
    assert math.isnan(h.adm.rollout_idle_ratio())
    await h.adm.heartbeat(a, protocol.Heartbeat(sender_id="A", version=0, idle_ratio=0.6))
    assert h.adm.rollout_idle_ratio() == pytest.approx(0.6)        # B unknown: left out
    await h.adm.heartbeat(b, protocol.Heartbeat(sender_id="B", version=0, idle_ratio=0.2))
    assert h.adm.rollout_idle_ratio() == pytest.approx(0.4)
    await h.adm.heartbeat(b, protocol.Heartbeat(sender_id="B", version=0, idle_ratio=0.0))
    assert h.adm.rollout_idle_ratio() == pytest.approx(0.3)        # a busy server counts as 0


async def test_hello_is_idempotent():
    h = Harness(g=2, batch_prompts=8, eta=3)
    await h.join("S", max_concurrency=6, credits=6)    # 3 groups out
    for _ in range(6):                                 # a reconnect storm: Hello + WorkRequest each
        srv = await h.join("S", max_concurrency=6, credits=6)
    assert list(h.adm.servers) == [b"S"]
    assert len(h.of_type(protocol.Welcome)) == 7       # every Hello is welcomed
    assert len(h.assigned()) == 3                      # ... but adds no credits
    assert srv.credits + h.adm.outstanding(srv) == 6
    assert h.metrics.value("slipstream_rollout_servers") == 1


async def test_a_second_socket_cannot_take_a_connected_server_id():
    h = Harness()
    await h.join("S")
    await h.adm.hello(b"other", protocol.Hello(server_id="S", engine="e", model="m", version=0))
    assert list(h.adm.servers) == [b"S"]
    assert h.of_type(protocol.Error, b"other")[0].code == "duplicate_server_id"


async def test_lag_rule_holds_work_until_the_server_catches_up():
    h = Harness(g=2, batch_prompts=8, eta=1)
    h.version = 3                                      # server at 0: 3 − 0 > η = 1
    srv = await h.join("S", version=0, credits=4)
    assert h.adm.lagging(srv) and h.assigned() == []
    await h.adm.heartbeat(srv, protocol.Heartbeat(sender_id="S", version=1))
    assert h.assigned() == []                          # 3 − 1 = 2 > 1: still lagging
    await h.adm.weights_applied(srv, protocol.WeightsApplied(server_id="S", version=2,
                                                             checksum="x", seconds=0.1))
    assert not h.adm.lagging(srv) and len(h.assigned()) == 2
    assert all(m.version == 3 for m in h.of_type(protocol.Assignment))


async def test_expired_lease_is_reissued_with_a_new_attempt():
    h = Harness(g=2, batch_prompts=8, eta=3, lease_timeout_s=50.0, server_timeout_s=1000.0)
    await h.join("A", max_concurrency=2, credits=2)
    first = h.of_type(protocol.Assignment)[0]
    await h.join("B", max_concurrency=2)
    h.version = 1
    h.now += 51                                      # past the lease deadline; both alive
    await h.adm.tick()
    assert h.adm.reissue                               # nobody has credits yet
    await h.adm.work_request(h.adm.servers[b"B"], protocol.WorkRequest(server_id="B", credits=2))
    again = h.of_type(protocol.Assignment, b"B")[0]
    assert (again.assignment_id, again.attempt, again.version) == (first.assignment_id, 2, 1)
    assert np.array_equal(again.prompt_token_ids, first.prompt_token_ids)
    assert h.buffer.counters["reissued"] == 2 and not h.adm.reissue
    # The late first copy and the re-issued copy: the first to arrive wins, the other is a duplicate.
    await h.complete(first)
    ack = [await h.buffer.put(s, 1) for s in samples_for(again, version=1)]
    assert [str(x) for x in ack] == ["duplicate", "duplicate"]


async def test_lost_server_leases_go_to_another_server():
    h = Harness(g=2, batch_prompts=8, eta=3, server_timeout_s=10.0)
    await h.join("A", max_concurrency=4, credits=4)
    b = await h.join("B", max_concurrency=4)
    lost = {m.assignment_id for m in h.of_type(protocol.Assignment, b"A")}
    assert len(lost) == 2
    h.now += 11
    h.adm.touch(b"B")                                  # B spoke; A stayed silent
    await h.adm.tick()
    assert list(h.adm.servers) == [b"B"]
    assert h.metrics.value("slipstream_rollout_servers_lost_total", {"reason": "timeout"}) == 1
    await h.adm.work_request(b, protocol.WorkRequest(server_id="B", credits=4))
    got = h.of_type(protocol.Assignment, b"B")
    assert {m.assignment_id for m in got} == lost and all(m.attempt == 2 for m in got)


async def test_unreachable_server_is_lost_at_once_and_its_lease_reissued():
    h = Harness(g=2, batch_prompts=8, eta=3)
    a = await h.join("A", max_concurrency=2)
    b = await h.join("B", max_concurrency=2)
    h.unreachable.add(b"A")
    await h.adm.work_request(a, protocol.WorkRequest(server_id="A", credits=2))
    assert b"A" not in h.adm.servers                   # the assignment could not be queued
    assert h.metrics.value("slipstream_rollout_servers_lost_total", {"reason": "unreachable"}) == 1
    await h.adm.work_request(b, protocol.WorkRequest(server_id="B", credits=2))
    (m,) = h.of_type(protocol.Assignment, b"B")
    assert (m.assignment_id, m.attempt) == ("a1", 2)


async def test_each_server_hears_how_many_assignments_of_the_burst_follow():
    """Assignment.burst_left: a dispatch that hands several assignments to one server counts
    down to 0 on the last one for that server (interleaved servers each count their own), so the
    server starts generating on it instead of waiting out its batch window."""
    h = Harness(g=2, batch_prompts=8, eta=3)
    a = await h.join("A", max_concurrency=6)
    b = await h.join("B", max_concurrency=4)
    a.credits, b.credits = 6, 4                        # both ready when the next dispatch runs
    await h.adm.dispatch()
    by = {name: [m.burst_left for m in h.of_type(protocol.Assignment, name)] for name in (b"A", b"B")}
    assert by == {b"A": [2, 1, 0], b"B": [1, 0]}
    await h.adm.work_request(b, protocol.WorkRequest(server_id="B", credits=2))   # a burst of one
    assert h.of_type(protocol.Assignment, b"B")[-1].burst_left == 0


async def test_a_server_lost_mid_burst_gets_nothing_more_of_it():
    h = Harness(g=2, batch_prompts=8, eta=3)
    a = await h.join("A", max_concurrency=6)
    a.credits = 6
    h.unreachable.add(b"A")
    await h.adm.dispatch()                             # the first send fails: A is lost
    assert b"A" not in h.adm.servers and h.of_type(protocol.Assignment) == []
    assert h.attempts.count(b"A") == 2                 # the Welcome and one assignment, no more
    await h.join("B", max_concurrency=6, credits=6)
    got = h.of_type(protocol.Assignment, b"B")
    assert sorted(m.assignment_id for m in got) == ["a1", "a2", "a3"]   # all three re-issued
    assert [m.burst_left for m in got] == [2, 1, 0] and {m.attempt for m in got} == {2}


async def test_announce_rejoin_and_reannounce():
    h = Harness(reannounce_s=5.0)
    srv = await h.join("S")
    manifest = protocol.WeightsAvailable(version=1, kind="full", tensors=[], total_bytes=0,
                                         chunk_bytes=1024, num_chunks=0, checksum="c1")
    h.version = 1
    await h.adm.announce(manifest)
    assert h.of_type(protocol.WeightsAvailable, b"S") == [manifest]
    await h.adm.heartbeat(srv, protocol.Heartbeat(sender_id="S", version=0))
    assert len(h.of_type(protocol.WeightsAvailable)) == 1        # announced just now
    h.now += 6
    await h.adm.heartbeat(srv, protocol.Heartbeat(sender_id="S", version=0))
    assert len(h.of_type(protocol.WeightsAvailable)) == 2        # still behind: again
    await h.join("S", version=0)                                 # rejoin behind: again
    assert len(h.of_type(protocol.WeightsAvailable)) == 3
    await h.join("T", version=1)                                 # a new server already there: no
    assert h.of_type(protocol.WeightsAvailable, b"T") == []
    ok = await h.adm.weights_applied(srv, protocol.WeightsApplied(server_id="S", version=1,
                                                                  checksum="wrong", seconds=0.0))
    assert not ok and ("checksum_mismatch" in [e for e, _ in h.log])
    assert h.metrics.value("slipstream_server_policy_version", {"server": "S"}) == 1


async def test_close_stops_new_work():
    h = Harness(g=2, batch_prompts=8, eta=3)
    srv = await h.join("S", max_concurrency=4)
    h.adm.close()
    await h.adm.work_request(srv, protocol.WorkRequest(server_id="S", credits=4))
    assert h.assigned() == []


@pytest.mark.parametrize("max_concurrency", [1, 3])
async def test_credits_below_a_group_get_no_work(max_concurrency):
    h = Harness(g=2 if max_concurrency == 3 else 4, batch_prompts=8, eta=3)
    srv = await h.join("S", max_concurrency=max_concurrency, credits=max_concurrency)
    g = h.buffer.group_size
    assert len(h.assigned()) == max_concurrency // g
    assert srv.credits == max_concurrency % g


async def test_max_inflight_per_server_caps_and_pause_stops_dispatch():
    h = Harness(g=2, batch_prompts=4, eta=1)           # B = 8: the gate (16) is not the limit here
    h.servers.max_inflight_per_server = 2                 # read at each dispatch
    a = await h.join("A", max_concurrency=8, credits=8)
    assert h.assigned() == [(b"A", "a1")]               # 2 outstanding: one group under a cap of 2
    h.servers.max_inflight_per_server = 4               # ctl set max_inflight_per_server 4
    await h.adm.dispatch()
    assert [aid for _, aid in h.assigned()] == ["a1", "a2"]
    h.adm.pause(True)                                   # ctl pause: nothing new, credits kept
    h.servers.max_inflight_per_server = 0
    await h.adm.dispatch()
    assert len(h.assigned()) == 2 and a.credits == 4
    h.adm.pause(False)
    await h.adm.dispatch()
    assert [aid for _, aid in h.assigned()] == ["a1", "a2", "a3", "a4"] and a.credits == 0


async def test_servers_that_returned_nothing_share_a_trial_budget_once_one_has():
    """While a proven server is known, unproven ones hold at most trial_share of the gate together
    (two groups here): the third newcomer waits while the proven server gets the gate's rest."""
    h = Harness(g=2, batch_prompts=2, eta=3, server_timeout_s=1e9)  # gate 16; budget max(2, 0.25·16) = 4
    a = await h.join("A", max_concurrency=8, credits=2)
    await h.complete(h.of_type(protocol.Assignment)[0])              # A completed a lease: proven
    assert h.adm.proven(a) and h.adm.trial_budget() == 4
    newcomers = [await h.join(f"N{i}", max_concurrency=8) for i in range(3)]
    for n in newcomers:
        n.credits = 8
    await h.adm.dispatch()
    assert [i for i, _ in h.assigned()] == [b"A", b"N0", b"N1"]      # a trial each, until 4 are held
    await h.adm.work_request(a, protocol.WorkRequest(server_id="A", credits=8))
    assert [i for i, _ in h.assigned()][3:] == [b"A"] * 4               # the proven one gets the rest
    assert h.buffer.capacity(0) >= 2 and h.adm.outstanding(newcomers[2]) == 0   # room, yet no trial
    # N0 returns its work: proven, and its group of the budget is free for N2's trial.
    await h.complete(h.of_type(protocol.Assignment, b"N0")[0])
    await h.adm.dispatch()
    assert h.adm.proven(newcomers[0]) and h.adm.outstanding(newcomers[2]) == 2
    # With no server proven there is no budget (a run's start): every server is on trial.
    h2 = Harness(g=2, batch_prompts=2, eta=3, server_timeout_s=1e9)
    for i in range(4):
        await h2.join(f"S{i}", max_concurrency=8, credits=4)
    assert len(h2.assigned()) == 8 and h2.buffer.capacity(0) == 0
    # initial_allowance 0 turns the allowance and the budget off.
    h3 = Harness(g=2, batch_prompts=2, eta=3, server_timeout_s=1e9, initial_allowance=0)
    a = await h3.join("A", max_concurrency=8, credits=2)
    await h3.complete(h3.of_type(protocol.Assignment)[0])
    for i in range(3):
        await h3.join(f"N{i}", max_concurrency=8, credits=2)
    assert [i for i, _ in h3.assigned()] == [b"A", b"N0", b"N1", b"N2"]


async def test_an_unproven_holder_shares_its_silence_threshold_with_the_idle_servers():
    """Nothing completed anywhere: the threshold is silent_factor x silent_min_s = 4 s; with 2
    unproven holders and 2 idle servers waiting, each holder's is 4 x 2 / 4 = 2 s."""
    h = Harness(g=2, batch_prompts=2, eta=1, server_timeout_s=1e9, lease_timeout_s=600.0,
                silent_min_s=1.0, silent_factor=4.0)                 # gate 8 = 4 groups
    await h.join("H0", max_concurrency=4, credits=4)                 # alone: 2 groups at once
    await h.join("H1", max_concurrency=4, credits=4)                 # 2 more: the gate is full
    assert [i for i, _ in h.assigned()] == [b"H0", b"H0", b"H1", b"H1"]
    idle = [await h.join(f"W{i}", max_concurrency=4, credits=4) for i in range(2)]
    h.now += 1.9
    await h.adm.tick()
    assert h.metrics.value("slipstream_leases_preempted_total") == 0
    h.now += 0.2                                                     # 2.1 s: past 2 s, not 4 s
    await h.adm.tick()
    assert h.metrics.value("slipstream_leases_preempted_total") == 4
    (event, fields), = [e for e in h.log if e[0] == "leases_preempted"][:1]
    assert event == "leases_preempted" and fields["threshold_s"] == 2.0, fields
    # Re-issued to the idle servers, one group each round-robin (H0, H1 are on probation).
    assert sorted(i for i, _ in h.assigned()[4:]) == [b"W0", b"W0", b"W1", b"W1"]
    assert all(h.adm.outstanding(w) == 4 for w in idle)


async def test_a_late_copy_does_not_prove_the_server_that_holds_the_lease_now():
    """An honest server pre-empted while slow finishes its group late, after the lease went to
    an identity that never returns work: that identity is not proven by it (it would escape the
    trial budget), and the sample still counts (the first copy wins)."""
    h = Harness(g=2, batch_prompts=2, eta=1, server_timeout_s=1e9, lease_timeout_s=600.0,
                silent_min_s=1.0, silent_factor=2.0)                 # gate 8 = 4 groups
    await h.join("A", max_concurrency=4, credits=4)                  # alone: 2 groups
    await h.join("H", max_concurrency=4, credits=4)                  # 2 more: the gate is full
    hoarder = await h.join("W", max_concurrency=4, credits=2)        # waits for work
    first = h.of_type(protocol.Assignment, b"A")[0]
    h.now += 2.1                                                     # past every threshold
    await h.adm.tick()
    assert first.assignment_id in [aid for i, aid in h.assigned() if i == b"W"]
    for s in samples_for(first, version=h.version):                  # A's late copy
        assert await h.buffer.put(s, h.version, sender="A") == "accepted"
    assert not h.adm.proven(hoarder) and h.buffer.leases.get(first.assignment_id) is None


async def test_a_result_is_its_connections_servers_whatever_it_claims():
    """The intake credits and releases leases by a result's server_id: ResultIngress sets it to
    the connection's server, so a peer cannot act in another server's name."""
    from types import SimpleNamespace

    from learner.serve.ingress import ResultIngress

    got = []

    async def receive(msg):
        got.append(msg)
        return protocol.Ack(sample_ids=[], statuses=[])

    async def nothing(*_):
        return True

    ingress = ResultIngress(receiver=SimpleNamespace(receive=receive), link=SimpleNamespace(send=nothing),
                            admission=SimpleNamespace(lose=lambda srv, why: None, dispatch=nothing),
                            batches=SimpleNamespace(check=lambda: False),
                            batch=SimpleNamespace(group_size=2), hold=False)
    await ingress.result(b"conn", SimpleNamespace(server_id="real"),
                         protocol.RolloutResult(server_id="someone-else", samples=[]))
    assert [m.server_id for m in got] == ["real"]


async def test_wrong_weights_hold_a_server_until_it_applies_the_newest_version_rightly():
    """issue 28.4: a checksum mismatch releases the server's leases, gives it no work and
    remembers the version (its tokens of it are refused by the intake); a right checksum of an
    older version does not clear it, the newest one does."""
    h = Harness(g=2, batch_prompts=2, eta=2)
    srv = await h.join("S", max_concurrency=4, credits=4)
    assert len(h.assigned()) == 2
    for v, checksum in ((1, "c1"), (2, "c2")):
        h.version = v
        await h.adm.announce(protocol.WeightsAvailable(version=v, kind="full", tensors=[], total_bytes=0,
                                                       chunk_bytes=1024, num_chunks=0, checksum=checksum))
    assert not await h.adm.weights_applied(srv, protocol.WeightsApplied(server_id="S", version=2, checksum="x",
                                                                        seconds=0.0))
    assert srv.unverified and h.adm.outstanding(srv) == 0 and len(h.adm.reissue) == 2
    assert h.adm.distrusted("S") == {2} and h.adm.distrusted("T") is None
    assert h.metrics.value("slipstream_weights_checksum_mismatch_total") == 1
    assert h.metrics.value("slipstream_rollout_servers_unverified") == 1
    await h.adm.work_request(srv, protocol.WorkRequest(server_id="S", credits=4))
    assert len(h.assigned()) == 2                                   # nothing new
    await h.adm.weights_applied(srv, protocol.WeightsApplied(server_id="S", version=1, checksum="c1", seconds=0.0))
    assert srv.unverified and len(h.assigned()) == 2                # right, but not the newest
    await h.adm.weights_applied(srv, protocol.WeightsApplied(server_id="S", version=2, checksum="c2", seconds=0.0))
    assert not srv.unverified and h.adm.status()["S"]["unverified"] is False
    assert len(h.assigned()) == 4                                   # the released groups, re-issued
    assert h.adm.distrusted("S") == {2}                             # its old tokens stay refused
    assert [e for e, _ in h.log].count("server_verified") == 1


async def test_the_version_skew_is_the_fleets_newest_minus_oldest():
    """issue 28.7: slipstream_rollout_version_skew follows the servers' applied versions and the
    servers that leave."""
    h = Harness()
    s = await h.join("S")
    t = await h.join("T")
    assert h.metrics.value("slipstream_rollout_version_skew") == 0
    h.version = 2
    await h.adm.weights_applied(t, protocol.WeightsApplied(server_id="T", version=2, checksum="c", seconds=0.0))
    assert h.metrics.value("slipstream_rollout_version_skew") == 2
    h.adm.lose(s, "timeout")
    assert h.metrics.value("slipstream_rollout_version_skew") == 0


async def test_the_relay_plan_is_a_tree_at_a_publish_and_holders_serve_late_joiners():
    """issue 28 items 2, 3: with relay_fanout 2, a publish reaches six relaying servers as a
    tree (the first from the learner, each other from its parent: (j - 1) // 2 in join order), a
    server that relays nothing hangs off a relay; once servers applied the version with the right
    checksum, a server that joins fetches it from one of them. Fanout 0: everyone from the learner."""
    h = Harness()
    h.adm.relay_fanout = 2
    relays = {}
    for i in range(6):
        name = f"r{i}"
        src = protocol.WeightsSource(endpoint=f"tcp://198.18.0.{i + 2}:6000")
        await h.adm.hello(name.encode(), protocol.Hello(server_id=name, engine="e", model="m", version=0,
                                                        max_concurrency=4, relay=src))
        relays[name] = src
    plain = await h.join("plain")
    await h.adm.hello(b"bad", protocol.Hello(server_id="bad", engine="e", model="m", version=0,
                                             max_concurrency=4, relay=protocol.WeightsSource(endpoint="tcp://no port")))
    assert any(e == "relay_refused" and f["server"] == "bad" for e, f in h.log)
    assert h.adm.servers[b"bad"].relay is None
    m = protocol.WeightsAvailable(version=1, kind="full", tensors=[], total_bytes=0, chunk_bytes=1024,
                                  num_chunks=0, checksum="c1")
    await h.adm.announce(m)
    got = {i.decode(): [s.endpoint for s in msg.sources] for i, msg in h.sent
           if isinstance(msg, protocol.WeightsAvailable)}
    parent = {"r0": None, "r1": "r0", "r2": "r0", "r3": "r1", "r4": "r1", "r5": "r2"}
    for name, p in parent.items():
        assert got[name] == ([] if p is None else [relays[p].endpoint]), (name, got[name])
    assert len(got["plain"]) == 1 and got["plain"][0] in {s.endpoint for s in relays.values()}
    # r3 and r4 applied version 1 rightly; a server joining now fetches it from one of them.
    for name in ("r3", "r4"):
        assert await h.adm.weights_applied(h.adm.servers[name.encode()], protocol.WeightsApplied(
            server_id=name, version=1, checksum="c1", seconds=0.1))
    late = await h.join("late")
    (manifest,) = h.of_type(protocol.WeightsAvailable, b"late")
    assert [s.endpoint for s in manifest.sources] in ([relays["r3"].endpoint], [relays["r4"].endpoint])
    h.adm.relay_fanout = 0
    assert h.adm.sources(late, m) == [] and h.adm.sources(plain, m) == []


async def test_servers_holding_the_version_before_get_small_deltas_from_the_learner():
    """The plan sends deltas straight from the learner when one to every server holding the
    version before costs at most one model (the last deltas' ratio x those servers <= 1): the
    relay would make them again at every hop. Larger deltas, and servers without the base
    (a joiner at version 0), go through the relays."""
    h = Harness()
    ratio = {"now": None}
    h.adm.relay_fanout, h.adm.delta_ratio = 1, lambda: ratio["now"]
    for i in range(3):
        await h.adm.hello(f"r{i}".encode(), protocol.Hello(server_id=f"r{i}", engine="e", model="m", version=0,
                                                          max_concurrency=4, relay=protocol.WeightsSource(
                                                              endpoint=f"tcp://198.18.0.{i + 2}:6000")))

    def manifest(v):
        return protocol.WeightsAvailable(version=v, kind="full", tensors=[], total_bytes=0, chunk_bytes=1024,
                                         num_chunks=0, checksum=f"c{v}")
    await h.adm.announce(manifest(1))
    for i in range(3):
        assert await h.adm.weights_applied(h.adm.servers[f"r{i}".encode()], protocol.WeightsApplied(
            server_id=f"r{i}", version=1, checksum="c1", seconds=0.1))
    await h.adm.announce(manifest(2))
    assert h.adm.previous == 1
    servers = [h.adm.servers[f"r{i}".encode()] for i in range(3)]
    assert [len(h.adm.sources(s, manifest(2))) for s in servers] == [0, 1, 1]    # no ratio yet: the chain
    ratio["now"] = 0.01                                                           # 3 x 0.01 <= 1
    assert [h.adm.sources(s, manifest(2)) for s in servers] == [[], [], []]
    ratio["now"] = 0.5                                                            # 3 x 0.5 > 1
    assert [len(h.adm.sources(s, manifest(2))) for s in servers] == [0, 1, 1]
    ratio["now"] = 0.01
    joiner = await h.join("late", version=0)
    assert len(h.adm.sources(joiner, manifest(2))) == 1                           # no base: a relay
