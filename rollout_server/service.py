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

Reconnects: the DEALER reconnects by itself with exponential backoff (``RECONNECT_IVL`` doubling up
to ``RECONNECT_IVL_MAX``); messages sent while the learner is away wait in the socket's queue. A
restarted learner answers the first heartbeat with ``unknown_server``; Hello -> Welcome then
re-sends every unacknowledged result.

Shutdown (SIGTERM/SIGINT): stop asking for work, finish every queued and generating assignment
(there is no "return lease" message; finishing is as good and loses nothing), wait for the acks of
all results — bounded by ``drain_timeout_s``; leases not finished by then expire on the learner and
are re-issued — then close the engine and exit 0. Acks cannot come from a learner that said
``learner_finished`` or whose connection is down for ``DRAIN_DISCONNECTED_S`` (a socket monitor
watches it): then the server stops waiting at once. A second signal skips the wait.
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
from rollout_server.rewards import Rewarder

HEARTBEAT_S = 2.0
CHUNK_TIMEOUT_S = 30.0
CHUNK_WINDOW = 4
CHUNK_RETRIES = 3
DRAIN_DISCONNECTED_S = 2.0


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
        self.rewarder = Rewarder(cfg.reward, cfg.reward_weights, cfg.reward_options)
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
        self.abort = asyncio.Event()          # a second signal: do not wait for the drain
        self.progress = asyncio.Event()       # set whenever generation finishes or an ack arrives
        self.generating = False
        self.learner_finished = False
        self.disconnected_since: float | None = None   # None while the learner connection is up
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
            loop.add_signal_handler(sig, self.on_signal)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"{self.server_id}".encode())
        self.sock.setsockopt(zmq.RECONNECT_IVL, int(self.cfg.reconnect_ivl_s * 1000))
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.cfg.reconnect_ivl_max_s * 1000))
        monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(self.cfg.learner)
        self.metrics.policy_version.set(self.engine.version)
        port = self.metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port, self.health)
        self.metrics_url = f"http://{self.cfg.metrics_host}:{port}"
        log("ready", server_id=self.server_id, learner=self.cfg.learner,
            metrics=f"{self.metrics_url}/metrics", healthz=f"{self.metrics_url}/healthz")
        await self.say_hello()
        tasks = [asyncio.create_task(c) for c in
                 (self.recv_loop(), self.generate_loop(), self.heartbeat_loop(), self.weights_loop(),
                  self.monitor_loop(monitor))]
        stop = asyncio.create_task(self.stopping.wait())
        try:
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stop and t.exception():
                    log("crashed", error=repr(t.exception()))
                    raise t.exception()
            log("stopping", unacked=len(self.unacked), queued=len(self.queue),
                assigned=self.assigned_samples)
            drained = await self.drain(tasks)
            log("drained", ok=drained, unacked=len(self.unacked), assigned=self.assigned_samples)
        finally:
            for t in [stop, *tasks]:
                t.cancel()
            await asyncio.gather(stop, *tasks, return_exceptions=True)
            await self.engine.close()
            self.metrics.close()
            self.sock.disable_monitor()
            monitor.close(0)
            self.sock.close(0)
            self.ctx.term()
        log("stopped")
        return 0

    def on_signal(self) -> None:
        if self.stopping.is_set():
            self.abort.set()
        self.stopping.set()

    def busy(self) -> bool:
        return bool(self.assigned_samples or self.unacked)

    def learner_gone(self) -> bool:
        """No ack can come: the run finished, or the connection has been down a while."""
        return self.learner_finished or (self.disconnected_since is not None and
                                         time.monotonic() - self.disconnected_since > DRAIN_DISCONNECTED_S)

    async def monitor_loop(self, monitor: zmq.asyncio.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                self.disconnected_since = None
            elif event == zmq.EVENT_DISCONNECTED:
                self.disconnected_since = time.monotonic()
                log("disconnected", learner=self.cfg.learner)
            self.progress.set()

    async def drain(self, tasks: list[asyncio.Task]) -> bool:
        """Finish queued and generating work and wait for its acks, up to ``drain_timeout_s``."""
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while (self.busy() and not self.abort.is_set() and not self.learner_gone()
               and time.monotonic() < deadline):
            if any(t.done() for t in tasks):          # a loop crashed: nothing more will finish
                return False
            self.progress.clear()
            waiters = [asyncio.create_task(e.wait()) for e in (self.progress, self.abort)]
            await asyncio.wait(waiters, timeout=min(1.0, max(0.0, deadline - time.monotonic())),
                               return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()
        return not self.busy()

    def health(self) -> tuple[bool, dict]:
        """/healthz: 200 while serving, 503 once stopping (or before the learner welcomed us)."""
        info = {"server_id": self.server_id, "version": self.engine.version,
                "connected": self.welcomed.is_set(), "stopping": self.stopping.is_set(),
                "assigned_samples": self.assigned_samples, "unacked_results": len(self.unacked)}
        return self.welcomed.is_set() and not self.stopping.is_set(), info

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
            self.progress.set()
        elif isinstance(msg, protocol.WeightsAvailable):
            if msg.version > self.engine.version and (
                    self.latest_manifest is None or msg.version > self.latest_manifest.version):
                self.latest_manifest = msg
                self.weights_event.set()
        elif isinstance(msg, protocol.Error):
            if msg.code == "unknown_server":
                self.metrics.reconnects.inc()
                log("rehello", reason=msg.message)
                await self.say_hello()
            else:
                if msg.code == "learner_finished":
                    self.learner_finished = True
                    self.progress.set()
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
        """Queued assignments go to the engine together: one generate call per batch. Keeps going
        while stopping (the drain finishes leases already granted)."""
        while True:
            await self.queue_event.wait()
            if self.cfg.batch_wait_s:
                await asyncio.sleep(self.cfg.batch_wait_s)   # let assignments sent together arrive
            batch, self.queue = self.queue, []
            self.queue_event.clear()
            if not batch:
                continue
            await self._wait_for_pending_weights()
            requests = [self._request(a) for a in batch]
            start = time.monotonic()
            self.generating = True
            try:
                groups = await self.engine.generate(requests)
            finally:
                self.generating = False
            gen_s = time.monotonic() - start
            self.metrics.generation_seconds.observe(gen_s)
            for a, completions in zip(batch, groups):
                samples = await self._make_samples(a, completions, gen_s)
                frames = protocol.encode(protocol.RolloutResult(server_id=self.server_id, samples=samples))
                self.unacked[a.assignment_id] = _Pending(frames, [s.sample_id for s in samples],
                                                         time.monotonic())
                await self.send_frames(frames)
            done = sum(a.group_size for a in batch)
            self.assigned_samples -= done
            self.metrics.requests_inflight.set(self.assigned_samples + len(self.unacked))
            self.progress.set()
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

    async def _make_samples(self, a: protocol.Assignment, completions: list, gen_s: float) -> list:
        """Decode and score one group (batched rewards see the whole group at once)."""
        texts = [self.engine.decode(c.token_ids) for c in completions]
        start = time.monotonic()
        items = [(a.prompt_text, t, {**a.metadata, "completion_tokens": len(c.token_ids),
                                     "finish_reason": c.finish_reason})
                 for t, c in zip(texts, completions)]
        scored = await self.rewarder.score_many(items)
        reward_s = (time.monotonic() - start) / max(1, len(completions))
        samples = []
        for i, (c, text, sc) in enumerate(zip(completions, texts, scored)):
            if sc.failed:     # a reward that raised or returned NaN: the sample says why
                self.metrics.errors.labels(kind="reward").inc()
                log("reward_failed", sample_id=f"{a.assignment_id}/{i}", error=sc.failed[:500])
            else:
                self.metrics.reward.observe(sc.total)
            self.metrics.generated_tokens.inc(len(c.token_ids))
            self.metrics.prompt_tokens.inc(len(a.prompt_token_ids))
            self.metrics.samples.inc()
            samples.append(protocol.Sample(
                sample_id=f"{a.assignment_id}/{i}", assignment_id=a.assignment_id, group_index=i,
                group_size=a.group_size, prompt_token_ids=a.prompt_token_ids,
                completion_token_ids=c.token_ids, behavior_logprobs=c.logprobs,
                token_versions=c.versions, reward=sc.total, reward_parts=sc.parts or {},
                finish_reason=c.finish_reason, timing={"generate_s": gen_s, "reward_s": reward_s},
                completion_text=text, failed=sc.failed))
        return samples

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
            try:
                await self.engine.update_weights(WeightUpdate(
                    version=manifest.version, kind=manifest.kind, tensors=tensors,
                    lora_config=manifest.metadata.get("lora", {})))
            except (ValueError, RuntimeError) as e:   # refused: keep serving the old version
                self.weights_applied.set()
                self.metrics.errors.labels(kind="weights").inc()
                log("weights_failed", version=manifest.version, error=str(e))
                continue
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
