"""The learner process: its sockets, its loops and its components (the train loop: learner.loop).

Sockets (all ROUTER, docs/design.md §6), each served by one :class:`learner.serve.router.RouterSocket` loop:

    rollout   Hello / WorkRequest / RolloutResult / Heartbeat / WeightsApplied /
              Error (assignment_refused) in; Welcome / Assignment / Ack / WeightsAvailable /
              Heartbeat (each one echoed) / Error out
    weights   WeightChunkRequest in, WeightChunk (zero-copy) out
    control   ControlRequest in, ControlReply out (``slipstream ctl``)

plus HTTP ``/metrics`` and ``/healthz``. The run directory gets ``learner.json`` (endpoints, and
the CURVE public key), ``metrics.jsonl`` (one row per step) and ``trained_ids.jsonl`` (the sample
ids of every applied step: an audit that nothing was trained twice). Every socket has ``ZMQ_MAXMSGSIZE`` set (a larger frame
disconnects its sender before it is buffered) and sends never wait (:mod:`learner.serve.router`).
Everything runs on one asyncio loop; the policy step and the weight snapshot run in a worker
thread, so the sockets stay responsive during training.

Components, each unit-tested without sockets or a model, are built by the composition root
(learner.app), which hands them typed ports; this process is their ``LearnerProcess`` port
(status, stop, stacks, the expected wait, stale ranks, health):

    Admission      servers, credits, dispatch, re-issue, expiry, the lag rule (learner.serve.admission)
    Intake         checks every sample against the run before the buffer sees it (learner.serve.intake)
    SampleWatch    failed and refused samples counted, reported; no valid one stops the run
                   (learner.serve.sample_watch)
    WeightsServer  versions published, chunks served (learner.serve.weights_server)
    Control        ctl commands and their validation (learner.serve.control)
    ResultIngress  results in bursts and their Acks (learner.serve.ingress)
    StepRecords    metrics.jsonl, trained_ids.jsonl, sinks, step gauges (learner.serve.step_records)
    RunState       run id, version, assignment counter (learner.state.run_state)
    LearnerOffers  the Welcome and fresh assignments (learner.serve.offers)
    TrainLoop      the policy step, top to bottom (learner.loop)

Delivery, the argument in one place (docs/design.md §3, §6): work goes out only as leases from the
buffer's staleness gate, so generation runs at most ``max_staleness`` + 1 batches ahead of
training, and never to a server more than ``max_staleness`` versions behind. Every result is
checked, then acknowledged with a final status; the buffer keeps the first copy of every sample
and calls later ones duplicates; a lease whose server died, went silent or cannot be reached is
re-issued. A message to a rollout server that cannot be queued (the peer is gone or not
reading) loses that server, whose leases are then re-issued and whose unacknowledged results
come again after its next Hello; a weights fetch missing a chunk fails on the server and is
repeated when the version is re-announced. So nothing is lost and nothing is trained twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import zmq
import zmq.asyncio

import protocol
from learner.app import assemble, assemble_model
from learner.config import LearnerConfig, TrainerConfig
from learner.data.evaluation import Evaluation
from learner.data.prompts import PromptSource
from learner.loop import Batches, TrainLoop
from learner.metrics import SERVER_ERROR_CODES
from learner.serve.control import control_error_reply
from learner.serve.ingress import ResultIngress
from learner.serve.intake import Intake
from learner.serve.router import RouterSocket
from learner.serve.sample_watch import EXIT_NO_VALID_SAMPLES
from learner.serve.security import LearnerCurve
from learner.state.checkpoint import EXIT_CHECKPOINT_FAILED, warm_save_imports
from learner.state.run_dir import claim
from learner.train.distributed import make_trainer
from protocol.plumbing.process import cancel_all, supervise, wait_event
from protocol.plumbing.sockets import advertised_host, bind, make_socket
from protocol.plumbing.stacks import dump_stacks, install_stack_dump, stacks_dir
from protocol.plumbing.unfinished import UnfinishedGuard

CLOSE_LINGER_MS = 1000
"""At exit, how long queued messages to rollout servers may still take to leave."""

EXIT_DIVERGED = 6
"""Exit code of a learner whose model stopped training: ``algorithm.max_consecutive_skips`` steps
skipped in a row, or an update that broke the weights with nothing to roll back to."""


def _run_state(name: str, writable: bool = True) -> property:
    """A service attribute that is the field ``name`` of its :class:`RunState` (one holder)."""
    def get(self):
        return getattr(self.state, name)

    def put(self, value) -> None:
        setattr(self.state, name, value)
    return property(get, put if writable else None)


class LearnerService:
    """One learner process. ``await run()`` serves until the last step (or ``stop``); returns the
    exit code. ``ready`` is set once every socket is bound and the model is loaded."""

    def __init__(self, cfg: LearnerConfig, model_path: str, run_id: str | None = None,
                 resume: str | None = None):
        self.cfg = cfg
        self.model_path = model_path
        self.resume = resume                  # --resume: "latest" or a checkpoint directory
        self.run_dir = Path(cfg.run_dir)
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()          # every socket bound, the model loaded
        self.finished = False
        self.no_valid_samples: str | None = None
        """Why the sample watch gave up on the servers' results: the run stops, exit EXIT_NO_VALID_SAMPLES."""
        self.diverged: str | None = None
        """Why the model stopped training (max_consecutive_skips skips in a row, or an update that
        broke the weights with no copy to roll back to): the run stops, exit EXIT_DIVERGED."""
        self.trainer = None
        self.runtime: dict = {}
        """Where and in what precision the trainer computes, and why (learner.train.devices.Runtime)."""
        self.ctx: zmq.asyncio.Context | None = None
        self.curve: LearnerCurve | None = None
        self.sockets: dict[str, RouterSocket] = {}
        # Every component, built by the composition root (learner.app); this process is their
        # LearnerProcess port. The run id: the given one, or new (a resume replaces it in _load).
        p = assemble(cfg, run_id=run_id or f"{self.run_dir.name}-{uuid.uuid4().hex[:6]}", process=self)
        self.state, self.log, self.metrics, self.thread = p.state, p.log, p.metrics, p.thread
        self.staleness, self.buffer, self.weights, self.endpoints = p.staleness, p.buffer, p.weights, p.endpoints
        self.link, self.offers, self.admission, self.publisher = p.link, p.offers, p.admission, p.publisher
        self.checkpoints, self.rollout_log, self.records = p.checkpoints, p.rollout_log, p.records
        self.sample_watch, self.control, self.waiting = p.sample_watch, p.control, p.waiting
        self.watchdog, self.http = p.watchdog, p.http
        self.parts = p
        # What needs the model (learner.app.assemble_model), once it is loaded (_load).
        self.intake: Intake | None = None
        self.prompts: PromptSource | None = None
        self.evaluation: Evaluation | None = None
        self.batches: Batches | None = None
        self.ingress: ResultIngress | None = None
        self.loop: TrainLoop | None = None

    # ---- main ------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        remove_stacks = install_stack_dump("learner", stacks_dir(self.run_dir / "stacks"), self.log)
        tasks: list[asyncio.Task] = []
        try:
            self._open()                      # ports first: a taken port fails before the model loads
            # On the train thread, like every step: the process's torch work on one thread (see
            # learner.app: the train thread).
            await self.thread.run(self._load)
            # Version 0 is published too: a server still holding another run's weights (this
            # learner started without --resume) must find something to fetch (learner.serve.admission).
            await self.publish()
            self.records.open(self.run_dir, self.cfg.metrics_sinks, config=self.cfg.model_dump(mode="json"))
            self.checkpoints.mark_resumed(self.records.trained_ids)
            if self.rollout_log is not None:      # after a resume: untrained samples come back
                await self.rollout_log.open(self.checkpoints.resumed_from)
            (self.run_dir / "learner.json").write_text(json.dumps(self.endpoint_file()))
            rollout, weights, control = (self.sockets[n] for n in ("rollout", "weights", "control"))
            train = asyncio.create_task(self.train(), name="train")
            tasks = [train,
                     asyncio.create_task(rollout.serve(self.on_rollout, idle=self.ingress.flush),
                                         name="rollout"),
                     asyncio.create_task(weights.serve(self.weights.handle), name="weights"),
                     asyncio.create_task(control.serve(self.control.handle, control_error_reply),
                                         name="control"),
                     asyncio.create_task(self.expiry_loop(), name="expiry")]
            self.ready.set()
            self.log("ready", **self.endpoint_file())
            self.watchdog.start()
            done, error = await supervise(tasks, self.stopping, self.log)
            code = 1 if error is not None else 0
            if train in done and error is None and self.diverged is None:
                await self.finish()
                code = EXIT_CHECKPOINT_FAILED if self.checkpoints.failed_stop else code
                if not self.cfg.exit_on_finish:
                    self.log("idle", reason="finished; serving metrics and control until stopped")
                    await self.stopping.wait()
            elif error is None:               # stopped: the step in progress ends, then a checkpoint
                self.control.release()        # a paused train loop (ctl pause) must see the stop
                code = await self.checkpoints.on_stop(train)
                if self.no_valid_samples is not None and code == 0:
                    code = EXIT_NO_VALID_SAMPLES
                if self.diverged is not None and code == 0:
                    code = EXIT_DIVERGED
                # Servers stop generating for this run at once (nothing more will be trained);
                # they stay up and re-join when the learner comes back with --resume.
                await self.admission.broadcast(protocol.Error(
                    code="learner_stopping", message=f"run {self.run_id} stopped at version "
                    f"{self.version}; resumable from its latest checkpoint"))
        finally:
            self.stopping.set()
            self.watchdog.stop()
            await cancel_all(tasks)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            remove_stacks()
            self._close()
            self.records.close()
            if self.rollout_log is not None:
                self.rollout_log.close()
        self.log("stopped", exit_code=code)
        return code

    # ---- the LearnerProcess port (learner.app): what components ask of the process ----------
    def expected_wait(self) -> str | None:
        """Why no step is due now (not a stall), or None."""
        if self.stopping.is_set():
            return "stopping"
        if self.finished or self.version >= self.cfg.total_steps:
            return "finished"
        if self.control.paused:
            return "paused (slipstream ctl resume)"
        return None

    def stale_ranks(self) -> list[dict]:
        """DeepSpeed worker ranks that stopped beating (learner.train.ds_group.RankBeat)."""
        group = getattr(getattr(self.trainer, "strategy", None), "group", None)
        if group is None or group.world < 2:
            return []
        from learner.train.ds_group import stale_ranks
        return stale_ranks(self.run_dir / "ranks", group.world)

    def dump_stacks(self) -> dict:
        """``ctl stacks``: this process's threads and tasks, written where SIGUSR1 writes them."""
        path = dump_stacks(stacks_dir(self.run_dir / "stacks"), "learner", asyncio.get_running_loop())
        self.log("stacks_written", path=str(path))
        return {"path": str(path)}

    def stop(self) -> None:
        """Stop as for SIGTERM (``ctl stop``)."""
        self.stopping.set()

    def has_reference(self) -> bool:
        """Whether the trainer holds a reference policy (``ctl set kl.coef`` needs one)."""
        return getattr(self.trainer, "reference", None) is not None

    def _diverge(self, reason: str) -> None:
        """The model stopped training (:attr:`diverged`): stop as for ``ctl stop`` (a checkpoint,
        unless the weights are broken), exit :data:`EXIT_DIVERGED`, and say why on one line."""
        self.diverged = reason
        self.log("diverged", level="error", reason=reason)
        print(f"slipstream learner: stopping: {reason}", file=sys.stderr, flush=True)
        self.stopping.set()

    def stop_no_valid_samples(self, reason: str) -> None:
        """The sample watch gave up on the servers' results: stop as for ``ctl stop`` (a
        checkpoint), exit :data:`EXIT_NO_VALID_SAMPLES`, and say why on one line."""
        self.no_valid_samples = reason
        self.log("no_valid_samples", level="error", reason=reason)
        print(f"slipstream learner: stopping: {reason}", file=sys.stderr, flush=True)
        self.stopping.set()

    def _open(self) -> None:
        cfg = self.cfg
        self.ctx = zmq.asyncio.Context()
        if cfg.security.curve:     # the ZAP handler runs before any socket binds
            self.curve = LearnerCurve(cfg.security, self.ctx,
                                      on_denied=self.metrics.denied)
        specs = (("rollout", cfg.network.rollout_port, cfg.network.max_message_bytes, cfg.network.send_hwm),
                 ("weights", cfg.network.weights_port, cfg.network.weights_max_message_bytes, cfg.network.weights_send_hwm),
                 ("control", cfg.network.control_port, cfg.network.control_max_message_bytes, cfg.network.send_hwm))
        host = cfg.network.advertise_host or advertised_host(cfg.network.bind_host)
        for name, port, max_bytes, hwm in specs:
            sock = make_socket(self.ctx, zmq.ROUTER, max_message_bytes=max_bytes, hwm=hwm,
                               curve=self.curve.server(name) if self.curve else None)
            if name == "rollout":
                # A restarted server (same server_id, so the same identity) takes over at once,
                # even while the dead process's connection has not timed out yet.
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            router = self.sockets[name] = RouterSocket(sock, name, self.metrics, self.log)
            if name == "rollout":
                self.link.socket = router         # the Sender port of admission and the ingress
            router.guard = UnfinishedGuard(sock, name, max_bytes=max_bytes, open_s=cfg.network.unfinished_timeout_s,
                                           curve=self.curve is not None, router=True, on_cut=router.cut)
            port = bind(sock, cfg.network.bind_host, port, f"learner.network.{name}_port")
            self.endpoints[name] = f"tcp://{host}:{port}"
        http_port = self.http.serve(cfg.network.metrics_host, cfg.network.metrics_port, "learner.network.metrics_port")
        base = f"http://{cfg.network.metrics_host}:{http_port}"
        self.endpoints.update(metrics=f"{base}/metrics", healthz=f"{base}/healthz")

    # The run state's fields, read (and counted on) where the service and its tests use them.
    run_id = _run_state("run_id", writable=False)
    version = _run_state("version")
    assignment_counter = _run_state("assignment_counter")

    def _load(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resumed = self.checkpoints.resume(self.resume) if self.resume else None   # verified first
        if resumed is not None:            # before anything reads the run id (evaluation's ids)
            self.checkpoints.load_run_state(resumed, self.state)
        claim(self.run_dir, self.run_id, resumed is not None, self.cfg.checkpoint.dir)  # one run a directory
        # The trainer gets its own copy of the config: ctl set changes self.cfg at once, and the
        # trainer's copy between steps (Control.before_step), so a step never sees half a change.
        self.trainer = make_trainer(TrainerConfig.of(self.cfg), self.model_path)   # DeepSpeed or not
        # Where and in what precision it trains, and why each `auto` chose that: said once here,
        # kept for ctl status and the report (RUN_DIR/runtime.json).
        self.runtime = self.trainer.runtime.describe(self.trainer.model, self.cfg.runtime.attn_implementation)
        self.log("runtime", **self.runtime)
        self._write_runtime()
        self.weights.kind = self.trainer.publish_kind            # full weights or a LoRA adapter
        self.weights.lora = self.trainer.publish_lora()
        m = assemble_model(self.parts, self.cfg, self.trainer)   # learner.app: what needs the model
        self.intake, self.prompts, self.evaluation = m.intake, m.prompts, m.evaluation
        self.batches, self.ingress, self.loop = m.batches, m.ingress, m.loop
        if self.prompts.finite:
            self.log("prompts", **self.prompts.status())
        warm_save_imports()
        if resumed is not None:
            self.checkpoints.apply(resumed, buffered_samples=self.buffer.pending_samples,
                                   leases=len(self.buffer.leases))

    def _close(self) -> None:
        close = getattr(self.trainer, "close", None)      # DeepSpeed: the other ranks exit
        if close is not None:
            close()
        self.thread.executor.shutdown(wait=False)
        self.http.close()
        for name, s in self.sockets.items():
            # The last words to the servers (learner_finished / learner_stopping) get a moment
            # to leave; everything else is dropped at once.
            s.close(linger_ms=CLOSE_LINGER_MS if name == "rollout" else 0)
        self.sockets = {}
        if self.curve is not None:
            self.curve.close()
            self.curve = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None

    def endpoint_file(self) -> dict:
        """learner.json: run id, endpoints, and (with CURVE) the learner's public key, which
        `slipstream ctl` and rollout servers need to connect (it is not a secret)."""
        info = {"run_id": self.run_id, **self.endpoints}
        if self.curve is not None:
            info["curve_public_key"] = self.curve.public_key.decode()
        return info

    def health(self) -> tuple[bool, dict]:
        """/healthz: ok while serving (ready and not stopping)."""
        serving = self.ready.is_set() and not self.stopping.is_set()
        return serving, {"run_id": self.run_id, "version": self.version,
                         "servers": len(self.admission.servers), "stopping": self.stopping.is_set(),
                         "finished": self.finished}

    async def finish(self) -> None:
        """After the last step: save, let servers fetch the last version, tell them the run ended."""
        await self.checkpoints.at_end()
        self.admission.close()
        out = self.run_dir / "final"
        await self.thread.run(self.trainer.save_policy, out)   # the model, or the PEFT adapter
        deadline = time.monotonic() + self.cfg.servers.final_sync_s
        while not self.admission.all_at(self.version) and time.monotonic() < deadline:
            self.admission.versions_changed.clear()
            if not await wait_event(self.admission.versions_changed, deadline - time.monotonic()):
                break
        if self.evaluation is not None:       # the last version's evaluation, if one is open
            await self.evaluation.wait_idle(deadline - time.monotonic())
        await self.admission.broadcast(protocol.Error(code="learner_finished",
                                                      message=f"run {self.run_id} finished"))
        self.finished = True
        self.log("finished", checkpoint=str(out), counters=self.buffer.counters,
                 pending_samples=self.buffer.pending_samples,
                 inflight_samples=self.buffer.inflight_samples, gate=self.buffer.gate.state_dict())

    # ---- training --------------------------------------------------------------------------
    async def train(self) -> None:
        """The train task: the loop's steps; a model that diverged stops the run."""
        reason = await self.loop.run_steps()
        if reason is not None:
            self._diverge(reason)

    async def publish(self) -> float:
        """Publish the current version (the process's first): awaited until announced, so a
        server that connects finds something to fetch; the train loop publishes the rest."""
        wait = await self.publisher.publish(self.version, self.trainer.named_tensors)
        await self.publisher.drain()
        return wait

    def update_gauges(self) -> None:
        """The buffer changed: is a finite dataset used up (learner.loop.Batches)?"""
        if self.batches is not None:
            self.batches.check()

    @property
    def learner_id(self) -> str:
        return self.offers.learner_id

    def sampling(self) -> protocol.SamplingParams:
        """The sampling settings of the next assignment (learner.serve.offers)."""
        return self.offers.sampling()

    async def expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.servers.expiry_interval_s)
            await self.admission.tick()
            self.update_gauges()

    # ---- rollout socket --------------------------------------------------------------------
    async def on_rollout(self, identity: bytes, msg: protocol.Message) -> protocol.Message | None:
        """Route one rollout-socket message to its component; the reply, if any. Results and
        their Acks go through :attr:`ingress`, which holds them until the loop stops reading."""
        a = self.admission
        if self.ingress and type(msg) is not protocol.RolloutResult:
            await self.ingress.flush()            # the held results and Acks go first
        if isinstance(msg, protocol.Hello):
            await a.hello(identity, msg)
            return None
        srv = a.touch(identity)
        if isinstance(msg, (protocol.WorkRequest, protocol.RolloutResult, protocol.Heartbeat,
                            protocol.WeightsApplied, protocol.Error)):
            if srv is None:
                return protocol.Error(code="unknown_server", message="say Hello first")
        else:
            raise protocol.ProtocolError(f"rollout socket: {type(msg).TYPE} is not sent to a learner")
        if isinstance(msg, protocol.RolloutResult):
            await self.ingress.result(identity, srv, msg)
        elif isinstance(msg, protocol.WorkRequest):
            await a.work_request(srv, msg)
            self.update_gauges()
        elif isinstance(msg, protocol.Heartbeat):
            await a.heartbeat(srv, msg)
            # Echoed, so a server can tell a live learner from a hung one (its /healthz).
            return protocol.Heartbeat(sender_id=self.learner_id, version=self.version)
        elif isinstance(msg, protocol.Error):
            code = msg.code if msg.code in SERVER_ERROR_CODES else "other"
            self.metrics.server_errors.labels(code=code).inc()
            if msg.code == "assignment_refused":
                await a.refused(srv, msg.ref_id, msg.message)
            else:
                self.log("server_error", server=srv.server_id, code=msg.code[:100],
                         message=msg.message[:500])
                if msg.code == "weights_failed":
                    await a.weights_failed(srv, msg.message)
        else:
            await a.weights_applied(srv, msg)
        return None

    # ---- control ---------------------------------------------------------------------------
    def _write_runtime(self) -> None:
        """RUN_DIR/runtime.json: this life's :attr:`runtime` (the report's Runtime line); a disk
        that refuses it costs the report that line only."""
        tmp = self.run_dir / ".runtime.json.tmp"
        try:
            tmp.write_text(json.dumps(self.runtime, indent=1) + "\n")
            os.replace(tmp, self.run_dir / "runtime.json")
        except OSError as e:
            self.log("record_failed", level="warning", file=str(self.run_dir / "runtime.json"),
                     error=f"{type(e).__name__}: {e}"[:300], action="the report has no Runtime line")

    def status(self) -> dict:
        watchdog = self.watchdog.status()
        return {"run_id": self.run_id, "version": self.version, "total_steps": self.cfg.total_steps,
                "training": self.loop is not None and self.loop.busy, "runtime": self.runtime,
                "buffered_samples": self.buffer.pending_samples,
                "inflight_samples": self.buffer.inflight_samples,
                "servers": self.admission.status(),
                "weights_versions": self.weights.versions,
                "counters": dict(self.buffer.counters),
                "invalid_samples": dict(self.intake.invalid) if self.intake else {},
                "refused_samples": self.sample_watch.status(),
                "waiting_on": watchdog["waiting_on"], "watchdog": watchdog,
                "prompts": self.prompts.status() if self.prompts else None,
                "evaluation": self.evaluation.status() if self.evaluation else None}


def serve(cfg: LearnerConfig, model_path: str, resume: str | None = None) -> int:
    if cfg.deepspeed is None:
        return asyncio.run(LearnerService(cfg, model_path, resume=resume).run())
    # Several ranks: only rank 0 is the service. The groups are left only after a clean end: a
    # failed run may have a thread stuck in a collective, and its exit code is what matters.
    from learner.train.distributed import worker_main
    from learner.train.ds_group import join_group, leave_group

    group = join_group(cfg.deepspeed)
    if group.rank != 0:
        code = worker_main(cfg, model_path, group)
    else:
        code = asyncio.run(LearnerService(cfg, model_path, resume=resume).run())
    if code == 0:
        leave_group()
    return code
