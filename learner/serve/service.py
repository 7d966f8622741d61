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

Components, each unit-tested without sockets or a model:

    Admission      servers, credits, dispatch, re-issue, expiry, the lag rule (learner.serve.admission)
    Intake         checks every sample against the run before the buffer sees it (learner.serve.intake)
    SampleWatch    failed and refused samples counted, reported; no valid one stops the run
                   (learner.serve.sample_watch)
    WeightsServer  versions published, chunks served (learner.serve.weights_server)
    Control        ctl commands and their validation (learner.serve.control)
    ResultIngress  results in bursts and their Acks (learner.serve.ingress)
    StepRecords    metrics.jsonl, trained_ids.jsonl, sinks, step gauges (learner.serve.step_records)
    RunState       run id, version, assignment counter (learner.state.run_state)

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import zmq
import zmq.asyncio

import protocol
from buffer import RolloutBuffer, StalenessController, StalenessLimit
from learner.config import LearnerConfig, TrainerConfig
from learner.data.evaluation import Evaluation
from learner.data.prompts import PromptSource
from learner.loop import Batches, TrainLoop, TrainThread
from learner.metrics import SERVER_ERROR_CODES, LearnerMetrics
from learner.serve.admission import Admission
from learner.serve.control import Control, control_error_reply
from learner.serve.ingress import ResultIngress
from learner.serve.intake import Intake
from learner.serve.router import RouterSocket
from learner.serve.sample_watch import EXIT_NO_VALID_SAMPLES, SampleWatch
from learner.serve.security import LearnerCurve
from learner.serve.step_records import StepRecords
from learner.serve.waiting import LearnerWaiting
from learner.serve.weights_server import Publisher, WeightsServer
from learner.state.checkpoint import EXIT_CHECKPOINT_FAILED, warm_save_imports
from learner.state.learner_checkpoints import BufferState, LearnerCheckpoints
from learner.state.rollout_log import LearnerRolloutLog, RolloutLogFailed
from learner.state.run_dir import claim
from learner.state.run_state import RunState
from learner.train.distributed import make_trainer
from protocol.plumbing.http import HttpEndpoint
from protocol.plumbing.process import EventLog, cancel_all, supervise, trace, wait_event
from protocol.plumbing.sockets import advertised_host, bind, make_socket
from protocol.plumbing.stacks import dump_stacks, install_stack_dump, stacks_dir
from protocol.plumbing.unfinished import UnfinishedGuard
from protocol.plumbing.watchdog import Watchdog


def vocab_size(trainer) -> int:
    """Rows of the policy's input embedding (``Trainer.vocab_size``, or read from the model)."""
    size = getattr(trainer, "vocab_size", None)
    return int(size) if size is not None else int(trainer.model.get_input_embeddings().num_embeddings)


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
        # The run id, the policy version and the assignment counter (a resume loads them first).
        self.state = RunState(run_id or f"{Path(cfg.run_dir).name}-{uuid.uuid4().hex[:6]}")
        self.run_dir = Path(cfg.run_dir)
        self.log = EventLog("learner", run_id=self.state.current_run_id, version=self.state.current_version)
        self.metrics = LearnerMetrics()
        # The model's load, every step, the checkpoints' tensor copies and the final save on one
        # thread: torch's OpenMP pool belongs to the thread that calls into it, and a second
        # team (steps hopping between the default executor's threads, or the model loaded on the
        # event loop's thread) slowed every step at learner.threads 2 to 2.2x (0.181 against
        # 0.083 s at eta 0 on 2 cores). At one thread there is no pool and no difference.
        self.train_thread = ThreadPoolExecutor(1, thread_name_prefix="slipstream-train")
        self.thread = TrainThread(self.train_thread)
        # η's one owner (buffer.staleness): ctl, the adaptive controller and a resume set it there.
        self.staleness = StalenessLimit(cfg.staleness.max_staleness, controller=None if (
            cfg.staleness.controller == "fixed") else StalenessController(
            min_staleness=cfg.staleness.min_staleness, ess_min=cfg.staleness.ess_min,
            mismatch_kl_max=cfg.staleness.mismatch_kl_max, ess_recover=cfg.staleness.ess_recover,
            mismatch_kl_recover=cfg.staleness.mismatch_kl_recover,
            recover_steps=cfg.staleness.recover_steps))
        self.buffer = RolloutBuffer(batch_samples=cfg.batch.batch_samples, group_size=cfg.batch.group_size,
                                    max_staleness=self.staleness, stale_policy=cfg.staleness.stale_policy,
                                    lease_timeout_s=cfg.servers.lease_timeout_s,
                                    max_attempts=cfg.servers.max_attempts,
                                    dedupe_window=cfg.servers.dedupe_window,
                                    length_bucketing=cfg.batch.length_bucketing)
        # Read at each scrape, not set after every result (two locked sets per message).
        self.metrics.buffered.set_function(lambda: self.buffer.pending_samples)
        self.metrics.inflight.set_function(lambda: self.buffer.inflight_samples)
        self.prompts: PromptSource | None = None      # built in _load: it needs the tokenizer
        self.evaluation: Evaluation | None = None     # eval_every > 0 (learner.data.evaluation)
        self.batches: Batches | None = None           # the train loop's batches (built in _load)
        self.loop: TrainLoop | None = None            # the policy steps (learner.loop), once loaded
        self.weights = WeightsServer(cfg.weights.chunk_bytes)
        self.publisher = Publisher(   # checksums, install and announcement beside the next step
            self.weights, lambda m: self.admission.announce(m), stopped=lambda: self.stopping.is_set(),
            observe_wait=self.metrics.publish_wait_seconds.observe,
            observe_latency=self.metrics.publish_seconds.observe, on_superseded=self._superseded)
        self.trainer = None
        self.runtime: dict = {}
        """Where and in what precision the trainer computes, and why (learner.train.devices.Runtime)."""
        self.intake: Intake | None = None
        self.assignment_counter = 0
        self.stopping = asyncio.Event()
        self.checkpoints = LearnerCheckpoints(
            cfg.checkpoint, cfg.run_dir, run=self.state, metrics=self.metrics,
            log=lambda event, **fields: self.log(event, **fields), stopping=self.stopping,
            executor=self.train_thread,
            before_stop=lambda: self.control.resumed.set())   # a paused train loop must see a stop
        self.rollout_log = None if cfg.rollout_log is None else LearnerRolloutLog(
            cfg.rollout_log, cfg.run_dir, run=self.state, buffer=self.buffer, metrics=self.metrics,
            log=lambda event, **fields: self.log(event, **fields),
            resumed_from=lambda: self.checkpoints.resumed_from)
        self.ready = asyncio.Event()
        self.finished = False
        self.endpoints: dict[str, str] = {}
        self.http = HttpEndpoint(self.metrics.render, self.health, on_error=lambda status: (
            self.metrics.protocol_errors.labels(socket="http").inc()))
        self.ctx: zmq.asyncio.Context | None = None
        self.curve: LearnerCurve | None = None
        self.sockets: dict[str, RouterSocket] = {}
        self.admission = Admission(
            self.buffer, self._send_rollout, self._new_assignment, version=self.state.current_version,
            welcome=self._welcome, metrics=self.metrics, log=self.log,
            server_timeout_s=cfg.servers.server_timeout_s, reannounce_s=cfg.servers.reannounce_s,
            weights_failure_limit=cfg.servers.weights_failure_limit,
            max_inflight=lambda: self.cfg.servers.max_inflight_per_server,
            max_servers=cfg.servers.max_servers, initial_allowance=cfg.servers.initial_allowance,
            silent_factor=cfg.servers.silent_factor, silent_min_s=cfg.servers.silent_min_s,
            trial_share=cfg.servers.trial_share)
        # Failed and refused samples: counted, reported, and the run stopped when none is valid.
        self.no_valid_samples: str | None = None
        self.diverged: str | None = None
        """Why the model stopped training (max_consecutive_skips skips in a row, or an update that
        broke the weights with no copy to roll back to): the run stops, exit EXIT_DIVERGED."""
        self.sample_watch = SampleWatch(
            metrics=self.metrics, log=self.log, on_stop=self._no_valid_samples,
            timeout_s=lambda: self.cfg.servers.no_valid_sample_timeout_s,
            max_share=lambda: self.cfg.servers.max_refused_share,
            window=lambda: self.cfg.servers.refused_share_window)
        self.ingress = ResultIngress(    # results in bursts, their Acks when the loop stops reading
            # (looked up at each call: tests and benchmarks put spies on the service's methods)
            receive=lambda msg: self.receive_result(msg), evaluation=lambda: self.evaluation,
            group_size=lambda: self.cfg.batch.group_size, hold=lambda: self.rollout_log is None,
            send=lambda identity, msg: self._send_rollout(identity, msg),
            lose=lambda srv: self.admission.lose(srv, "unreachable"),
            after=lambda: self.update_gauges(), dispatch=lambda: self.admission.dispatch())
        self.records = StepRecords(
            run=self.state, metrics=self.metrics, log=self.log, buffer=self.buffer,
            admission=self.admission, sanity_tolerances=lambda: (self.cfg.algorithm.sanity_ratio_tolerance, self.cfg.algorithm.sanity_kl_tolerance),
            clock=time.time, on_write_failure=lambda e: self.checkpoints.write_failed(e))
        self.control = Control(cfg, self.buffer, staleness=self.staleness, metrics=self.metrics, status=self.status,
                               stop=self.stopping.set, after_set=self.admission.dispatch,
                               pause=lambda paused: setattr(self.admission, "paused", paused),
                               has_reference=lambda: getattr(self.trainer, "reference", None) is not None,
                               checkpoint=self.checkpoints.request, stacks=self._dump_stacks,
                               log=self._control_log)

        # No step for a while: one line saying what the learner waits on (learner.serve.waiting).
        self.waiting = LearnerWaiting(
            admission=self.admission, buffer=self.buffer, sample_watch=self.sample_watch,
            checkpoints=self.checkpoints, batch_samples=lambda: self.cfg.batch.batch_samples,
            endpoint=lambda: self.endpoints.get("rollout", "?"), expected=self._expected_wait,
            ranks=self._stale_ranks)
        self.watchdog = Watchdog(
            "learner", noun="step", diagnose=self.waiting, log=self.log,
            stall_s=lambda: self.cfg.watchdog.stall_s, dump_after_s=lambda: self.cfg.watchdog.dump_after_s,
            abort_after_s=lambda: self.cfg.watchdog.abort_after_s,
            dump=lambda: dump_stacks(stacks_dir(self.run_dir / "stacks"), "learner", self.watchdog.loop))
        self.watchdog.export(self.metrics.stalled_seconds, self.metrics.waiting_on)

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
            # train_thread).
            await self.thread.run(self._load)
            self.loop = self._train_loop()
            # Version 0 is published too: a server still holding another run's weights (this
            # learner started without --resume) must find something to fetch (learner.serve.admission).
            await self.publish()
            self.records.open(self.run_dir, self.cfg.metrics_sinks)
            self.checkpoints.mark_resumed(self.records.trained_ids)
            if self.rollout_log is not None:      # after a resume: untrained samples come back
                await self.rollout_log.open()
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

    def _expected_wait(self) -> str | None:
        """Why no step is due now (not a stall), or None."""
        if self.stopping.is_set():
            return "stopping"
        if self.finished or self.version >= self.cfg.total_steps:
            return "finished"
        if self.control.paused:
            return "paused (slipstream ctl resume)"
        return None

    def _stale_ranks(self) -> list[dict]:
        """DeepSpeed worker ranks that stopped beating (learner.train.ds_group.RankBeat)."""
        group = getattr(getattr(self.trainer, "strategy", None), "group", None)
        if group is None or group.world < 2:
            return []
        from learner.train.ds_group import stale_ranks
        return stale_ranks(self.run_dir / "ranks", group.world)

    def _dump_stacks(self) -> dict:
        """``ctl stacks``: this process's threads and tasks, written where SIGUSR1 writes them."""
        path = dump_stacks(stacks_dir(self.run_dir / "stacks"), "learner", asyncio.get_running_loop())
        self.log("stacks_written", path=str(path))
        return {"path": str(path)}

    def _control_log(self, event: str, **fields) -> None:
        """Control's events; a ``ctl set`` is also a metrics.jsonl row (the report's markers)."""
        self.log(event, **fields)
        if event == "control_set" and self.records.jsonl is not None:
            self.records.control(fields)

    def _diverge(self, reason: str) -> None:
        """The model stopped training (:attr:`diverged`): stop as for ``ctl stop`` (a checkpoint,
        unless the weights are broken), exit :data:`EXIT_DIVERGED`, and say why on one line."""
        self.diverged = reason
        self.log("diverged", level="error", reason=reason)
        print(f"slipstream learner: stopping: {reason}", file=sys.stderr, flush=True)
        self.stopping.set()

    def _no_valid_samples(self, reason: str) -> None:
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
                                      on_denied=lambda s: self.metrics.auth_denied.labels(socket=s).inc())
        specs = (("rollout", cfg.network.rollout_port, cfg.network.max_message_bytes, cfg.network.send_hwm),
                 ("weights", cfg.network.weights_port, cfg.network.weights_max_message_bytes, cfg.network.weights_send_hwm),
                 ("control", cfg.network.control_port, cfg.network.control_max_message_bytes, cfg.network.send_hwm))
        host = advertised_host(cfg.network.bind_host)
        for name, port, max_bytes, hwm in specs:
            sock = make_socket(self.ctx, zmq.ROUTER, max_message_bytes=max_bytes, hwm=hwm,
                               curve=self.curve.server(name) if self.curve else None)
            if name == "rollout":
                # A restarted server (same server_id, so the same identity) takes over at once,
                # even while the dead process's connection has not timed out yet.
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            router = self.sockets[name] = RouterSocket(sock, name, self.metrics, self.log)
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
        self.intake = Intake(self.buffer, vocab_size=vocab_size(self.trainer),
                             max_new_tokens=lambda: self.cfg.sampling.max_new_tokens,
                             max_abs_reward=lambda: self.cfg.servers.max_abs_reward,
                             version=self.state.current_version, metrics=self.metrics, log=self.log,
                             release=self.admission.release_invalid, watch=self.sample_watch)
        self._load_prompts()
        staleness = self.cfg.staleness
        self.checkpoints.attach(self.trainer, {          # state.json's parts besides the run state
            "data": self.prompts,
            "buffer": BufferState(self.buffer, lambda: (staleness.max_staleness, staleness.stale_policy))})
        warm_save_imports()
        if resumed is not None:
            self.checkpoints.apply(resumed, buffered_samples=self.buffer.pending_samples,
                                   leases=len(self.buffer.leases))

    def _load_prompts(self) -> None:
        """The prompt stream (and the eval prompts), formatted and tokenized once with the policy's
        tokenizer (learner.data.prompts); eval work joins dispatch through Admission.side_work."""
        tok, encode = self.trainer.tokenizer, self.trainer.encode_prompt
        cfg = self.cfg
        self.prompts = PromptSource.from_config(
            cfg.data, seed=cfg.seed, batch_prompts=cfg.batch.batch_prompts, tokenizer=tok, encode=encode,
            on_skip=lambda reason, n: self.metrics.prompts_skipped.labels(reason=reason).inc(n))
        if cfg.evaluation.every:
            self.evaluation = Evaluation.from_config(
                cfg.evaluation, cfg.data, seed=cfg.seed, max_new_tokens=cfg.sampling.max_new_tokens,
                lease_timeout_s=cfg.servers.lease_timeout_s, tokenizer=tok, encode=encode, run_id=self.run_id,
                version=self.state.current_version, metrics=self.metrics, record=self.records.eval_round,
                log=self.log)
            self.admission.side_work = self.evaluation
        self.batches = Batches(self.buffer, self.prompts, cfg.batch)
        if self.prompts.finite:
            self.log("prompts", **self.prompts.status())

    def _close(self) -> None:
        close = getattr(self.trainer, "close", None)      # DeepSpeed: the other ranks exit
        if close is not None:
            close()
        self.train_thread.shutdown(wait=False)
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
    def _train_loop(self) -> TrainLoop:
        """The policy steps (learner.loop), once the trainer and the prompts exist."""
        return TrainLoop(self.cfg, run=self.state, trainer=self.trainer, thread=self.thread,
                         batches=self.batches, checkpoints=self.checkpoints, control=self.control,
                         publisher=self.publisher, staleness=self.staleness, records=self.records,
                         admission=self.admission, rollout_log=self.rollout_log,
                         evaluation=self.evaluation, waiting=self.waiting, watchdog=self.watchdog,
                         log=self.log)

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

    def _superseded(self, version: int, by: int) -> None:
        self.metrics.publish_superseded.inc()
        self.log("weights_superseded", weights_version=version, by=by,
                 hint="steps finish faster than a publish is prepared; servers get the newer one")

    def update_gauges(self) -> None:
        """The buffer changed: is a finite dataset used up (learner.loop.Batches)?"""
        if self.batches is not None:
            self.batches.check()

    # ---- admission plumbing ----------------------------------------------------------------
    async def _send_rollout(self, identity: bytes, message: protocol.Message) -> bool:
        return await self.sockets["rollout"].send(identity, message)

    def _welcome(self) -> protocol.Welcome:
        return protocol.Welcome(learner_id=self.learner_id, run_id=self.run_id,
                                version=self.version, weights_endpoint=self.endpoints["weights"],
                                weights_kind=self.weights.kind)

    @property
    def learner_id(self) -> str:
        return f"learner-{os.getpid()}"

    def sampling(self) -> protocol.SamplingParams:
        cfg = self.cfg
        return protocol.SamplingParams(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=0,
                                       max_new_tokens=cfg.sampling.max_new_tokens)

    def _new_assignment(self) -> protocol.Assignment | None:
        p = next(self.prompts, None)
        while self.rollout_log is not None and p is not None:   # ids (and prompts) restored
            skip_id, skip_prompt = self.rollout_log.passed_over(
                f"{self.run_id}-a{self.assignment_counter + 1}", p["prompt_token_ids"])
            if not skip_id:
                break
            self.assignment_counter += 1
            if skip_prompt:
                p = next(self.prompts, None)
        if p is None:
            return None                       # a finite dataset is used up (learner.data.prompts)
        self.assignment_counter += 1
        return protocol.Assignment(
            assignment_id=f"{self.run_id}-a{self.assignment_counter}", prompt_id=p["prompt_id"],
            prompt_token_ids=p["prompt_token_ids"], group_size=self.cfg.batch.group_size,
            version=self.version, prompt_text=p["prompt"], sampling=self.sampling(),
            metadata={"answer": p["answer"], **p.get("metadata", {})},
            deadline_s=self.cfg.servers.lease_timeout_s)

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

    async def receive_result(self, msg: protocol.RolloutResult) -> protocol.Ack:
        """Intake, then (``rollout_log``) the accepted samples on disk before the Ack may leave;
        RolloutLogFailed when that write failed."""
        trace("learner.result")
        ack = await self.intake.receive(msg)
        if self.rollout_log is not None and not await self.rollout_log.receive(msg, ack):
            raise RolloutLogFailed(msg.server_id)
        return ack

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
