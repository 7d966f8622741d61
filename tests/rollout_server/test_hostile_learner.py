"""A real rollout server (RolloutService, tiny HF model) driven by a hostile learner: messages that
do not decode, values no server should honour, manifests that do not add up or are too big,
versions going backwards, a weights endpoint nobody listens on, and a weights socket answering
with the wrong chunks. The server refuses and counts each one, keeps serving, applies the good
weights when they come and answers a good assignment on them afterwards."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket

import msgpack
import torch
import zmq
import zmq.asyncio
from config_kit import rollout_config
from fake_learner import FakeLearner, assignment, chunk_reply, get, parse_metrics, publish, wait_until

import protocol
from rollout_server.service import RolloutService


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tampered(msg: protocol.Message, edit) -> list[bytes]:
    """``msg`` encoded, then its body changed by ``edit(list) -> list`` (what a buggy or hostile
    sender could put on the wire; the codec never writes it)."""
    header, body, *rest = protocol.encode(msg)
    return [header, msgpack.packb(edit(msgpack.unpackb(body)), use_bin_type=True), *rest]


class HostileWeights:
    """The learner's weights ROUTER, answering the first requests wrongly, then honestly."""

    def __init__(self):
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.published: dict[int, tuple] = {}
        self.requests = 0

    def script(self, n: int, reply: protocol.WeightChunk) -> list:
        if n == 1:
            return [dataclasses.replace(reply, index=10**6)]              # an index out of range
        if n == 2:
            return [dataclasses.replace(reply, version=reply.version + 5)]  # another version
        if n == 3:
            return [dataclasses.replace(reply, data=bytes(reply.data) + b"\x00" * 4)]  # wrong size
        if n == 4:
            data = bytearray(reply.data)
            data[-1] ^= 0x55
            return [dataclasses.replace(reply, data=bytes(data))]          # corrupted bytes
        if n == 5:
            return [reply, reply]                                         # the same chunk twice
        return [reply]

    async def serve(self) -> None:
        while True:
            ident, *frames = await self.sock.recv_multipart()
            req = protocol.decode(frames)
            self.requests += 1
            manifest, chunks = self.published[req.version]
            reply = chunk_reply(manifest, chunks, req.index)
            for r in self.script(self.requests, reply) if isinstance(reply, protocol.WeightChunk) else [reply]:
                await self.sock.send_multipart([ident, *protocol.encode(r)])

    def close(self) -> None:
        self.sock.close(0)


async def test_a_hostile_learner_cannot_stop_the_server(tiny_model_dir):
    learner, weights = FakeLearner(), HostileWeights()
    cfg = rollout_config(learner=learner.endpoint, server_id="victim", metrics_port=0, threads=1,
                        max_concurrency=4, max_new_tokens_limit=64, max_prompt_tokens=32,
                        chunk_timeout_s=5.0, heartbeat_interval_s=0.2)  # (a loaded loop may stall 0.5 s)
    svc = RolloutService(cfg, tiny_model_dir)
    run = asyncio.create_task(svc.run())
    serve = asyncio.create_task(weights.serve())
    m = svc.metrics
    bos = svc.engine.tokenizer.bos_token_id
    named = [(n, p.detach().clone() + 0.01) for n, p in svc.engine.model.named_parameters()]
    v1, c1 = publish(1, named, chunk_bytes=64 << 10)
    v2, c2 = publish(2, named, chunk_bytes=64 << 10)
    weights.published = {1: (v1, c1), 2: (v2, c2)}
    assert v2.num_chunks >= 6

    async def refused(frames_or_msg, code: str) -> protocol.Error:
        if isinstance(frames_or_msg, protocol.Message):
            await learner.send(ident, frames_or_msg)
        else:
            await learner.send_raw(ident, frames_or_msg)
        _, err = await learner.expect(protocol.Error)
        assert err.code == code, err
        return err

    try:
        ident, _ = await learner.expect(protocol.Hello)
        dead = f"tcp://127.0.0.1:{free_port()}"                   # nobody listens there
        await learner.welcome(ident, weights_endpoint=dead)
        await learner.expect(protocol.WorkRequest)

        # -- messages that do not decode: counted, answered with protocol_error ----------------
        await refused([b"\x00garbage"], "protocol_error")
        hot = tampered(assignment("hot", [bos, 5]), lambda b: b[:6] + [["hot", 1.0, 0, 8]] + b[7:])
        await refused(hot, "protocol_error")                          # sampling not a number
        await refused(tampered(assignment("neg", [bos, 5]), lambda b: b[:3] + [-2] + b[4:]),
                      "protocol_error")                               # group_size -2
        miscounted = tampered(v1, lambda b: b[:5] + [b[5] + 1] + b[6:])
        await refused(miscounted, "protocol_error")                   # num_chunks does not add up
        sizes = dataclasses.replace(v1, total_bytes=v1.total_bytes + 8)
        await refused(protocol.encode(sizes), "protocol_error")       # total_bytes != tensors
        no_endpoint = tampered(protocol.Welcome(learner_id="l", run_id="r", version=0,
                                                weights_endpoint="tcp://x:1"), lambda b: b[:3])
        await refused(no_endpoint, "protocol_error")                  # Welcome without its endpoint
        await refused(tampered(assignment("burst", [bos, 5]), lambda b: b[:10] + [-5]),
                      "protocol_error")                               # burst_left below -1
        lora = dataclasses.replace(v1, kind="lora", lora=protocol.LoraSpec(
            r=8, lora_alpha=16.0, lora_dropout=0.0, target_modules=["q_proj"]))
        await refused(tampered(lora, lambda b: b[:-1] + [["8", 16.0, 0.0, ["q_proj"]]]),
                      "protocol_error")                               # LoRA r as a string
        await refused(tampered(lora, lambda b: b[:-1] + [[8, 16.0, 0.0, "q_proj"]]),
                      "protocol_error")                               # target_modules not a list
        assert m.registry.get_sample_value("slipstream_protocol_errors_total") == 9

        # -- well-formed but not for this server: refused with an Error, counted ---------------
        err = await refused(assignment("wide", [bos, 5], group_size=10**6), "assignment_refused")
        assert "'wide'" in err.message and err.ref_id
        await refused(assignment("long", [bos, 5], max_new_tokens=10**6), "assignment_refused")
        await refused(assignment("vocab", [bos, 2**31 - 1]), "assignment_refused")
        await refused(assignment("prompt", [bos] * 10**5), "assignment_refused")
        await learner.send(ident, protocol.Ack(sample_ids=["never/0", "not an id"],
                                               statuses=["accepted", "stale"]))
        await learner.send(ident, protocol.WorkRequest(server_id="learner?", credits=10**9))
        await learner.send(ident, protocol.WeightChunk(version=9, index=0, checksum="x", data=b"1"))
        # Unknown fields (a newer minor version) are ignored, not refused.
        await learner.send_raw(ident, tampered(protocol.Heartbeat(sender_id="l", version=0),
                                               lambda b: b + ["future", {"x": 1}]))

        # -- weights: too big, then an endpoint nobody answers on ------------------------------
        tib = [protocol.TensorSpec(name="w", dtype="uint8", shape=[1 << 40], offset=0, nbytes=1 << 40)]
        await learner.send(ident, dataclasses.replace(
            v1, tensors=tib, total_bytes=1 << 40, chunk_bytes=1 << 30, num_chunks=1 << 10,
            chunk_checksums=[]))
        await learner.send(ident, v1)
        await wait_until(lambda: m.error_count("weights_timeout") == 1, timeout_s=30,
                         what="the fetch from a dead endpoint to time out")
        assert svc.engine.version == 0
        # Each failure is reported to the learner (its circuit breaker counts them).
        for kind in ("weights_manifest", "weights_timeout"):
            _, err = await learner.expect(protocol.Error)
            assert err.code == "weights_failed" and kind in err.message, err
        # A Welcome nobody asked for does not move the weights endpoint.
        await learner.welcome(ident, weights_endpoint=weights.endpoint)
        assert svc.receiver.endpoint == dead

        # -- the learner "restarts": a Hello, a Welcome with the (hostile) weights socket --------
        await learner.send(ident, protocol.Error(code="unknown_server", message="who are you"))
        await learner.expect(protocol.Hello)
        await learner.welcome(ident, weights_endpoint=weights.endpoint)
        await learner.send(ident, v2)
        _, applied = await learner.expect(protocol.WeightsApplied, timeout_s=60)
        assert (applied.version, applied.checksum) == (2, v2.checksum)
        assert svc.engine.version == 2
        for name, p in svc.engine.model.named_parameters():
            assert torch.equal(p, dict(named)[name])
        await learner.send(ident, v1)                                 # backwards: refused
        _, err = await learner.expect(protocol.Error)
        assert err.code == "weights_failed" and "weights_version" in err.message
        await learner.send(ident, v2)                                 # a repeat: ignored

        # -- still serving: a good assignment, generated on the new weights; it promises a
        # burst of 10**9 more that never come: the batch window (batch_wait_s) bounds the wait
        await learner.send(ident, assignment("good", [bos, 7, 8], group_size=2, max_new_tokens=6,
                                             burst_left=10**9, temperature=0.8))
        _, result = await learner.expect(protocol.RolloutResult)
        assert sorted(s.sample_id for s in result.samples) == ["good/0", "good/1"]
        for s in result.samples:
            assert s.failed is None and len(s.completion_token_ids) >= 1
            assert s.sampling_temperature == 0.8                      # the typed field, echoed
            assert (s.token_versions == 2).all()
        await learner.ack(ident, result.samples)

        assert not run.done()
        status, body = await asyncio.to_thread(get, f"{svc.metrics_url}/metrics")
        counts = {k: v for k, v in parse_metrics(body.decode()).items()
                  if k.startswith("slipstream_rollout_errors_total") and v}   # (the rest are at 0)
        kind = 'slipstream_rollout_errors_total{{kind="{}"}}'.format
        assert counts == {
            kind("assignment_group_size"): 1, kind("assignment_max_new_tokens"): 1,
            kind("assignment_prompt"): 2, kind("unknown_ack"): 2, kind("unexpected_message"): 2,
            kind("weights_manifest"): 1, kind("weights_timeout"): 1, kind("weights_version"): 1,
            # the hostile chunk replies: index, version, size, duplicate; one corrupted chunk
            kind("weights_chunk"): 4, kind("weights_checksum"): 1,
        }, counts
        assert svc.learner_echoes
        status, body = await asyncio.to_thread(get, f"{svc.metrics_url}/healthz")
        assert status == 200 and json.loads(body)["version"] == 2
    finally:
        svc.stopping.set()
        svc.abort.set()
        code = await asyncio.wait_for(run, 60)
        serve.cancel()
        learner.close()
        weights.close()
    assert code == 0
