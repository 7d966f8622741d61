"""The rollout server process: ask for work, generate, score, stream results, apply new weights.

Delivery (DESIGN.md §6): the server is a DEALER connected to the learner's ROUTER. It grants
*credits* (free generation slots, counted in samples) with ``WorkRequest``; the learner answers
with ``Assignment`` leases. Every ``RolloutResult`` stays in ``unacked`` until the learner's
``Ack`` names its samples; results are re-sent after ``ack_timeout_s`` and after every
(re)connect (``Welcome``), and the learner de-duplicates by sample id — so nothing is lost and
nothing is trained twice. A learner that does not know this server (it restarted) answers a
heartbeat with ``Error(code="unknown_server")`` and the server says Hello again.

Weights: on ``WeightsAvailable`` a separate DEALER fetches the chunks from the learner's weights
socket, verifies every checksum (a corrupted chunk is fetched again), and the engine applies the
tensors between generate calls. Only then does the server report ``WeightsApplied`` and tag new
tokens with the new version: a server never reports a version it has not applied.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

import protocol
from ops.tensor_bytes import unflatten_tensors
from protocol.weights import chunk_checksum, combine_checksums
from rollout_server.config import RolloutConfig
from rollout_server.engine import GenRequest, WeightUpdate
from rollout_server.engines import create_engine
from rollout_server.metrics import RolloutMetrics
from rollout_server.rewards import load_reward, score

HEARTBEAT_S = 2.0
CHUNK_TIMEOUT_S = 30.0
CHUNK_WINDOW = 4
CHUNK_RETRIES = 3


def log(event: str, **fields) -> None:
    """One JSON line per event on stdout (the launcher and log collectors read these)."""
    print(json.dumps({"proc": "rollout", "event": event, **fields}), flush=True)


@dataclass
class _Pending:
    frames: list
    sample_ids: list[str]
    sent_at: float


class RolloutService:
    def __init__(self, cfg: RolloutConfig, model_path: str):
        self.cfg = cfg
        self.server_id = cfg.server_id or f"{socket.gethostname()}-{os.getpid()}"
        self.reward_fn = load_reward(cfg.reward)
        if cfg.threads:
            import torch
            torch.set_num_threads(cfg.threads)
        self.engine = create_engine(cfg, model_path)
        self.model_name = os.path.basename(os.path.normpath(model_path))
        self.metrics = RolloutMetrics()
        self.queue: list[protocol.Assignment] = []
        self.queue_event = asyncio.Event()
        self.assigned_samples = 0          # queued + generating (credits the learner has used)
        self.unacked: dict[str, _Pending] = {}
        self.stopping = asyncio.Event()
        self.welcomed = asyncio.Event()
        self.weights_endpoint: str | None = None
        self.latest_manifest: protocol.WeightsAvailable | None = None
        self.weights_event = asyncio.Event()
        self.weights_applied = asyncio.Event()
        self.send_lock = asyncio.Lock()
        self.ctx = zmq.asyncio.Context()
        self.sock: zmq.asyncio.Socket | None = None

    # ---- transport -------------------------------------------------------------------------
    async def send(self, message: protocol.Message) -> None:
        await self.send_frames(protocol.encode(message))

    async def send_frames(self, frames: list) -> None:
        async with self.send_lock:
            await self.sock.send_multipart(frames, copy=False)

    # ---- main ------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"{self.server_id}".encode())
        self.sock.connect(self.cfg.learner)
        port = self.metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
        log("ready", server_id=self.server_id, learner=self.cfg.learner,
            metrics=f"http://{self.cfg.metrics_host}:{port}/metrics")
        await self.say_hello()
        tasks = [asyncio.create_task(c) for c in
                 (self.recv_loop(), self.generate_loop(), self.heartbeat_loop(), self.weights_loop())]
        stop = asyncio.create_task(self.stopping.wait())
        done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is not stop and t.exception():
                log("crashed", error=repr(t.exception()))
                raise t.exception()
        log("stopping", unacked=len(self.unacked), queued=len(self.queue))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.sock.close(0)
        self.ctx.term()
        log("stopped")
        return 0

    async def say_hello(self) -> None:
        self.welcomed.clear()
        await self.send(protocol.Hello(server_id=self.server_id, engine=self.engine.name,
                                       model=self.model_name, version=self.engine.version,
                                       max_concurrency=self.cfg.max_concurrency))

    async def recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=True)
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as e:
                self.metrics.protocol_errors.inc()
                log("protocol_error", error=str(e))
                continue
            await self.handle(msg)

    async def handle(self, msg: protocol.Message) -> None:
        if isinstance(msg, protocol.Welcome):
            host = self.cfg.learner.rsplit(":", 1)[0]
            self.weights_endpoint = f"{host}:{msg.metadata['weights_port']}"
            log("welcome", run_id=msg.run_id, learner_version=msg.version, version=self.engine.version)
            self.welcomed.set()
            credits = self.cfg.max_concurrency - self.assigned_samples
            if credits > 0 and not self.stopping.is_set():
                await self.send(protocol.WorkRequest(server_id=self.server_id, credits=credits))
            for pending in list(self.unacked.values()):       # re-send after (re)connect
                self.metrics.send_retries.inc()
                pending.sent_at = time.monotonic()
                await self.send_frames(pending.frames)
        elif isinstance(msg, protocol.Assignment):
            self.queue.append(msg)
            self.assigned_samples += msg.group_size
            self.queue_event.set()
        elif isinstance(msg, protocol.Ack):
            for sid in msg.sample_ids:
                key = sid.rpartition("/")[0]            # sample ids are "<assignment_id>/<index>"
                pending = self.unacked.get(key)
                if pending is not None and sid in pending.sample_ids:
                    pending.sample_ids.remove(sid)
                    if not pending.sample_ids:
                        del self.unacked[key]
            self.metrics.requests_inflight.set(self.assigned_samples + len(self.unacked))
        elif isinstance(msg, protocol.WeightsAvailable):
            if msg.version > self.engine.version and (
                    self.latest_manifest is None or msg.version > self.latest_manifest.version):
                self.latest_manifest = msg
                self.weights_event.set()
        elif isinstance(msg, protocol.Error):
            if msg.code == "unknown_server":
                await self.say_hello()
            else:
                log("learner_error", code=msg.code, message=msg.message)
        else:
            log("unexpected_message", type=type(msg).TYPE)

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self.send(protocol.Heartbeat(sender_id=self.server_id, version=self.engine.version,
                                               inflight=self.assigned_samples))
            now = time.monotonic()
            for pending in list(self.unacked.values()):
                if now - pending.sent_at > self.cfg.ack_timeout_s:
                    self.metrics.send_retries.inc()
                    pending.sent_at = now
                    await self.send_frames(pending.frames)

    # ---- generation ------------------------------------------------------------------------
    async def generate_loop(self) -> None:
        while True:
            await self.queue_event.wait()
            batch, self.queue = self.queue, []
            self.queue_event.clear()
            if self.stopping.is_set():
                return
            await self._wait_for_pending_weights()
            requests = [self._request(a) for a in batch]
            start = time.monotonic()
            groups = await self.engine.generate(requests)
            gen_s = time.monotonic() - start
            self.metrics.generation_seconds.observe(gen_s)
            for a, completions in zip(batch, groups):
                samples = [await self._make_sample(a, i, c, gen_s) for i, c in enumerate(completions)]
                frames = protocol.encode(protocol.RolloutResult(server_id=self.server_id, samples=samples))
                self.unacked[a.assignment_id] = _Pending(frames, [s.sample_id for s in samples],
                                                         time.monotonic())
                await self.send_frames(frames)
            done = sum(a.group_size for a in batch)
            self.assigned_samples -= done
            self.metrics.requests_inflight.set(self.assigned_samples + len(self.unacked))
            if not self.stopping.is_set():
                await self.send(protocol.WorkRequest(server_id=self.server_id, credits=done))

    async def _wait_for_pending_weights(self) -> None:
        """Newer weights announced? Let them land before starting new work (bounded wait), so
        fresh assignments are not generated on a version the learner has already left behind."""
        deadline = time.monotonic() + self.cfg.weights_wait_s
        while (self.latest_manifest is not None and self.latest_manifest.version > self.engine.version
               and time.monotonic() < deadline):
            self.weights_applied.clear()
            try:
                await asyncio.wait_for(self.weights_applied.wait(), deadline - time.monotonic())
            except TimeoutError:
                return

    def _request(self, a: protocol.Assignment) -> GenRequest:
        s = a.sampling
        return GenRequest(prompt_token_ids=a.prompt_token_ids, n=a.group_size,
                          temperature=float(s.get("temperature", 1.0)), top_p=float(s.get("top_p", 1.0)),
                          top_k=int(s.get("top_k", 0)), max_new_tokens=int(s.get("max_new_tokens", 16)))

    async def _make_sample(self, a: protocol.Assignment, i: int, c, gen_s: float) -> protocol.Sample:
        text = self.engine.decode(c.token_ids)
        start = time.monotonic()
        failed = None
        try:
            reward, parts = await score(self.reward_fn, a.prompt_text, text, a.metadata)
        except Exception as e:  # a user reward function may raise anything: count it, go on
            reward, parts, failed = 0.0, {}, f"reward: {type(e).__name__}: {e}"
            self.metrics.errors.labels(kind="reward").inc()
        self.metrics.generated_tokens.inc(len(c.token_ids))
        self.metrics.prompt_tokens.inc(len(a.prompt_token_ids))
        self.metrics.samples.inc()
        self.metrics.reward.observe(reward)
        return protocol.Sample(
            sample_id=f"{a.assignment_id}/{i}", assignment_id=a.assignment_id, group_index=i,
            group_size=a.group_size, prompt_token_ids=a.prompt_token_ids,
            completion_token_ids=c.token_ids, behavior_logprobs=c.logprobs, token_versions=c.versions,
            reward=reward, reward_parts=parts, finish_reason=c.finish_reason,
            timing={"generate_s": gen_s, "reward_s": time.monotonic() - start}, completion_text=text,
            failed=failed)

    # ---- weights ---------------------------------------------------------------------------
    async def weights_loop(self) -> None:
        while True:
            await self.weights_event.wait()
            self.weights_event.clear()
            manifest = self.latest_manifest
            if manifest is None or manifest.version <= self.engine.version or not self.weights_endpoint:
                continue
            start = time.monotonic()
            try:
                buffer = await self.fetch_weights(manifest)
            except (TimeoutError, ValueError, protocol.ProtocolError) as e:
                self.weights_applied.set()        # do not hold generation back for a failed fetch
                self.metrics.errors.labels(kind="weights").inc()
                log("weights_failed", version=manifest.version, error=str(e))
                continue
            tensors = unflatten_tensors(buffer, [
                {"name": t.name, "dtype": t.dtype, "shape": t.shape, "offset": t.offset, "nbytes": t.nbytes}
                for t in manifest.tensors])
            await self.engine.update_weights(WeightUpdate(version=manifest.version, kind=manifest.kind,
                                                          tensors=tensors,
                                                          lora_config=manifest.metadata.get("lora", {})))
            seconds = time.monotonic() - start
            self.metrics.weight_update_seconds.observe(seconds)
            self.metrics.policy_version.set(manifest.version)
            await self.send(protocol.WeightsApplied(server_id=self.server_id, version=manifest.version,
                                                    checksum=manifest.checksum, seconds=seconds))
            self.weights_applied.set()
            log("weights_applied", version=manifest.version, seconds=round(seconds, 4))

    async def fetch_weights(self, m: protocol.WeightsAvailable) -> bytearray:
        """Fetch every chunk of ``m`` (a window of requests in flight), verifying checksums."""
        buffer = bytearray(m.total_bytes)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.weights_endpoint)
        try:
            got: list[str | None] = [None] * m.num_chunks
            attempts = [0] * m.num_chunks
            todo = list(range(m.num_chunks))
            inflight = 0
            while todo or inflight:
                while todo and inflight < CHUNK_WINDOW:
                    i = todo.pop(0)
                    attempts[i] += 1
                    await sock.send_multipart(protocol.encode(
                        protocol.WeightChunkRequest(version=m.version, index=i)))
                    inflight += 1
                if not await sock.poll(CHUNK_TIMEOUT_S * 1000):
                    raise TimeoutError(f"no weight chunk for {CHUNK_TIMEOUT_S}s (version {m.version})")
                reply = protocol.decode(await sock.recv_multipart(copy=True))
                inflight -= 1
                if isinstance(reply, protocol.Error):
                    raise ValueError(f"learner refused chunk: {reply.code}: {reply.message}")
                if not isinstance(reply, protocol.WeightChunk) or reply.version != m.version:
                    continue
                i = reply.index
                data = memoryview(reply.data)
                expected = m.chunk_checksums[i] if m.chunk_checksums else reply.checksum
                if chunk_checksum(data) != expected or i >= m.num_chunks:
                    self.metrics.errors.labels(kind="weights_checksum").inc()
                    if i < m.num_chunks and attempts[i] < CHUNK_RETRIES:
                        todo.append(i)
                        continue
                    raise ValueError(f"weight chunk {i} of version {m.version} failed its checksum")
                start = i * m.chunk_bytes
                buffer[start:start + data.nbytes] = data
                got[i] = expected
            if combine_checksums(got) != m.checksum:
                raise ValueError(f"weights version {m.version}: checksum mismatch")
            return buffer
        finally:
            sock.close(0)


def serve(cfg: RolloutConfig, model_path: str) -> int:
    service = RolloutService(cfg, model_path)
    try:
        return asyncio.run(service.run())
    except KeyboardInterrupt:
        return 0
    finally:
        sys.stdout.flush()
