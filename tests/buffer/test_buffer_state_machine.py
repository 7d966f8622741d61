"""Random interleavings of everything that happens to a buffer, with its invariants checked after
every step: issue, results (fresh, stale, failed, duplicate, unknown), expiry, re-issue, holders
leaving, cancellation, training, version bumps, η and policy changes, checkpoint round trips.

Invariants:
- the gate: capacity is never negative, follows the rule, moves in whole groups; in flight equals
  the samples still missing from open leases; accepted_total − consumed equals what is buffered;
- nothing vanishes: accepted == consumed + buffered + dropped_stale + dropped_incomplete;
- batches: whole groups in group_index order, no sample and no slot yielded twice, only accepted
  samples yielded; under ``drop`` nothing over η; with η = 0 every token is from the current
  version; staleness and needs_correction are right;
- acknowledgements are final: a re-send of an accepted sample is a duplicate;
- all of the above still hold after a state-dict round trip (msgpack) into a new buffer.
"""

from __future__ import annotations

import asyncio

import msgpack
from buffer_testkit import FakeClock, make_sample
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from buffer import AckStatus, RolloutBuffer

HOLDERS = st.sampled_from(["s0", "s1", "s2"])


class BufferMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock(0.0)
        self.buf: RolloutBuffer | None = None
        self.version = 0
        self.next_id = 0
        self.to_reissue = []               # leases the "learner" holds for reissue
        self.sent = []                     # (sample, first status)
        self.accepted_ids: set[str] = set()
        self.yielded_ids: set[str] = set()
        self.yielded_slots: set[tuple[str, int]] = set()

    def teardown(self):
        self.loop.close()

    def new_buffer(self) -> RolloutBuffer:
        return RolloutBuffer(batch_samples=self.batch_samples, group_size=self.gs,
                             max_staleness=0, stale_policy="drop", lease_timeout_s=10.0,
                             max_attempts=2, dedupe_window=100_000, clock=self.clock)

    @initialize(gs=st.integers(1, 3), groups_per_batch=st.integers(1, 2), eta=st.integers(0, 2),
                policy=st.sampled_from(["drop", "correct"]), start=st.integers(0, 3))
    def setup(self, gs, groups_per_batch, eta, policy, start):
        self.gs, self.batch_samples = gs, gs * groups_per_batch
        self.buf = self.new_buffer()
        self.buf.staleness.set(eta, "test")
        self.buf.set_stale_policy(policy)
        self.version = start               # a learner resumed without buffer state, if > 0
        self.issue("s0", all_of_it=True)   # a learner starts by filling the gate

    # -- generation side ---------------------------------------------------------------------------

    @rule(holder=HOLDERS, all_of_it=st.booleans())
    def issue(self, holder, all_of_it):
        while self.buf.capacity(self.version) >= self.gs:
            self.buf.issue(f"a{self.next_id}", holder, self.gs)
            self.next_id += 1
            if not all_of_it:
                break

    def put(self, sample):
        return self.loop.run_until_complete(self.buf.put(sample, self.version))

    @rule(data=st.data())
    def put_result(self, data):
        open_ids = [le.assignment_id for le in self.buf.leases]
        if not open_ids:
            return
        aid = data.draw(st.sampled_from(open_ids))
        gi = data.draw(st.integers(0, self.gs - 1))
        lag = data.draw(st.integers(0, 3))
        n = data.draw(st.integers(0, 3))
        oldest = max(0, self.version - lag)
        versions = sorted(data.draw(st.lists(st.integers(oldest, self.version), min_size=n,
                                             max_size=n)))
        failed = data.draw(st.sampled_from([None] * 9 + ["reward error"]))
        sample = make_sample(aid, gi, self.gs, versions, sample_id=f"{aid}/{gi}/{self.next_id}",
                             failed=failed)
        self.next_id += 1
        status = self.put(sample)
        assert status in (AckStatus.ACCEPTED, AckStatus.DUPLICATE, AckStatus.STALE)
        if status is AckStatus.STALE:
            assert self.buf.stale_policy == "drop"
        if status is AckStatus.ACCEPTED:
            self.accepted_ids.add(sample.sample_id)
        self.sent.append((sample, status))

    @rule(data=st.data())
    def complete_group(self, data):
        """A server returns every missing sample of one assignment, mostly on fresh weights."""
        open_ids = [le.assignment_id for le in self.buf.leases]
        if not open_ids:
            return
        aid = data.draw(st.sampled_from(open_ids))
        lag = data.draw(st.sampled_from([0, 0, 0, 1, 2]))
        for gi in range(self.gs):
            if self.buf.remaining(aid) == 0:
                break
            versions = (max(0, self.version - lag), self.version)
            sample = make_sample(aid, gi, self.gs, versions, sample_id=f"{aid}/{gi}/{self.next_id}")
            self.next_id += 1
            status = self.put(sample)
            if status is AckStatus.ACCEPTED:
                self.accepted_ids.add(sample.sample_id)
            self.sent.append((sample, status))

    @precondition(lambda self: self.sent)
    @rule(data=st.data())
    def resend(self, data):
        sample, first = data.draw(st.sampled_from(self.sent))
        status = self.put(sample)
        if first is AckStatus.ACCEPTED:
            assert status is AckStatus.DUPLICATE
        else:
            assert status in (AckStatus.DUPLICATE, AckStatus.STALE)

    @rule()
    def put_unknown(self):
        assert self.put(make_sample("never-issued", 0, self.gs)) is AckStatus.INVALID

    @rule(dt=st.sampled_from([0.0, 5.0, 10.0]))
    def expire(self, dt):
        self.clock.advance(dt)
        self.to_reissue.extend(self.buf.expire())

    @rule(holder=HOLDERS)
    def release_holder(self, holder):
        self.to_reissue.extend(self.buf.release_holder(holder))

    @precondition(lambda self: self.to_reissue)
    @rule(holder=HOLDERS, cancel=st.booleans())
    def reissue_or_cancel(self, holder, cancel):
        lease = self.to_reissue.pop(0)
        if not self.buf.is_open(lease.assignment_id) or lease.active:
            return                         # finished meanwhile (a late result completed it)
        if cancel:
            assert self.buf.cancel(lease.assignment_id)
        else:
            before = lease.attempt
            self.buf.reissue(lease, holder)
            assert lease.attempt == before + 1 and lease.holder == holder

    # -- learner side ------------------------------------------------------------------------------

    @rule()
    def train(self):
        v, buf = self.version, self.buf
        batch = buf.poll_batch(v)
        if batch is None:
            return
        eta, policy = buf.max_staleness, buf.stale_policy
        assert len(batch) == self.batch_samples and batch.version == v
        assert all(n == self.gs for n in batch.group_sizes)
        for grp in batch.groups:
            assert [s.group_index for s in grp] == list(range(self.gs))
            assert len({s.assignment_id for s in grp}) == 1
        for s, stale, flag in zip(batch.samples, batch.staleness, batch.needs_correction):
            assert s.sample_id in self.accepted_ids and s.failed is None
            assert s.sample_id not in self.yielded_ids
            assert (s.assignment_id, s.group_index) not in self.yielded_slots
            self.yielded_ids.add(s.sample_id)
            self.yielded_slots.add((s.assignment_id, s.group_index))
            assert stale == (v - s.min_version if len(s.token_versions) else 0)
            assert flag == (stale > eta)
            if policy == "drop":
                assert stale <= eta
                if eta == 0 and len(s.token_versions):
                    assert s.min_version == v
        self.version += 1

    @rule()
    def bump_version(self):
        self.version += 1

    @rule(eta=st.integers(0, 3))
    def set_max_staleness(self, eta):
        self.buf.staleness.set(eta, "test")

    @rule(policy=st.sampled_from(["drop", "correct"]))
    def set_stale_policy(self, policy):
        self.buf.set_stale_policy(policy)

    @rule()
    def checkpoint_round_trip(self):
        state = msgpack.unpackb(msgpack.packb(self.buf.state_dict()), strict_map_key=False)
        before = (self.buf.pending_samples, self.buf.inflight_samples, self.buf.counters,
                  self.buf.max_staleness, self.buf.stale_policy)
        self.buf = self.new_buffer()
        self.buf.load_state_dict(state)
        assert (self.buf.pending_samples, self.buf.inflight_samples, self.buf.counters,
                self.buf.max_staleness, self.buf.stale_policy) == before
        # The learner restarted: its queue of leases is gone; the buffer reports them all again.
        self.to_reissue = self.buf.expire()

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def gate_follows_the_rule(self):
        if self.buf is None:
            return
        buf, gate = self.buf, self.buf.gate
        v = buf.version
        raw = (v + gate.max_staleness + 1) * self.batch_samples - (gate.accepted_total
                                                                   + gate.in_flight)
        cap = gate.capacity(v)
        assert cap == max(0, raw) and cap >= 0
        assert cap % self.gs == 0          # everything moves in whole groups
        assert gate.in_flight == sum(buf.remaining(le.assignment_id) for le in buf.leases)
        assert gate.buffered == buf.pending_samples >= buf.ready_samples >= 0

    @invariant()
    def nothing_vanishes(self):
        if self.buf is None:
            return
        c = self.buf.counters
        assert all(n >= 0 for n in c.values())
        assert c["accepted"] == (c["consumed"] + self.buf.pending_samples + c["dropped_stale"]
                                 + c["dropped_incomplete"])
        assert c["consumed"] == len(self.yielded_ids) == sum(self.buf.staleness_histogram.values())
        # Every issued slot ended once (or is in flight); re-issues move no slot.
        assert c["issued"] == (c["accepted"] + c["stale"] - c["stale_late"] + c["abandoned"]
                               + c["failed"] - c["failed_reported"] + c["cancelled"]
                               + self.buf.inflight_samples)


def test_buffer_state_machine():
    run_state_machine_as_test(
        BufferMachine,
        settings=settings(max_examples=300, stateful_step_count=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )
