"""Rollout service against a fake learner (a real ZeroMQ ROUTER in the test), with the tiny HF
model: rewards and their failures, metrics and /healthz over HTTP (and /healthz going 503 when
the learner dies or goes silent), one Hello per learner restart, re-send after a restart,
startup errors before the model loads, a slow reward that does not stall heartbeats, and SIGTERM
draining in a real subprocess."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
import yaml
import zmq
from config_kit import rollout_config, rollout_nested
from fake_learner import FakeLearner, assignment, get, parse_metrics, wait_event, wait_until

import protocol
from rollout_server import service as service_mod
from rollout_server.service import RolloutService


@pytest.fixture
def reward_plugin():
    mod = types.ModuleType("slipstream_service_rewards")
    release = threading.Event()

    async def judged(prompt, completion, metadata):
        if metadata["answer"] == "boom":
            raise RuntimeError("judge exploded")
        if metadata["answer"] == "nan":
            return float("nan")
        return {"tokens": float(metadata["completion_tokens"])}

    def stuck(prompt, completion, metadata):      # a synchronous reward far slower than its timeout
        release.wait(30)
        return 1.0

    mod.judged, mod.stuck = judged, stuck
    sys.modules[mod.__name__] = mod
    yield mod.__name__
    release.set()
    del sys.modules[mod.__name__]


class Running:
    """A RolloutService running in this event loop, stopped and checked at exit."""

    def __init__(self, learner: FakeLearner, model_dir: str, **cfg):
        cfg = {"server_id": "s1", "metrics_port": 0, "threads": 1, "learner": learner.endpoint, **cfg}
        self.svc = RolloutService(rollout_config(**cfg), model_dir)

    async def __aenter__(self) -> RolloutService:
        self.task = asyncio.create_task(self.svc.run())
        return self.svc

    async def __aexit__(self, *exc):
        self.svc.stopping.set()
        self.svc.abort.set()
        assert await asyncio.wait_for(self.task, 60) == 0


async def hello_and_welcome(learner: FakeLearner, **welcome) -> tuple[bytes, protocol.WorkRequest]:
    ident, _ = await learner.expect(protocol.Hello)
    await learner.welcome(ident, **welcome)
    _, wr = await learner.expect(protocol.WorkRequest)
    return ident, wr


async def test_service_scores_and_serves_metrics(tiny_model_dir, reward_plugin):
    learner = FakeLearner()
    try:
        async with Running(learner, tiny_model_dir, max_concurrency=6,
                           reward=["builtin:exact_numeric", f"{reward_plugin}:judged"]) as svc:
            ident, hello = await learner.expect(protocol.Hello)
            assert hello.server_id == "s1" and hello.version == 0
            status, _ = await asyncio.to_thread(get, f"{svc.metrics_url}/healthz")
            assert status == 503                                  # not welcomed yet
            await learner.welcome(ident)
            _, wr = await learner.expect(protocol.WorkRequest)
            assert wr.credits == 6
            bos = svc.engine.tokenizer.bos_token_id
            for aid, answer in (("a1", "7"), ("a2", "boom"), ("a3", "nan")):
                await learner.send(ident, assignment(aid, [bos, 7, 8, 9], answer=answer))
            samples, credits = {}, 0
            while len(samples) < 6 or credits < 6:                # the credits come back too
                _, msg = await learner.expect((protocol.RolloutResult, protocol.WorkRequest))
                if isinstance(msg, protocol.WorkRequest):
                    credits += msg.credits
                else:
                    samples.update({s.sample_id: s for s in msg.samples})
            assert credits == 6
            for s in (samples["a1/0"], samples["a1/1"]):
                assert s.failed is None
                assert s.reward_parts["tokens"] == len(s.completion_token_ids)
                assert s.reward == s.reward_parts["tokens"] + s.reward_parts["exact_numeric"]
                assert len(s.token_versions) == len(s.completion_token_ids) == len(s.behavior_logprobs)
            assert "RuntimeError: judge exploded" in samples["a2/0"].failed
            assert "non-finite" in samples["a3/1"].failed
            await learner.send(ident, protocol.Ack(sample_ids=sorted(samples), statuses=["accepted"] * 6))
            await wait_event(svc, lambda: len(svc.outbox) == 0, what="acks applied")

            status, body = await asyncio.to_thread(get, f"{svc.metrics_url}/healthz")
            health = json.loads(body)
            assert status == 200 and health["connected"] is True and health["run_id"] == "run"
            status, body = await asyncio.to_thread(get, f"{svc.metrics_url}/metrics")
            m = parse_metrics(body.decode())
            gen = sum(len(s.completion_token_ids) for s in samples.values())
            assert m["slipstream_rollout_generated_tokens_total"] == gen
            assert m["slipstream_rollout_prompt_tokens_total"] == 6 * 4
            assert 1 <= m["slipstream_rollout_generation_seconds_count"] <= 3
            assert m['slipstream_rollout_errors_total{kind="reward"}'] == 4
            assert m["slipstream_rollout_reward_count"] == 2       # failed samples are not observed
            assert m["slipstream_policy_version"] == 0
            assert m["slipstream_rollout_learner_connected"] == 1
            assert m['slipstream_rollout_acks_total{status="accepted"}'] == 6
            assert "slipstream_rollout_requests_inflight" in m
            assert "slipstream_rollout_weight_update_seconds_count" in m
            assert m["slipstream_rollout_send_retries_total"] == 0
    finally:
        learner.close()


async def test_healthz_goes_503_when_the_learner_dies(tiny_model_dir):
    learner = FakeLearner()
    try:
        async with Running(learner, tiny_model_dir, learner_timeout_s=1.0,
                           heartbeat_interval_s=0.1) as svc:
            await hello_and_welcome(learner)
            await wait_event(svc, svc.connected, what="connected")
            status, _ = await asyncio.to_thread(get, f"{svc.metrics_url}/healthz")
            assert status == 200
            learner.close()                                   # killed: its socket goes away
            t0 = time.monotonic()
            await wait_event(svc, lambda: not svc.link_up, timeout_s=10, what="link down")
            assert time.monotonic() - t0 < 5
            status, body = await asyncio.to_thread(get, f"{svc.metrics_url}/healthz")
            assert status == 503 and json.loads(body)["connected"] is False
    finally:
        learner.close()


async def test_healthz_goes_503_when_a_heartbeating_learner_goes_silent(tiny_model_dir):
    learner = FakeLearner()
    try:
        # (2 s: a shorter silence is one stall of a loaded machine's loop, and re-Hellos)
        async with Running(learner, tiny_model_dir, learner_timeout_s=2.0,
                           heartbeat_interval_s=0.05) as svc:
            ident, _ = await hello_and_welcome(learner)
            for _ in range(3):                               # a learner that answers heartbeats
                _, hb = await learner.expect(protocol.Heartbeat)
                await learner.send(ident, protocol.Heartbeat(sender_id="learner", version=0))
            await wait_until(lambda: svc.learner_echoes, what="echo seen")
            assert svc.connected()
            # It stops answering (hung) but its socket stays open.
            await wait_until(lambda: not svc.connected(), timeout_s=10, what="silence noticed")
            assert svc.link_up
            status, body = await asyncio.to_thread(get, f"{svc.metrics_url}/healthz")
            assert status == 503 and json.loads(body)["last_learner_message_s"] >= 2.0
    finally:
        learner.close()


async def test_one_hello_per_restart_and_one_grant_per_welcome(tiny_model_dir):
    learner = FakeLearner()
    try:
        async with Running(learner, tiny_model_dir, max_concurrency=4) as svc:
            ident, wr = await hello_and_welcome(learner)
            assert wr.credits == 4
            # A restarted learner answers each queued heartbeat with unknown_server: one Hello.
            for _ in range(5):
                await learner.send(ident, protocol.Error(code="unknown_server", message="say Hello"))
            await learner.welcome(ident)
            before = await learner.until(protocol.WorkRequest)
            assert sum(isinstance(m, protocol.Hello) for m in before) == 1
            assert before[-1].credits == 4
            # A Welcome nobody asked for grants nothing: the next message after work is its result.
            await learner.welcome(ident)
            await learner.send(ident, assignment("a", [svc.engine.tokenizer.bos_token_id, 5]))
            before = await learner.until(protocol.RolloutResult)
            assert not any(isinstance(m, (protocol.WorkRequest, protocol.Hello)) for m in before)
            assert svc.metrics.registry.get_sample_value("slipstream_rollout_reconnects_total") == 1
    finally:
        learner.close()


async def test_rehello_and_resend_after_learner_restart(tiny_model_dir):
    first = FakeLearner()
    port = first.port
    second = None
    try:
        async with Running(first, tiny_model_dir, max_concurrency=2, heartbeat_interval_s=0.05,
                           reconnect_ivl_s=0.02, reconnect_ivl_max_s=0.1) as svc:
            ident, _ = await hello_and_welcome(first)
            await first.send(ident, assignment("b1", [svc.engine.tokenizer.bos_token_id, 5, 6]))
            _, res = await first.expect(protocol.RolloutResult)
            ids = sorted(s.sample_id for s in res.samples)
            first.close()                                       # the learner dies before acking
            await wait_event(svc, lambda: not svc.link_up, what="link down")
            deadline = time.monotonic() + 30
            while second is None:                               # the port may take a moment
                try:
                    second = FakeLearner(port)
                except zmq.ZMQError:
                    assert time.monotonic() < deadline, "port never came free"
                    await asyncio.sleep(0.05)
            ident2, msg = await second.recv()
            while not isinstance(msg, protocol.Hello):          # unknown to the new learner
                await second.send(ident2, protocol.Error(code="unknown_server", message="say Hello"))
                ident2, msg = await second.recv()
            await second.welcome(ident2)
            _, again = await second.expect(protocol.RolloutResult)
            assert sorted(s.sample_id for s in again.samples) == ids    # the same samples, re-sent
            await second.ack(ident2, again.samples)
            await wait_event(svc, lambda: len(svc.outbox) == 0, what="acked")
            reg = svc.metrics.registry
            assert reg.get_sample_value("slipstream_rollout_send_retries_total") >= 1
            assert reg.get_sample_value("slipstream_rollout_reconnects_total") >= 1
    finally:
        first.close()
        if second is not None:
            second.close()


async def test_a_slow_reward_times_out_and_heartbeats_keep_flowing(tiny_model_dir, reward_plugin):
    learner = FakeLearner()
    try:
        async with Running(learner, tiny_model_dir, reward=f"{reward_plugin}:stuck",
                           reward_timeout_s=1.0, heartbeat_interval_s=0.05) as svc:
            ident, _ = await hello_and_welcome(learner)
            await learner.send(ident, assignment("r", [svc.engine.tokenizer.bos_token_id, 5]))
            before = await learner.until(protocol.RolloutResult)
            result = before[-1]
            assert all("timed out after 1s" in s.failed for s in result.samples)
            # The reward held its thread for the whole second; the event loop kept beating
            # (one every 0.05 s: about 20 while it waited).
            assert sum(isinstance(m, protocol.Heartbeat) for m in before) >= 5
            assert svc.metrics.error_count("reward_timeout") == 2
    finally:
        learner.close()


@pytest.mark.parametrize("how", ["learner_finished", "learner_gone"])
async def test_drain_does_not_wait_for_acks_that_cannot_come(tiny_model_dir, how):
    learner = FakeLearner()
    svc = RolloutService(rollout_config(learner=learner.endpoint, server_id="s4", metrics_port=0,
                                       max_concurrency=2, drain_timeout_s=600, threads=1,
                                       drain_disconnected_s=0.2), tiny_model_dir)
    run = asyncio.create_task(svc.run())
    try:
        ident, _ = await hello_and_welcome(learner)
        await learner.send(ident, assignment("d1", [svc.engine.tokenizer.bos_token_id, 5]))
        await learner.expect(protocol.RolloutResult)             # never acknowledged
        if how == "learner_finished":
            await learner.send(ident, protocol.Error(code="learner_finished", message="done"))
            await wait_event(svc, lambda: svc.learner_finished, what="finished seen")
        else:
            learner.close()
        svc.stopping.set()
        assert await asyncio.wait_for(run, 30) == 0               # not drain_timeout_s = 600
        assert len(svc.outbox)                                    # it gave up on those acks
    finally:
        if not run.done():
            run.cancel()
        learner.close()


# ---- startup ---------------------------------------------------------------------------------

class _ModelLoaded(Exception):
    pass


@pytest.fixture
def no_model(monkeypatch):
    """Startup checks must come before the model: loading it ends the test."""
    def load(cfg, path):
        raise _ModelLoaded
    monkeypatch.setattr(service_mod, "create_engine", load)


def test_an_endpoint_without_scheme_fails_before_the_model(no_model):
    with pytest.raises(protocol.StartupError, match="tcp://"):
        RolloutService(rollout_config(learner="localhost:5555"), "unused")


def test_a_metrics_port_in_use_fails_before_the_model_when_chosen(no_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(protocol.StartupError, match="rollout.network.metrics_port"):
            RolloutService(rollout_config(metrics_port=port), "unused")


def test_the_default_metrics_port_gives_way_to_a_free_one(no_model, capsys):
    default = rollout_config().network.metrics_port
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", default))
            taken.listen()
        except OSError:
            pass                           # already taken by someone else: just as good
        with pytest.raises(_ModelLoaded):
            RolloutService(rollout_config(), "unused")
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    (moved,) = [e for e in events if e["event"] == "metrics_port_in_use"]
    assert moved["wanted"] == default and moved["port"] != default and moved["proc"] == "rollout"


async def test_the_inflight_policy_reaches_the_hf_engine(tiny_model_dir):
    svc = RolloutService(rollout_config(inflight_update="resubmit", metrics_port=0), tiny_model_dir)
    try:
        assert svc.engine.inflight_update == "resubmit"
        assert svc.pipeline.limits.vocab_size == svc.engine.model.get_input_embeddings().num_embeddings
    finally:
        await svc.close()


# ---- a real process ---------------------------------------------------------------------------

async def test_sigterm_finishes_work_waits_for_acks_and_exits_0(tmp_path, tiny_model_dir, subprocess_env):
    learner = FakeLearner()
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        metrics_port = sk.getsockname()[1]
    cfg = {"model": tiny_model_dir,
           "rollout": rollout_nested({"metrics_port": metrics_port, "threads": 1, "max_concurrency": 8, "batch_wait_s": 0.0,
                       "server_id": "s3"})}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "rollout", "--config",
                             str(tmp_path / "cfg.yaml"), "--learner", learner.endpoint],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=subprocess_env, cwd=tmp_path, start_new_session=True)
    try:
        ident, _ = await learner.expect(protocol.Hello, timeout_s=180)
        await learner.welcome(ident)
        await learner.expect(protocol.WorkRequest)
        bos = 1
        await learner.send(ident, assignment("c1", [bos, 7, 8], group_size=4, max_new_tokens=200))
        await learner.send(ident, assignment("c2", [bos, 9, 9], group_size=4, max_new_tokens=200))
        _, first = await learner.expect(protocol.RolloutResult)
        # SIGTERM while `first` is unacknowledged (and the other assignment maybe still generating).
        proc.send_signal(signal.SIGTERM)
        health: dict = {}

        def stopping() -> bool:             # /healthz says when the signal has been handled
            nonlocal health
            status, body = get(f"http://127.0.0.1:{metrics_port}/healthz")
            health = {"status": status, **json.loads(body)}
            return health["stopping"]

        await wait_until(lambda: stopping(), timeout_s=30, what="stopping on /healthz")
        assert health["status"] == 503 and health["unacked_results"] >= 1   # something to drain
        got = {s.sample_id for s in first.samples}
        results = [first]
        while len(got) < 8:
            _, res = await learner.expect(protocol.RolloutResult)
            got.update(s.sample_id for s in res.samples)
            results.append(res)
        assert got == {f"c{a}/{i}" for a in (1, 2) for i in range(4)}
        for res in results:                                     # only now the acks
            await learner.ack(ident, res.samples)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0, out
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        names = [e["event"] for e in events]
        assert "stopping" in names and names[-1] == "stopped"
        drained = next(e for e in events if e["event"] == "drained")
        assert drained["ok"] is True and drained["unacked"] == 0 and drained["assigned"] == 0
        assert all(e.get("run_id") == "run" for e in events if e["event"] in ("drained", "stopped"))
    finally:
        if proc.poll() is None:
            import os
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        learner.close()
