"""R6: a server that keeps old weights (it never applies what is announced) shows in the
per-server version metric and gets no new work while it lags more than η versions; once it
applies the current version it gets work again. Real learner, real sockets, tiny model."""

from __future__ import annotations

import pytest
from learner_testkit import (
    FakeServer,
    HonestServer,
    learner_config,
    metric,
    real_server,
    running_learner,
    samples_for,
    wait_until,
)

import protocol

pytestmark = pytest.mark.slow


async def test_a_server_on_old_weights_gets_no_new_work_until_it_catches_up(tmp_path, tiny_model_dir):
    async with running_learner(learner_config(tmp_path, max_staleness=1), tiny_model_dir) as svc:
        endpoint = svc.endpoints["rollout"]
        stuck = FakeServer(endpoint, "stuck", max_concurrency=2)
        try:
            await stuck.hello()
            await stuck.work(2)
            first = await stuck.expect(protocol.Assignment)         # version 0: it may work
            ack = await stuck.answer(samples_for(first, version=0))
            assert ack.statuses == ["accepted", "accepted"]
            async with HonestServer(endpoint) as good:
                await good.wait_version(3)                           # the learner moved on
            # The stuck server still reports version 0 and asks for work: it gets none.
            await stuck.heartbeat(version=0)
            await stuck.work(2)
            got = await stuck.drain(timeout_s=0.5)
            assert not [m for m in got if isinstance(m, protocol.Assignment)], got
            manifests = [m for m in stuck.seen if isinstance(m, protocol.WeightsAvailable)]
            assert manifests and max(m.version for m in manifests) >= 3       # it was told
            assert metric(svc, "slipstream_server_policy_version", server="stuck") == 0
            assert metric(svc, "slipstream_policy_version") >= 3
            assert svc.admission.status()["stuck"]["lagging"] is True
            # It applies the newest announced version: work comes again (its credits were kept).
            latest = max(manifests, key=lambda m: m.version)
            if latest.version != svc.version:                         # the learner may be ahead
                await stuck.heartbeat(version=0)
                latest = await stuck.expect(protocol.WeightsAvailable, skip=(protocol.Heartbeat,))
            await stuck.send(protocol.WeightsApplied(server_id="stuck", version=latest.version,
                                                     checksum=latest.checksum, seconds=0.0))
            a = await stuck.expect(protocol.Assignment)
            assert a.version >= latest.version
            assert metric(svc, "slipstream_server_policy_version", server="stuck") == latest.version
        finally:
            stuck.close()


async def test_a_real_server_generates_with_the_version_its_work_was_issued_at(tmp_path, tiny_model_dir):
    """An assignment issued right after a step can reach the server before that step's manifest
    (announced once its checksums are done, beside the next step). The server waits for the
    version the work was issued at, so no sample goes over η and none is dropped as stale."""
    async with running_learner(learner_config(tmp_path, max_staleness=1, batch_prompts=2),
                               tiny_model_dir) as svc:
        async with real_server(svc, tiny_model_dir) as (server, task):
            await wait_until(lambda: svc.version >= 8 or task.done(), 240, "eight steps")
            assert not task.done()
            assert svc.buffer.counters["dropped_stale"] == 0, svc.buffer.counters
            assert server.metrics.error_count("weights_behind") == 0
            hist = svc.buffer.staleness_histogram
            assert hist and max(hist) <= 1, hist
