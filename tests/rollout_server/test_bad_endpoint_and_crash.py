"""A learner whose Welcome names a weights endpoint no socket can connect to, a loop of the server
that dies, and the normal end of a run (issue 31.6, 30.7).

A bad ``weights_endpoint`` is refused like any protocol error (counted, answered
``protocol_error``); the server keeps serving ``/healthz`` (503: not welcomed), asks again after
``learner_timeout_s`` and joins a learner that then names a good endpoint. A loop that dies ends
a real ``slipstream rollout`` process with ``EXIT_TASK_CRASHED`` and one stderr line naming it,
even when it left a socket open (which used to hang the process in ``zmq_ctx_term``)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
import yaml
import zmq
import zmq.asyncio
from config_kit import rollout_config, rollout_nested
from fake_learner import FakeLearner, chunk_reply, get, parse_metrics, publish

import protocol
from rollout_server.service import EXIT_TASK_CRASHED, RolloutService

BEATS = (protocol.Heartbeat,)     # skipped while waiting; a WorkRequest is not (nothing granted)


class Weights:
    """The learner's weights ROUTER, answering every chunk request honestly."""

    def __init__(self):
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.published: dict[int, tuple] = {}

    async def serve(self) -> None:
        while True:
            ident, *frames = await self.sock.recv_multipart()
            req = protocol.decode(frames)
            manifest, chunks = self.published[req.version]
            await self.sock.send_multipart([ident, *protocol.encode(chunk_reply(manifest, chunks, req.index))])

    def close(self) -> None:
        self.sock.close(0)


def protocol_errors(svc: RolloutService) -> float:
    _, body = get(f"{svc.metrics_url}/metrics")
    return parse_metrics(body.decode())["slipstream_protocol_errors_total"]


@pytest.mark.parametrize("bad", ["tcp://127.0.0.1:99999", "tcp://exa mple:5", "tcp://:0",
                                 "tcp://*:5", "ipc://", "tcp://h:5\x00"])
async def test_a_welcome_with_a_bad_weights_endpoint_is_refused_counted_and_retried(
        tiny_model_dir, bad):
    learner, weights = FakeLearner(), Weights()
    cfg = rollout_config(learner=learner.endpoint, server_id="s-bad", metrics_port=0, threads=1,
                        max_concurrency=4, learner_timeout_s=1.0, heartbeat_interval_s=0.2,
                        chunk_timeout_s=5.0)
    svc = RolloutService(cfg, tiny_model_dir)
    run = asyncio.create_task(svc.run())
    serve = asyncio.create_task(weights.serve())
    try:
        ident, _ = await learner.expect(protocol.Hello)
        await learner.welcome(ident, weights_endpoint=bad)
        _, err = await learner.expect(protocol.Error, skip=BEATS)
        assert err.code == "protocol_error" and "Welcome.weights_endpoint" in err.message, err
        assert protocol_errors(svc) == 1
        status, body = get(f"{svc.metrics_url}/healthz")
        assert status == 503 and json.loads(body)["connected"] is False

        # A manifest now is refused (no usable endpoint), not fetched: nothing dies.
        named = [(n, p.detach().clone() + 0.01) for n, p in svc.engine.model.named_parameters()]
        manifest, chunks = publish(1, named, chunk_bytes=64 << 10)
        weights.published[1] = (manifest, chunks)
        await learner.send(ident, manifest)
        _, err = await learner.expect(protocol.Error, skip=BEATS)
        assert err.code == "weights_failed" and "no weights endpoint" in err.message, err

        # After learner_timeout_s the server says Hello again; a good Welcome is taken.
        ident, _ = await learner.expect(protocol.Hello, timeout_s=15, skip=BEATS)
        await learner.welcome(ident, weights_endpoint=weights.endpoint)
        await learner.expect(protocol.WorkRequest, skip=BEATS)
        assert get(f"{svc.metrics_url}/healthz")[0] == 200
        await learner.send(ident, manifest)
        _, applied = await learner.expect(protocol.WeightsApplied, skip=BEATS + (protocol.WorkRequest,))
        assert applied.version == 1 and svc.engine.version == 1
        assert protocol_errors(svc) == 1 and not run.done()
    finally:
        svc.stopping.set()
        svc.abort.set()
        code = await asyncio.wait_for(run, 60)
        serve.cancel()
        weights.close()
        learner.close()
    assert code == 0


CRASHING_SERVER = """
import sys
import rollout_server.receiver as receiver

async def run(self):
    self.leaked = self.connect("tcp://127.0.0.1:1", 1 << 16)   # left open, as a dying fetch did
    raise RuntimeError("weights loop broke")

receiver.WeightsReceiver.run = run
from deploy.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_task_ends_the_process_with_its_exit_code(tmp_path, tiny_model_dir, subprocess_env,
                                                       process_groups):
    learner = FakeLearner()       # the server connects to it; it never has to answer
    cfg = {"model": tiny_model_dir, "rollout": rollout_nested({"metrics_port": 0, "threads": 1, "server_id": "s-crash"})}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    try:
        done = process_groups.run([sys.executable, "-c", CRASHING_SERVER, "rollout", "--config",
                                   str(tmp_path / "cfg.yaml"), "--learner", learner.endpoint],
                                  timeout=60, env=subprocess_env, cwd=tmp_path)
    finally:
        learner.close()
    assert done.returncode == EXIT_TASK_CRASHED, (done.stdout[-2000:], done.stderr[-3000:])
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("slipstream rollout: the 'weights' task crashed: RuntimeError: "
                           "weights loop broke"), done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    crashed = [e for e in events if e["event"] == "crashed"]
    assert crashed == [{"proc": "rollout", "event": "crashed", "version": 0, "task": "weights",
                        "error": "RuntimeError('weights loop broke')"}]
    assert events[-1]["event"] == "stopped" and events[-1]["exit_code"] == EXIT_TASK_CRASHED


async def test_a_finished_run_is_an_info_event_not_a_learner_error(tiny_model_dir, capsys):
    learner = FakeLearner()
    svc = RolloutService(rollout_config(learner=learner.endpoint, server_id="s-fin", metrics_port=0,
                                       threads=1), tiny_model_dir)
    run = asyncio.create_task(svc.run())
    try:
        ident, _ = await learner.expect(protocol.Hello)
        await learner.welcome(ident)
        await learner.expect(protocol.WorkRequest)
        await learner.send(ident, protocol.Error(code="learner_stopping", message="paused run"))
        await learner.send(ident, protocol.Error(code="learner_finished", message="done"))
        await learner.send(ident, protocol.Error(code="learner_finished", message="done"))
        assert await asyncio.wait_for(run, 30) == 0
    finally:
        if not run.done():
            run.cancel()
        learner.close()
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    finished = [e for e in events if e["event"] == "learner_finished"]
    assert [(e["level"], e["action"], e["message"]) for e in finished] == [("info", "exiting", "done")]
    errors = [e["code"] for e in events if e["event"] == "learner_error"]
    assert errors == ["learner_stopping"]            # other learner errors are still errors
    assert events[-1]["event"] == "stopped"
