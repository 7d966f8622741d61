"""The learner's train loop: one policy step, top to bottom (docs/design.md §8).

    async with checkpoints.between_steps():         # a ctl checkpoint or a stop may save here
        batch = await batches.next_batch(version)   # samples from the buffer's staleness gate
    control.before_step(trainer)                    # ctl pause waits here; ctl set lands here
    stats = await thread.run(trainer.step, batch)   # the policy step, on the train thread
    records.trained(batch)                          # trained_ids.jsonl
    version += 1                                    # tokens of the new version become acceptable
    await publisher.publish(version, ...)           # the snapshot; checksums and announce go on beside
    staleness.after_step(bound, stats)              # η's adaptive controller (buffer.staleness)
    records.step(stats)                             # gauges, metrics.jsonl, the step event
    await admission.dispatch()                      # new work for the new version
    await checkpoints.save(version, last=...)       # the checkpointer decides whether one is due

A step the trainer skips (a non-finite loss or gradient) gives its samples' capacity back and
counts towards ``algorithm.max_consecutive_skips``; an update that broke the weights with no copy
to roll back to forbids any further checkpoint. Either way the loop ends with the reason
(:attr:`TrainLoop.diverged`) and the process stops (``learner.serve.service``).

The loop owns nothing but its own progress (busy, the skip streak): the version is the run
state's, η the staleness limit's, when to save the checkpointer's.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Any

from buffer import Batch, RolloutBuffer, StalenessLimit
from learner.train.trainer import BrokenWeights, SkippedStep
from protocol.plumbing.process import trace


class TrainThread:
    """The one thread all of this process's torch work runs on (the model's load, every step, the
    checkpoints' tensor copies): torch's OpenMP pool belongs to the thread that calls into it."""

    def __init__(self, executor: Executor):
        self.executor = executor

    async def run(self, fn, *args):
        """``fn(*args)`` on the train thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


class Batches:
    """Where the loop's batches come from: the buffer's next complete batch, or None once a finite
    dataset is used up (every prompt drawn, nothing in flight, less than a batch ready).

    ``prompts``: the prompt stream (``finite``, ``exhausted``); ``settings``: the ``learner.batch``
    section (``batch_samples``, read at use time)."""

    def __init__(self, buffer: RolloutBuffer, prompts: Any, settings: Any):
        self.buffer, self.prompts, self.settings = buffer, prompts, settings
        self.done = asyncio.Event()

    def check(self) -> bool:
        """Whether the dataset is used up (sets :attr:`done`); called whenever the buffer changed."""
        p = self.prompts
        if (p is not None and p.exhausted and not self.buffer.inflight_samples
                and self.buffer.ready_samples < self.settings.batch_samples):
            self.done.set()
        return self.done.is_set()

    async def next_batch(self, version: int) -> Batch | None:
        """The next batch for ``version``; cancellation-safe (it takes nothing until it returns)."""
        if not self.prompts.finite:
            return await self.buffer.next_batch(version)
        self.check()
        get = asyncio.ensure_future(self.buffer.next_batch(version))
        done = asyncio.ensure_future(self.done.wait())
        try:
            await asyncio.wait({get, done}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            get.cancel()                      # the buffer's next_batch takes nothing when cancelled
        return get.result() if get.done() and not get.cancelled() else None


class TrainLoop:
    """The policy steps until ``total_steps`` (or a finite dataset's end, or divergence).

    ``cfg``: the learner config (``total_steps``, ``algorithm.max_consecutive_skips`` and
    ``staleness.max_staleness`` are read at each step: ``ctl set`` may change them)."""

    def __init__(self, cfg: Any, *, run: Any, trainer: Any, thread: TrainThread, batches: Batches,
                 checkpoints: Any, control: Any, publisher: Any, staleness: StalenessLimit, records: Any,
                 admission: Any, rollout_log: Any, evaluation: Any, waiting: Any, watchdog: Any,
                 log: Any):
        self.cfg, self.run, self.trainer, self.thread = cfg, run, trainer, thread
        self.batches, self.checkpoints, self.control = batches, checkpoints, control
        self.publisher, self.staleness, self.records = publisher, staleness, records
        self.admission, self.rollout_log, self.evaluation = admission, rollout_log, evaluation
        self.waiting, self.watchdog, self.log = waiting, watchdog, log
        self.busy = False                     # a step (and its publish) is running
        self.skip_streak = 0                  # steps skipped in a row
        self.diverged: str | None = None
        """Why the model stopped training: ``max_consecutive_skips`` skips in a row, or an update
        that broke the weights with no copy to roll back to."""

    async def run_steps(self) -> str | None:
        """Train until the end; returns why the model diverged, or None."""
        self.evaluate()
        while self.run.version < self.cfg.total_steps:
            self.busy = False                 # waiting for a batch (or paused), not stepping
            self.waiting.enter("batch")
            cycle_start = time.monotonic()
            async with self.checkpoints.between_steps():
                batch = await self.batches.next_batch(self.run.version)
            if batch is None:
                self.log("data_exhausted", steps=self.run.version, prompts=self.batches.prompts.status(),
                         pending_samples=self.batches.buffer.pending_samples)
                break
            trace("learner.batch")
            await self.control.resumed.wait()        # ctl pause: no step until resume
            self.control.before_step(self.trainer)   # ctl set of step settings lands here
            self.busy = True
            self.waiting.enter("step")
            idle_s = time.monotonic() - cycle_start  # waiting for samples (or paused)
            stats = await self.step(batch)
            if self.diverged is not None:
                return self.diverged
            if stats is None:                 # skipped: its samples went back to the gate
                self.watchdog.progress("skipped step")
                await self.admission.dispatch()
                continue
            stats.update(self.records.batch_versions(batch))
            stats.update(self.records.batch_datasets(batch))
            self.records.trained(batch)
            if self.rollout_log is not None:
                self.waiting.enter("rollout_log")
                await self.rollout_log.after_step()    # fsync: step
            self.run.version += 1            # before the publish: tokens of v+1 must be acceptable
            self.waiting.enter("publish")
            stats["publish_wait_s"] = await self.publisher.publish(   # the loop's wait on the snapshot
                self.run.version, self.trainer.named_tensors)
            self.watchdog.progress("step")
            trace("learner.published")
            stats.update(self.records.idle_stats(idle_s, time.monotonic() - cycle_start))
            bound = self.cfg.staleness.max_staleness       # the operator's; the controller stays under it
            self.records.staleness_changed(self.staleness.after_step(bound, stats), stats, bound)
            self.records.step(stats)
            self.batches.check()
            self.evaluate()
            await self.admission.dispatch()
            trace("learner.dispatched")
            self.waiting.enter("checkpoint")
            await self.checkpoints.save(self.run.version, last=self.run.version >= self.cfg.total_steps)
        await self.publisher.drain()          # the last version is announced before finish waits
        return None

    async def step(self, batch: Batch) -> dict | None:
        """The trainer's step on ``batch``: its statistics, or None when it skipped the step (and
        :attr:`diverged` set when that ends the run)."""
        try:
            stats = await self.thread.run(self.trainer.step, batch)
        except SkippedStep as skip:
            self.records.skipped(batch, skip.reason)
            self.skip_streak += 1
            limit = self.cfg.algorithm.max_consecutive_skips
            if limit and self.skip_streak >= limit:
                self.diverged = (f"{self.skip_streak} steps in a row skipped (the last: {skip.reason}); "
                                 "check the learning rate and the rewards, then --resume from the last "
                                 "checkpoint")
            return None
        except BrokenWeights as broken:
            self.records.skipped(batch, str(broken))
            self.checkpoints.forbid(str(broken))         # nothing of this model is saved
            self.diverged = f"{broken}; --resume goes on from the last checkpoint"
            return None
        self.skip_streak = 0
        trace("learner.step_end")
        return stats

    def evaluate(self) -> None:
        """An evaluation round when one is due at this version (learner.data.evaluation)."""
        if self.evaluation is not None and self.evaluation.maybe_start(self.run.version):
            self.batches.check()
