"""A real LearnerService (tiny model, real ZeroMQ sockets, real HTTP) against clients played by
the test: an honest rollout server, and hostile ones for every crash or stall found so far."""

from __future__ import annotations

import asyncio
import struct
import threading

import numpy as np
import pytest
import zmq
import zmq.asyncio
from learner_testkit import (
    FakeServer,
    HonestServer,
    ctl,
    http_get,
    learner_config,
    metric,
    running_learner,
    samples_for,
    wait_until,
)
from zmtp_kit import frame, rss_bytes, send_as_dealer, send_huge_frame, send_unfinished, zmtp_dealer

import protocol
from learner.serve.service import LearnerService
from learner.serve.step_records import StepRecords

pytestmark = pytest.mark.slow


async def test_trains_with_an_honest_server_and_serves_health_metrics_control(tmp_path, tiny_model_dir):
    async with running_learner(learner_config(tmp_path), tiny_model_dir) as svc:
        async with HonestServer(svc.endpoints["rollout"]) as good:
            await good.wait_version(2)
        status, health = await asyncio.to_thread(http_get, svc.endpoints["healthz"])
        assert status == 200 and health["ok"] is True
        assert health["run_id"] == "test" and health["version"] >= 2 and health["stopping"] is False
        assert health["servers"] in (0, 1)                       # the honest server just left
        status, text = await asyncio.to_thread(http_get, svc.endpoints["metrics"])
        assert status == 200 and "slipstream_policy_version" in text
        reply = await ctl(svc.endpoints["control"], "status")
        assert reply.ok and reply.result["version"] >= 2 and reply.result["settable"]
        assert svc.buffer.counters["consumed"] >= 4


async def test_the_model_is_loaded_and_trained_on_one_thread(tmp_path, tiny_model_dir, monkeypatch):
    """torch's OpenMP pool belongs to the thread that calls into it: a model loaded on the event
    loop's thread and trained on another ran its steps 2x slower with 2 threads (0.181 against
    0.083 s at eta 0 on 2 cores). Loading, building the trainer and every step share one thread.
    (Run at the test kit's one thread: torch's thread count is global to this pytest process.)"""
    import learner.serve.service as service_module
    threads = []
    real = service_module.make_trainer

    def recording(*args, **kwargs):
        threads.append(("load", threading.get_ident()))
        return real(*args, **kwargs)
    monkeypatch.setattr(service_module, "make_trainer", recording)
    async with running_learner(learner_config(tmp_path), tiny_model_dir) as svc:
        step = svc.trainer.step

        def recording_step(batch):
            threads.append(("step", threading.get_ident()))
            return step(batch)
        svc.trainer.step = recording_step
        async with HonestServer(svc.endpoints["rollout"]) as good:
            await good.wait_version(2)
    kinds = [k for k, _ in threads]
    assert kinds[0] == "load" and kinds.count("step") >= 2, kinds
    assert len({t for _, t in threads}) == 1 and threads[0][1] != threading.get_ident(), threads


async def test_invalid_samples_are_acked_invalid_and_never_reach_the_trainer(tmp_path, tiny_model_dir):
    async with running_learner(learner_config(tmp_path), tiny_model_dir) as svc:
        vocab = svc.intake.vocab_size
        bad = FakeServer(svc.endpoints["rollout"], "hostile", max_concurrency=2)
        try:
            await bad.hello()
            await bad.work(2)
            a = await bad.expect(protocol.Assignment)
            assert a.sampling == svc.sampling() and a.metadata["answer"]
            good = samples_for(a, version=0)[0]
            cases = {
                "vocab": dict(completion_token_ids=np.array([4, vocab, 5], np.int32)),
                "length": dict(completion_token_ids=np.arange(4, 9, dtype=np.int32),
                               behavior_logprobs=np.full(5, -1.0, np.float32),
                               token_versions=np.zeros(5, np.int32)),
                "version": dict(token_versions=np.array([0, 5, 0], np.int32)),
                "prompt": dict(prompt_token_ids=np.array([1, 2, 3], np.int32)),
                "group_size": dict(group_size=3),
                "reward": dict(reward=1e30),
            }
            for reason, change in cases.items():
                fields = {f: getattr(good, f) for f in protocol.Sample.__dataclass_fields__}
                fields.update(change)
                ack = await bad.answer([protocol.Sample(**fields)])
                assert ack.statuses == ["invalid"], reason
                assert metric(svc, "slipstream_samples_invalid_total", reason=reason) == 1
            assert svc.buffer.counters["accepted"] == 0 and svc.buffer.pending_samples == 0
            async with HonestServer(svc.endpoints["rollout"]) as honest:
                await honest.wait_version(2)                     # trained: nothing invalid got in
        finally:
            bad.close()


async def test_huge_work_request_with_heartbeats_does_not_freeze_training(tmp_path, tiny_model_dir):
    # B = 2 prompts x 2 = 4 samples, eta = 1: the gate allows 8 samples = 4 groups at version 0. A
    # server granted 10^12 credits used to take all 4 and, by beating, keep them.
    cfg = learner_config(tmp_path, batch_prompts=2)
    async with running_learner(cfg, tiny_model_dir) as svc:
        bad = FakeServer(svc.endpoints["rollout"], "greedy", max_concurrency=2)

        async def beat():
            while True:
                await bad.heartbeat(0)
                await asyncio.sleep(0.05)

        beating = None
        try:
            await bad.hello()
            await bad.work(10**12)
            await bad.expect(protocol.Assignment)
            beating = asyncio.create_task(beat())
            async with HonestServer(svc.endpoints["rollout"]) as good:
                await good.wait_version(3, timeout_s=60)
            beating.cancel()                                     # (the learner echoes each beat)
            got = [m for m in await bad.drain() if isinstance(m, protocol.Assignment)]
            assert got == []                                     # one group (2 samples) in all
            assert metric(svc, "slipstream_credits_refused_total") == 10**12 - 2
        finally:
            if beating is not None:
                beating.cancel()
            bad.close()


async def test_heartbeat_is_echoed_with_the_learner_version(tmp_path, tiny_model_dir):
    async with running_learner(learner_config(tmp_path), tiny_model_dir) as svc:
        s = FakeServer(svc.endpoints["rollout"], "beater", max_concurrency=4)
        try:
            await s.hello()
            await s.heartbeat(0)
            echo = await s.expect(protocol.Heartbeat, skip=(protocol.WeightsAvailable, protocol.Assignment))
            assert echo.sender_id.startswith("learner-") and echo.version == svc.version
        finally:
            s.close()


async def test_refused_assignment_is_reissued_at_once(tmp_path, tiny_model_dir):
    """A server that cannot take an assignment says so; the lease comes back for re-issue now,
    not after its deadline (lease_timeout_s is 120 s here), and is given up after max_attempts."""
    cfg = learner_config(tmp_path, batch_prompts=2)
    async with running_learner(cfg, tiny_model_dir) as svc:
        s = FakeServer(svc.endpoints["rollout"], "picky", max_concurrency=2)
        try:
            await s.hello()
            await s.work(2)
            first = await s.expect(protocol.Assignment)
            await s.send(protocol.Error(code="assignment_refused", message="prompt too long",
                                        ref_id=first.assignment_id))
            await s.work(2)
            again = await s.expect(protocol.Assignment, timeout_s=10)
            assert (again.assignment_id, again.attempt) == (first.assignment_id, 2)
            assert metric(svc, "slipstream_server_errors_total", code="assignment_refused") == 1
            assert svc.buffer.counters["released"] == 2
        finally:
            s.close()


async def test_repeated_hello_adds_no_credits(tmp_path, tiny_model_dir):
    cfg = learner_config(tmp_path, batch_prompts=8, max_staleness=4)  # the gate allows 40 groups
    async with running_learner(cfg, tiny_model_dir) as svc:
        s = FakeServer(svc.endpoints["rollout"], "flappy", max_concurrency=4)
        try:
            for _ in range(6):
                await s.hello()
                await s.work(4)
            msgs = await s.drain(timeout_s=0.5)
            assignments = [m for m in s.seen if isinstance(m, protocol.Assignment)]
            assert len(assignments) == 2, msgs                   # 4 credits = 2 groups, once
            (srv,) = svc.admission.servers.values()
            assert srv.credits + svc.admission.outstanding(srv) == 4
            assert metric(svc, "slipstream_rollout_servers") == 1
        finally:
            s.close()


async def test_oversize_frames_are_refused_before_they_are_buffered(tmp_path, tiny_model_dir):
    async with running_learner(learner_config(tmp_path), tiny_model_dir) as svc:
        # The hand-made handshake is right: a small frame through it reaches the learner (and is
        # refused there as the one-frame garbage it is).
        _, writer = await zmtp_dealer(svc.endpoints["rollout"])
        writer.write(b"\x00\x05hello")
        await wait_until(lambda: metric(svc, "slipstream_protocol_errors_total", socket="rollout") == 1,
                         what="the raw ZMTP frame decoded")
        writer.close()
        before = rss_bytes()
        for name in ("rollout", "weights", "control"):
            written = await send_as_dealer(svc.endpoints[name], send_huge_frame, 2 << 30, 64 << 20)
            assert written < 64 << 20, f"{name}: a 2 GiB frame was not refused"
        assert rss_bytes() - before < 32 << 20
        assert [metric(svc, "slipstream_protocol_errors_total", socket=n)
                for n in ("rollout", "weights", "control")] == [1, 0, 0]      # never decoded
        async with HonestServer(svc.endpoints["rollout"]) as good:
            await good.wait_version(1)
        assert (await ctl(svc.endpoints["control"], "status")).ok


async def test_unfinished_messages_are_cut_on_every_socket(tmp_path, tiny_model_dir):
    """Issue 31 item 2: frames within ZMQ_MAXMSGSIZE, each with MORE set and the message never
    finished, piled up in libzmq (25 x 60 MiB: +1.5 GB; 10,000 x 60 KiB on the control socket:
    +587 MB). Each socket now cuts the connection once the message passes the socket's
    max_message_bytes (rollout 1 MiB here, weights and control 64 KiB), and one held open past
    network.unfinished_timeout_s; the learner's memory stays put and an honest server trains."""
    cfg = learner_config(tmp_path, network={"unfinished_timeout_s": 1.0})
    async with running_learner(cfg, tiny_model_dir) as svc:
        before = rss_bytes()
        for name, size in (("rollout", 256 << 10), ("weights", 16 << 10), ("control", 60 << 10)):
            written = await send_as_dealer(svc.endpoints[name], send_unfinished, (256 << 20) // size, size)
            assert written < 256 << 20, f"{name}: an unfinished message was never cut"
            await wait_until(lambda n=name: metric(svc, "slipstream_connections_cut_total",
                                                   socket=n, reason="too_large") == 1,
                             what=f"the {name} cut counted")
        await wait_until(lambda: rss_bytes() - before < 64 << 20, what="the cut messages' memory freed")
        # Held open: 200 KiB of a message (under the rollout socket's 1 MiB), then nothing.
        reader, writer = await zmtp_dealer(svc.endpoints["rollout"])
        writer.write(frame(bytes(200 << 10), more=True))
        assert await asyncio.wait_for(reader.read(), 20) == b""        # the learner hung up
        writer.close()
        assert metric(svc, "slipstream_connections_cut_total", socket="rollout", reason="open_too_long") == 1
        async with HonestServer(svc.endpoints["rollout"]) as good:
            await good.wait_version(1)
        assert (await ctl(svc.endpoints["control"], "status")).ok


def hot_result(temperature) -> list[bytes]:
    """A result whose one sample says it was drawn at ``temperature`` (NaN, inf, negative)."""
    s = protocol.Sample("a/0", "a", 0, 1, np.zeros(1, np.int32), np.zeros(1, np.int32),
                        np.zeros(1, np.float32), np.zeros(1, np.int32), 0.0, sampling_temperature=1.0)
    header, body = protocol.encode(protocol.RolloutResult(server_id="x", samples=[s]))
    return [header, body[:-9] + struct.pack(">Bd", 0xCB, temperature)]   # the last value: float 64


async def test_garbage_and_wrong_types_on_every_socket_are_counted(tmp_path, tiny_model_dir):
    hello = protocol.Hello(server_id="x", engine="e", model="m", version=0)
    bad_inputs = {
        "rollout": [[b"garbage"], [b"\x92\x01", b"\xc1"],
                    hot_result(float("nan")), hot_result(float("inf")), hot_result(-1.0),
                    protocol.encode(protocol.ControlRequest(command="status")),
                    protocol.encode(protocol.Welcome(learner_id="l", run_id="r", version=0,
                                                     weights_endpoint="tcp://h:1"))],
        "weights": [[b"garbage"], protocol.encode(hello), [b"a", b"b", b"c"]],
        "control": [[b"\xff" * 100], protocol.encode(protocol.Heartbeat(sender_id="x", version=0))],
    }
    async with running_learner(learner_config(tmp_path), tiny_model_dir) as svc:
        ctx = zmq.asyncio.Context.instance()
        for name, inputs in bad_inputs.items():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(svc.endpoints[name])
            try:
                for frames in inputs:
                    await sock.send_multipart(frames)
                    assert await sock.poll(10_000), f"{name}: no answer to {frames!r}"
                    reply = protocol.decode(await sock.recv_multipart())
                    if name == "control":
                        assert isinstance(reply, protocol.ControlReply) and not reply.ok
                    else:
                        assert isinstance(reply, protocol.Error) and reply.code == "protocol_error"
            finally:
                sock.close(0)
            assert metric(svc, "slipstream_protocol_errors_total", socket=name) == len(inputs)
        async with HonestServer(svc.endpoints["rollout"]) as good:
            await good.wait_version(1)
        assert (await ctl(svc.endpoints["control"], "status")).ok


async def test_a_server_that_stops_reading_never_blocks_the_learner(tmp_path, tiny_model_dir):
    # send_hwm 2: the learner queues at most 2 messages for a peer. The hostile peer reads nothing
    # and keeps its kernel buffer tiny; each result it sends is answered by a ~0.9 MiB Ack.
    cfg = learner_config(tmp_path, send_hwm=2)
    async with running_learner(cfg, tiny_model_dir) as svc:
        slow = FakeServer(svc.endpoints["rollout"], "slow", RCVHWM=1, RCVBUF=4096)
        try:
            await slow.hello()
            filler = [protocol.Sample(
                sample_id="z" * 75_000, assignment_id=f"nope{i}", group_index=0, group_size=2,
                prompt_token_ids=np.zeros(1, np.int32), completion_token_ids=np.zeros(0, np.int32),
                behavior_logprobs=np.zeros(0, np.float32), token_versions=np.zeros(0, np.int32),
                reward=0.0) for i in range(12)]
            for _ in range(30):
                await slow.send(protocol.RolloutResult(server_id="slow", samples=filler))
            await wait_until(lambda: metric(svc, "slipstream_send_dropped_total", socket="rollout",
                                            reason="full") >= 1, what="a send refused as full")
            assert "slow" not in {s.server_id for s in svc.admission.servers.values()}
            assert metric(svc, "slipstream_rollout_servers_lost_total", reason="unreachable") == 1
            async with HonestServer(svc.endpoints["rollout"]) as good:     # the loop still serves
                await good.wait_version(2, timeout_s=60)
            assert (await ctl(svc.endpoints["control"], "status")).ok
        finally:
            slow.close()


async def test_port_in_use_is_a_startup_error_before_the_model_loads(tmp_path, tiny_model_dir):
    ctx = zmq.Context.instance()
    taken = ctx.socket(zmq.ROUTER)
    taken.setsockopt(zmq.LINGER, 0)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        svc = LearnerService(learner_config(tmp_path, control_port=port), tiny_model_dir)
        with pytest.raises(protocol.StartupError, match=rf"learner\.network\.control_port: port {port} .*in use"):
            await svc.run()
        assert svc.trainer is None and svc.sockets == {}
    finally:
        taken.close(0)


def test_batch_versions_are_the_oldest_and_newest_token_of_the_batch():
    """StepRecords.batch_versions (one concatenation) against the per-sample definition: the
    oldest token version (-1 when a sample has no tokens), the newest (0 at least)."""
    from types import SimpleNamespace

    from buffer import Batch

    def sample(i, versions):
        tv = np.asarray(versions, np.int32)
        return protocol.Sample(
            sample_id=f"a/{i}", assignment_id="a", group_index=i, group_size=4,
            prompt_token_ids=np.zeros(2, np.int32), completion_token_ids=np.zeros(len(tv), np.int32),
            behavior_logprobs=np.zeros(len(tv), np.float32), token_versions=tv, reward=0.0)

    def reference(version, samples):
        return {"trained_on_version": float(version),
                "token_version_min": float(min(s.min_version for s in samples)),
                "token_version_max": float(max(int(s.token_versions.max(initial=0)) for s in samples))}

    rng = np.random.default_rng(0)
    cases = [[[3, 4], [5], [2, 7, 7], [6]], [[3, 4], [], [5], [6]], [[], [], [], []], [[0], [0], [1], [0]]]
    cases += [[list(rng.integers(0, 50, rng.integers(0, 9))) for _ in range(4)] for _ in range(50)]
    for versions in cases:
        samples = [sample(i, v) for i, v in enumerate(versions)]
        records = SimpleNamespace(run=SimpleNamespace(version=9), buffer=SimpleNamespace(drop_uniform_groups=False))
        got = StepRecords.batch_versions(records, Batch(samples=samples, version=9, uniform_dropped=2))
        assert got == reference(9, samples), versions
        records.buffer.drop_uniform_groups = True       # dynamic sampling: the groups dropped before it
        got = StepRecords.batch_versions(records, Batch(samples=samples, version=9, uniform_dropped=2))
        assert got == {**reference(9, samples), "dynamic_sampling_dropped_groups": 2.0}, versions


def test_the_buffer_options_come_from_the_config(tmp_path):
    """learner.servers.max_attempts / dedupe_window and learner.batch.length_bucketing reach the
    service's buffer (the service is built, nothing is served)."""
    cfg = learner_config(tmp_path, servers={"max_attempts": 5, "dedupe_window": 2048, "lease_timeout_s": 42.0},
                         batch={"length_bucketing": True})
    svc = LearnerService(cfg, "unused-model-path")
    assert svc.buffer.leases.max_attempts == 5 and svc.buffer.leases.timeout_s == 42.0
    assert svc.buffer._seen.capacity == svc.buffer._closed.capacity == 2048
    assert svc.buffer.length_bucketing is True
    default = LearnerService(learner_config(tmp_path), "unused-model-path").buffer
    assert (default.leases.max_attempts, default._seen.capacity, default.length_bucketing) == (3, 100_000, False)
