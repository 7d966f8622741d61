"""next_batch: wakes as soon as a batch is complete, times out cleanly, is cancellation-safe.

No sleeps for synchronization: ``settle`` only lets ready tasks run (``sleep(0)``), and waits
are on the buffer's own state (``buf.waiting``) or on the tasks themselves.
"""

from __future__ import annotations

import asyncio

import pytest
from buffer_testkit import FakeClock, fill, group

from buffer import RolloutBuffer


def make_buffer(**kw) -> RolloutBuffer:
    args = dict(batch_samples=8, group_size=4, max_staleness=1, clock=FakeClock())
    args.update(kw)
    return RolloutBuffer(**args)


async def settle(until=lambda: True, rounds: int = 50) -> None:
    """Let every ready task run, until ``until()`` holds (bounded: no wall-clock waiting)."""
    for _ in range(rounds):
        await asyncio.sleep(0)
        if until():
            return
    raise AssertionError("condition not reached")


async def test_next_batch_returns_at_once_when_ready():
    buf = make_buffer()
    await fill(buf, "a", 0)
    await fill(buf, "b", 0)
    batch = await buf.next_batch(0)
    assert len(batch) == 8


async def test_next_batch_wakes_on_the_sample_that_completes_the_batch():
    buf = make_buffer()
    buf.issue("a", "s0", 4)
    buf.issue("b", "s0", 4)
    task = asyncio.create_task(buf.next_batch(0))
    await settle(lambda: buf.waiting == 1)
    samples = group("a", 4) + group("b", 4)
    for s in samples[:-1]:
        await buf.put(s, 0)
        await settle()
        assert not task.done()               # 7 of 8: still waiting
    await buf.put(samples[-1], 0)
    batch = await asyncio.wait_for(task, timeout=5)   # a safety net, not a synchronization
    assert len(batch) == 8 and buf.waiting == 0


async def test_timeout_raises_and_takes_nothing():
    buf = make_buffer()
    await fill(buf, "a", 0)                  # half a batch
    with pytest.raises(asyncio.TimeoutError):
        await buf.next_batch(0, max_wait_s=0.01)
    with pytest.raises(asyncio.TimeoutError):   # the builtin TimeoutError on Python >= 3.11
        await buf.next_batch(0, max_wait_s=0)
    assert buf.waiting == 0 and buf.ready_samples == 4 and buf.counters["consumed"] == 0
    await fill(buf, "b", 0)
    assert len(await buf.next_batch(0, max_wait_s=5)) == 8


async def test_cancelled_waiter_takes_nothing_and_the_next_caller_gets_everything():
    buf = make_buffer()
    task = asyncio.create_task(buf.next_batch(0))
    await settle(lambda: buf.waiting == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert buf.waiting == 0
    await fill(buf, "a", 0)
    await fill(buf, "b", 0)
    batch = await buf.next_batch(0)
    assert len(batch) == 8 and buf.counters["consumed"] == 8 and buf.counters["batches"] == 1


async def test_cancel_racing_with_completion_loses_no_batch():
    buf = make_buffer()
    task = asyncio.create_task(buf.next_batch(0))
    await settle(lambda: buf.waiting == 1)
    await fill(buf, "a", 0)
    await fill(buf, "b", 0)                  # notifies; the waiter has not run yet
    task.cancel()
    try:
        batch = await task
    except asyncio.CancelledError:
        batch = None
    if batch is None:                        # cancelled before it took anything
        assert buf.ready_samples == 8 and buf.counters["consumed"] == 0
        assert len(buf.poll_batch(0)) == 8
    else:                                    # it took the batch and returned it
        assert len(batch) == 8 and buf.ready_samples == 0


async def test_two_waiters_get_one_batch_each():
    buf = make_buffer(max_staleness=3)
    t1 = asyncio.create_task(buf.next_batch(0))
    t2 = asyncio.create_task(buf.next_batch(0))
    await settle(lambda: buf.waiting == 2)
    for aid in "abcd":
        await fill(buf, aid, 0)
    b1, b2 = await asyncio.wait_for(asyncio.gather(t1, t2), timeout=5)
    ids = [s.sample_id for s in b1.samples + b2.samples]
    assert len(ids) == 16 and len(set(ids)) == 16


async def test_waiter_at_a_newer_version_skips_groups_gone_stale():
    buf = make_buffer(batch_samples=4, max_staleness=0)
    await fill(buf, "old", 0)
    buf.capacity(1)
    task = asyncio.create_task(buf.next_batch(1))
    await settle(lambda: buf.waiting == 1)
    assert buf.counters["dropped_stale"] == 4   # "old" is 1 > 0 stale at v = 1
    await fill(buf, "new", 1)
    batch = await asyncio.wait_for(task, timeout=5)
    assert [s.assignment_id for s in batch.samples] == ["new"] * 4
