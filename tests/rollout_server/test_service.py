"""Rollout service against a fake learner (a real ZeroMQ ROUTER in the test): batching, rewards
and their failures, metrics and /healthz scraped over HTTP, re-Hello + re-send after a learner
restart on the same port, and SIGTERM draining in a real subprocess."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import types
import urllib.error
import urllib.request

import numpy as np
import pytest
import yaml
import zmq
import zmq.asyncio

import protocol
from rollout_server import service as service_mod
from rollout_server.config import RolloutConfig
from rollout_server.service import RolloutService


class FakeLearner:
    """The learner's rollout ROUTER, driven by hand."""

    def __init__(self, port: int = 0):
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://127.0.0.1:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"

    async def recv(self, timeout_s: float = 60) -> tuple[bytes, protocol.Message]:
        if not await self.sock.poll(timeout_s * 1000):
            raise AssertionError(f"nothing from the server within {timeout_s}s")
        ident, *frames = await self.sock.recv_multipart()
        return ident, protocol.decode(frames)

    async def expect(self, cls, timeout_s: float = 60) -> tuple[bytes, protocol.Message]:
        """The next message of type ``cls``, skipping heartbeats (and WorkRequests unless asked)."""
        while True:
            ident, msg = await self.recv(timeout_s)
            if isinstance(msg, cls):
                return ident, msg
            if not isinstance(msg, (protocol.Heartbeat, protocol.WorkRequest, protocol.WeightsApplied)):
                raise AssertionError(f"expected {cls.__name__}, got {msg!r}")

    async def send(self, ident: bytes, msg: protocol.Message) -> None:
        await self.sock.send_multipart([ident, *protocol.encode(msg)])

    async def welcome(self, ident: bytes) -> None:
        await self.send(ident, protocol.Welcome(learner_id="fake", run_id="run", version=0,
                                                metadata={"weights_port": 1}))

    def close(self) -> None:
        self.sock.close(0)


def assignment(aid: str, tokens: list[int], group_size: int = 2, answer: str = "7",
               max_new_tokens: int = 5) -> protocol.Assignment:
    return protocol.Assignment(
        assignment_id=aid, prompt_id=aid, prompt_token_ids=np.array(tokens, dtype=np.int32),
        group_size=group_size, version=0, prompt_text="3+4=",
        sampling={"temperature": 1.0, "top_p": 1.0, "max_new_tokens": max_new_tokens},
        metadata={"answer": answer}, deadline_s=60.0)


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def parse(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.fixture
def reward_plugin():
    mod = types.ModuleType("slipstream_service_rewards")

    async def judged(prompt, completion, metadata):
        if metadata["answer"] == "boom":
            raise RuntimeError("judge exploded")
        if metadata["answer"] == "nan":
            return float("nan")
        return {"tokens": float(metadata["completion_tokens"])}

    mod.judged = judged
    sys.modules[mod.__name__] = mod
    yield f"{mod.__name__}:judged"
    del sys.modules[mod.__name__]


async def test_service_batches_scores_and_serves_metrics(tiny_model_dir, reward_plugin):
    learner = FakeLearner()
    cfg = RolloutConfig(learner=learner.endpoint, server_id="s1", metrics_port=0, max_concurrency=6,
                        reward=["builtin:exact_numeric", reward_plugin], batch_wait_s=0.05, threads=1)
    svc = RolloutService(cfg, tiny_model_dir)
    run = asyncio.create_task(svc.run())
    try:
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
        samples = {}
        while len(samples) < 6:
            _, res = await learner.expect(protocol.RolloutResult)
            samples.update({s.sample_id: s for s in res.samples})
        assert svc.engine.generate_calls == 1                 # three assignments, one decode
        ok = [samples["a1/0"], samples["a1/1"]]
        for s in ok:
            assert s.failed is None
            assert s.reward_parts["tokens"] == len(s.completion_token_ids)
            assert s.reward == s.reward_parts["tokens"] + s.reward_parts["exact_numeric"]
            assert len(s.token_versions) == len(s.completion_token_ids) == len(s.behavior_logprobs)
        assert "RuntimeError: judge exploded" in samples["a2/0"].failed
        assert "non-finite" in samples["a3/1"].failed
        _, wr = await learner.expect(protocol.WorkRequest)     # the credits come back
        assert wr.credits == 6
        await learner.send(ident, protocol.Ack(sample_ids=sorted(samples), statuses=["accepted"] * 6))

        status, body = await asyncio.to_thread(get, f"{svc.metrics_url}/healthz")
        assert status == 200 and json.loads(body)["connected"] is True
        status, body = await asyncio.to_thread(get, f"{svc.metrics_url}/metrics")
        m = parse(body.decode())
        gen = sum(len(s.completion_token_ids) for s in samples.values())
        assert m["slipstream_rollout_generated_tokens_total"] == gen
        assert m["slipstream_rollout_prompt_tokens_total"] == 6 * 4
        assert m["slipstream_rollout_generation_seconds_count"] == 1
        assert m['slipstream_rollout_errors_total{kind="reward"}'] == 4
        assert m["slipstream_rollout_reward_count"] == 2       # failed samples are not observed
        assert m["slipstream_policy_version"] == 0
        assert "slipstream_rollout_requests_inflight" in m
        assert "slipstream_rollout_weight_update_seconds_count" in m
        assert m["slipstream_rollout_send_retries_total"] == 0
    finally:
        svc.stopping.set()
        assert await asyncio.wait_for(run, 60) == 0
        learner.close()


async def test_rehello_and_resend_after_learner_restart(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(service_mod, "HEARTBEAT_S", 0.05)
    first = FakeLearner()
    port = first.port
    cfg = RolloutConfig(learner=first.endpoint, server_id="s2", metrics_port=0, max_concurrency=2,
                        reconnect_ivl_s=0.02, reconnect_ivl_max_s=0.1, threads=1)
    svc = RolloutService(cfg, tiny_model_dir)
    run = asyncio.create_task(svc.run())
    second = None
    try:
        ident, _ = await first.expect(protocol.Hello)
        await first.welcome(ident)
        await first.expect(protocol.WorkRequest)
        await first.send(ident, assignment("b1", [svc.engine.tokenizer.bos_token_id, 5, 6]))
        _, res = await first.expect(protocol.RolloutResult)
        ids = sorted(s.sample_id for s in res.samples)
        first.close()                                           # the learner dies before acking
        for _ in range(100):                                    # the port may take a moment
            try:
                second = FakeLearner(port)
                break
            except zmq.ZMQError:
                await asyncio.sleep(0.05)
        assert second is not None
        ident2, msg = await second.recv()
        while not isinstance(msg, protocol.Hello):               # unknown to the new learner
            await second.send(ident2, protocol.Error(code="unknown_server", message="say Hello first"))
            ident2, msg = await second.recv()
        await second.welcome(ident2)
        _, again = await second.expect(protocol.RolloutResult)
        assert sorted(s.sample_id for s in again.samples) == ids    # the same samples, re-sent
        await second.send(ident2, protocol.Ack(sample_ids=ids, statuses=["accepted"] * len(ids)))
        while svc.unacked:
            svc.progress.clear()
            await asyncio.wait_for(svc.progress.wait(), 30)
        reg = svc.metrics.registry
        assert reg.get_sample_value("slipstream_rollout_send_retries_total") >= 1
        assert reg.get_sample_value("slipstream_rollout_reconnects_total") >= 1
    finally:
        svc.stopping.set()
        assert await asyncio.wait_for(run, 60) == 0
        first.close()
        if second is not None:
            second.close()


async def test_sigterm_finishes_work_waits_for_acks_and_exits_0(tmp_path, tiny_model_dir, subprocess_env):
    learner = FakeLearner()
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        metrics_port = sk.getsockname()[1]
    cfg = {"model": tiny_model_dir,
           "rollout": {"metrics_port": metrics_port, "threads": 1, "max_concurrency": 8, "batch_wait_s": 0.0,
                       "server_id": "s3"}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "rollout", "--config",
                             str(tmp_path / "cfg.yaml"), "--learner", learner.endpoint],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=subprocess_env, cwd=tmp_path)
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
        while True:                              # /healthz says when the signal has been handled
            status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{metrics_port}/healthz")
            health = json.loads(body)
            if health["stopping"]:
                break
        assert status == 503 and health["unacked_results"] >= 1     # there is something to drain
        got = {s.sample_id for s in first.samples}
        results = [first]
        while len(got) < 8:
            _, res = await learner.expect(protocol.RolloutResult)
            got.update(s.sample_id for s in res.samples)
            results.append(res)
        assert got == {f"c{a}/{i}" for a in (1, 2) for i in range(4)}
        for res in results:                                     # only now the acks
            await learner.send(ident, protocol.Ack(sample_ids=[s.sample_id for s in res.samples],
                                                   statuses=["accepted"] * len(res.samples)))
        out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0, out
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        names = [e["event"] for e in events]
        assert "stopping" in names and names[-1] == "stopped"
        drained = next(e for e in events if e["event"] == "drained")
        assert drained["ok"] is True and drained["unacked"] == 0 and drained["assigned"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        learner.close()


@pytest.mark.parametrize("how", ["learner_finished", "learner_gone"])
async def test_drain_does_not_wait_for_acks_that_cannot_come(tiny_model_dir, how):
    learner = FakeLearner()
    cfg = RolloutConfig(learner=learner.endpoint, server_id="s4", metrics_port=0, max_concurrency=2,
                        drain_timeout_s=600, threads=1)
    svc = RolloutService(cfg, tiny_model_dir)
    run = asyncio.create_task(svc.run())
    try:
        ident, _ = await learner.expect(protocol.Hello)
        await learner.welcome(ident)
        await learner.expect(protocol.WorkRequest)
        await learner.send(ident, assignment("d1", [svc.engine.tokenizer.bos_token_id, 5]))
        await learner.expect(protocol.RolloutResult)             # never acknowledged
        if how == "learner_finished":
            await learner.send(ident, protocol.Error(code="learner_finished", message="done"))
            while not svc.learner_finished:
                svc.progress.clear()
                await asyncio.wait_for(svc.progress.wait(), 30)
        else:
            learner.close()
        svc.stopping.set()
        assert await asyncio.wait_for(run, 30) == 0               # not drain_timeout_s = 600
        assert svc.unacked                                        # it gave up on those acks
    finally:
        if not run.done():
            run.cancel()
        learner.close()


def test_inflight_policy_reaches_the_hf_engine(tiny_model_dir):
    svc = RolloutService(RolloutConfig(inflight_update="resubmit", metrics_port=0), tiny_model_dir)
    assert svc.engine.inflight_update == "resubmit"
    assert svc.engine.batch_wait_s == 0.0          # the service batches its queue itself
