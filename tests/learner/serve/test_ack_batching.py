"""The learner holds the results of a burst and their Acks, and receives them (one server's
consecutive results as one) and sends one Ack per server when its rollout loop stops reading
(learner.serve.ingress.ResultIngress, learner.serve.router.PendingAcks): a real LearnerService (tiny model) and
real sockets. Every sample is acknowledged exactly once, in arrival order; nothing is held while
the loop waits; any other message from a server sends what is held first."""

from __future__ import annotations

import asyncio

import pytest
import zmq
from learner_testkit import FakeServer, learner_config, running_learner, samples_for

import protocol
from learner.serve.router import PendingAcks

pytestmark = pytest.mark.slow
GROUPS = 6


async def assignments(server: FakeServer, n: int) -> list[protocol.Assignment]:
    await server.hello()
    await server.work(n * 2)
    return [await server.expect(protocol.Assignment) for _ in range(n)]


async def acks_until(server: FakeServer, n_samples: int) -> list[protocol.Ack]:
    got: list[protocol.Ack] = []
    while sum(len(a.sample_ids) for a in got) < n_samples:
        got.append(await server.expect(protocol.Ack, skip=(protocol.WeightsAvailable,
                                                          protocol.Assignment, protocol.Heartbeat)))
    return got


async def test_a_burst_is_acknowledged_once_per_sample_in_order_through_the_loop(tmp_path, tiny_model_dir):
    cfg = learner_config(tmp_path, max_staleness=GROUPS)
    async with running_learner(cfg, tiny_model_dir) as svc:
        server = FakeServer(svc.endpoints["rollout"], "burst", max_concurrency=2 * GROUPS)
        # The results leave from a plain socket of the same identity in one go, without
        # yielding to the loop, so the learner finds several of them queued.
        ctx = zmq.Context()
        push = ctx.socket(zmq.DEALER)
        try:
            work = await assignments(server, GROUPS)
            server.close()
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.IDENTITY, b"burst")
            push.connect(svc.endpoints["rollout"])
            expected = []
            for a in work:
                samples = samples_for(a, version=0)
                expected += [s.sample_id for s in samples]
                push.send_multipart(protocol.encode(protocol.RolloutResult("burst", samples)))
            ids, statuses, acks = [], [], 0
            while len(ids) < len(expected):
                assert await asyncio.to_thread(push.poll, 30_000), f"acks for {len(ids)} samples only"
                msg = protocol.decode(push.recv_multipart())
                if isinstance(msg, protocol.Ack):
                    acks += 1
                    ids += msg.sample_ids
                    statuses += msg.statuses
            assert ids == expected and statuses == ["accepted"] * len(expected)
            assert 1 <= acks <= GROUPS
            assert not svc.ingress.pending_acks                  # nothing held while the loop waits
        finally:
            push.close(0)
            ctx.term()


async def test_held_acks_merge_per_server_and_leave_before_anything_else(tmp_path, tiny_model_dir):
    cfg = learner_config(tmp_path, max_staleness=GROUPS)
    async with running_learner(cfg, tiny_model_dir) as svc:
        one = FakeServer(svc.endpoints["rollout"], "one", max_concurrency=8)
        two = FakeServer(svc.endpoints["rollout"], "two", max_concurrency=8)
        try:
            a1, a2, a3 = await assignments(one, 3)
            (b1,) = await assignments(two, 1)
            # What the rollout loop does for a burst of four results: on_rollout for each (no
            # await in there yields), then the loop's idle hook.
            for identity, a in ((b"one", a1), (b"two", b1), (b"one", a2)):
                reply = await svc.on_rollout(identity, protocol.RolloutResult(
                    identity.decode(), samples_for(a, version=0)))
                assert reply is None
            # Whole groups are received at once; their Acks are held, not sent.
            assert not svc.ingress.held and svc.ingress.pending_acks
            assert svc.buffer.counters["accepted"] == 6
            await svc.ingress.flush()
            assert not svc.ingress.pending_acks and not svc.ingress.held
            (ack,) = await acks_until(one, 4)
            assert ack.sample_ids == [s.sample_id for a in (a1, a2) for s in samples_for(a)]
            assert ack.statuses == ["accepted"] * 4
            (ack,) = await acks_until(two, 2)
            assert ack.sample_ids == [s.sample_id for s in samples_for(b1)]
            # Another message from a server: what is held goes first (the Ack, then the echo).
            await svc.on_rollout(b"one", protocol.RolloutResult("one", samples_for(a3, version=0)))
            echo = await svc.on_rollout(b"one", protocol.Heartbeat(sender_id="one", version=0))
            assert isinstance(echo, protocol.Heartbeat) and not svc.ingress.pending_acks
            assert not svc.ingress.held
            (ack,) = await acks_until(one, 2)
            assert ack.sample_ids == [s.sample_id for s in samples_for(a3)]
            assert svc.buffer.counters["accepted"] == 8 and svc.buffer.counters["duplicate"] == 0
        finally:
            one.close()
            two.close()


async def test_one_servers_results_of_a_burst_are_received_as_one(tmp_path, tiny_model_dir, monkeypatch):
    """A server streaming one sample per result: the learner's intake sees the burst's
    consecutive results of that server as one result (its checks and its Ack once), split where
    another server's result comes between and where MERGE_SAMPLES would be passed; a hostile
    sample in the middle is refused alone, and every other sample is accepted."""
    import learner.serve.ingress as ingress_module
    monkeypatch.setattr(ingress_module, "MERGE_SAMPLES", 6)
    cfg = learner_config(tmp_path, max_staleness=GROUPS)
    async with running_learner(cfg, tiny_model_dir) as svc:
        one = FakeServer(svc.endpoints["rollout"], "one", max_concurrency=8)
        two = FakeServer(svc.endpoints["rollout"], "two", max_concurrency=8)
        seen: list[int] = []
        receive = svc.intake.receive

        async def counting(msg):
            seen.append(len(msg.samples))
            return await receive(msg)

        monkeypatch.setattr(svc.intake, "receive", counting)
        try:
            a1, a2, a3, a4 = await assignments(one, 4)
            (b1,) = await assignments(two, 1)
            singles = [s for a in (a1, a2, a3, a4) for s in samples_for(a, version=0)]
            singles[3].token_versions[-1] = 10 ** 6          # newer than the learner: invalid
            (b1_first, b1_second) = samples_for(b1, version=0)
            for s in singles[:1]:
                await svc.on_rollout(b"one", protocol.RolloutResult("one", [s]))
            await svc.on_rollout(b"two", protocol.RolloutResult("two", [b1_first]))
            for s in singles[1:]:
                await svc.on_rollout(b"one", protocol.RolloutResult("one", [s]))
            assert seen == [] and len(svc.ingress.held) == 9           # nothing received yet
            # A whole group's result is received at once, after what is held (arrival order).
            await svc.on_rollout(b"two", protocol.RolloutResult("two", [b1_second, b1_first]))
            assert seen == [1, 1, 6, 1, 2] and not svc.ingress.held   # cut by server and at 6
            await svc.ingress.flush()
            (ack,) = await acks_until(one, 8)
            assert ack.sample_ids == [s.sample_id for s in singles]
            assert ack.statuses == ["accepted"] * 3 + ["invalid"] + ["accepted"] * 4
            (ack,) = await acks_until(two, 3)
            assert ack.sample_ids == [b1_first.sample_id, b1_second.sample_id, b1_first.sample_id]
            assert ack.statuses == ["accepted", "accepted", "duplicate"]
            assert svc.buffer.counters["accepted"] == 9 and svc.intake.invalid == {"version": 1}
        finally:
            one.close()
            two.close()


def test_pending_acks_split_where_one_ack_would_pass_the_list_limit(monkeypatch):
    import learner.serve.router as router

    monkeypatch.setattr(router, "MAX_ACK_IDS", 5)
    held = PendingAcks()
    srv, other = object(), object()
    for i in range(3):
        held.add(b"a", srv, protocol.Ack([f"x{i}/0", f"x{i}/1"], ["accepted", "stale"]))
    held.add(b"a", other, protocol.Ack(["y/0"], ["duplicate"]))     # same identity, new server
    held.add(b"b", srv, protocol.Ack([], []))
    out = held.take()
    assert not held and held.take() == []
    assert [(i, s, a.sample_ids) for i, s, a in out] == [
        (b"a", srv, ["x0/0", "x0/1", "x1/0", "x1/1"]), (b"a", srv, ["x2/0", "x2/1"]),
        (b"a", other, ["y/0"]), (b"b", srv, [])]
    assert out[0][2].statuses == ["accepted", "stale"] * 2


def test_pending_acks_do_not_merge_past_the_character_limit(monkeypatch):
    """Merged Acks stay small: a peer echoed huge sample ids gets one Ack per result, so the send
    HWM (in messages) still stops what it can pile up (test_learner_service's stuck server)."""
    import learner.serve.router as router

    monkeypatch.setattr(router, "MAX_ACK_CHARS", 10)
    held = PendingAcks()
    srv = object()
    held.add(b"a", srv, protocol.Ack(["x" * 12], ["invalid"]))       # one alone may pass it
    held.add(b"a", srv, protocol.Ack(["a/0"], ["accepted"]))
    held.add(b"a", srv, protocol.Ack(["b/0", "b/1"], ["accepted", "accepted"]))
    held.add(b"a", srv, protocol.Ack(["c/0", "c/1"], ["accepted", "accepted"]))
    assert [a.sample_ids for _, _, a in held.take()] == [
        ["x" * 12], ["a/0", "b/0", "b/1"], ["c/0", "c/1"]]
