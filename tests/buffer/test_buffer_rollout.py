"""RolloutBuffer: acknowledgements, groups, staleness policies, leases, batching, checkpoints."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest
from buffer_testkit import FakeClock, fill, group, make_sample

from buffer import AckStatus, Batch, RolloutBuffer
from protocol import ACK_STATUSES, Assignment, SamplingParams

A, D, S, INV = AckStatus.ACCEPTED, AckStatus.DUPLICATE, AckStatus.STALE, AckStatus.INVALID


def make_buffer(**kw) -> RolloutBuffer:
    args = dict(batch_samples=8, group_size=4, max_staleness=1, clock=FakeClock())
    args.update(kw)
    return RolloutBuffer(**args)


def conserved(buf: RolloutBuffer) -> bool:
    c = buf.counters
    return c["accepted"] == (c["consumed"] + buf.pending_samples + c["dropped_stale"]
                             + c["dropped_incomplete"])


def test_ack_status_values_match_the_protocol():
    assert tuple(s.value for s in AckStatus) == ACK_STATUSES
    assert str(AckStatus.STALE) == "stale" and AckStatus.STALE == "stale"


def test_constructor_validates():
    with pytest.raises(ValueError, match="multiple of group_size"):
        RolloutBuffer(batch_samples=10, group_size=4)
    with pytest.raises(ValueError):
        RolloutBuffer(batch_samples=8, group_size=4, stale_policy="keep")


async def test_groups_come_out_whole_contiguous_and_in_order():
    buf = make_buffer()
    buf.issue("a", "s0", 4)
    buf.issue("b", "s0", 4)
    # interleaved and out of order
    for i in (3, 1):
        assert await buf.put(make_sample("a", i, 4), 0) is A
    for i in (2, 0, 3, 1):
        assert await buf.put(make_sample("b", i, 4), 0) is A
    assert buf.poll_batch(0) is None         # "a" is incomplete: 4 + 2 < 8
    for i in (0, 2):
        await buf.put(make_sample("a", i, 4), 0)
    batch = buf.poll_batch(0)
    assert isinstance(batch, Batch) and len(batch) == 8
    # "b" completed first, so it comes first
    assert [(s.assignment_id, s.group_index) for s in batch.samples] == \
        [("b", 0), ("b", 1), ("b", 2), ("b", 3), ("a", 0), ("a", 1), ("a", 2), ("a", 3)]
    assert batch.group_sizes == [4, 4] and [g[0].assignment_id for g in batch.groups] == ["b", "a"]
    assert batch.staleness == [0] * 8 and batch.needs_correction == [False] * 8
    assert batch.num_tokens == 8 * (3 + 1)
    assert buf.counters["consumed"] == 8 and buf.staleness_histogram == {0: 8}
    assert buf.pending_samples == 0 and conserved(buf)


async def test_duplicates_by_slot_by_id_and_after_training():
    buf = make_buffer()
    buf.issue("a", "s0", 4)
    assert await buf.put(make_sample("a", 0, 4), 0) is A
    # same slot, another sample id (the other server's copy of a re-issued assignment)
    assert await buf.put(make_sample("a", 0, 4, sample_id="other"), 0) is D
    # same sample id, another slot (a confused re-send)
    assert await buf.put(make_sample("a", 1, 4, sample_id="a/0"), 0) is D
    for i in (1, 2, 3):
        await buf.put(make_sample("a", i, 4), 0)
    await fill(buf, "b", 0)
    assert len(buf.poll_batch(0)) == 8
    # re-sent after the group was trained
    assert await buf.put(make_sample("a", 2, 4), 0) is D
    assert await buf.put(make_sample("a", 2, 4, sample_id="late"), 0) is D
    c = buf.counters
    assert (c["accepted"], c["duplicate"], c["consumed"]) == (8, 4, 8)


async def test_invalid_results():
    buf = make_buffer()
    assert await buf.put(make_sample("nobody-issued-this", 0, 4), 0) is INV
    assert "unknown assignment" in buf.last_invalid_reason
    buf.issue("a", "s0", 4)
    assert await buf.put(make_sample("a", 0, 8), 0) is INV              # group_size 8 != 4
    assert await buf.put(make_sample("a", 0, 4, versions=(0, 1)), 0) is INV  # version 1 > learner 0
    assert "newer" in buf.last_invalid_reason
    assert buf.counters["invalid"] == 3 and buf.remaining("a") == 4  # nothing resolved
    assert await buf.put(make_sample("a", 0, 4), 0) is A


async def test_versions_only_grow():
    buf = make_buffer()
    buf.capacity(3)
    with pytest.raises(ValueError, match="only grow"):
        buf.capacity(2)


async def test_issue_respects_the_gate():
    buf = make_buffer(max_staleness=0)
    # (0 + 0 + 1) * 8 = 8: two groups of 4
    assert buf.capacity(0) == 8
    buf.issue("a", "s0", 4)
    buf.issue("b", "s0")                     # n_samples defaults to group_size
    assert buf.capacity(0) == 0
    with pytest.raises(ValueError, match="capacity"):
        buf.issue("c", "s0", 4)
    buf.issue("c", "s0", 4, force=True)      # knowingly past the gate
    with pytest.raises(ValueError, match="used before"):
        buf.issue("c", "s0", 4, force=True)
    with pytest.raises(ValueError, match="whole group"):
        buf.issue("d", "s0", 3, force=True)
    assert buf.inflight_samples == 12 and buf.counters["issued"] == 12


async def test_eta_zero_is_on_policy():
    buf = make_buffer(max_staleness=0)
    await fill(buf, "a", 0)
    await fill(buf, "b", 0)
    batch = buf.poll_batch(0)
    assert [s.min_version for s in batch.samples] == [0] * 8
    # v = 1: (1 + 0 + 1) * 8 - (8 + 0) = 8
    assert buf.capacity(1) == 8
    buf.issue("c", "s0", 4)
    # a server still on version 0 weights: its result is stale at v = 1 and dropped
    assert await buf.put(make_sample("c", 0, 4, versions=(0,)), 1) is S
    # the rest of the group follows it (groups are never split)
    assert await buf.put(make_sample("c", 1, 4, versions=(1,)), 1) is S
    # the whole group's capacity is back: (1 + 0 + 1) * 8 - (8 + 0) = 8
    assert buf.capacity(1) == 8 and buf.inflight_samples == 0
    c = buf.counters
    assert (c["stale"], c["abandoned"], c["stale_dropped"]) == (2, 3, 2)


async def test_stale_member_drops_the_group_under_drop():
    buf = make_buffer(max_staleness=1)
    buf.capacity(2)                           # the learner is at version 2
    buf.issue("a", "s0", 4)
    assert await buf.put(make_sample("a", 0, 4, versions=(2, 2)), 2) is A
    assert await buf.put(make_sample("a", 1, 4, versions=(1, 2)), 2) is A   # staleness 1 <= 1
    assert await buf.put(make_sample("a", 2, 4, versions=(0, 2)), 2) is S   # staleness 2 > 1
    c = buf.counters
    # two accepted members dropped with it, one slot still in flight abandoned
    assert (c["stale"], c["dropped_stale"], c["abandoned"]) == (1, 2, 1)
    assert c["stale_dropped"] == 3
    assert buf.pending_samples == 0 and buf.inflight_samples == 0 and conserved(buf)
    # late members of the dropped group are stale; re-sends of accepted ones are duplicates
    assert await buf.put(make_sample("a", 3, 4, versions=(2,)), 2) is S
    assert await buf.put(make_sample("a", 0, 4, versions=(2, 2)), 2) is D


async def test_version_bump_drops_buffered_groups_over_the_limit():
    buf = make_buffer(batch_samples=4, max_staleness=1)
    # (0 + 1 + 1) * 4 = 8: two groups
    await fill(buf, "a", 0)
    await fill(buf, "b", 0)
    assert len(buf.poll_batch(0)) == 4        # "a" at v = 0
    # "b" is never taken at v = 1 (say the learner skipped); at v = 2 it is 2 > 1 stale
    assert buf.capacity(2) == (2 + 1 + 1) * 4 - (4 + 0)     # = 12: "b" (4) gave its room back
    c = buf.counters
    assert c["dropped_stale"] == 4 and buf.pending_samples == 0 and conserved(buf)
    assert buf.poll_batch(2) is None


async def test_shrinking_eta_drops_or_flags_buffered_samples():
    for policy in ("drop", "correct"):
        buf = make_buffer(batch_samples=8, max_staleness=2, stale_policy=policy)
        await fill(buf, "a", 0)
        await fill(buf, "b", 0)
        buf.capacity(1)                        # learner at v = 1: staleness 1 <= 2
        # (1 + 2 + 1) * 8 - (8 + 0) = 24
        assert buf.capacity(1) == 24
        buf.staleness.set(0, "test")               # now 1 > 0
        if policy == "drop":
            # dropped at once, capacity back: (1 + 0 + 1) * 8 - (0 + 0) = 16
            assert buf.pending_samples == 0 and buf.capacity(1) == 16
            assert buf.counters["dropped_stale"] == 8
        else:
            # kept: (1 + 0 + 1) * 8 - (8 + 0) = 8, and flagged when trained
            assert buf.pending_samples == 8 and buf.capacity(1) == 8
            batch = buf.poll_batch(1)
            assert batch.staleness == [1] * 8 and batch.needs_correction == [True] * 8
            assert buf.counters["corrected"] == 8 and buf.staleness_histogram == {1: 8}
        assert conserved(buf)


async def test_switching_to_drop_drops_what_is_over_the_limit():
    buf = make_buffer(batch_samples=8, max_staleness=0, stale_policy="correct")
    buf.capacity(1)
    buf.issue("a", "s0", 4, force=True)
    assert await buf.put(make_sample("a", 0, 4, versions=(0,)), 1) is A    # kept under correct
    assert buf.stale_policy == "correct"
    buf.set_stale_policy("drop")
    assert buf.stale_policy == "drop" and buf.pending_samples == 0
    assert buf.inflight_samples == 0 and buf.counters["abandoned"] == 3


async def test_growing_eta_lets_the_gate_issue_more():
    buf = make_buffer(batch_samples=8, max_staleness=0)
    buf.issue("a", "s0", 4)
    buf.issue("b", "s0", 4)
    assert buf.capacity(0) == 0
    buf.staleness.set(2, "test")
    # (0 + 2 + 1) * 8 - (0 + 8) = 16
    assert buf.max_staleness == 2 and buf.capacity(0) == 16


async def test_failed_member_drops_its_group():
    buf = make_buffer()
    buf.issue("a", "s0", 4)
    assert await buf.put(make_sample("a", 0, 4), 0) is A
    assert await buf.put(make_sample("a", 1, 4, failed="reward timeout"), 0) is A
    c = buf.counters
    # the failed one + the accepted member are dropped, two slots in flight are released
    assert (c["failed"], c["dropped_incomplete"], c["abandoned"]) == (1, 2, 2)
    assert buf.pending_samples == 0 and buf.inflight_samples == 0 and conserved(buf)
    # (0 + 1 + 1) * 8 - 0 = 16: all capacity back
    assert buf.capacity(0) == 16
    assert await buf.put(make_sample("a", 2, 4), 0) is D
    assert await buf.put(make_sample("a", 1, 4, failed="reward timeout"), 0) is D


async def test_expired_lease_is_reissued_and_the_first_result_wins():
    clock = FakeClock(0.0)
    buf = make_buffer(clock=clock, lease_timeout_s=10.0, max_attempts=3)
    lease = buf.issue("a", "s0", 4, payload={"prompt_id": "p7"})
    await buf.put(make_sample("a", 0, 4, sample_id="s0-0"), 0)   # extends to 0 + 10
    clock.advance(10.0)
    assert buf.expire() == [lease]
    # three slots expired; their capacity stays reserved while waiting for reissue
    assert buf.counters["expired"] == 3 and buf.inflight_samples == 3
    # (0 + 1 + 1) * 8 - (1 + 3) = 12
    assert buf.capacity(0) == 12
    assert buf.reissue(lease, "s1") is lease
    assert (lease.holder, lease.attempt, lease.payload) == ("s1", 2, {"prompt_id": "p7"})
    assert buf.counters["reissued"] == 3
    # the slow first holder answers slot 1 first: it wins
    assert await buf.put(make_sample("a", 1, 4, sample_id="s0-1"), 0) is A
    # the new holder's copies of slots 0 and 1 are duplicates, its 2 and 3 are accepted
    statuses = [await buf.put(make_sample("a", i, 4, sample_id=f"s1-{i}"), 0) for i in range(4)]
    assert statuses == [D, D, A, A]
    assert not buf.is_open("a") and buf.ready_samples == 4 and buf.inflight_samples == 0


async def test_lease_out_of_attempts_fails_and_returns_capacity():
    clock = FakeClock(0.0)
    buf = make_buffer(clock=clock, lease_timeout_s=1.0, max_attempts=2)
    lease = buf.issue("a", "s0", 4)
    await buf.put(make_sample("a", 0, 4), 0)
    clock.advance(1.0)
    buf.reissue(buf.expire()[0], "s1")
    clock.advance(1.0)
    assert buf.expire() == []                 # attempt 2 of 2 lost: given up
    c = buf.counters
    assert (c["expired"], c["failed"], c["dropped_incomplete"]) == (6, 3, 1)
    assert buf.inflight_samples == 0 and buf.pending_samples == 0 and conserved(buf)
    assert buf.capacity(0) == 16
    with pytest.raises(KeyError):
        buf.reissue(lease, "s2")
    assert await buf.put(make_sample("a", 1, 4), 0) is D


async def test_release_holder_and_cancel():
    buf = make_buffer(max_attempts=2)
    a = buf.issue("a", "s0", 4)
    buf.issue("b", "s1", 4)
    await buf.put(make_sample("a", 0, 4), 0)
    assert buf.release_holder("s0") == [a]
    assert buf.counters["released"] == 3 and buf.inflight_samples == 3 + 4
    assert buf.cancel("a") and not buf.cancel("a") and not buf.cancel("zzz")
    c = buf.counters
    assert (c["cancelled"], c["dropped_incomplete"]) == (3, 1)
    assert buf.inflight_samples == 4 and conserved(buf)
    a2 = buf.issue("c", "s0", 4)
    a2.attempt = 2                             # last attempt: releasing it gives it up
    assert buf.release_holder("s0") == []
    assert buf.counters["failed"] == 4 and buf.inflight_samples == 4


async def test_result_for_an_expired_lease_completes_it_before_reissue():
    clock = FakeClock(0.0)
    buf = make_buffer(clock=clock, lease_timeout_s=1.0)
    lease = buf.issue("a", "s0", 4)
    clock.advance(1.0)
    assert buf.expire() == [lease]
    for s in group("a", 4):
        assert await buf.put(s, 0) is A
    assert not buf.is_open("a")
    with pytest.raises(KeyError):
        buf.reissue(lease, "s1")
    assert buf.inflight_samples == 0 and buf.ready_samples == 4


async def test_length_bucketing_groups_similar_lengths_without_starving():
    # batch of 2 groups of 2; eta = 3 leaves room for 8 groups
    buf = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=3, length_bucketing=True,
                        clock=FakeClock())
    lengths = {"long0": 100, "short0": 5, "short1": 6, "long1": 99, "short2": 5, "long2": 97}
    for aid, n in lengths.items():
        await fill(buf, aid, 0, versions=(0,) * n)
    first = buf.poll_batch(0)
    # the oldest group ("long0") anchors the batch; its partner is the closest in length
    assert [g[0].assignment_id for g in first.groups] == ["long0", "long1"]
    second = buf.poll_batch(1)
    assert [g[0].assignment_id for g in second.groups] == ["short0", "short2"]
    third = buf.poll_batch(2)
    assert [g[0].assignment_id for g in third.groups] == ["short1", "long2"]


async def test_length_bucketing_takes_groups_about_to_go_stale_first():
    buf = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=1, length_bucketing=True,
                        clock=FakeClock())
    await fill(buf, "old-long", 0, versions=(0,) * 50)
    buf.capacity(1)
    await fill(buf, "new-short-a", 1, versions=(1,) * 5)
    await fill(buf, "new-short-b", 1, versions=(1,) * 5)
    await fill(buf, "new-long", 1, versions=(1,) * 50, holder="s1")
    # at v = 1 "old-long" has staleness 1 == eta: it must go now or be dropped at v = 2
    batch = buf.poll_batch(1)
    assert [g[0].assignment_id for g in batch.groups] == ["old-long", "new-long"]
    assert buf.counters["stale_dropped"] == 0


async def test_dedupe_window_is_bounded():
    buf = make_buffer(batch_samples=4, max_staleness=100, dedupe_window=8)
    for i in range(6):
        await fill(buf, f"g{i}", 0)
        assert len(buf.poll_batch(0)) == 4
    assert len(buf._seen) == 8 and len(buf._closed) == 6
    # g0's id fell out of both windows: an ancient re-send is unknown, not trained again
    for i in range(3):
        await fill(buf, f"h{i}", 0)
        buf.poll_batch(0)
    assert await buf.put(make_sample("g0", 0, 4), 0) is INV
    assert await buf.put(make_sample("h2", 0, 4), 0) is D


async def test_resume_without_buffer_state_does_not_inflate_capacity():
    buf = make_buffer(batch_samples=8, max_staleness=1)
    # a learner resumed at v = 10 with a fresh buffer: (10 + 1 + 1) * 8 - 10 * 8 = 16, not 96
    assert buf.capacity(10) == 16
    assert buf.counters["consumed"] == 0          # the metrics do not pretend


@pytest.mark.parametrize("binary", [True, False])
async def test_state_dict_round_trip_resumes_exactly(binary):
    clock = FakeClock(0.0)
    buf = make_buffer(batch_samples=8, max_staleness=2, clock=clock, max_attempts=2)
    await fill(buf, "ready", 0)                               # complete, buffered
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=9)
    buf.issue("partial", "s0", 4, payload=Assignment(
        assignment_id="partial", prompt_id="p1", prompt_token_ids=np.arange(5, dtype=np.int32),
        group_size=4, version=0, sampling=sampling))
    await buf.put(make_sample("partial", 2, 4), 0)            # 1 of 4 back
    last = buf.issue("last-try", "s1", 4, payload={"prompt": "2+2", "answer": "4"})
    last.attempt = 2
    await fill(buf, "trained", 0)
    await fill(buf, "trained2", 0)
    assert len(buf.poll_batch(0)) == 8                         # "ready" + "trained"
    buf.staleness.set(1, "test")
    before = (buf.capacity(0), buf.pending_samples, buf.inflight_samples, buf.counters,
              buf.staleness_histogram)
    # accepted 13 (8 trained + 5 buffered), in flight 3 + 4 = 7:
    # (0 + 1 + 1) * 8 - (13 + 7) = -4 -> 0
    assert before[:3] == (0, 5, 7)

    state = buf.state_dict(binary=binary)
    state = json.loads(json.dumps(state)) if not binary else msgpack.unpackb(
        msgpack.packb(state), strict_map_key=False)
    new = make_buffer(batch_samples=8, max_staleness=0, clock=FakeClock(500.0), max_attempts=2)
    new.load_state_dict(state)
    assert (new.capacity(0), new.pending_samples, new.inflight_samples, new.counters,
            new.staleness_histogram) == before
    assert new.max_staleness == 1 and new.version == 0

    # The servers of the saved run are gone: the next expire() reports every lease.
    retry = new.expire()
    assert [le.assignment_id for le in retry] == ["partial"]
    assert isinstance(retry[0].payload, Assignment) and retry[0].payload.prompt_id == "p1"
    assert retry[0].payload.sampling == sampling               # typed sampling survives the checkpoint
    # "last-try" was on its last attempt: given up, capacity back
    # in flight 7 - 4 = 3: (0 + 1 + 1) * 8 - (13 + 3) = 0
    assert new.inflight_samples == 3 and new.counters["failed"] == 4 and new.capacity(0) == 0
    new.reissue(retry[0], "s5")
    # old results re-sent after reconnect are still recognised
    assert await new.put(make_sample("partial", 2, 4), 0) is D
    assert await new.put(make_sample("trained", 0, 4), 0) is D
    for i in (0, 1, 3):
        assert await new.put(make_sample("partial", i, 4), 0) is A
    batch = new.poll_batch(0)
    assert [g[0].assignment_id for g in batch.groups] == ["trained2", "partial"]
    assert conserved(new) and new.inflight_samples == 0


async def test_load_refuses_another_group_size():
    buf = make_buffer()
    with pytest.raises(ValueError, match="group_size"):
        RolloutBuffer(batch_samples=8, group_size=8).load_state_dict(buf.state_dict())


async def test_samples_without_tokens_have_staleness_zero():
    buf = make_buffer(batch_samples=4, max_staleness=0)
    buf.capacity(3)
    buf.issue("a", "s0", 4)
    for i in range(4):
        assert await buf.put(make_sample("a", i, 4, versions=()), 3) is A
    batch = buf.poll_batch(3)
    assert batch.staleness == [0] * 4


async def test_put_nowait_then_wake_is_put():
    """A result's samples put in a row without the wake-up (``put_nowait``, given or not the
    oldest version), then one ``wake``: the same statuses and group as ``put``, and a waiting
    ``next_batch`` is woken only by ``wake``."""
    import asyncio

    versions = [(1, 1, 2), (0, 2, 2), (2,), (1, 2)]
    bufs = [make_buffer(batch_samples=4, max_staleness=3) for _ in range(3)]
    for buf in bufs:
        buf.issue("a", "s0", 4)
    samples = [make_sample("a", i, 4, v) for i, v in enumerate(versions)]
    assert [await bufs[0].put(s, 2) for s in samples] == [A] * 4
    waiter = asyncio.create_task(bufs[1].next_batch(2))
    await asyncio.sleep(0)
    assert bufs[1].waiting == 1
    assert [bufs[1].put_nowait(s, 2) for s in samples] == [(A, False)] * 3 + [(A, True)]
    await asyncio.sleep(0)
    assert not waiter.done()                    # no wake-up yet
    await bufs[1].wake()
    batch = await asyncio.wait_for(waiter, 1)
    assert [bufs[2].put_nowait(s, 2, min(v))[0] for s, v in zip(samples, versions)] == [A] * 4
    assert bufs[0]._groups["a"].mins == bufs[2]._groups["a"].mins == [1, 0, 2, 1]
    assert bufs[0].poll_batch(2).staleness == bufs[2].poll_batch(2).staleness == batch.staleness
    bufs[2].issue("b", "s0", 4)
    assert bufs[2].put_nowait(make_sample("b", 0, 4, (1, 3)), 2, 1) == (INV, False)  # newest 3 > 2


async def test_a_waiter_is_woken_once_a_batch_is_ready_not_per_group():
    """Completed groups that do not make a batch yet wake no one (the waiter would find none);
    the group that completes the batch wakes it, through put and through put_nowait + wake."""
    import asyncio

    for via_put in (True, False):
        buf = make_buffer(batch_samples=8, group_size=4)
        polls = []
        poll = buf.poll_batch
        buf.poll_batch = lambda version, polls=polls, poll=poll: polls.append(version) or poll(version)
        waiter = asyncio.create_task(buf.next_batch(0))
        await asyncio.sleep(0)
        assert polls == [0, 0] and buf.waiting == 1        # next_batch's poll, then the wait's
        for aid in ("a", "b"):
            buf.issue(aid, "s0", 4)
            for i in range(4):
                s = make_sample(aid, i, 4)
                if via_put:
                    assert await buf.put(s, 0) is A
                else:
                    assert buf.put_nowait(s, 0)[0] is A
                    await buf.wake()
            for _ in range(3):
                await asyncio.sleep(0)
            if aid == "a":
                assert polls == [0, 0] and not waiter.done()   # one group: no wake-up
        batch = await asyncio.wait_for(waiter, 1)
        assert len(batch) == 8 and polls == [0, 0, 0]


def _state(buf: RolloutBuffer) -> tuple:
    groups = {aid: ([s.sample_id if s is not None else None for s in g.slots], g.mins, g.filled,
                    g.resolved, g.min_version, g.max_len, g.ready)
              for aid, g in buf._groups.items()}
    gate = (buf.gate.in_flight, buf.gate.accepted_total, buf.gate.consumed_total)
    return (buf.counters, groups, [g.assignment_id for g in buf._ready], buf.pending_samples,
            sorted(lease.assignment_id for lease in buf.leases), gate, buf._seen.items())


GROUP_CASES = {
    "in order": lambda ss: ss,
    "shuffled": lambda ss: [ss[2], ss[0], ss[3], ss[1]],
    "index repeated": lambda ss: [ss[0], ss[1], ss[1], ss[3]],
    "index repeated, other id": lambda ss: ss[:3] + [make_sample("a", 1, 4, (2,), sample_id="a/9")],
    "id repeated": lambda ss: ss[:3] + [make_sample("a", 3, 4, (1, 2), sample_id="a/0")],
    "one failed": lambda ss: ss[:3] + [make_sample("a", 3, 4, (2,), failed="engine")],
    "token too new": lambda ss: ss[:3] + [make_sample("a", 3, 4, (1, 5))],
    "stale": lambda ss: [make_sample("a", 0, 4, (0, 2))] + ss[1:],
    "no tokens": lambda ss: ss[:3] + [make_sample("a", 3, 4, ())],
    "other assignment": lambda ss: ss[:3] + [make_sample("b", 3, 4, (2,))],
    "wrong size": lambda ss: ss[:3],
    "index out of range": lambda ss: ss[:3] + [make_sample("a", 4, 4, (2,))],
}


@pytest.mark.parametrize("prefilled", [False, True])
@pytest.mark.parametrize("case", list(GROUP_CASES))
async def test_put_group_nowait_ends_as_put_nowait_one_by_one(case, prefilled):
    """``put_group_nowait`` takes a whole group at once or changes nothing; either way (then
    ``put_nowait`` of each in turn) the buffer ends as with ``put_nowait`` one by one."""
    ends = []
    for whole in (True, False):
        buf = make_buffer(batch_samples=4, max_staleness=1)
        buf.issue("a", "s0", 4)
        buf.issue("b", "s0", 4)
        if prefilled:
            assert buf.put_nowait(make_sample("a", 1, 4, (2,)), 2) == (A, False)
        samples = GROUP_CASES[case]([make_sample("a", i, 4, (1 + i % 2, 2)) for i in range(4)])
        mins = [int(s.token_versions.min()) if len(s.token_versions) else -1 for s in samples]
        before = _state(buf)
        if whole and buf.put_group_nowait(samples, 2, mins):
            statuses = [A] * len(samples)
            taken = True
        else:
            assert _state(buf) == before              # refused: nothing changed
            statuses = [buf.put_nowait(s, 2, mv)[0] for s, mv in zip(samples, mins)]
            taken = False
        ends.append((statuses, _state(buf)))
        if whole:
            assert taken == (case in ("in order", "shuffled", "no tokens") and not prefilled), case
    assert ends[0] == ends[1]
