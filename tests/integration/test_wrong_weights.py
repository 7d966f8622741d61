"""A server that reports wrong weights gets no work (issue 28.4), through real sockets: a
protocol-level server against a real learner reports version 1 applied with a checksum that is
not the published one. Its leases go back for re-issue, it gets no new work, the samples it
generated on those weights are refused (``unverified_weights``) — and once it applies the version
with the right checksum it works again."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest
import zmq
import zmq.asyncio
from load_client import group
from load_kit import control_status, scrape, start_learner

import protocol

pytestmark = pytest.mark.slow


def test_a_server_with_wrong_weights_gets_no_work_and_its_samples_are_refused(tmp_path, tiny_model_dir,
                                                                              subprocess_env, process_groups):
    learner, ready, lines = start_learner(tmp_path, tiny_model_dir, subprocess_env, process_groups.popen)

    async def scenario() -> dict:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(ready["rollout"])
        inbox: list[protocol.Message] = []

        async def send(msg: protocol.Message) -> None:
            await sock.send_multipart(protocol.encode(msg))

        async def until(pred, what: str, timeout_s: float = 30.0) -> list:
            """Read messages into the inbox until ``pred(inbox)`` holds (bounded)."""
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout_s
            while not pred(inbox):
                left = end - loop.time()
                assert left > 0 and await sock.poll(int(left * 1000)), f"no {what} in {inbox}"
                inbox.append(protocol.decode(await sock.recv_multipart()))
            return inbox

        def of(kind) -> list:
            return [m for m in inbox if isinstance(m, kind)]

        await send(protocol.Hello(server_id="liar", engine="x", model="none", version=0, max_concurrency=8))
        await send(protocol.WorkRequest(server_id="liar", credits=8))
        await until(lambda _: len(of(protocol.Assignment)) >= 2, "first two assignments")
        # Honest at version 0: a batch (2 groups of 4), trained, version 1 published.
        for a in of(protocol.Assignment)[:2]:
            await send(protocol.RolloutResult(server_id="liar", samples=group(a, 0)))
        await send(protocol.WorkRequest(server_id="liar", credits=8))
        await until(lambda _: len(of(protocol.Assignment)) >= 4
                    and any(m.version == 1 for m in of(protocol.WeightsAvailable)), "version 1 and more work")
        manifest = next(m for m in of(protocol.WeightsAvailable) if m.version == 1)
        held = of(protocol.Assignment)[2:4]
        # The lie: version 1 applied, a checksum that is not the published one; then the held work,
        # generated on those weights.
        await send(protocol.WeightsApplied(server_id="liar", version=1, checksum="0" * 16, seconds=0.0))
        for a in held:
            await send(protocol.RolloutResult(server_id="liar", samples=group(a, 1)))
        await until(lambda _: sum(len(m.statuses) for m in of(protocol.Ack)) >= 16, "the acks")
        statuses = [s for m in of(protocol.Ack) for s in m.statuses]
        # No work while unverified: the credits are asked for, nothing comes.
        n_assigned = len(of(protocol.Assignment))
        await send(protocol.WorkRequest(server_id="liar", credits=8))
        await send(protocol.Heartbeat(sender_id="liar", version=1))
        await until(lambda _: any(isinstance(m, protocol.Heartbeat) for m in inbox), "the heartbeat echo")
        await asyncio.sleep(1.0)                       # time for a dispatch that must not come
        while await sock.poll(0):
            inbox.append(protocol.decode(await sock.recv_multipart()))
        unverified = control_status(ready["control"])["servers"]["liar"]
        assigned_while_unverified = len(of(protocol.Assignment)) - n_assigned
        # The right checksum: work again (the released groups, re-issued).
        await send(protocol.WeightsApplied(server_id="liar", version=1, checksum=manifest.checksum, seconds=0.0))
        await until(lambda _: len(of(protocol.Assignment)) > n_assigned, "work after verification")
        verified = control_status(ready["control"])["servers"]["liar"]
        again = of(protocol.Assignment)[n_assigned:]
        sock.close(0)
        ctx.term()
        return {"statuses": statuses, "unverified": unverified, "verified": verified,
                "assigned_while_unverified": assigned_while_unverified, "held": held, "again": again}

    out = asyncio.run(scenario())
    m = scrape(ready["metrics"])
    learner.send_signal(signal.SIGTERM)
    learner.wait(timeout=60)
    events = [json.loads(x) for x in lines if x.startswith("{")]
    # Version 0's groups accepted; the 8 samples made on the wrong weights refused.
    assert out["statuses"][:8] == ["accepted"] * 8 and out["statuses"][8:] == ["invalid"] * 8, out["statuses"]
    assert m.get('slipstream_samples_invalid_total{reason="unverified_weights"}') == 8, m
    assert m.get("slipstream_weights_checksum_mismatch_total") == 1, m
    assert m.get('slipstream_leases_released_total{reason="unverified_weights"}') == 2, m
    assert out["unverified"]["unverified"] is True and out["unverified"]["outstanding"] == 0, out["unverified"]
    assert out["assigned_while_unverified"] == 0, out
    assert out["verified"]["unverified"] is False, out["verified"]
    # The first work after it: a held group, re-issued (attempt 2).
    held = {a.assignment_id for a in out["held"]}
    assert out["again"][0].assignment_id in held and out["again"][0].attempt == 2, out["again"]
    mismatch = [e for e in events if e.get("event") == "checksum_mismatch"]
    assert len(mismatch) == 1 and mismatch[0]["released_assignments"] == 2, mismatch
    assert any(e.get("event") == "server_verified" for e in events), events[-10:]
