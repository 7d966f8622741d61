"""DAPO's dynamic sampling in the buffer (issue 27.1): a group whose rewards are all equal is
dropped when it completes, counted, and its capacity goes back through the gate, so more work is
issued in its place; the gate's staleness bound still holds."""

from __future__ import annotations

from buffer_testkit import make_sample
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer import AckStatus, RolloutBuffer


def _put_group(buf: RolloutBuffer, aid: str, rewards: list[float], version: int, tokens: int = 0,
               whole: bool = False) -> list[AckStatus]:
    samples = [make_sample(aid, gi, len(rewards), (tokens,), reward=r) for gi, r in enumerate(rewards)]
    if whole:
        assert buf.put_group_nowait(samples, version, [tokens] * len(samples))
        return [AckStatus.ACCEPTED] * len(samples)
    return [buf.put_nowait(s, version)[0] for s in samples]


def test_a_uniform_group_is_dropped_counted_and_gives_its_capacity_back():
    buf = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=0, drop_uniform_groups=True)
    assert buf.capacity(0) == 4
    for aid in ("a0", "a1"):
        buf.issue(aid, "s0")
    assert buf.capacity(0) == 0
    # Both rewards 1.0: accepted, then dropped at completion; its two slots are free again.
    assert _put_group(buf, "a0", [1.0, 1.0], 0) == [AckStatus.ACCEPTED] * 2
    assert buf.capacity(0) == 2 and buf.pending_samples == 0 and buf.uniform_streak == 1
    c = buf.counters
    assert c["dropped_uniform"] == 2 and c["accepted"] == 2 and c["consumed"] == 0
    # A late copy of a dropped group's sample is a duplicate (its acknowledgement was final).
    assert buf.put_nowait(make_sample("a0", 0, 2, (0,), sample_id="late", reward=0.0), 0)[0] is AckStatus.DUPLICATE
    # Informative groups fill the batch; the batch says how many were dropped before it.
    buf.issue("a2", "s0")
    _put_group(buf, "a1", [0.0, 1.0], 0)
    _put_group(buf, "a2", [0.5, 0.25], 0, whole=True)        # the whole-group path too
    batch = buf.poll_batch(0)
    assert batch is not None and [s.assignment_id for s in batch.samples] == ["a1", "a1", "a2", "a2"]
    assert batch.uniform_dropped == 1 and buf.uniform_streak == 0
    c = buf.counters
    assert c["accepted"] == c["consumed"] + buf.pending_samples + c["dropped_stale"] + c["dropped_incomplete"] + c["dropped_uniform"]


def test_the_whole_group_path_drops_a_uniform_group_too():
    buf = RolloutBuffer(batch_samples=2, group_size=2, max_staleness=0, drop_uniform_groups=True)
    buf.capacity(0)
    buf.issue("a0", "s0")
    _put_group(buf, "a0", [0.0, 0.0], 0, whole=True)
    assert buf.poll_batch(0) is None and buf.counters["dropped_uniform"] == 2 and buf.capacity(0) == 2


def test_off_by_default_and_groups_of_one_are_never_uniform():
    buf = RolloutBuffer(batch_samples=2, group_size=2, max_staleness=0)
    buf.capacity(0)
    buf.issue("a0", "s0")
    _put_group(buf, "a0", [1.0, 1.0], 0)
    assert buf.poll_batch(0) is not None
    one = RolloutBuffer(batch_samples=1, group_size=1, max_staleness=0, drop_uniform_groups=True)
    one.capacity(0)
    one.issue("a0", "s0")
    _put_group(one, "a0", [1.0], 0)
    assert one.poll_batch(0) is not None                     # no group to compare within


@settings(max_examples=150, deadline=None)
@given(eta=st.integers(0, 2), gs=st.integers(2, 3), groups_per_batch=st.integers(1, 3), fifo=st.booleans(),
       actions=st.lists(st.tuples(st.sampled_from(["deliver", "deliver", "train"]), st.integers(0, 50),
                                  st.lists(st.sampled_from([0.0, 1.0]), min_size=3, max_size=3)),
                        min_size=20, max_size=100))
def test_the_gate_bound_holds_under_dynamic_sampling(eta, gs, groups_per_batch, fifo, actions):
    """Generation runs as far ahead as the gate allows, each assignment generated on the weights
    of the version it was issued at (the most stale a server can be), about half the groups
    uniform. In any delivery order the gate's arithmetic holds: what is accepted and not dropped
    plus what is in flight never exceeds (v + η + 1)·B, a dropped group's capacity coming back
    once. Delivered in issue order (the case the gate bounds; out of order, a slow group can be
    overtaken and the stale filter is what catches it, docs/design.md §3), every trained sample is
    at most η versions old under stale_policy correct (the filter drops nothing), as without
    dynamic sampling. Nothing is lost either way."""
    B = gs * groups_per_batch
    buf = RolloutBuffer(batch_samples=B, group_size=gs, max_staleness=eta, stale_policy="correct",
                        drop_uniform_groups=True)
    version, issued_at, n, trained = 0, {}, 0, 0
    for kind, pick, rewards in actions:
        while buf.capacity(version) >= gs:                    # the learner fills the gate
            aid = f"a{n}"
            n += 1
            buf.issue(aid, "s0")
            issued_at[aid] = version
        open_ids = [le.assignment_id for le in buf.leases]
        if kind == "deliver" and open_ids:
            aid = min(open_ids, key=lambda a: int(a[1:])) if fifo else open_ids[pick % len(open_ids)]
            for gi in range(gs):
                s = make_sample(aid, gi, gs, (issued_at[aid],), reward=rewards[gi % 3])
                assert buf.put_nowait(s, version)[0] is AckStatus.ACCEPTED
        elif kind == "train":
            batch = buf.poll_batch(version)
            if batch is not None:
                if fifo:
                    assert max(batch.staleness) <= eta and not any(batch.needs_correction)
                for grp in batch.groups:                       # no uniform group is trained
                    assert len({s.reward for s in grp}) > 1
                version += 1
                trained += len(batch)
        gate, c = buf.gate, buf.counters
        assert gate.accepted_total + gate.in_flight <= (version + eta + 1) * B
        assert gate.accepted_total == c["accepted"] - c["dropped_uniform"] - c["dropped_stale"] - c["dropped_incomplete"]
        assert c["accepted"] == (c["consumed"] + buf.pending_samples + c["dropped_uniform"]
                                 + c["dropped_stale"] + c["dropped_incomplete"])
        assert c["consumed"] == trained
