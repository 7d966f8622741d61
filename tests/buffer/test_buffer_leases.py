"""LeaseTable: deadlines, extension, expiry, re-issue up to max_attempts, holders, restarts."""

from __future__ import annotations

import json
import math

import pytest
from buffer_testkit import FakeClock

from buffer import LeaseState, LeaseTable


def test_issue_extend_complete():
    clock = FakeClock(100.0)
    table = LeaseTable(timeout_s=10.0, max_attempts=3, clock=clock)
    lease = table.issue("a", "s0", 8, payload={"prompt_id": "p0"}, version=4)
    assert (lease.deadline_s, lease.attempt, lease.state, lease.version) == (110.0, 1,
                                                                            LeaseState.ACTIVE, 4)
    assert "a" in table and len(table) == 1 and table.get("a") is lease
    with pytest.raises(ValueError):
        table.issue("a", "s1", 8)
    clock.advance(9.0)
    assert table.extend("a")                 # a result arrived: 109 + 10 = 119
    assert lease.deadline_s == 119.0
    clock.advance(9.5)
    assert table.expire() == ([], [])        # 118.5 < 119
    assert table.complete("a") is lease
    assert "a" not in table and table.complete("a") is None
    assert not table.extend("a")


def test_expire_reissue_until_attempts_run_out():
    clock = FakeClock(0.0)
    table = LeaseTable(timeout_s=5.0, max_attempts=2, clock=clock)
    lease = table.issue("a", "s0", 4)
    clock.advance(5.0)                       # deadline 5.0 <= now 5.0: lost
    retry, exhausted = table.expire()
    assert retry == [lease] and exhausted == []
    assert lease.state is LeaseState.EXPIRED and lease.holder == ""
    assert table.expire() == ([], [])        # reported once
    assert not table.extend("a")             # an expired lease is not extended
    table.reissue(lease, "s1", version=3)
    assert (lease.holder, lease.attempt, lease.deadline_s, lease.version) == ("s1", 2, 10.0, 3)
    with pytest.raises(ValueError):
        table.reissue(lease, "s2")           # ACTIVE, not expired
    clock.advance(5.0)
    retry, exhausted = table.expire()        # attempt 2 of 2 lost: given up
    assert retry == [] and exhausted == [lease]
    assert "a" not in table
    with pytest.raises(KeyError):
        table.reissue(lease, "s2")


def test_release_holder_loses_only_its_active_leases():
    table = LeaseTable(timeout_s=5.0, max_attempts=2, clock=FakeClock())
    a = table.issue("a", "s0", 4)
    b = table.issue("b", "s1", 4)
    c = table.issue("c", "s0", 4)
    c.attempt = 2                            # on its last attempt
    retry, exhausted = table.release_holder("s0")
    assert retry == [a] and exhausted == [c]
    assert b.active and table.held_by("s1") == [b]
    assert table.release_holder("s0") == ([], [])


def test_restart_loses_every_lease_and_reports_it_on_the_next_expire():
    clock = FakeClock(50.0)
    table = LeaseTable(timeout_s=5.0, max_attempts=2, clock=clock)
    table.issue("active", "s0", 4, payload={"p": 1})
    last = table.issue("last-attempt", "s0", 4)
    last.attempt = 2
    table.issue("waiting", "s1", 4)
    table.release_holder("s1")               # "waiting" is EXPIRED when the checkpoint is taken
    table.issue("done-meanwhile", "s0", 4)
    state = json.loads(json.dumps(table.state_dict()))

    fresh = LeaseTable(timeout_s=5.0, max_attempts=2, clock=FakeClock(0.0))
    fresh.load_state_dict(state)
    assert len(fresh) == 4 and all(not le.active for le in fresh)
    fresh.complete("done-meanwhile")         # a re-sent result completed it before expire()
    retry, exhausted = fresh.expire()
    assert sorted(le.assignment_id for le in retry) == ["active", "waiting"]
    assert [le.assignment_id for le in exhausted] == ["last-attempt"]
    by_id = {le.assignment_id: le for le in retry}
    assert by_id["active"].payload == {"p": 1} and by_id["active"].attempt == 1
    assert fresh.expire() == ([], [])
    fresh.reissue(by_id["active"], "s9")
    assert by_id["active"].attempt == 2 and by_id["active"].holder == "s9"


def test_bad_arguments():
    with pytest.raises(ValueError):
        LeaseTable(timeout_s=0)
    with pytest.raises(ValueError):
        LeaseTable(max_attempts=0)


def test_deliveries_and_held_samples_follow_the_leases():
    clock = FakeClock(0.0)
    table = LeaseTable(timeout_s=100.0, max_attempts=3, clock=clock)
    table.issue("a", "s0", 4)
    table.issue("b", "s0", 4)
    table.issue("c", "s1", 2)
    assert (table.held_samples("s0"), table.held_samples("s1"), table.held_samples("x")) == (8, 2, 0)
    assert table.oldest_issue_by_holder() == {"s0": 0.0, "s1": 0.0}
    clock.advance(2.0)
    table.complete("a")
    d = table.delivery("s0")
    assert (d.completed, d.last_s, d.mean_s, table.held_samples("s0")) == (1, 2.0, 2.0, 4)
    clock.advance(2.0)
    table.complete("b")                      # took 4 s: EWMA 2 + 0.2 * (4 - 2)
    assert table.delivery("s0").mean_s == pytest.approx(2.4) and table.held_samples("s0") == 0
    assert table.mean_completion_s == pytest.approx(2.4)
    assert table.delivery("s1").completed == 0 and table.delivery("s1").mean_s != table.delivery("s1").mean_s
    table.forget("s0")
    assert table.delivery("s0").completed == 0


def test_a_late_copy_from_an_earlier_holder_credits_no_one():
    """A pre-empted server's late result finishes the lease re-issued to another: the new holder
    did not deliver it (else identities that never return work would look proven, learner.serve.
    admission: Trials); the sender, no longer the holder, is not credited either."""
    clock = FakeClock(0.0)
    table = LeaseTable(timeout_s=100.0, max_attempts=3, clock=clock)
    lease = table.issue("a", "slow", 4)
    table.preempt_holder("slow")
    table.reissue(lease, "hoarder")
    clock.advance(3.0)
    assert table.extend("a", by="slow") and table.delivery("hoarder").last_s == float("-inf")
    table.complete("a", by="slow")
    assert table.delivery("hoarder").completed == 0 and table.delivery("slow").completed == 0
    assert table.held_samples("hoarder") == 0 and math.isnan(table.mean_completion_s)
    # From the holder itself (or a caller that does not know the sender): its delivery.
    table.issue("b", "hoarder", 4)
    table.complete("b", by="hoarder")
    table.issue("c", "hoarder", 4)
    table.complete("c")
    assert table.delivery("hoarder").completed == 2


def test_preemption_uses_no_attempt_the_first_max_attempts_times():
    clock = FakeClock(0.0)
    table = LeaseTable(timeout_s=100.0, max_attempts=2, clock=clock)
    lease = table.issue("a", "s0", 4)
    for i in range(2):                       # two free pre-emptions, each re-issued elsewhere
        assert table.preempt_holder(lease.holder) == ([lease], [])
        assert lease.state is LeaseState.EXPIRED and table.held_samples(f"s{i}") == 0
        table.reissue(lease, f"s{i + 1}")
    assert (lease.attempt, lease.preemptions) == (3, 2)
    # The third pre-emption is a loss like any other: attempt 3 - 2 free = 1 < 2, retried once more
    assert table.preempt_holder("s2") == ([lease], [])
    table.reissue(lease, "s3")
    assert table.preempt_holder("s3") == ([], [lease])       # out of attempts: given up
    assert "a" not in table
    # Saved and restored with its pre-emptions (a restart does not hand out new free ones)
    table.issue("b", "s0", 4)
    table.preempt_holder("s0")
    restored = LeaseTable(timeout_s=100.0, max_attempts=2, clock=clock)
    restored.load_state_dict(json.loads(json.dumps(table.state_dict())))
    assert restored.get("b").preemptions == 1
