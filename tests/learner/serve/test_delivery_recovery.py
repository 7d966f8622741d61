"""Delivery through real processes and sockets (issue 14): a learner restarted without --resume is
not poisoned by a server that holds a newer version of the old run; a separately started server
exits 0 when the learner says the run finished; the weights circuit breaker drops a server that
keeps failing and takes it back once it applies weights; a restarted server (same id, new
session) gets its old leases re-issued at once."""

from __future__ import annotations

import asyncio
import json
import socket
import sys

import pytest
import yaml
from config_kit import rollout_config, rollout_nested
from learner_testkit import FakeServer, learner_config, samples_for, wait_until

import protocol
from learner.serve.service import LearnerService
from rollout_server.service import RolloutService

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events(out: str, name: str) -> list[dict]:
    found = []
    for line in out.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("event") == name:
            found.append(ev)
    return found


async def start(svc: LearnerService) -> asyncio.Task:
    task = asyncio.create_task(svc.run())
    await asyncio.wait([task, asyncio.create_task(svc.ready.wait())], timeout=120,
                       return_when=asyncio.FIRST_COMPLETED)
    assert svc.ready.is_set(), task.exception() if task.done() else "learner not ready"
    return task


async def test_a_new_run_rebases_a_server_of_the_old_one_which_exits_0_at_the_end(
        tmp_path, tiny_model_dir, subprocess_env, process_groups, capsys):
    ports = {k: free_port() for k in ("rollout_port", "weights_port", "control_port")}
    old = LearnerService(learner_config(tmp_path / "a", **ports), tiny_model_dir, run_id="run-a")
    old_task = await start(old)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"model": tiny_model_dir, "rollout": rollout_nested({
        "metrics_port": 0, "threads": 1, "max_concurrency": 4, "heartbeat_interval_s": 0.5,
        "reconnect_ivl_s": 0.05, "reconnect_ivl_max_s": 0.5})}))
    server = process_groups.watch([sys.executable, "-m", "deploy.cli", "rollout", "--config", str(cfg),
                                   "--learner", old.endpoints["rollout"]], env=subprocess_env)
    await asyncio.to_thread(server.wait_for, lambda line: '"weights_version": 3' in line, 240,
                            "the server at version 3 of the old run")
    old.stopping.set()
    assert await asyncio.wait_for(old_task, 60) == 0

    # The same ports, a new run at version 0 (no --resume), 3 steps, then exit.
    new = LearnerService(learner_config(tmp_path / "b", **ports, total_steps=3, exit_on_finish=True,
                                        final_sync_s=10, reannounce_s=0.5),
                         tiny_model_dir, run_id="run-b")
    new_task = await start(new)
    rebased = await asyncio.to_thread(server.wait_for_event, "new_run", 120)
    assert rebased["previous_run_id"] == "run-a" and rebased["server_version"] >= 3
    assert rebased["learner_version"] == 0
    applied = await asyncio.to_thread(server.wait_for_event, "weights_applied", 120)
    assert applied["weights_version"] == 0 and applied["run_id"] == "run-b"    # re-tagged
    assert await asyncio.wait_for(new_task, 240) == 0
    assert new.version == 3 and new.finished
    assert new.buffer.counters["invalid"] == 0 and not new.intake.invalid     # nothing poisoned
    steps = [json.loads(r) for r in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["token_version_max"] <= s["trained_on_version"] for s in steps)
    mismatch = events(capsys.readouterr().out, "server_version_mismatch")
    assert mismatch and mismatch[0]["server_version"] >= 3 and mismatch[0]["learner_version"] == 0
    # The learner said the run finished: the separately started server exits 0 on its own.
    assert await asyncio.to_thread(server.proc.wait, 60) == 0
    assert server.wait_for_event("learner_finished", 5)["action"] == "exiting"


async def test_circuit_breaker_drops_a_failing_server_and_takes_it_back(tmp_path, tiny_model_dir, capsys):
    cfg = learner_config(tmp_path, weights_failure_limit=3, reannounce_s=0.2, max_staleness=1)
    svc = LearnerService(cfg, tiny_model_dir, run_id="cb")
    task = await start(svc)
    flaky = FakeServer(svc.endpoints["rollout"], "flaky", max_concurrency=2)
    real = None
    try:
        await flaky.hello()
        await flaky.work(2)
        a = await flaky.expect(protocol.Assignment)
        await flaky.answer(samples_for(a, version=0))
        v1 = await flaky.expect(protocol.WeightsAvailable, skip=(protocol.Heartbeat, protocol.Assignment))
        assert v1.version == 1
        for i in range(3):
            await flaky.send(protocol.Error(code="weights_failed", message=f"fetch {i}: timeout"))
        srv = next(s for s in svc.admission.servers.values() if s.server_id == "flaky")
        await wait_until(lambda: srv.dropped, 10, "the breaker opened")
        await flaky.work(2)                         # credits, not lagging (eta 1): still no work
        assert not any(isinstance(m, protocol.Assignment) for m in await flaky.drain(0.5))
        assert svc.admission.status()["flaky"]["dropped"] is True
        await flaky.send(protocol.WeightsApplied(server_id="flaky", version=1, checksum=v1.checksum,
                                                 seconds=0.1))
        await flaky.expect(protocol.Assignment, skip=(protocol.Heartbeat, protocol.WeightsAvailable))
        assert not srv.dropped and srv.weights_failures == 0

        # A real server whose every manifest is refused (max_weights_bytes too small) reports
        # each refusal and is dropped too, on its own.
        real = RolloutService(rollout_config(learner=svc.endpoints["rollout"], server_id="small",
                                            metrics_port=0, threads=1, max_concurrency=2,
                                            max_weights_bytes=1024, heartbeat_interval_s=0.2),
                              tiny_model_dir)
        real_task = asyncio.create_task(real.run())
        await wait_until(lambda: any(s.server_id == "small" and s.dropped
                                     for s in svc.admission.servers.values()) or real_task.done(),
                         120, "the real server dropped")
        assert not real_task.done()
        assert real.metrics.error_count("weights_manifest") >= 3
        out = capsys.readouterr().out
        assert {e["server"] for e in events(out, "server_dropped")} == {"flaky", "small"}
        assert [e["server"] for e in events(out, "server_readmitted")] == ["flaky"]
    finally:
        flaky.close()
        if real is not None:
            real.stopping.set()
            real.abort.set()
            await asyncio.wait_for(real_task, 60)
        svc.stopping.set()
        await asyncio.wait_for(task, 60)


async def test_a_restarted_server_gets_its_old_leases_reissued_at_once(tmp_path, tiny_model_dir):
    cfg = learner_config(tmp_path, batch_prompts=2, lease_timeout_s=600)
    svc = LearnerService(cfg, tiny_model_dir, run_id="rs")
    task = await start(svc)
    try:
        first = FakeServer(svc.endpoints["rollout"], "same", max_concurrency=4)
        await first.send(protocol.Hello(server_id="same", engine="e", model="m", version=0,
                                        max_concurrency=4, metadata={"session": "one"}))
        await first.expect(protocol.Welcome)
        await first.work(4)
        held = {(await first.expect(protocol.Assignment)).assignment_id for _ in range(2)}
        first.close()                               # "killed": its two leases are open
        second = FakeServer(svc.endpoints["rollout"], "same", max_concurrency=4)
        await second.send(protocol.Hello(server_id="same", engine="e", model="m", version=0,
                                         max_concurrency=4, metadata={"session": "two"}))
        await second.expect(protocol.Welcome, skip=(protocol.Heartbeat, protocol.WeightsAvailable,
                                                    protocol.Assignment))
        await second.work(4)
        again = {(await second.expect(protocol.Assignment, timeout_s=10)).assignment_id for _ in range(2)}
        assert again == held                        # re-issued now, not after lease_timeout_s 600
        assert svc.buffer.counters["released"] == 4 and svc.buffer.counters["reissued"] == 4
        second.close()
    finally:
        svc.stopping.set()
        await asyncio.wait_for(task, 60)
