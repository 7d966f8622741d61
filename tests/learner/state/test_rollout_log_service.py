"""The rollout log in a real LearnerService (tiny model, real sockets, a rollout server played by
the test): every Ack follows its record on disk, a failed write sends no Ack, and after a crash
and --resume the accepted-but-untrained samples are trained from the log, not regenerated."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
from learner_testkit import FakeServer, learner_config, metric, running_learner, samples_for, wait_until

import protocol
from learner.serve.service import LearnerService
from learner.state.checkpoint import effective_trained_ids
from learner.state.rollout_log import RESULT, LogReader

pytestmark = pytest.mark.slow


def logged_ids(svc) -> set[str]:
    return {s.sample_id for r in LogReader(svc.rollout_log.root) if r.kind == RESULT
            for s in r.result.samples}


async def test_every_ack_follows_its_record_and_a_failed_write_sends_no_ack(tmp_path, tiny_model_dir):
    cfg = learner_config(tmp_path, rollout_log={"fsync": "record"}, batch_prompts=4)
    async with running_learner(cfg, tiny_model_dir) as svc:
        on_disk: list[bool] = []
        send = svc.link.send

        async def spy(identity, msg):          # at the moment an Ack leaves: is it on disk?
            if isinstance(msg, protocol.Ack):
                ids = logged_ids(svc)
                on_disk.append(all(i in ids for i, st in zip(msg.sample_ids, msg.statuses, strict=True)
                                   if st == "accepted"))
            return await send(identity, msg)
        svc.link.send = spy                    # the Sender port of admission and the ingress
        s = FakeServer(svc.endpoints["rollout"], "s1", max_concurrency=8)
        try:
            await s.hello()
            await s.work(4)
            a1, a2 = await s.expect(protocol.Assignment), await s.expect(protocol.Assignment)
            ack = await s.answer(samples_for(a1))
            assert ack.statuses == ["accepted", "accepted"] and on_disk == [True]
            # The disk is full: no Ack at all (the server keeps the result), counted, logged.
            def full(fd, data):
                raise OSError(28, "No space left on device")
            svc.rollout_log.writer._write = full
            await s.send(protocol.RolloutResult(server_id="s1", samples=samples_for(a2)))
            await s.heartbeat()
            got = []
            while not isinstance(got[-1] if got else None, protocol.Heartbeat):
                got.append(await s.recv())
            assert not any(isinstance(m, protocol.Ack) for m in got), got
            assert metric(svc, "slipstream_rollout_log_failures_total") == 1
            assert on_disk == [True]
            assert {x.sample_id for x in samples_for(a2)}.isdisjoint(logged_ids(svc))
        finally:
            s.close()


@contextlib.asynccontextmanager
async def learner(cfg, model_dir, resume=None):
    svc = LearnerService(cfg, model_dir, run_id="test", resume=resume)
    task = asyncio.create_task(svc.run())
    ready = asyncio.create_task(svc.ready.wait())
    await asyncio.wait([task, ready], timeout=120, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    assert svc.ready.is_set()
    try:
        yield svc, task
    finally:
        if not task.done():                   # the crash: no stop, no final checkpoint
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_after_a_crash_the_untrained_samples_come_back_from_the_log(tmp_path, tiny_model_dir):
    # 3 groups of 2 per step, eta 1, a checkpoint after every step.
    cfg = learner_config(tmp_path, rollout_log={}, batch_prompts=3, group_size=2, max_staleness=1,
                         save_every=1)
    async with learner(cfg, tiny_model_dir) as (svc, _):
        s = FakeServer(svc.endpoints["rollout"], "s1", max_concurrency=12)
        try:
            await s.hello()
            await s.work(12)
            a = {k: await s.expect(protocol.Assignment) for k in range(1, 7)}   # (0+1+1)*6 = 12
            for k in (1, 2, 3):
                await s.answer(samples_for(a[k]))
            await wait_until(lambda: svc.checkpoints.saved_version == 1, what="checkpoint 1")
            # After checkpoint 1: a4 whole and half of a5 (their leases are in the checkpoint),
            # and a7, issued after it, whole with version-1 tokens: 5 samples, not a batch yet.
            assert (await s.answer(samples_for(a[4]))).statuses == ["accepted"] * 2
            assert (await s.answer(samples_for(a[5])[:1])).statuses == ["accepted"]
            await s.work(2)
            a[7] = await s.expect(protocol.Assignment)
            assert a[7].assignment_id == "test-a7" and a[7].version == 1
            assert (await s.answer(samples_for(a[7]))).statuses == ["accepted"] * 2
            assert svc.version == 1 and svc.buffer.pending_samples == 5
        finally:
            s.close()
    # Crashed (cancelled: nothing saved after checkpoint 1). Resumed: the 5 samples are back.
    async with learner(cfg, tiny_model_dir, resume="latest") as (svc, _):
        assert metric(svc, "slipstream_rollout_log_restored_samples_total") == 5
        assert svc.version == 1 and svc.buffer.pending_samples == 5 and svc.buffer.ready_samples == 4
        s = FakeServer(svc.endpoints["rollout"], "s2", max_concurrency=12)
        try:
            await s.hello(version=1)
            await s.work(12)
            # Re-issued: a5 (its missing half) and a6; new: (1+1+1)*6 - (11 + 3) = 4 samples, a8
            # and a9. a7's id (and its prompt) is never issued again.
            got = {}
            for _ in range(4):
                m = await s.expect(protocol.Assignment)
                got[m.assignment_id] = m
            assert set(got) == {"test-a5", "test-a6", "test-a8", "test-a9"}, sorted(got)
            # The data stream continues from the checkpoint: a6 is the prompt it was; a7's prompt
            # (its group is back) is passed over, not handed out under a new id.
            assert np.array_equal(got["test-a6"].prompt_token_ids, a[6].prompt_token_ids)
            assert not any(np.array_equal(m.prompt_token_ids, a[7].prompt_token_ids) for m in got.values())
            await s.answer(samples_for(got["test-a6"]))
            await wait_until(lambda: svc.version >= 2, timeout_s=60, what="step 1")
        finally:
            s.close()
        trained = effective_trained_ids(tmp_path / "run" / "trained_ids.jsonl")
        assert len(trained) == len(set(trained)) == 12                # nothing trained twice
        assert {f"test-a{k}/{i}" for k in (4, 6, 7) for i in (0, 1)} <= set(trained[6:])
