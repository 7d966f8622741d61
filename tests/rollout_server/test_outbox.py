"""Outbox without a socket: results kept until acked, re-sent after reconnect and after the ack
timeout, repeated acks ignored, acks for unknown ids counted."""

from __future__ import annotations

import numpy as np
import pytest

import protocol
from rollout_server.metrics import RolloutMetrics
from rollout_server.outbox import Outbox


def result(aid: str, n: int = 2) -> protocol.RolloutResult:
    tok = np.array([5], dtype=np.int32)
    return protocol.RolloutResult(server_id="s", samples=[protocol.Sample(
        protocol.sample_id(aid, i), aid, i, n, tok, tok, np.zeros(1, np.float32),
        np.zeros(1, np.int32), 1.0) for i in range(n)])


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def box():
    sent: list[list] = []
    changes = []

    async def send(frames):
        sent.append(frames)

    metrics = RolloutMetrics()
    clock = Clock()
    box = Outbox(send, metrics, ack_timeout_s=30.0, clock=clock, on_change=lambda: changes.append(1))
    box.sent, box.clock_, box.changes = sent, clock, changes
    return box


def ack(*ids: str, status: str = "accepted") -> protocol.Ack:
    return protocol.Ack(sample_ids=list(ids), statuses=[status] * len(ids))


def ids_in(frames) -> list[str]:
    return [s.sample_id for s in protocol.decode(frames).samples]


async def test_kept_until_every_sample_is_acked(box):
    await box.put(result("a1"))
    await box.put(result("a2", n=3))
    assert len(box) == 2 and box.samples == 5 and len(box.sent) == 2
    assert ids_in(box.sent[0]) == ["a1/0", "a1/1"]
    assert box.ack(ack("a1/0")) == 1 and len(box) == 2 and box.samples == 4
    assert box.ack(ack("a1/1", "a2/0", "a2/1", "a2/2")) == 4
    assert len(box) == 0 and box.samples == 0
    assert box.metrics.registry.get_sample_value("slipstream_rollout_acks_total",
                                                 {"status": "accepted"}) == 5


async def test_resend_after_reconnect_and_after_the_ack_timeout(box):
    await box.put(result("a1"))
    box.clock_.t += 10
    await box.put(result("a2"))
    assert await box.resend_all() == 2 and len(box.sent) == 4          # after a Welcome: all
    box.clock_.t += 29                                                # 29 s since the re-send
    assert await box.resend_due() == 0
    box.ack(ack("a2/0", "a2/1"))
    box.clock_.t += 2                                                 # 31 s: a1 is overdue
    assert await box.resend_due() == 1 and ids_in(box.sent[-1]) == ["a1/0", "a1/1"]
    assert await box.resend_due() == 0                                # its clock restarted
    assert box.metrics.registry.get_sample_value("slipstream_rollout_send_retries_total") == 3


async def test_repeated_acks_are_ignored_and_unknown_ones_counted(box):
    await box.put(result("a1"))
    box.ack(ack("a1/0"))
    box.ack(ack("a1/0", status="duplicate"))          # the learner acks every copy it receives
    box.ack(ack("a1/0", "a1/1"))
    box.ack(ack("a1/1", status="duplicate"))          # after the result was complete
    assert box.metrics.error_count("unknown_ack") == 0
    box.ack(ack("zz/0", "a1/7", "not-a-sample-id", "/3"))
    assert box.metrics.error_count("unknown_ack") == 4
    assert len(box) == 0
    assert box.metrics.registry.get_sample_value("slipstream_rollout_acks_total",
                                                 {"status": "duplicate"}) == 2


async def test_change_callback_and_one_result_per_assignment(box):
    await box.put(result("a1"))
    assert box.changes == [1]
    box.ack(ack("nope/0"))
    assert box.changes == [1]                         # nothing changed
    box.ack(ack("a1/0"))
    assert box.changes == [1, 1]
    mixed = protocol.RolloutResult(server_id="s", samples=result("a").samples + result("b").samples)
    with pytest.raises(ValueError, match="one result per assignment"):
        await box.put(mixed)
