"""Length buckets that reach the batch (issue 27.4): an assignment carries its prompt's length
bucket (protocol.BUCKET_KEY); the buffer makes each batch of one bucket, urgent groups first, and
falls back to nearest lengths only when no bucket can fill a batch any more."""

from __future__ import annotations

import numpy as np
from buffer_testkit import make_sample
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol
from buffer import AckStatus, RolloutBuffer
from protocol import BUCKET_KEY


def _issue(buf: RolloutBuffer, aid: str, bucket: int | None) -> None:
    """Issue ``aid`` with the payload the learner's admission gives: its Assignment."""
    payload = protocol.Assignment(
        assignment_id=aid, prompt_id="p", prompt_token_ids=np.arange(3, dtype=np.int32),
        group_size=buf.group_size, version=0, prompt_text="q", sampling=protocol.SamplingParams(),
        metadata={} if bucket is None else {BUCKET_KEY: bucket}, deadline_s=60.0)
    buf.issue(aid, "s0", payload=payload)


def _deliver(buf: RolloutBuffer, aid: str, version: int, tokens: int = 0) -> None:
    for gi in range(buf.group_size):
        status, _ = buf.put_nowait(make_sample(aid, gi, buf.group_size, (tokens,), reward=float(gi)), version)
        assert status is AckStatus.ACCEPTED


def test_a_batch_is_one_bucket_and_waits_for_one_to_fill():
    buf = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=1)    # 2 groups a batch, 4 issued
    buf.capacity(0)
    for aid, b in (("a0", 0), ("a1", 1), ("a2", 0), ("a3", 1)):
        _issue(buf, aid, b)
    _deliver(buf, "a0", 0)
    _deliver(buf, "a1", 0)                   # two ready, of two buckets: no batch yet
    assert buf.ready_samples == 4 and buf.poll_batch(0) is None
    _deliver(buf, "a3", 0)                   # bucket 1 is full
    batch = buf.poll_batch(0)
    assert [s.assignment_id for s in batch.samples] == ["a1", "a1", "a3", "a3"]
    _deliver(buf, "a2", 0)
    assert {s.assignment_id for s in buf.poll_batch(1).samples} == {"a0", "a2"}


def test_the_most_urgent_bucket_goes_first():
    buf = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=2, stale_policy="correct")
    buf.capacity(0)
    for aid, b in (("a0", 0), ("a1", 1), ("a2", 1), ("a3", 0)):
        _issue(buf, aid, b)
    _deliver(buf, "a1", 2, tokens=1)         # fresher
    _deliver(buf, "a2", 2, tokens=1)
    _deliver(buf, "a0", 2, tokens=0)         # staleness 2 == eta at version 2: urgent
    _deliver(buf, "a3", 2, tokens=1)
    batch = buf.poll_batch(2)
    assert {s.assignment_id for s in batch.samples} == {"a0", "a3"}


def test_no_bucket_can_fill_a_batch_then_the_nearest_lengths_go():
    """The gate is full and every bucket is short: the batch is the ready groups (as
    length_bucketing picks them), not a wait forever."""
    buf = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=0)    # capacity: 2 groups
    buf.capacity(0)
    _issue(buf, "a0", 0)
    _issue(buf, "a1", 1)
    _deliver(buf, "a0", 0)
    assert buf.poll_batch(0) is None         # a1 in flight: it cannot fill a bucket, but wait for it
    _deliver(buf, "a1", 0)
    batch = buf.poll_batch(0)                # nothing in flight, no capacity: stuck -> mixed batch
    assert batch is not None and {s.assignment_id for s in batch.samples} == {"a0", "a1"}


def test_without_buckets_nothing_changes_and_the_bucket_survives_a_checkpoint():
    plain = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=1)
    plain.capacity(0)
    for aid in ("a0", "a1"):
        _issue(plain, aid, None)
        _deliver(plain, aid, 0)
    assert plain.poll_batch(0) is not None
    buf = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=1)
    buf.capacity(0)
    for aid, b in (("a0", 0), ("a1", 1), ("a2", 0)):
        _issue(buf, aid, b)
    _deliver(buf, "a0", 0)
    _deliver(buf, "a1", 0)
    state = buf.state_dict(binary=False)
    again = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=1)
    again.load_state_dict(state)
    assert again.poll_batch(0) is None       # still one of each bucket: the buckets came back
    for lease in again.expire():             # the saved run's lease of a2, re-issued
        again.reissue(lease, "s1")
    _deliver(again, "a2", 0)
    assert {s.assignment_id for s in again.poll_batch(0).samples} == {"a0", "a2"}


@settings(max_examples=150, deadline=None)
@given(eta=st.integers(0, 2), k=st.integers(1, 3), buckets=st.integers(1, 3),
       actions=st.lists(st.tuples(st.sampled_from(["deliver", "deliver", "fail", "train"]), st.integers(0, 99)),
                        min_size=10, max_size=120))
def test_batches_are_one_bucket_unless_stuck_and_the_run_never_stalls(eta, k, buckets, actions):
    """The learner fills the gate with runs of k prompts of one bucket (as the stream does);
    groups complete in any order and some fail (their place refilled from the next run): every
    batch is one bucket or, only when no bucket could fill one, the ready groups; and whenever
    nothing is in flight and the gate is closed, a batch can be taken (the run goes on)."""
    gs = 2
    buf = RolloutBuffer(batch_samples=k * gs, group_size=gs, max_staleness=eta, stale_policy="correct")
    version, n, bucket_of = 0, 0, {}
    for kind, pick in actions:
        while buf.capacity(version) >= gs:
            aid = f"a{n}"
            bucket_of[aid] = (n // k) % buckets
            _issue(buf, aid, bucket_of[aid])
            n += 1
        open_ids = [le.assignment_id for le in buf.leases]
        if kind == "deliver" and open_ids:
            _deliver(buf, open_ids[pick % len(open_ids)], version)
        elif kind == "fail" and open_ids:
            aid = open_ids[pick % len(open_ids)]
            buf.put_nowait(make_sample(aid, 0, gs, (version,), failed="generate: boom"), version)
        elif kind == "train":
            stuck = buf._bucket_stuck(version, k)
            batch = buf.poll_batch(version)
            if batch is not None:
                got = {bucket_of[s.assignment_id] for s in batch.samples}
                assert len(got) == 1 or stuck, got
                version += 1
        if not buf.inflight_samples and buf.capacity(version) < gs and buf.ready_samples >= k * gs:
            assert buf.poll_batch(version) is not None       # never a stall
            version += 1
