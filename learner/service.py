"""The learner process: hand out work, collect rollouts, train, publish weights, take control.

Sockets (all ROUTER, DESIGN.md §6): ``rollout`` (Hello / WorkRequest / RolloutResult / Heartbeat /
WeightsApplied in; Welcome / Assignment / Ack / WeightsAvailable out), ``weights`` (chunk requests),
``control`` (``slipstream ctl``). Everything runs on one asyncio loop; the policy step and the
weight serialization run in a worker thread so the sockets stay responsive during training.

Admission: a server's ``WorkRequest`` grants credits; ``dispatch`` turns credits into assignments
only while the buffer's staleness gate has capacity, so generation runs at most ``max_staleness``
+ 1 batches ahead of training (DESIGN.md §3). Expired leases are re-issued to any server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

import protocol
from buffer import RolloutBuffer
from learner.config import LearnerConfig
from learner.data import PromptSource
from learner.metrics import JsonlLog, LearnerMetrics
from learner.publisher import WeightPublisher
from learner.trainer import Trainer

SERVER_TIMEOUT_S = 30.0
EXPIRY_CHECK_S = 1.0
FINAL_SYNC_S = 30.0


@dataclass
class ServerState:
    server_id: str
    identity: bytes
    version: int = 0
    credits: int = 0
    last_seen: float = 0.0


class LearnerService:
    def __init__(self, cfg: LearnerConfig, model_path: str, run_id: str | None = None):
        self.cfg = cfg
        self.run_id = run_id or f"{Path(cfg.run_dir).name}-{uuid.uuid4().hex[:6]}"
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.trainer = Trainer(cfg, model_path)
        self.version = 0
        self.buffer = RolloutBuffer(batch_samples=cfg.batch_samples, group_size=cfg.group_size,
                                    max_staleness=cfg.max_staleness, stale_policy=cfg.stale_policy,
                                    lease_timeout_s=cfg.lease_timeout_s)
        self.prompts = PromptSource(cfg.dataset, cfg.seed)
        self.publisher = WeightPublisher(cfg.weights_chunk_bytes)
        self.metrics = LearnerMetrics()
        self.metrics.max_staleness.set(cfg.max_staleness)
        self.jsonl = JsonlLog(self.run_dir / "metrics.jsonl")
        self.servers: dict[bytes, ServerState] = {}
        self.reissue: list = []
        self.assignment_counter = 0
        self.ctx = zmq.asyncio.Context()
        self.send_lock = asyncio.Lock()
        self.stopping = asyncio.Event()
        self.versions_changed = asyncio.Event()
        self.endpoints: dict[str, str] = {}

    def log(self, event: str, **fields) -> None:
        print(json.dumps({"proc": "learner", "event": event, "run_id": self.run_id,
                          "version": self.version, **fields}), flush=True)

    # ---- sockets ---------------------------------------------------------------------------
    def _bind(self, port: int) -> tuple[zmq.asyncio.Socket, int]:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port:
            sock.bind(f"tcp://{self.cfg.bind_host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{self.cfg.bind_host}")
        return sock, port

    async def send_to(self, identity: bytes, message: protocol.Message) -> None:
        async with self.send_lock:
            await self.rollout_sock.send_multipart([identity, *protocol.encode(message)], copy=False)

    # ---- main ------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        self.rollout_sock, rollout_port = self._bind(self.cfg.rollout_port)
        self.weights_sock, self.weights_port = self._bind(self.cfg.weights_port)
        self.control_sock, control_port = self._bind(self.cfg.control_port)
        metrics_port = self.metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
        host = self.cfg.bind_host if self.cfg.bind_host not in ("0.0.0.0", "*") else "127.0.0.1"
        self.endpoints = {"rollout": f"tcp://{host}:{rollout_port}",
                          "weights": f"tcp://{host}:{self.weights_port}",
                          "control": f"tcp://{host}:{control_port}",
                          "metrics": f"http://{self.cfg.metrics_host}:{metrics_port}/metrics"}
        (self.run_dir / "learner.json").write_text(json.dumps({"run_id": self.run_id, **self.endpoints}))
        self.log("ready", **self.endpoints)
        tasks = [asyncio.create_task(c) for c in (self.rollout_loop(), self.weights_loop(),
                                                  self.control_loop(), self.expiry_loop())]
        train = asyncio.create_task(self.train_loop())
        stop = asyncio.create_task(self.stopping.wait())
        done, _ = await asyncio.wait([train, stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        code = 0
        for t in done:
            if t is not stop and t.exception() is not None:
                self.log("crashed", error=repr(t.exception()))
                code = 1
        if train in done and code == 0:
            await self.finish()
            if not self.cfg.exit_on_finish:
                self.log("idle", reason="finished; serving metrics and control until stopped")
                await self.stopping.wait()
        for t in [train, stop, *tasks]:
            t.cancel()
        await asyncio.gather(train, stop, *tasks, return_exceptions=True)
        for s in (self.rollout_sock, self.weights_sock, self.control_sock):
            s.close(0)
        self.ctx.term()
        self.jsonl.close()
        self.log("stopped", exit_code=code)
        return code

    async def finish(self) -> None:
        out = self.run_dir / "final"
        await asyncio.to_thread(self.trainer.model.save_pretrained, out)
        await asyncio.to_thread(self.trainer.tokenizer.save_pretrained, out)
        # Let connected servers fetch the last version before the weights socket closes.
        deadline = time.monotonic() + FINAL_SYNC_S
        while (time.monotonic() < deadline
               and any(s.version < self.version for s in self.servers.values())):
            self.versions_changed.clear()
            try:
                await asyncio.wait_for(self.versions_changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
        for srv in list(self.servers.values()):
            await self.send_to(srv.identity, protocol.Error(code="learner_finished",
                                                            message=f"run {self.run_id} finished"))
        self.log("finished", checkpoint=str(out), counters=self.buffer.counters)

    # ---- training --------------------------------------------------------------------------
    async def train_loop(self) -> None:
        while self.version < self.cfg.total_steps:
            batch = await self.buffer.next_batch(self.version)
            stats = await asyncio.to_thread(self.trainer.step, batch.samples, batch.staleness)
            stats["trained_on_version"] = float(self.version)
            stats["token_version_min"] = float(min(s.min_version for s in batch.samples))
            stats["token_version_max"] = float(max(int(s.token_versions.max(initial=0))
                                                   for s in batch.samples))
            self.version += 1
            start = time.monotonic()
            manifest = await asyncio.to_thread(self.publisher.publish, self.version,
                                               self.trainer.named_tensors())
            self.metrics.publish_seconds.observe(time.monotonic() - start)
            for srv in list(self.servers.values()):
                await self.send_to(srv.identity, manifest)
            self.record_step(stats)
            await self.dispatch()

    def record_step(self, stats: dict[str, float]) -> None:
        m = self.metrics
        m.policy_version.set(self.version)
        m.step_seconds.observe(stats["step_s"])
        m.reward_mean.set(stats["reward_mean"])
        m.staleness_mean.set(stats["staleness_mean"])
        for k, v in stats.items():
            m.step_stats.labels(name=k).set(v)
        self.update_gauges()
        record = {"step": self.version, "version": self.version, "time": time.time(), **stats,
                  "server_versions": {s.server_id: s.version for s in self.servers.values()}}
        self.jsonl.write(record)
        self.log("step", **{k: round(v, 5) if isinstance(v, float) else v for k, v in record.items()
                            if k not in ("version", "time")})

    def update_gauges(self) -> None:
        self.metrics.buffered.set(self.buffer.pending_samples)
        self.metrics.inflight.set(self.buffer.inflight_samples)
        self.metrics.servers.set(len(self.servers))

    # ---- admission -------------------------------------------------------------------------
    def _new_assignment(self) -> protocol.Assignment:
        p = next(self.prompts)
        self.assignment_counter += 1
        return protocol.Assignment(
            assignment_id=f"{self.run_id}-a{self.assignment_counter}", prompt_id=p["prompt_id"],
            prompt_token_ids=self.trainer.encode_prompt(p["prompt"]), group_size=self.cfg.group_size,
            version=self.version, prompt_text=p["prompt"],
            sampling={"temperature": self.cfg.temperature, "top_p": self.cfg.top_p,
                      "max_new_tokens": self.cfg.max_new_tokens},
            metadata={"answer": p["answer"]}, deadline_s=self.cfg.lease_timeout_s)

    async def dispatch(self) -> None:
        """Turn servers' credits into assignments while the staleness gate allows (round robin)."""
        g = self.cfg.group_size
        progress = True
        while progress:
            progress = False
            for srv in list(self.servers.values()):
                if srv.credits < g:
                    continue
                while self.reissue and not self.buffer.is_open(self.reissue[0].assignment_id):
                    self.reissue.pop(0)       # finished meanwhile by its first holder
                if self.reissue:
                    lease = self.buffer.reissue(self.reissue.pop(0), srv.server_id)
                    old: protocol.Assignment = lease.payload
                    assignment = protocol.Assignment(
                        assignment_id=old.assignment_id, prompt_id=old.prompt_id,
                        prompt_token_ids=old.prompt_token_ids, group_size=old.group_size,
                        version=self.version, prompt_text=old.prompt_text, sampling=old.sampling,
                        metadata=old.metadata, deadline_s=old.deadline_s, attempt=lease.attempt)
                elif self.buffer.capacity(self.version) >= g:
                    assignment = self._new_assignment()
                    self.buffer.issue(assignment.assignment_id, srv.server_id, g, payload=assignment)
                else:
                    return
                srv.credits -= g
                await self.send_to(srv.identity, assignment)
                progress = True
        self.update_gauges()

    async def expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_CHECK_S)
            now = time.monotonic()
            for ident, srv in list(self.servers.items()):
                if now - srv.last_seen > SERVER_TIMEOUT_S:
                    self.log("server_lost", server=srv.server_id)
                    del self.servers[ident]
                    self.metrics.server_version.remove(srv.server_id)
                    self.reissue.extend(self.buffer.release_holder(srv.server_id))
            self.reissue.extend(self.buffer.expire())
            if self.reissue:
                await self.dispatch()

    # ---- rollout socket --------------------------------------------------------------------
    async def rollout_loop(self) -> None:
        while True:
            identity, *frames = await self.rollout_sock.recv_multipart(copy=True)
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as e:
                self.metrics.protocol_errors.labels(socket="rollout").inc()
                self.log("protocol_error", error=str(e))
                await self.send_to(identity, protocol.Error(code="protocol_error", message=str(e),
                                                            ref_id=protocol.message_id(frames)))
                continue
            await self.handle(identity, msg)

    async def handle(self, identity: bytes, msg: protocol.Message) -> None:
        srv = self.servers.get(identity)
        if isinstance(msg, protocol.Hello):
            self.servers[identity] = srv = ServerState(msg.server_id, identity, msg.version,
                                                       last_seen=time.monotonic())
            self.metrics.server_version.labels(server=msg.server_id).set(msg.version)
            await self.send_to(identity, protocol.Welcome(
                learner_id=f"learner-{os.getpid()}", run_id=self.run_id, version=self.version,
                metadata={"weights_port": self.weights_port}))
            latest = self.publisher.latest
            if latest is not None and latest.version > msg.version:
                await self.send_to(identity, latest)
            self.log("server_joined", server=msg.server_id, server_version=msg.version)
            self.update_gauges()
            return
        if srv is None:
            await self.send_to(identity, protocol.Error(code="unknown_server",
                                                        message="say Hello first"))
            return
        srv.last_seen = time.monotonic()
        if isinstance(msg, protocol.WorkRequest):
            srv.credits += msg.credits
            await self.dispatch()
        elif isinstance(msg, protocol.RolloutResult):
            statuses = []
            for sample in msg.samples:
                status = await self.buffer.put(sample, self.version)
                statuses.append(str(getattr(status, "value", status)))
                self.metrics.samples.labels(status=statuses[-1]).inc()
            self.metrics.rollouts_received.inc(len(msg.samples))
            await self.send_to(identity, protocol.Ack(sample_ids=[s.sample_id for s in msg.samples],
                                                      statuses=statuses))
            self.update_gauges()
            await self.dispatch()
        elif isinstance(msg, protocol.WeightsApplied):
            srv.version = msg.version
            self.versions_changed.set()
            self.metrics.server_version.labels(server=srv.server_id).set(msg.version)
            expected = self.publisher.versions.get(msg.version)
            if expected is not None and expected[0].checksum != msg.checksum:
                self.log("checksum_mismatch", server=srv.server_id, server_version=msg.version)
        elif isinstance(msg, protocol.Heartbeat):
            srv.version = msg.version
        else:
            await self.send_to(identity, protocol.Error(code="unexpected",
                                                        message=f"{type(msg).TYPE} not handled here"))

    # ---- weights socket --------------------------------------------------------------------
    async def weights_loop(self) -> None:
        while True:
            identity, *frames = await self.weights_sock.recv_multipart(copy=True)
            try:
                msg = protocol.decode(frames)
                if not isinstance(msg, protocol.WeightChunkRequest):
                    raise protocol.ProtocolError(f"weights socket: unexpected {type(msg).TYPE}")
                reply = self.publisher.chunk(msg.version, msg.index)
            except protocol.ProtocolError as e:
                self.metrics.protocol_errors.labels(socket="weights").inc()
                reply = protocol.Error(code="protocol_error", message=str(e))
            await self.weights_sock.send_multipart([identity, *protocol.encode(reply)], copy=False)

    # ---- control socket --------------------------------------------------------------------
    async def control_loop(self) -> None:
        while True:
            identity, *frames = await self.control_sock.recv_multipart(copy=True)
            try:
                msg = protocol.decode(frames)
                if not isinstance(msg, protocol.ControlRequest):
                    raise protocol.ProtocolError(f"control socket: unexpected {type(msg).TYPE}")
                reply = await self.control(msg)
            except protocol.ProtocolError as e:
                self.metrics.protocol_errors.labels(socket="control").inc()
                reply = protocol.ControlReply(ok=False, error=str(e))
            await self.control_sock.send_multipart([identity, *protocol.encode(reply)])

    def status(self) -> dict:
        return {"run_id": self.run_id, "version": self.version, "total_steps": self.cfg.total_steps,
                "max_staleness": self.buffer.max_staleness, "stale_policy": self.buffer.stale_policy,
                "buffered_samples": self.buffer.pending_samples,
                "inflight_samples": self.buffer.inflight_samples,
                "servers": {s.server_id: {"version": s.version, "credits": s.credits}
                            for s in self.servers.values()},
                "counters": dict(self.buffer.counters)}

    async def control(self, req: protocol.ControlRequest) -> protocol.ControlReply:
        if req.command in ("status", "get"):
            return protocol.ControlReply(ok=True, result=self.status())
        if req.command == "set":
            key, value = req.args.get("key"), req.args.get("value")
            try:
                if key == "max_staleness":
                    eta = int(value)
                    if eta < 0 or str(eta) != str(value).strip():
                        raise ValueError
                    self.buffer.set_max_staleness(eta)
                    self.metrics.max_staleness.set(eta)
                elif key == "stale_policy":
                    if value not in ("drop", "correct"):
                        raise ValueError
                    self.buffer.set_stale_policy(value)
                else:
                    return protocol.ControlReply(ok=False, error=f"unknown setting {key!r}; "
                                                 "settable: max_staleness, stale_policy")
            except (TypeError, ValueError):
                return protocol.ControlReply(ok=False, error=f"bad value {value!r} for {key}: "
                                             "max_staleness takes an integer >= 0, stale_policy drop|correct")
            self.log("control_set", key=key, value=value)
            await self.dispatch()
            return protocol.ControlReply(ok=True, result=self.status())
        if req.command == "stop":
            self.stopping.set()
            return protocol.ControlReply(ok=True, result={"stopping": True})
        return protocol.ControlReply(ok=False, error=f"unknown command {req.command!r}; "
                                     "commands: status, set, stop")


def serve(cfg: LearnerConfig, model_path: str) -> int:
    return asyncio.run(LearnerService(cfg, model_path).run())
