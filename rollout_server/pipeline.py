"""The pipeline: assignment -> engine request -> completions -> rewards -> samples.

Admission (:meth:`Pipeline.admit`): an assignment is refused, with :class:`Refused` naming the
error kind, when this server cannot or will not run it: more completions than
``max_concurrency`` or than the credits it granted, ``max_new_tokens`` above
``max_new_tokens_limit``, an empty prompt or one longer than ``max_prompt_tokens`` (or than the
engine's ``max_model_len``), token ids outside the vocabulary. Checked here, before the engine
sees it, so no learner message can make a decode raise for the whole batch.

Batching (:meth:`Pipeline.run`): assignments queued together go to the engine in one
``generate`` call; after work arrives the pipeline waits for the rest of the learner's burst
(``Assignment.burst_left``: how many more follow), at most ``batch_wait_s``. Each
batch first lets announced weights land (``before_batch``, bounded), so fresh work does not start
on a version the learner has already left.

Episodes (:mod:`rollout_server.episodes`): an assignment whose environment is set
(``rollout.environment``) is not part of the batch's generate call; its group runs as episodes in
a task of its own, turn after turn, and is sent and its credits given back when its last episode
ends, so a long episode or a slow environment holds nothing else. The turns of concurrent
episodes share the engine's decodes (the engines merge concurrent calls). A group with a failed
episode under ``rollout.environment.on_failure: reissue`` is not sent: ``give_back`` refuses the
assignment (``Error(code="assignment_refused")``), so the learner issues it again.

Failures are per sample: an engine that raises for a batch makes every sample of it
``failed`` (``finish_reason="error"``, counted ``generate``); a reward that raises or times out
fails its sample (counted ``reward`` / ``reward_timeout``). Failed samples are still sent, so the
learner gives their capacity back at once. Sample ids come from :func:`protocol.sample_id`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

import protocol
from protocol.plumbing.process import raise_if_cancelling, trace, wait_event
from rollout_server.engine import Completion, GenRequest
from rollout_server.episodes import EpisodeRunner
from rollout_server.metrics import RolloutMetrics
from rollout_server.rewards import Scored

_EMPTY_I32 = np.zeros(0, dtype=np.int32)
_EMPTY_F32 = np.zeros(0, dtype=np.float32)


class Refused(Exception):
    """An assignment this server will not run; ``kind`` is its error kind (``assignment_*``)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Limits:
    """What an assignment may ask of this server."""

    max_concurrency: int
    max_new_tokens: int
    max_prompt_tokens: int
    vocab_size: int
    max_model_len: int | None = None


class Pipeline:
    """Queue, generate, score. Handed the functions it needs:

    ``generate(requests)`` the engine's; ``decode(token_ids)`` text of a completion;
    ``score(items)`` the rewarder's ``score_many``; ``emit(result)`` sends a ``RolloutResult``
    (the outbox); ``release(n)`` gives ``n`` credits back once their samples are out;
    ``before_batch(batch)`` waits (bounded) for the weights the batch should run on; ``on_change()`` wakes anyone waiting
    for progress (the drain).
    """

    def __init__(self, *, server_id: str, limits: Limits,
                 generate: Callable[[list[GenRequest]], Awaitable[list[list[Completion]]]],
                 decode: Callable[[np.ndarray], str],
                 score: Callable[[list[tuple[str, str, dict]]], Awaitable[list[Scored]]],
                 emit: Callable[[protocol.RolloutResult], Awaitable[None]],
                 release: Callable[[int], Awaitable[None]], metrics: RolloutMetrics,
                 log: Callable[..., None],
                 before_batch: Callable[[list[protocol.Assignment]], Awaitable[object]] | None = None,
                 on_change: Callable[[], None] = lambda: None, batch_wait_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, episodes: EpisodeRunner | None = None,
                 give_back: Callable[[protocol.Assignment, str], Awaitable[None]] | None = None):
        self.server_id, self.limits = server_id, limits
        self.generate, self.decode, self.score = generate, decode, score
        self.emit, self.release, self.before_batch = emit, release, before_batch
        self.metrics, self.log, self.on_change = metrics, log, on_change
        self.batch_wait_s, self.clock = batch_wait_s, clock
        self.episodes, self.give_back = episodes, give_back
        self.episode_tasks: set[asyncio.Task] = set()   # groups running as episodes, each on its own
        self.queue: list[protocol.Assignment] = []
        self.assigned = 0                 # samples queued or generating (credits in use)
        self.generating = False
        self.stage: tuple[str, str, float] | None = None
        """(stage, what, since) of the batch in progress: weights (waiting for them), generate,
        reward (the watchdog's view)."""
        self.busy_s = 0.0                 # seconds spent in generate calls, in total
        self._gen_start = 0.0
        self._meter = (clock(), 0.0)      # (time, busy_s) at the last idle_ratio() call
        self._queued = asyncio.Event()
        self._arrived = asyncio.Event()   # set by every admit (the batch window watches it)
        self._epoch = 0                   # bumped by drop(): results of older batches are discarded

    # ---- admission --------------------------------------------------------------------------
    def check(self, a: protocol.Assignment) -> None:
        """Raise :class:`Refused` if ``a`` cannot run here (see the module docstring)."""
        lim, g = self.limits, a.group_size
        if g > lim.max_concurrency:
            raise Refused("assignment_group_size", f"group_size {g} > this server's "
                          f"max_concurrency {lim.max_concurrency}")
        if self.assigned + g > lim.max_concurrency:
            raise Refused("assignment_over_credit", f"group_size {g} with {self.assigned} samples "
                          f"assigned exceeds the {lim.max_concurrency} credits granted")
        if a.sampling.max_new_tokens > lim.max_new_tokens:
            raise Refused("assignment_max_new_tokens", f"max_new_tokens {a.sampling.max_new_tokens}"
                          f" > this server's max_new_tokens_limit {lim.max_new_tokens}")
        prompt = a.prompt_token_ids
        n = len(prompt)
        longest = lim.max_prompt_tokens
        if lim.max_model_len is not None:
            longest = min(longest, lim.max_model_len - 1)      # room for one new token at least
        if n == 0 or n > longest:
            raise Refused("assignment_prompt", f"prompt of {n} tokens (this server takes 1.."
                          f"{longest})")
        low, high = int(prompt.min()), int(prompt.max())
        if low < 0 or high >= lim.vocab_size:
            raise Refused("assignment_prompt", f"prompt token ids {low}..{high} outside the "
                          f"vocabulary 0..{lim.vocab_size - 1}")

    def admit(self, a: protocol.Assignment) -> None:
        """Queue ``a`` for the next batch, or raise :class:`Refused`."""
        self.check(a)
        trace("rollout.assignment")
        self.queue.append(a)
        self.assigned += a.group_size
        self._queued.set()
        self._arrived.set()

    def drop(self) -> int:
        """Forget every queued assignment, and the results of the batch generating now (a new
        learner run: these leases mean nothing to it). Returns the samples dropped from the
        queue; the generating batch's credits come back when it ends, as usual."""
        n = sum(a.group_size for a in self.queue)
        self.queue = []
        self._queued.clear()
        self.assigned -= n
        self._epoch += 1
        self.on_change()
        return n

    def idle_ratio(self) -> float:
        """The fraction of the time since the last call that the engine was not generating (it
        waited for work, for weights, or for rewards and sends): verl's fully-async trainer's
        rollout idle ratio. A call starts the next window."""
        now = self.clock()
        busy = self.busy_s + (now - self._gen_start if self.generating else 0.0)
        then, busy_then = self._meter
        self._meter = (now, busy)
        elapsed = now - then
        if elapsed <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - (busy - busy_then) / elapsed))

    # ---- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Batches until cancelled; keeps going while stopping (the drain finishes leases).
        Cancelled, it cancels the episodes still running."""
        try:
            while True:
                raise_if_cancelling()    # one swallowed on the way (a reward's wait_for) ends it here
                await self._queued.wait()
                await self._window()
                batch, self.queue = self.queue, []
                self._queued.clear()
                if batch:
                    await self.run_batch(batch)
        finally:
            for task in list(self.episode_tasks):
                task.cancel()

    async def _window(self) -> None:
        """Wait for the rest of the learner's burst to join the batch: until an assignment says
        none follow (``burst_left == 0``), for at most ``batch_wait_s``; an assignment that does
        not say (``-1``: an older learner, evaluation work) waits the whole window."""
        if not self.batch_wait_s:
            return
        deadline = time.monotonic() + self.batch_wait_s
        while self.queue and self.queue[-1].burst_left != 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self.queue[-1].burst_left < 0:
                await asyncio.sleep(left)
                return
            self._arrived.clear()
            if not await wait_event(self._arrived, left):
                return

    async def run_batch(self, batch: list[protocol.Assignment]) -> None:
        try:
            await self._run_batch(batch)
        finally:
            self.stage = None

    async def _run_batch(self, batch: list[protocol.Assignment]) -> None:
        epoch = self._epoch
        sequences = sum(a.group_size for a in batch)
        self.stage = ("weights", f"{len(batch)} assignments", self.clock())
        if self.before_batch is not None:
            await self.before_batch(batch)
        if epoch != self._epoch:              # dropped while waiting for weights
            self.log("results_dropped", assignments=len(batch), reason="a new learner run")
            await self._done(batch)
            return
        if self.episodes is not None:         # multi-turn groups run on their own, each as it goes
            specs = [self.episodes.spec_for(a) for a in batch]
            for a, spec in zip(batch, specs):
                if spec is not None:
                    task = asyncio.create_task(self._run_episodes(a, spec, epoch),
                                               name=f"episodes {a.assignment_id}")
                    self.episode_tasks.add(task)
                    task.add_done_callback(self.episode_tasks.discard)
            batch = [a for a, spec in zip(batch, specs) if spec is None]
            if not batch:
                return
            sequences = sum(a.group_size for a in batch)
        trace("rollout.generate")
        requests = [GenRequest.from_sampling(a.prompt_token_ids, a.group_size, a.sampling)
                    for a in batch]
        start = self._gen_start = self.clock()
        tokens = sum(len(a.prompt_token_ids) * a.group_size for a in batch)
        self.stage = ("generate", f"{sequences} sequences, {tokens:,} prompt tokens, up to "
                                  f"{max(a.sampling.max_new_tokens for a in batch):,} new tokens each",
                      start)
        self.generating = True
        error = None
        try:
            groups = await self.generate(requests)
            if len(groups) != len(batch) or any(len(c) != a.group_size for a, c in zip(batch, groups)):
                raise RuntimeError("the engine returned a different number of completions")
        except Exception as e:  # noqa: BLE001 - an engine failure fails these samples, not the server
            groups, error = [[] for _ in batch], f"generate: {type(e).__name__}: {e}"
            self.metrics.count("generate", sum(a.group_size for a in batch))
            self.log("generate_failed", assignments=len(batch), error=error[:500])
        finally:
            self.generating = False
        trace("rollout.generated")
        gen_s = self.clock() - start
        self.busy_s += gen_s
        self.metrics.generation_seconds.observe(gen_s)
        self.stage = ("reward", f"{sequences} samples", self.clock())
        results = await asyncio.gather(*(
            self.samples(a, c, gen_s) if error is None else self.failed_samples(a, error)
            for a, c in zip(batch, groups)))
        if epoch == self._epoch:
            trace("rollout.scored")
            for samples in results:
                await self.emit(protocol.RolloutResult(server_id=self.server_id, samples=samples))
            trace("rollout.sent")
        else:
            self.log("results_dropped", assignments=len(batch), reason="a new learner run")
        await self._done(batch)

    async def _run_episodes(self, a: protocol.Assignment, spec: str, epoch: int) -> None:
        """``a``'s group as episodes in environment ``spec`` (rollout_server/episodes.py); its
        samples out, its credits back."""
        try:
            samples = await self.episodes.run_group(a, spec)
            failed = next((s.failed for s in samples if s.failed), None)
            if failed and self.give_back is not None and self.episodes.settings.on_failure == "reissue":
                self.metrics.episode_groups_reissued.inc()
                self.log("episodes_given_back", assignment_id=a.assignment_id[:200], error=failed[:500])
                if epoch == self._epoch:
                    await self.give_back(a, f"an episode failed, its group goes back for re-issue: {failed}")
                return
            if epoch == self._epoch:
                await self.emit(protocol.RolloutResult(server_id=self.server_id, samples=samples))
            else:
                self.log("results_dropped", assignments=1, reason="a new learner run")
        finally:
            await self._done([a])

    async def _done(self, batch: list[protocol.Assignment]) -> None:
        """``batch`` is out (or dropped): its credits are free again."""
        done = sum(a.group_size for a in batch)
        self.assigned -= done
        self.on_change()
        await self.release(done)

    # ---- samples ----------------------------------------------------------------------------
    async def samples(self, a: protocol.Assignment, completions: list[Completion],
                      gen_s: float) -> list[protocol.Sample]:
        """Decode and score one group (batched rewards see the whole group at once)."""
        texts = [self.decode(c.token_ids) for c in completions]
        start = self.clock()
        items = [(a.prompt_text, t, {**a.metadata, "completion_tokens": len(c.token_ids),
                                     "finish_reason": c.finish_reason, "completion_ids": c.token_ids.tolist(),
                                     "policy_version": int(c.versions.min()) if len(c.versions) else a.version})
                 for t, c in zip(texts, completions)]
        scored = await self.score(items)
        reward_s = (self.clock() - start) / max(1, len(completions))
        out = []
        for i, (c, text, sc) in enumerate(zip(completions, texts, scored)):
            sid = protocol.sample_id(a.assignment_id, i)
            if sc.failed:     # a reward that raised, timed out or returned NaN: the sample says why
                self.metrics.count("reward_timeout" if sc.timed_out else "reward")
                self.log("reward_failed", sample_id=sid, error=sc.failed[:500])
            else:
                self.metrics.reward.observe(sc.total)
            self.metrics.generated_tokens.inc(len(c.token_ids))
            self.metrics.prompt_tokens.inc(len(a.prompt_token_ids))
            self.metrics.samples.inc()
            out.append(protocol.Sample(
                sample_id=sid, assignment_id=a.assignment_id, group_index=i,
                group_size=a.group_size, prompt_token_ids=a.prompt_token_ids,
                completion_token_ids=c.token_ids, behavior_logprobs=c.logprobs,
                token_versions=c.versions, reward=sc.total, reward_parts=sc.parts or {},
                finish_reason=c.finish_reason, timing={"generate_s": gen_s, "reward_s": reward_s},
                completion_text=text, failed=sc.failed, sampling_temperature=a.sampling.temperature))
        return out

    async def failed_samples(self, a: protocol.Assignment, reason: str) -> list[protocol.Sample]:
        """The group of an assignment whose generation failed: empty, ``failed``, sent anyway."""
        return [protocol.Sample(
            sample_id=protocol.sample_id(a.assignment_id, i), assignment_id=a.assignment_id,
            group_index=i, group_size=a.group_size, prompt_token_ids=a.prompt_token_ids,
            completion_token_ids=_EMPTY_I32, behavior_logprobs=_EMPTY_F32,
            token_versions=_EMPTY_I32, reward=0.0, finish_reason="error",
            failed=reason[:1000]) for i in range(a.group_size)]
