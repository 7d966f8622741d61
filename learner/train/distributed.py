"""The learner on several processes: the policy (and critic) as DeepSpeed engines, data-parallel
(issue 11; the section is ``learner.deepspeed``, learner/train/ds_config.py). It is a strategy
the one :class:`learner.train.trainer.Trainer` is given (:class:`DeepSpeedStrategy`, the
operations of learner.train.strategy); :func:`make_trainer` builds the trainer either way.

Who does what. Rank 0 is the learner service: the sockets, the buffer, control, metrics and
publishing, exactly as one process. Every other rank runs :func:`worker_main`: no sockets, no
buffer; it waits for rank 0's next command on a gloo group and runs the same handler
(``DeepSpeedStrategy._do_<command>``), so the collectives of the two sides always meet in the same
order. Ranks never talk ZeroMQ.

    command       rank 0 sends                 every rank runs
    step          the live config, the batch   Trainer.local_step on the whole batch, training its share
    gather        -                            ZeRO-3: the publish's parameters, bucket by bucket
    save_policy   the directory                ZeRO-3: the gathered policy, written by rank 0
    save_engine   the directory                engine/ of a checkpoint (learner.train.ds_state)
    load_engine   the directory                every rank sets its partitions and RNG states from it
    ping          -                            nothing (rank 0 is alive while it waits for rollouts)
    stop          -                            the worker exits 0

Data parallelism inside a step. Every rank gets the whole batch (token ids: small) and computes
what is cheap and needs the whole batch on every rank identically (scores, advantages, importance
weights, the plan). The passes over the model are shared out: the no-grad passes (reference,
values, proximal) run over micro-batches ``rank, rank + N, ...`` and are summed into the full
tensor; in each mini-batch every rank trains the micro-batches ``rank::N`` of the trainer's plan
(one place decides micro-batches: :func:`learner.train.batching.plan_updates`). A rank with fewer of them
runs a dummy micro-batch with a zero loss, so every rank makes the same passes (under ZeRO-3 each
pass is collective). DeepSpeed averages gradients over ranks; each loss is multiplied by N before
its backward, so the reduced gradient is the sum over the mini-batch's micro-batches, the number
one process computes. What a mini-batch measured (losses, clip and importance statistics) is
gathered from every rank before any decision (non-finite, ``target_kl``), so every rank decides
the same. Hence the equivalence the tests check: two ranks give one process's losses and updated
parameters to float rounding.

Steps that apply nothing. DeepSpeed clips on the reduced gradients and skips an update whose norm
is not finite (fp32, bf16 with ``check_grad_overflow``, fp16's loss scaler); the trainer reports a
skipped step. Gradients that must be dropped without an update (a non-finite loss, ``target_kl``)
are discarded through DeepSpeed's own overflow path; earlier updates of the step are rolled back
(below).

Checkpoints. learner.state.checkpoint writes them as for one process (atomically, with a manifest);
the strategy adds ``engine/`` (learner.train.ds_state): each trained parameter's float32 master
weight and Adam moments,
gathered whole from every rank's partitions and written by rank 0 as safetensors (no pickle,
and a resume may use another number of ranks); resuming, every rank reads it and sets its own
partitions. The policy directory is saved as well (plain HF, gathered under ZeRO-3).

RNG states per rank. ``engine/`` also holds every rank's RNG states (torch CPU, every CUDA device
the rank initialized, python, numpy: learner.state.checkpoint's :func:`rng_state`), gathered to rank 0
(``rng.safetensors``, and ``rng`` in ``engine.json``). Resuming, rank r takes rank r's states back
(rank 0's equal the checkpoint's top-level ones). With another number of ranks: a rank below the
saved count takes its own; a rank at or beyond it (or every rank but 0, for an engine state
saved without RNG states) is seeded from (``learner.seed``, rank) through numpy's SeedSequence
(:func:`rank_seed`) — deterministic, and different on every rank and from any saved rank's.

Rolling back a step. A step with several optimizer steps whose later update is skipped (a
non-finite loss, or a non-finite reduced gradient that DeepSpeed declined to apply) restores, on
every rank, what the step's earlier updates changed: this rank's float32 master partitions, its
partitions (ZeRO-3) or copies (ZeRO-1/2) of the model's parameters, and the torch optimizer's
state (Adam moments and step counts) — all local, no collective, each rank the part it holds
(:meth:`DeepSpeedStrategy.snapshot`). Every rank takes the same decision (the losses are gathered,
the norm is the reduced one), so every rank rolls back. The same copy guards a step of one update
that trains both the policy and a critic: DeepSpeed knows a gradient norm only inside
``engine.step()``, so the policy's update is undone when the critic's is then skipped. The cost
is the plain path's: one copy of this rank's part of the weights and optimizer state per step of
several updates (and, with a critic, of the policy's part per one-update step).

Launchers. ``slipstream learner --nproc N`` (torchrun, :func:`launch_ranks`), ``torchrun ... -m
deploy.cli learner ...``, or the deepspeed launcher with ``--no_local_rank --module deploy.cli
learner ...`` (the ranks read ``LOCAL_RANK`` from the environment; the CLI takes no
``--local_rank`` argument). On CPU the deepspeed launcher's ``--num_gpus N`` starts N ranks.

Failure. Every process group has ``timeout_s``; rank 0 pings idle workers every ``heartbeat_s``.
A rank that dies makes the collectives of the others fail (or time out), each raises and exits
non-zero, and the launcher takes the group down.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

import ops
from buffer import Batch
from learner.config import LearnerConfig, TrainerConfig, changed_paths, set_path
from learner.train.ds_config import engine_config
from learner.train.ds_group import (
    Group,
    Heartbeat,
    RankBeat,
    batch_from_wire,
    batch_to_wire,
    check_precision,
    discard_gradients,
    free_port,
    join_group,
    local_data,
    master_weights,
)
from learner.train.ds_state import load_engine, save_engine
from learner.train.policy_io import publish_tensors, save_pretrained
from learner.train.step import MiniBatch, SkippedStep, StepPlan, UpdateLog
from learner.train.strategy import Skip
from learner.train.trainer import Trainer
from protocol.errors import StartupError

__all__ = ["DeepSpeedStrategy", "join_group", "launch_ranks", "make_trainer", "serve", "worker_main"]


class DeepSpeedStrategy:
    """:class:`learner.train.strategy.TrainStrategy` with the trainer's models as DeepSpeed
    engines over a :class:`Group` (module docstring). On rank 0 the service calls the trainer as
    it calls a plain one; the operations that are collective send their command to the other ranks
    first. Made before the trainer (it checks the section and joins the group: a StartupError
    comes before any model loads); :meth:`wrap` builds the engines."""

    def __init__(self, cfg: TrainerConfig, group: Group | None = None):
        import deepspeed  # noqa: F401 - an ImportError before anything else

        ds = cfg.deepspeed
        if ds is None:
            raise StartupError("DeepSpeedStrategy needs a learner.deepspeed section")
        if cfg.runtime.dtype not in ("auto", "float32"):
            raise StartupError(f"learner.runtime.dtype={cfg.runtime.dtype} with learner.deepspeed: load in float32 "
                               "(dtype: auto or float32) and set learner.deepspeed.precision "
                               "(bf16 / fp16) for the engines' precision")
        self.group = group or join_group(ds)
        self.ds = ds
        check_precision(ds)
        self.trainer: Trainer | None = None
        self.engine = None
        self.critic_engine = None
        self._dirty: set[str] = set()          # engines with gradients not yet stepped
        self.last_gather: dict[str, float] = {}
        self._heartbeat: Heartbeat | None = None
        self._closed = False

    @property
    def rank(self) -> int:
        return self.group.rank

    def configure(self, cfg: TrainerConfig) -> TrainerConfig:
        """The engines decide the device (one per rank) and cast to their precision themselves
        (``deepspeed.precision``: no autocast of ours)."""
        runtime = cfg.runtime.model_copy(update={"device": self.group.device, "dtype": "float32",
                                                 "autocast": "none"})
        return cfg.model_copy(update={"runtime": runtime})

    def wrap(self, trainer: Trainer) -> None:
        import deepspeed

        self.trainer = trainer
        cfg, world = trainer.cfg, self.group.world
        self.engine, *_ = deepspeed.initialize(
            model=trainer.model, optimizer=trainer.optimizer, dist_init_required=False,
            config=engine_config(self.ds, cfg.optimizer.max_grad_norm, world))
        if trainer.critic is not None:
            self.critic_engine, *_ = deepspeed.initialize(
                model=trainer.critic, optimizer=trainer.critic_optimizer, dist_init_required=False,
                config=engine_config(self.ds, cfg.critic.max_grad_norm, world))
        # Every pass goes through the engine's forward (it starts DeepSpeed's per-micro-batch
        # bookkeeping: without it ZeRO-3 keeps only the last micro-batch's gradients).
        trainer.forward.model = self.engine
        if self.critic_engine is not None:
            trainer.critic = self.critic_engine
        if self.ds.zero_stage == 3:
            # The hidden-state path multiplies by the head's weight outside the head's forward,
            # where ZeRO-3 holds only this rank's partition of it: the logits path instead.
            trainer.forward.uses_hidden = False
            if trainer.reference is not None and not trainer.reference.owns_weights:
                trainer.reference.forward.uses_hidden = False
        if self.group.rank == 0 and world > 1:
            self._heartbeat = Heartbeat(self.group, self.ds.heartbeat_s)
            self._heartbeat.start()

    def engines(self) -> list[tuple[str, object, torch.optim.Optimizer]]:
        """(name, engine, the torch optimizer it steps) of each trained model."""
        tr = self.trainer
        return [(n, e, o) for n, e, o in (("policy", self.engine, tr.optimizer),
                                          ("critic", self.critic_engine, tr.critic_optimizer)) if e is not None]

    # ---- commands ----------------------------------------------------------------------------
    def _command(self, name: str, *args):
        """Rank 0: send the command, then run it here (its collectives meet the others')."""
        with self.group.lock:
            self.group.send(name, *args)
            return getattr(self, f"_do_{name}")(*args)

    def step(self, batch: Batch) -> dict[str, float]:
        with self.group.lock:
            self.group.send("step", self.trainer.cfg.model_dump(mode="json"), batch_to_wire(batch))
            return self.trainer.local_step(batch)

    def _do_step(self, cfg: dict, batch: dict) -> dict[str, float]:
        """A worker: what changed in rank 0's config since the last step (``ctl set`` changes it
        between steps; each changed key validated by its section, not the whole config again),
        then the step. The device and dtype stay this rank's own."""
        live = self.trainer.cfg
        for key, value in changed_paths(live.model_dump(mode="json"), cfg):
            if key not in ("runtime.device", "runtime.dtype"):
                set_path(live, key, value)
        return self.trainer.local_step(batch_from_wire(batch))

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        if self.ds.zero_stage != 3:             # stages 1, 2: parameters are whole on every rank
            return publish_tensors(self.trainer.model, lora=self.trainer.lora_config is not None)
        return self._command("gather")

    def _do_gather(self) -> list[tuple[str, torch.Tensor]]:
        """ZeRO-3: the publish's tensors, gathered bucket by bucket (each bucket is all-gathered,
        copied to the CPU on rank 0 and released before the next); [] on the other ranks."""
        import time

        import deepspeed

        tr = self.trainer
        t0, total = time.perf_counter(), 0
        out: list[tuple[str, torch.Tensor]] = []
        if tr.lora_config is not None:
            from peft import get_peft_model_state_dict

            with deepspeed.zero.GatheredParameters(tr.trainable, modifier_rank=None):
                if self.rank == 0:
                    out = [(n, t.detach().to("cpu", copy=True))
                           for n, t in get_peft_model_state_dict(tr.model).items()]
        else:
            bucket: list[tuple[str, torch.nn.Parameter]] = []
            size = 0

            def flush() -> None:
                with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
                    if self.rank == 0:
                        out.extend((n, p.detach().to("cpu", copy=True)) for n, p in bucket)
                bucket.clear()

            for name, p in tr.model.named_parameters():
                nbytes = int(getattr(p, "ds_numel", p.numel())) * p.element_size()
                bucket.append((name, p))
                size += nbytes
                total += nbytes
                if size >= self.ds.publish_bucket_bytes:
                    flush()
                    size = 0
            if bucket:
                flush()
        if self.rank == 0:
            total = sum(t.numel() * t.element_size() for _, t in out)
        self.last_gather = {"bytes": float(total), "seconds": time.perf_counter() - t0}
        return out

    def save_policy(self, path: Path) -> Path:
        if self.ds.zero_stage != 3:
            return save_pretrained(self.trainer.model, self.trainer.tokenizer, path)
        return self._command("save_policy", str(path))

    def _do_save_policy(self, path: str) -> Path:
        import deepspeed

        model = self.trainer.model
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            if self.rank == 0:
                return save_pretrained(model, self.trainer.tokenizer, path)
        return Path(path)

    def close(self) -> None:
        """Rank 0: tell the other ranks to exit (they return 0). When a command is still running
        (a failed run: a step's thread stuck in a collective) nothing is sent; the other ranks
        then fail on the closed connection, or on their timeout, and exit non-zero."""
        if self._heartbeat is not None:
            self._heartbeat.stopped.set()
        if self.group.world == 1 or self._closed:
            return
        if not self.group.lock.acquire(timeout=self.ds.heartbeat_s):
            return
        try:
            self.group.send("stop")
            self._closed = True
        except RuntimeError:                   # a rank is gone already
            pass
        finally:
            self.group.lock.release()

    # ---- checkpoints (learner.state.checkpoint calls these through the trainer) -------------
    def model_state(self) -> dict:
        """Nothing in trainer.json / trainer.safetensors: weights and optimizer moments are the
        engines' (:meth:`save_engine_state`); the reference is the initial policy (not saved)."""
        return {}

    def load_model_state(self, state: dict) -> None:
        return None

    def save_engine_state(self, path: str | Path) -> None:
        """Write ``path/`` (learner.train.ds_state): every trained parameter's float32 master
        weight and Adam moments, gathered whole from the ranks' partitions (collective) and
        written by rank 0, and every rank's RNG states; so a resume does not depend on the number
        of ranks and nothing is pickled (DeepSpeed's own checkpoints are torch.save files)."""
        self._command("save_engine", str(path))

    def _do_save_engine(self, path: str) -> None:
        save_engine(path, self.engines(), self.group, self.ds.zero_stage, self.ds.precision)

    def load_engine_state(self, path: str | Path) -> None:
        """Every rank reads ``path`` (a directory every rank can see) and sets its partitions of
        the master weights and Adam moments, the model's own weights and its RNG states (module
        docstring: another rank count); ValueError when the file does not fit this model."""
        self._command("load_engine", str(path))

    def _do_load_engine(self, path: str) -> None:
        load_engine(path, self.engines(), self.rank, self.ds.zero_stage, self.trainer.cfg.seed)

    # ---- inside a step -----------------------------------------------------------------------
    def _engine(self, which: str):
        return self.engine if which == "policy" else self.critic_engine

    def share(self, chunks: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        """(this rank's chunks ``rank::N``, dummy passes to make every rank's count equal)."""
        n = -(-len(chunks) // self.group.world)
        mine = chunks[self.rank::self.group.world]
        return mine, n - len(mine)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        return self.group.sum_(t)             # rows are disjoint: the sum is each row's own value

    def backward(self, loss: torch.Tensor, which: str) -> None:
        # DeepSpeed averages over ranks; times N the reduced gradient is the mini-batch's sum.
        self._engine(which).backward(loss * self.group.world)
        self._dirty.add(which)

    def merge_minibatch(self, mb: MiniBatch) -> MiniBatch:
        mb.pg_parts, mb.vf_parts = mb.read(mb.pg_parts, mb.vf_parts)   # plain numbers to gather
        merged = MiniBatch()
        for losses, pg, vf in self.group.gather((mb.losses, mb.pg_parts, mb.vf_parts)):
            for k, v in losses.items():
                merged.losses[k] = merged.losses.get(k, 0.0) + v
            merged.pg_parts.extend(pg)
            merged.vf_parts.extend(vf)
        return merged

    def clip_grads(self, s: StepPlan) -> tuple[float, float]:
        return 0.0, 0.0                      # DeepSpeed clips inside engine.step (reduced gradients)

    def optimizer_steps(self, s: StepPlan, gn: float, cn: float, skip: Skip) -> tuple[float, float]:
        norms = {"policy": 0.0, "critic": 0.0}
        critic = self.critic_engine is not None
        # One update of both models: the trainer takes no snapshot (one optimizer step), but the
        # critic's norm is known only after the policy's update (module docstring).
        guard = self.snapshot(("policy",)) if s.train_policy and critic and s.n_updates == 1 else None
        for which, on in (("policy", s.train_policy), ("critic", critic)):
            if not on:
                continue
            engine = self._engine(which)
            engine.step()
            self._dirty.discard(which)
            norm = engine.get_global_grad_norm()
            norm = float(norm) if norm is not None else float("nan")
            if not engine.was_step_applied() or not math.isfinite(norm):
                if guard is not None:
                    self.restore(guard)
                raise skip(f"non-finite {which} gradient norm (DeepSpeed skipped the update)")
            norms[which] = norm
        return norms["policy"], norms["critic"]

    def broken_weights(self, s: StepPlan) -> str | None:
        """Each rank checks its own partitions (ZeRO-3) and the float32 masters; the answers are
        gathered so that every rank rolls back (or stops) alike."""
        mine = None
        for name, engine, _ in self.engines():
            if name == "policy" and not s.train_policy:
                continue
            local = [local_data(p) for p in engine.module.parameters() if p.requires_grad]
            if not ops.weights_finite(local + master_weights(engine)):
                mine = name
                break
        return next((b for b in self.group.gather(mine) if b is not None), None)

    def zero_grad(self) -> None:
        for which in sorted(self._dirty):
            discard_gradients(self._engine(which))
        self._dirty.clear()

    def snapshot(self, which: tuple[str, ...] = ("policy", "critic")) -> list:
        """What an update changes on this rank, copied (module docstring, "Rolling back"): per
        engine, the trained parameters' local data (ZeRO-3: the partition), the float32 master
        partitions and the torch optimizer's state. Local: no collective."""
        snap = []
        for name, engine, opt in self.engines():
            if name not in which:
                continue
            params = [local_data(p) for p in engine.module.parameters() if p.requires_grad]
            masters = master_weights(engine)
            state = {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                     for p, st in opt.state.items()}
            snap.append((engine, opt, [(t, t.clone()) for t in params + masters], state))
        return snap

    @torch.no_grad()
    def restore(self, snap: list) -> None:
        for _, opt, tensors, state in snap:
            for live, saved in tensors:
                live.copy_(saved)
            for p, st in opt.state.items():
                before = state.get(id(p))
                for k, v in st.items():
                    # A state made by this step's first update goes back to Adam's initial one
                    # (zeros, step 0) in place: DeepSpeed keeps views of these tensors.
                    old = before.get(k) if before is not None else None
                    if torch.is_tensor(v) and old is not None:
                        v.copy_(old)
                    elif torch.is_tensor(v):
                        v.zero_()
                    elif before is not None:
                        st[k] = before[k]

    def merge_log(self, log: UpdateLog, shortcut: bool) -> None:
        """What each rank's micro-batches recorded outside the mini-batch: entropy sums, the
        shortcut's proximal log-probs and importance statistics, the sanity check."""
        if self.group.world == 1:
            return
        log.read()                           # this rank's statistics, as plain numbers to gather
        mine = (log.entropy_sum, log.entropy_tokens, log.is_parts if shortcut else [],
                (log.sanity.dev_sum, log.sanity.dev_max, log.sanity.kl_sum, log.sanity.tokens))
        parts = self.group.gather(mine)
        log.entropy_sum = sum(p[0] for p in parts)
        log.entropy_tokens = sum(p[1] for p in parts)
        if shortcut:
            log.is_parts = [x for p in parts for x in p[2]]
            self.group.sum_(log.filled)      # each row was filled by the one rank that trained it
        san = [p[3] for p in parts]
        log.sanity.dev_sum = sum(x[0] for x in san)
        log.sanity.dev_max = max(x[1] for x in san)
        log.sanity.kl_sum = sum(x[2] for x in san)
        log.sanity.tokens = sum(x[3] for x in san)


def launch_ranks(nproc: int, cfg: LearnerConfig, config_file: str, overrides: list[str],
                 resume: str | None) -> int:
    """``slipstream learner --nproc N``: this process becomes ``torchrun`` (one node) running N
    ``slipstream learner`` ranks with the same arguments (no restarts: a rank that dies ends the
    group, and torchrun exits non-zero)."""
    import sys

    if cfg.deepspeed is None:
        raise StartupError(f"--nproc {nproc} needs a learner.deepspeed section (e.g. --set "
                           "learner.deepspeed.zero_stage=2)")
    # Static rendezvous on a free local port: no rendezvous keep-alives to miss on a busy host
    # (--standalone's c10d rendezvous times out under load).
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
            str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "--max-restarts", "0", "-m", "deploy.cli", "learner", "--config", config_file]
    for item in overrides:
        argv += ["--set", item]
    if resume is not None:
        argv += ["--resume", resume]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 1                                  # not reached


def make_trainer(cfg: TrainerConfig, model_path: str, group: Group | None = None) -> Trainer:
    """The Trainer: plain, or given a :class:`DeepSpeedStrategy` (on ``group``, by default this
    process's) when ``learner.deepspeed`` is set."""
    if cfg.deepspeed is None:
        return Trainer(cfg, model_path)
    return Trainer(cfg, model_path, DeepSpeedStrategy(cfg, group))


def worker_main(cfg: LearnerConfig, model_path: str, group: Group) -> int:
    """A rank other than 0: build the same trainer, then run rank 0's commands until ``stop``,
    beating its liveness file (:class:`RankBeat`) and watched by its own watchdog: no command from
    rank 0 for ``watchdog.stall_s`` (rank 0 pings an idle group every ``heartbeat_s``), or one that
    runs that long, is a ``stalled`` line naming the command and the frame this rank is in."""
    import threading

    from protocol.plumbing.process import EventLog
    from protocol.plumbing.stacks import dump_stacks, stacks_dir
    from protocol.plumbing.watchdog import Waiting, Watchdog, frame_of

    proc = f"learner-rank{group.rank}"
    log = EventLog(proc)
    trainer = make_trainer(TrainerConfig.of(cfg), model_path, group)
    beat = RankBeat(Path(cfg.run_dir) / "ranks", group.rank)
    main = threading.get_ident()

    def waiting_on(idle_s: float) -> Waiting:
        name, since = beat.command
        where = frame_of(main)
        where = f"; it is in {where}" if where else ""
        if name != "idle":
            return Waiting("step", f"rank 0's command {name} has run {time.time() - since:.0f} s{where}")
        return Waiting("rank", f"no command from rank 0 in {idle_s:.0f} s (it pings an idle group "
                               f"every learner.deepspeed.heartbeat_s){where}")
    watchdog = Watchdog(proc, noun="command", diagnose=waiting_on, log=log,
                        # an idle worker hears rank 0's ping every heartbeat_s: never less than 3
                        stall_s=lambda: cfg.watchdog.stall_s and max(cfg.watchdog.stall_s,
                                                                     3 * cfg.deepspeed.heartbeat_s),
                        dump_after_s=lambda: cfg.watchdog.dump_after_s,
                        abort_after_s=lambda: cfg.watchdog.abort_after_s,
                        dump=lambda: dump_stacks(stacks_dir(Path(cfg.run_dir) / "stacks"), proc))
    log("worker_ready", rank=group.rank, world=group.world, pid=os.getpid())
    beat.start()
    watchdog.start(loop=None)
    try:
        return serve(trainer, group, beat, watchdog)
    finally:
        watchdog.stop()
        beat.stop()


def serve(trainer: Trainer, group: Group, beat: RankBeat | None = None, watchdog=None) -> int:
    """Run rank 0's commands on ``trainer`` (its :class:`DeepSpeedStrategy`'s handlers) until
    ``stop`` (then 0); ``beat.command`` says which one runs, ``watchdog`` hears of each."""
    while True:
        name, args = group.receive()
        if watchdog is not None:
            watchdog.progress(name)
        if name == "stop":
            return 0
        if name == "ping":
            continue
        if beat is not None:
            beat.command = (name, time.time())
        try:
            getattr(trainer.strategy, f"_do_{name}")(*args)
        except SkippedStep:
            pass                              # rank 0 reports it; every rank skipped the same
        finally:
            if beat is not None:
                beat.command = ("idle", time.time())
