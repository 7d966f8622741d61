"""The learner's composition root: every component of a learner process is built here, from its
config section and plain collaborators (as torchtitan's ``train.py`` builds its trainer's);
nothing else constructs them (docs/design.md §8).

Two phases, because part of the process can only be built once the model is loaded:

    assemble(cfg, run_id, process)            -> Parts       run state, η, buffer, weights, the
                                                             ports, admission, checkpoints, control,
                                                             records, the watchdog, ...
    assemble_model(parts, cfg, trainer, ...)  -> ModelParts  intake, prompts, evaluation, batches,
                                                             the result ingress, the train loop

Components get typed ports, never callables that reach back into the service: ``Sender``
(learner.serve.admission; the rollout socket, learner.serve.router.RolloutLink), ``Offers``
(learner.serve.offers.LearnerOffers), ``ResultReceiver`` (learner.serve.ingress.IntakePath), and
what the process itself answers, :class:`LearnerProcess` (learner.serve.service.LearnerService
implements it). Live settings are read from their config sections at use time (``ctl set``
changes the sections in place). Tests put their spies on the ports.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from buffer import RolloutBuffer, StalenessController, StalenessLimit
from learner.config import LearnerConfig
from learner.data.evaluation import Evaluation
from learner.data.prompts import MixedSource, PromptSource, open_prompts
from learner.loop import Batches, TrainLoop, TrainThread
from learner.metrics import LearnerMetrics
from learner.serve.admission import Admission
from learner.serve.control import Control
from learner.serve.ingress import IntakePath, ResultIngress
from learner.serve.intake import Intake
from learner.serve.offers import LearnerOffers
from learner.serve.router import RolloutLink
from learner.serve.sample_watch import SampleWatch
from learner.serve.step_records import StepRecords
from learner.serve.waiting import LearnerWaiting
from learner.serve.weights_server import Publisher, WeightsServer
from learner.state.learner_checkpoints import BufferState, LearnerCheckpoints
from learner.state.rollout_log import LearnerRolloutLog
from learner.state.run_state import RunState
from protocol.plumbing.http import HttpEndpoint
from protocol.plumbing.process import EventLog
from protocol.plumbing.stacks import stacks_dir
from protocol.plumbing.watchdog import Watchdog


class LearnerProcess(Protocol):
    """What the components ask of the learner process itself (learner.serve.service): the
    ``ControlledProcess`` of learner.serve.control and the ``WaitingProcess`` of
    learner.serve.waiting, its health, and its stop."""

    stopping: asyncio.Event

    def status(self) -> dict: ...

    def stop(self) -> None: ...

    def dump_stacks(self) -> dict: ...

    def has_reference(self) -> bool: ...

    def expected_wait(self) -> str | None: ...

    def stale_ranks(self) -> list[dict]: ...

    def health(self) -> tuple[bool, dict]: ...

    def stop_no_valid_samples(self, reason: str) -> None:
        """The sample watch gave up on the servers' results (learner.serve.sample_watch)."""
        ...


@dataclass
class Parts:
    """A learner process's components before the model loads (the service's attributes)."""

    state: RunState
    log: EventLog
    metrics: LearnerMetrics
    thread: TrainThread
    staleness: StalenessLimit
    buffer: RolloutBuffer
    weights: WeightsServer
    endpoints: dict[str, str]
    link: RolloutLink
    checkpoints: LearnerCheckpoints
    rollout_log: LearnerRolloutLog | None
    offers: LearnerOffers
    admission: Admission
    publisher: Publisher
    sample_watch: SampleWatch
    records: StepRecords
    control: Control
    waiting: LearnerWaiting
    watchdog: Watchdog
    http: HttpEndpoint


@dataclass
class ModelParts:
    """What needs the loaded model: its vocabulary, its tokenizer, the trainer itself."""

    intake: Intake
    prompts: PromptSource | MixedSource
    evaluation: Evaluation | None
    batches: Batches
    ingress: ResultIngress
    loop: TrainLoop


def staleness_limit(cfg: LearnerConfig) -> StalenessLimit:
    """η's one owner (buffer.staleness): ctl, the adaptive controller and a resume set it there."""
    s = cfg.staleness
    controller = None if s.controller == "fixed" else StalenessController(
        min_staleness=s.min_staleness, ess_min=s.ess_min, mismatch_kl_max=s.mismatch_kl_max,
        ess_recover=s.ess_recover, mismatch_kl_recover=s.mismatch_kl_recover, recover_steps=s.recover_steps)
    return StalenessLimit(s.max_staleness, controller=controller)


def assemble(cfg: LearnerConfig, *, run_id: str, process: LearnerProcess) -> Parts:
    """The process's components, wired; nothing runs yet."""
    state = RunState(run_id)              # a resume loads its fields first (LearnerService._load)
    log = EventLog("learner", run_id=state.current_run_id, version=state.current_version)
    metrics = LearnerMetrics()
    # The model's load, every step, the checkpoints' tensor copies and the final save on one
    # thread: torch's OpenMP pool belongs to the thread that calls into it, and a second team
    # (steps hopping between the default executor's threads, or the model loaded on the event
    # loop's thread) slowed every step at learner.threads 2 to 2.2x (0.181 against 0.083 s at
    # eta 0 on 2 cores). At one thread there is no pool and no difference.
    thread = TrainThread(ThreadPoolExecutor(1, thread_name_prefix="slipstream-train"))
    staleness = staleness_limit(cfg)
    buffer = RolloutBuffer(batch_samples=cfg.batch.batch_samples, group_size=cfg.batch.group_size,
                           max_staleness=staleness, stale_policy=cfg.staleness.stale_policy,
                           lease_timeout_s=cfg.servers.lease_timeout_s, max_attempts=cfg.servers.max_attempts,
                           dedupe_window=cfg.servers.dedupe_window, length_bucketing=cfg.batch.length_bucketing,
                           drop_uniform_groups=cfg.batch.dynamic_sampling)
    metrics.watch_buffer(buffer)
    weights = WeightsServer(cfg.weights.chunk_bytes, metrics=metrics, delta=cfg.weights.delta)
    endpoints: dict[str, str] = {}        # filled as the sockets bind (LearnerService._open)
    link = RolloutLink()
    checkpoints = LearnerCheckpoints(cfg.checkpoint, cfg.run_dir, run=state, metrics=metrics, log=log,
                                     stopping=process.stopping, executor=thread.executor)
    rollout_log = None if cfg.rollout_log is None else LearnerRolloutLog(
        cfg.rollout_log, cfg.run_dir, run=state, buffer=buffer, metrics=metrics, log=log)
    offers = LearnerOffers(cfg, state, weights, endpoints, rollout_log)
    admission = Admission(buffer, link, offers, version=state.current_version, servers=cfg.servers,
                          metrics=metrics, log=log, relay_fanout=cfg.weights.relay_fanout,
                          delta_ratio=weights.delta_ratio)
    # Checksums, install and announcement beside the next step (learner.serve.weights_server).
    publisher = Publisher(weights, admission, stopped=process.stopping.is_set, metrics=metrics,
                          log=log)
    sample_watch = SampleWatch(metrics=metrics, on_stop=process.stop_no_valid_samples, servers=cfg.servers,
                               batch=cfg.batch, log=log)
    records = StepRecords(run=state, metrics=metrics, log=log, buffer=buffer, admission=admission,
                          algorithm=cfg.algorithm, clock=time.time, on_write_failure=checkpoints.write_failed)
    control = Control(cfg, buffer, metrics=metrics, staleness=staleness, process=process,
                      admission=admission, checkpoints=checkpoints, records=records, log=log)
    # No step for a while: one line saying what the learner waits on (learner.serve.waiting).
    waiting = LearnerWaiting(admission=admission, buffer=buffer, sample_watch=sample_watch,
                             checkpoints=checkpoints, batch=cfg.batch, endpoints=endpoints, process=process)
    watchdog = Watchdog("learner", noun="step", diagnose=waiting, log=log, settings=cfg.watchdog,
                        stacks=stacks_dir(Path(cfg.run_dir) / "stacks"))
    watchdog.export(metrics.stalled_seconds, metrics.waiting_on)
    http = HttpEndpoint(metrics.render, process.health, on_error=metrics.http_error)
    return Parts(state=state, log=log, metrics=metrics, thread=thread, staleness=staleness, buffer=buffer,
                 weights=weights, endpoints=endpoints, link=link, checkpoints=checkpoints,
                 rollout_log=rollout_log, offers=offers, admission=admission, publisher=publisher,
                 sample_watch=sample_watch, records=records, control=control, waiting=waiting,
                 watchdog=watchdog, http=http)


def vocab_size(trainer: Any) -> int:
    """Rows of the policy's input embedding (``Trainer.vocab_size``, or read from the model)."""
    size = getattr(trainer, "vocab_size", None)
    return int(size) if size is not None else int(trainer.model.get_input_embeddings().num_embeddings)


def assemble_results(p: Parts, cfg: LearnerConfig, *, intake: Any, prompts: Any,
                     evaluation: Evaluation | None) -> tuple[Batches, ResultIngress]:
    """The way results go in (the ingress, the intake path) and batches come out."""
    batches = Batches(p.buffer, prompts, cfg.batch)
    ingress = ResultIngress(receiver=IntakePath(intake, p.rollout_log), link=p.link, admission=p.admission,
                            batches=batches, batch=cfg.batch, evaluation=evaluation,
                            hold=p.rollout_log is None)
    return batches, ingress


def assemble_model(p: Parts, cfg: LearnerConfig, trainer: Any) -> ModelParts:
    """What needs the loaded ``trainer``, wired into ``p`` (admission's side work, the offers'
    prompts, the checkpoint's parts); on the train thread (the prompts are tokenized here)."""
    intake = Intake(p.buffer, vocab_size=vocab_size(trainer), sampling=cfg.sampling, servers=cfg.servers,
                    version=p.state.current_version, metrics=p.metrics, log=p.log,
                    release=p.admission.release_invalid, watch=p.sample_watch,
                    distrusted=p.admission.distrusted)
    # The prompt stream (and the eval prompts), formatted and tokenized once with the policy's
    # tokenizer (learner.data.prompts).
    tok, encode = trainer.tokenizer, trainer.encode_prompt
    prompts = open_prompts(cfg.data, seed=cfg.seed, batch_prompts=cfg.batch.batch_prompts,
                           tokenizer=tok, encode=encode, on_skip=p.metrics.prompt_skipped)
    evaluation = None
    if cfg.evaluation.every:              # its work joins dispatch through Admission.side_work
        evaluation = Evaluation.from_config(
            cfg.evaluation, cfg.data, seed=cfg.seed, max_new_tokens=cfg.sampling.max_new_tokens,
            stop=cfg.sampling.stop, stop_token_ids=cfg.sampling.stop_token_ids,
            max_turns=cfg.sampling.max_turns, max_episode_tokens=cfg.sampling.episode_tokens,
            lease_timeout_s=cfg.servers.lease_timeout_s, tokenizer=tok, encode=encode,
            run_id=p.state.run_id, version=p.state.current_version, metrics=p.metrics,
            record=p.records.eval_round, log=p.log, distrusted=p.admission.distrusted)
        p.admission.side_work = evaluation
    p.offers.prompts = prompts
    batches, ingress = assemble_results(p, cfg, intake=intake, prompts=prompts, evaluation=evaluation)
    loop = TrainLoop(cfg, run=p.state, trainer=trainer, thread=p.thread, batches=batches,
                     checkpoints=p.checkpoints, control=p.control, publisher=p.publisher,
                     staleness=p.staleness, records=p.records, admission=p.admission,
                     rollout_log=p.rollout_log, evaluation=evaluation, waiting=p.waiting,
                     watchdog=p.watchdog, log=p.log)
    p.checkpoints.attach(trainer, {       # state.json's parts besides the run state
        "data": prompts, "buffer": BufferState(p.buffer, cfg.staleness)})
    return ModelParts(intake=intake, prompts=prompts, evaluation=evaluation, batches=batches,
                      ingress=ingress, loop=loop)
