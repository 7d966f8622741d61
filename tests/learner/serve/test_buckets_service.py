"""Length buckets through a real LearnerService (issue 27.4): with learner.data.length_buckets every
assignment carries its prompt's bucket, and a server that answers out of order (evens first) still
gets every trained batch made of one bucket: short prompts with short, long with long."""

from __future__ import annotations

import json

import pytest
from learner_testkit import FakeServer, learner_config, running_learner, samples_for, wait_until

import protocol

pytestmark = pytest.mark.slow


async def test_each_trained_batch_is_one_length_bucket(tmp_path, tiny_model_dir):
    data = tmp_path / "d.jsonl"
    short = [{"prompt": f"q{i}", "answer": i} for i in range(8)]
    long = [{"prompt": f"q{i}" + "x" * 30, "answer": i} for i in range(8)]
    data.write_text("\n".join(json.dumps(r) for r in short + long))
    cfg = learner_config(tmp_path, batch_prompts=2, group_size=2, max_staleness=1, total_steps=6,
                         data={"dataset": str(data), "length_buckets": 2})
    batches: list[set[int]] = []
    async with running_learner(cfg, tiny_model_dir) as svc:
        step = svc.trainer.step

        def recording(batch):
            batches.append({len(s.prompt_token_ids) > 10 for s in batch.samples})
            return step(batch)

        svc.trainer.step = recording
        server = FakeServer(svc.endpoints["rollout"], "shuffler", max_concurrency=8)
        try:
            await server.hello()
            await server.work(8)
            buckets, version = set(), 0
            while len(batches) < 6:
                # Everything the learner sends until it pauses; its assignments answered evens
                # first (0, 2, ..., 1, 3, ...), so the runs of one bucket come apart.
                msgs = [await server.recv(timeout_s=60)] + await server.drain(0.3)
                held = [m for m in msgs if isinstance(m, protocol.Assignment)]
                for m in msgs:
                    if isinstance(m, protocol.WeightsAvailable) and m.version > version:
                        version = m.version
                        await server.send(protocol.WeightsApplied(server_id="shuffler", version=m.version,
                                                                  checksum=m.checksum, seconds=0.0))
                for a in held[0::2] + held[1::2]:
                    buckets.add(a.metadata[protocol.BUCKET_KEY])
                    await server.send(protocol.RolloutResult(server_id="shuffler",
                                                             samples=samples_for(a, version=version)))
                if held:
                    await server.work(sum(a.group_size for a in held))
        finally:
            server.close()
        await wait_until(lambda: len(batches) >= 6, timeout_s=30, what="six steps")
    assert buckets == {0, 1}
    assert all(len(b) == 1 for b in batches), batches       # never a short prompt beside a long one
    assert {next(iter(b)) for b in batches} == {False, True}
