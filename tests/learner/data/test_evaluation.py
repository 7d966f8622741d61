"""Through a real LearnerService (tiny model, real ZeroMQ sockets): a dataset file with a chat
template runs its epochs and ends the run; held-out evaluation rounds are sent greedily outside the
gate, scored, reported, acknowledged and never trained on; an eval assignment whose server dies is
re-issued to another server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil

import pytest
from config_kit import rollout_config
from learner_testkit import FakeServer, http_get, learner_config, metric, samples_for, wait_until

import protocol
from learner.serve.service import LearnerService

TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}.{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


def eval_reward(a: protocol.Assignment) -> float:
    """What the scripted server scores an eval completion: right for answers 1 and 2 only."""
    return 1.0 if a.metadata["answer"] in ("1", "2") else 0.0


class ScriptedServer:
    """A rollout server played by the test: answers every assignment (eval ones with
    :func:`eval_reward`), applies every announced version, keeps every assignment and ack."""

    def __init__(self, endpoint: str, server_id: str = "s1", max_concurrency: int = 4):
        self.s = FakeServer(endpoint, server_id, max_concurrency)
        self.version = 0
        self.assignments: list[protocol.Assignment] = []
        self.acks: dict[str, str] = {}
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> ScriptedServer:
        self.task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.s.close()

    async def _serve(self) -> None:
        s = self.s
        await s.hello()
        await s.work(s.max_concurrency)
        while True:
            msg = await s.recv(timeout_s=120)
            if isinstance(msg, protocol.Assignment):
                self.assignments.append(msg)
                if msg.group_size == 1:
                    reward = eval_reward(msg)
                    samples = samples_for(msg, version=self.version, reward=lambda i, r=reward: r)
                else:
                    samples = samples_for(msg, version=self.version)
                await s.send(protocol.RolloutResult(server_id=s.server_id, samples=samples))
                await s.work(msg.group_size)
            elif isinstance(msg, protocol.Ack):
                self.acks.update(zip(msg.sample_ids, msg.statuses))
            elif isinstance(msg, protocol.WeightsAvailable) and msg.version > self.version:
                await s.send(protocol.WeightsApplied(server_id=s.server_id, version=msg.version,
                                                     checksum=msg.checksum, seconds=0.0))
                self.version = msg.version


async def run_to_end(cfg, model_dir: str, server_id: str = "s1") -> tuple[LearnerService, ScriptedServer]:
    svc = LearnerService(cfg, model_dir, run_id="test")
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 120)
    async with ScriptedServer(svc.endpoints["rollout"], server_id) as server:
        assert await asyncio.wait_for(task, 120) == 0
    return svc, server


def rows_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_chat_dataset_runs_its_epochs_and_ends_the_run(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    model = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model)
    data = tmp_path / "train.jsonl"
    lines = [json.dumps({"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1), "level": i})
             for i in range(3)]
    lines.append(json.dumps({"prompt": [{"role": "user", "content": "1234567+1="}], "answer": "0", "level": 9}))
    data.write_text("\n".join(lines))                          # the last row: 15 tokens, skipped
    # 3 rows x 2 epochs = 6 prompts = 3 batches of 2; total_steps is far away: the data ends the run.
    # (max_staleness 3: no group is dropped as stale, so all three batches form.)
    cfg = learner_config(tmp_path, dataset=str(data), epochs=2, batch_prompts=2, exit_on_finish=True,
                         final_sync_s=5.0, max_staleness=3, max_prompt_tokens=12)
    svc, server = await run_to_end(cfg, str(model))
    assert svc.version == 3 and svc.prompts.exhausted and svc.finished
    steps = [r for r in rows_of(tmp_path / "run" / "metrics.jsonl") if r.get("kind") != "eval"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert len(server.assignments) == 6                      # nothing generated past the data
    texts = sorted(a.prompt_text for a in server.assignments)
    assert texts == sorted([f"u:{i}+1=.a:" for i in range(3)] * 2)
    for a in server.assignments:                             # the template's tokens, encoded once
        assert a.prompt_token_ids.tolist() == tok.encode(a.prompt_text, add_special_tokens=False)
        assert a.metadata["answer"] == str(a.metadata["level"] + 1)
    assert svc.status()["prompts"]["exhausted"] is True
    assert svc.status()["prompts"]["skipped"] == {"too_long": 1}
    assert metric(svc, "slipstream_prompts_skipped_total", reason="too_long") == 1


async def test_eval_rounds_are_greedy_reported_and_never_trained(tmp_path, tiny_model_dir):
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("\n".join(json.dumps({"prompt": f"{a}+0=", "answer": str(a)}) for a in (1, 2, 3)))
    cfg = learner_config(tmp_path, total_steps=4, eval_data=str(held_out), eval_every=2,
                         exit_on_finish=True, final_sync_s=10.0)
    svc, server = await run_to_end(cfg, tiny_model_dir)
    assert svc.version == 4
    evals = [a for a in server.assignments if a.group_size == 1]
    train = [a for a in server.assignments if a.group_size == 2]
    assert all(a.assignment_id.startswith("test-e") and a.sampling.temperature == 1e-6 for a in evals)
    assert all(a.assignment_id.startswith("test-a") for a in train)
    # Rounds at versions 0, 2 and 4; one still open when the next is due is skipped (logged and
    # counted): steps 3 and 4 can run before version 2's round is answered on a loaded machine.
    complete = metric(svc, "slipstream_eval_rounds_total", outcome="complete")
    skipped = metric(svc, "slipstream_eval_rounds_total", outcome="skipped")
    assert complete + skipped == 3 and complete >= 2 and len(evals) == 3 * complete
    assert {a.prompt_text for a in evals} == {"1+0=", "2+0=", "3+0="}
    run = tmp_path / "run"
    rows = rows_of(run / "metrics.jsonl")
    eval_rows = [r for r in rows if r.get("kind") == "eval"]
    versions = [r["eval_version"] for r in eval_rows]
    assert versions[0] == 0 and len(versions) == complete and set(versions) <= {0, 2, 4}
    assert versions == sorted(versions)
    for r in eval_rows:
        assert r["eval_samples"] == 3 and r["eval_failed"] == 0 and r["eval_dropped"] == 0
        assert abs(r["eval_reward_mean"] - 2 / 3) < 1e-9 and abs(r["eval_accuracy"] - 2 / 3) < 1e-9
        assert r["eval_token_version_min"] >= r["eval_version"]
    assert len([r for r in rows if r.get("kind") != "eval"]) == 4          # training unaffected
    trained = [sid for line in rows_of(run / "trained_ids.jsonl") for sid in line["sample_ids"]]
    assert len(trained) == 8 and not any("-e" in sid for sid in trained)   # never trained on
    eval_acks = {sid: st for sid, st in server.acks.items() if sid.startswith("test-e")}
    assert len(eval_acks) == 3 * complete and set(eval_acks.values()) == {"accepted"}
    # The gate saw training work only: every issued sample is a training one.
    assert svc.buffer.counters["issued"] == 2 * len(train)
    assert abs(metric(svc, "slipstream_eval_reward_mean") - 2 / 3) < 1e-9
    assert abs(metric(svc, "slipstream_eval_accuracy") - 2 / 3) < 1e-9
    assert metric(svc, "slipstream_eval_policy_version") == versions[-1]
    assert metric(svc, "slipstream_eval_samples_total", status="accepted") == 3 * complete


async def test_an_eval_assignment_whose_server_dies_is_reissued(tmp_path, tiny_model_dir):
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}))
    cfg = learner_config(tmp_path, eval_data=str(held_out), eval_every=1000, server_timeout_s=1.0)
    svc = LearnerService(cfg, tiny_model_dir, run_id="test")
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 120)
    dies = FakeServer(svc.endpoints["rollout"], "dies", max_concurrency=1)
    good = FakeServer(svc.endpoints["rollout"], "good", max_concurrency=5)
    try:
        await dies.hello()
        await dies.work(1)                    # one credit: room for the eval assignment, not a group
        first = await dies.expect(protocol.Assignment)
        assert first.group_size == 1 and first.attempt == 1 and first.assignment_id == "test-e1.0"
        assert svc.admission.outstanding(svc.admission.servers[b"dies"]) == 1   # credits are shared
        dies.close()                          # dies holding it: silent from now on
        await good.hello()
        await good.work(5)                    # two groups (all the gate allows) and one credit left
        train = await good.expect(protocol.Assignment)
        assert train.group_size == 2
        # "dies" is lost after server_timeout_s; its eval assignment comes to "good", attempt 2.
        again = None
        while again is None:
            await good.heartbeat()
            with contextlib.suppress(AssertionError):
                msg = await good.expect(protocol.Assignment, timeout_s=0.3)
                again = msg if msg.group_size == 1 else None
        assert again.assignment_id == first.assignment_id and again.attempt == 2
        assert sum(metric(svc, "slipstream_rollout_servers_lost_total", reason=r)
                   for r in ("timeout", "unreachable")) == 1
        # One result holding a training group and the eval sample: each part acked by its owner.
        ev = samples_for(again, reward=lambda i: 1.0)
        ack = await good.answer([*samples_for(train), *ev])
        assert ack.statuses == ["accepted"] * 3
        assert (await good.answer(ev)).statuses == ["duplicate"]          # a re-send is a duplicate
        await wait_until(lambda: svc.evaluation.last is not None, 10, "the eval round")
        assert svc.evaluation.last["eval_accuracy"] == 1.0 and svc.evaluation.last["eval_samples"] == 1
        assert svc.buffer.counters["accepted"] == 2                        # the group only
        _, text = await asyncio.to_thread(http_get, svc.endpoints["metrics"])
        assert "slipstream_eval_accuracy 1.0" in text and "slipstream_eval_policy_version 0.0" in text
        status = svc.status()
        assert status["evaluation"]["rounds"] == 1 and status["evaluation"]["open"] is None
    finally:
        good.close()
        svc.stopping.set()
        assert await asyncio.wait_for(task, 60) == 0


@pytest.mark.slow
async def test_eval_through_a_real_hf_server_is_the_greedy_completion(tmp_path, builtin_cache, monkeypatch):
    """The demo model behind a real RolloutService (HF engine): version 0's eval completions are
    the model's own greedy decode (transformers generate, do_sample=False) of each eval prompt,
    and every eval sample is acknowledged (the server's outbox ends empty)."""
    import torch
    from transformers import AutoModelForCausalLM

    from learner.models.builtin import ensure_builtin_model
    from rollout_server.service import RolloutService

    monkeypatch.setenv("SLIPSTREAM_CACHE", str(builtin_cache))
    model_dir = str(ensure_builtin_model("builtin:tiny-arith", log=lambda *a: None))
    cfg = learner_config(tmp_path, total_steps=2, eval_data="builtin:arith", eval_prompts=4, eval_every=2,
                         exit_on_finish=True, final_sync_s=30.0, max_new_tokens=3)
    svc = LearnerService(cfg, model_dir, run_id="test")
    seen: list[protocol.Sample] = []
    task = asyncio.create_task(svc.run())
    await asyncio.wait_for(svc.ready.wait(), 120)
    take = svc.evaluation._take

    def observed(sample):                                         # what the round scores
        seen.append(sample)
        return take(sample)
    svc.evaluation._take = observed
    server = RolloutService(rollout_config(learner=svc.endpoints["rollout"], server_id="hf-0", metrics_port=0,
                                          threads=1, max_concurrency=8, seed=0,
                                          reward="builtin:exact_numeric"), model_dir)
    serving = asyncio.create_task(server.run())
    try:
        assert await asyncio.wait_for(task, 120) == 0
    finally:
        server.stopping.set()
        server.abort.set()
        await asyncio.wait_for(serving, 60)
    assert server.outbox.samples == 0                                    # every eval sample acked
    rows = [r for r in rows_of(tmp_path / "run" / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [r["eval_version"] for r in rows] == [0, 2] and all(r["eval_samples"] == 4 for r in rows)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = {p["prompt_id"]: p for p in svc.evaluation.prompts}
    first = [s for s in seen if s.assignment_id.startswith("test-e1.")]
    assert len(first) == 4 and all(int(s.token_versions.max()) == 0 for s in first)
    for s in first:
        ids = torch.tensor(prompts[f"e{s.assignment_id.rsplit('.', 1)[1]}"]["prompt_token_ids"],
                           dtype=torch.long)[None]                 # a copy: the ids are read-only
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=3, pad_token_id=model.config.pad_token_id)
        assert s.completion_token_ids.tolist() == out[0, ids.shape[1]:].tolist()[:len(s.completion_token_ids)]


def test_the_report_counts_steps_not_eval_rows(tmp_path):
    from deploy.report import write_report

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"run_id": "r", "step": s, "time": 100.0 + s, "reward_mean": 0.1 * s} for s in (1, 2, 3)]
    rows.insert(0, {"run_id": "r", "kind": "eval", "step": 0, "time": 100.0, "eval_reward_mean": 0.2,
                    "eval_accuracy": 0.2})
    rows.append({"run_id": "r", "kind": "eval", "step": 3, "time": 104.0, "eval_reward_mean": 0.5,
                 "eval_accuracy": 0.5})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    text = write_report(run, out=tmp_path / "report").read_text()
    assert "3 policy steps (step 1 → 3)" in text
    assert "| eval accuracy | 0.200 | 0.500 | 0.200 | 0.500 |" in text
