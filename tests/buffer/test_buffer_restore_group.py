"""RolloutBuffer.restore_group: a whole group from the rollout log re-enters through put."""

from __future__ import annotations

import pytest
from buffer_testkit import fill, group

from buffer import RolloutBuffer


def conserved(buf: RolloutBuffer) -> bool:
    n = buf.counters
    return n["accepted"] == (n["consumed"] + buf.pending_samples + n["dropped_stale"]
                             + n["dropped_incomplete"])


async def test_a_restored_group_is_issued_accepted_and_trained_like_any_other():
    buf = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=1)
    await fill(buf, "a1", 0)
    # a2 was accepted in an earlier life; the gate is over its capacity (force), as that work exists.
    statuses = await buf.restore_group(group("a2", 2, (0,)), 0)
    assert [str(s) for s in statuses] == ["accepted", "accepted"]
    n = buf.counters
    assert n["issued"] == 4 and n["accepted"] == 4 and buf.inflight_samples == 0
    # (0 + 1 + 1) * 4 - (4 accepted + 0 in flight) = 4: restored samples use up capacity.
    assert buf.capacity(0) == 4
    batch = buf.poll_batch(0)
    assert batch is not None and [s.assignment_id for s in batch.samples] == ["a1", "a1", "a2", "a2"]
    assert conserved(buf)


async def test_restore_applies_the_staleness_rule_and_refuses_known_ids_and_partial_groups():
    buf = RolloutBuffer(batch_samples=2, group_size=2, max_staleness=1)
    # At version 3 a group of version-1 tokens has staleness 2 > 1: dropped, counted stale.
    statuses = await buf.restore_group(group("old", 2, (1,)), 3)
    assert str(statuses[0]) == "stale" and buf.counters["stale"] >= 1 and buf.pending_samples == 0
    with pytest.raises(ValueError):             # its id is known now (closed as stale)
        await buf.restore_group(group("old", 2, (3,)), 3)
    with pytest.raises(ValueError):             # half a group
        await buf.restore_group(group("half", 2, (3,))[:1], 3)
    assert await buf.restore_group(group("new", 2, (3,)), 3) and buf.ready_samples == 2
    assert conserved(buf)
