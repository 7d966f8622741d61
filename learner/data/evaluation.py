"""Held-out evaluation: greedy completions of ``eval_data`` prompts, scored, never trained on.

Every ``eval_every`` policy steps (and at version 0, the baseline) the learner starts a *round* at
its version ``v``: the same ``eval_prompts`` prompts each round, one completion each
(``group_size`` 1, ``eval_temperature``: greedy by default), sent as ``Assignment`` messages whose
ids are ``<run_id>-e<round>.<k>``, a namespace the training assignments (``<run_id>-a<n>``) never
use. The rollout servers treat them like any assignment (generate, score with the run's reward,
send the result, re-send until acknowledged); the learner tells them apart by the id:

- **Outside the staleness gate.** They are not leases of the buffer, take no gate capacity and
  never enter it: their samples go here, not to :class:`learner.serve.intake.Intake`, so they can be
  neither buffered nor trained (``trained_ids.jsonl`` never names them).
- **Server credits.** They do take credits: a server's slots are shared. :class:`Admission` counts
  their samples in what a server holds (``outstanding``) and hands them out first at every
  dispatch, one credit each, to eligible servers that have applied version ``v`` or newer (so the
  completions are ``v``'s; the token versions actually seen are reported too).
- **Acknowledged.** Every eval sample is acked (``accepted``; a second copy ``duplicate``; one for
  a round already closed ``stale``; one that does not fit its assignment ``invalid``, whose lease
  then expires and is re-issued), so servers do not re-send.
- **Leases like every other.** An eval assignment is a :class:`buffer.leases.Lease` in a
  :class:`buffer.leases.LeaseTable` of its own (the same lifecycle as the training leases, kept
  apart from the buffer's table because those move gate capacity and are checkpointed): one whose
  server died, went silent past ``lease_timeout_s`` or refused it is **re-issued** (to any
  eligible server, same id, attempt + 1), at most ``max_attempts`` times in all; then it is
  dropped and counted in ``eval_dropped``. :class:`Admission` hands them out through the same
  dispatch as training work: it asks :meth:`Evaluation.take` for the next one for a server,
  charges the server's credit and sends it (the :class:`learner.serve.admission.SideWork` port).

A round is complete when every prompt has a result or was dropped. Its numbers — ``eval_reward_mean``
(over samples not failed), ``eval_accuracy`` (the fraction with reward >= ``eval_correct_threshold``,
0-1), samples, failed, dropped, the token versions seen, seconds — go to ``metrics.jsonl`` as a row
with ``"kind": "eval"`` (``step`` = ``version`` = ``v``), to the gauges
``slipstream_eval_reward_mean`` / ``slipstream_eval_accuracy`` / ``slipstream_eval_policy_version``,
and to an ``eval`` event. A round that comes due while the previous one is still open is skipped
(counted). After the last step the learner waits (``final_sync_s``) for an open round to finish.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import protocol
from buffer.leases import Lease, LeaseState, LeaseTable
from learner.config import DataSettings, EvaluationSettings
from learner.data.prompts import PromptSource
from learner.metrics import LearnerMetrics
from protocol.plumbing.process import wait_event

MAX_ATTEMPTS = 3
RECENT_ROUNDS = 4          # closed rounds whose ids still answer "duplicate" (else "stale")


@dataclass
class EvalRound:
    number: int
    version: int
    started_s: float
    unsent: deque[tuple[str, dict]] = field(default_factory=deque)   # (id, prompt) never issued
    retry: deque[Lease] = field(default_factory=deque)               # lost leases (sent first)
    rewards: list[float] = field(default_factory=list)
    failed: int = 0
    dropped: int = 0
    token_versions: list[int] = field(default_factory=list)      # min and max of every sample


class Evaluation:
    """Evaluation rounds (see the module docstring). Driven by calls, like Admission: the service
    calls :meth:`maybe_start` after each version, routes results through :meth:`receive`; Admission
    calls :meth:`wants`, :meth:`take`, :meth:`outstanding`, :meth:`release_holder`, :meth:`refused`
    and :meth:`expire` (its :class:`learner.serve.admission.SideWork` port).

    Args:
        prompts: the round's prompts (stream items with ``prompt_token_ids``).
        prefix: assignment ids start with this (``<run_id>-e``).
        every: a round every this many versions.
        sampling: the SamplingParams of every eval assignment.
        version: the learner's version now.
        record: writes one metrics.jsonl row.
    """

    def __init__(self, prompts: list[dict], *, prefix: str, every: int, sampling: protocol.SamplingParams,
                 version: Callable[[], int], metrics: LearnerMetrics, record: Callable[[dict], None],
                 log: Callable[..., None] = lambda event, **fields: None, lease_timeout_s: float = 120.0,
                 correct_threshold: float = 1.0, max_attempts: int = MAX_ATTEMPTS,
                 clock: Callable[[], float] = time.monotonic,
                 distrusted: Callable[[str], set[int] | None] = lambda server_id: None):
        if not prompts:
            raise ValueError("an evaluation needs prompts")
        self.prompts, self.prefix, self.every, self.sampling = prompts, prefix, every, sampling
        self.version, self.metrics, self.record, self.log = version, metrics, record, log
        self.lease_timeout_s, self.correct_threshold = lease_timeout_s, correct_threshold
        self.max_attempts, self.clock = max_attempts, clock
        # Admission.distrusted: the versions a server applied with a wrong checksum; its eval
        # samples with a token of one are refused and re-issued, as the intake refuses its
        # training samples (their scores are not the policy's).
        self.distrusted = distrusted
        self.round: EvalRound | None = None
        self.rounds = 0
        self.last: dict[str, Any] | None = None       # the last complete round's numbers
        self._recent: deque[str] = deque(maxlen=RECENT_ROUNDS)   # prefixes of closed rounds
        # The open round's leases (a closed round has none left: each was answered or dropped).
        self.leases = LeaseTable(timeout_s=lease_timeout_s, max_attempts=max_attempts, clock=clock)
        self.idle = asyncio.Event()
        self.idle.set()

    @classmethod
    def from_config(cls, settings: EvaluationSettings, data: DataSettings, *, seed: int,
                    max_new_tokens: int, lease_timeout_s: float, tokenizer, encode, run_id: str,
                    stop: list[str] | tuple = (), stop_token_ids: list[int] | tuple = (),
                    max_turns: int = 1, max_episode_tokens: int | None = None,
                    **kwargs) -> Evaluation:
        """The evaluation of ``learner.evaluation`` (``every`` > 0): ``prompts`` prompts of its
        ``data``, formatted and tokenized like the training prompts (``learner.data``)."""
        source = PromptSource.from_config(data, seed=seed, eval_data=settings.data, tokenizer=tokenizer,
                                          encode=encode)
        rows = source.rows                      # None: an endless built-in task
        if rows is None and not settings.prompts:
            raise protocol.StartupError(f"learner.evaluation.prompts: evaluation.data {settings.data} is an "
                                        "endless built-in task; set evaluation.prompts to a number of prompts")
        n = settings.prompts if rows is None else min(settings.prompts or rows, rows)   # each row once
        prompts = [{**p, "prompt_id": f"e{i}"} for i, p in enumerate(source.take(n))]
        sampling = protocol.SamplingParams(temperature=settings.temperature, top_p=1.0, top_k=0,
                                           max_new_tokens=max_new_tokens, stop=list(stop),
                                           stop_token_ids=list(stop_token_ids), max_turns=max_turns,
                                           max_episode_tokens=max_episode_tokens if max_turns > 1 else None)
        return cls(prompts, prefix=f"{run_id}-e", every=settings.every, sampling=sampling,
                   lease_timeout_s=lease_timeout_s, correct_threshold=settings.correct_threshold, **kwargs)

    # ---- rounds --------------------------------------------------------------------------------
    def maybe_start(self, version: int) -> bool:
        """Start a round at ``version`` if one is due; True if it started."""
        if not self.every or version % self.every:
            return False
        if self.round is not None:
            self.metrics.eval_rounds.labels(outcome="skipped").inc()
            self.log("eval_skipped", level="warning", eval_version=version,
                     open_round_version=self.round.version, waiting=self._open_count(),
                     hint="the previous evaluation is still running: raise eval_every or add servers")
            return False
        self.rounds += 1
        r = self.round = EvalRound(self.rounds, version, self.clock())
        r.unsent.extend((f"{self.prefix}{r.number}.{k}", p) for k, p in enumerate(self.prompts))
        self.idle.clear()
        self.log("eval_started", eval_version=version, prompts=len(self.prompts))
        return True

    def owns(self, assignment_id: str) -> bool:
        return assignment_id.startswith(self.prefix)

    def outstanding(self, server_id: str) -> int:
        """Eval samples ``server_id`` holds (one per held assignment)."""
        return self.leases.held_samples(server_id)

    def _open_count(self) -> int:
        r = self.round
        return 0 if r is None else len(r.unsent) + len(self.leases)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the open round to finish; True if none is open."""
        return await wait_event(self.idle, timeout_s)

    # ---- handing out work (Admission's SideWork port) ------------------------------------------
    def wants(self, server_version: int) -> bool:
        """There is eval work a server at ``server_version`` may take (the round's version or newer,
        so its completions are that version's)."""
        r = self.round
        return r is not None and bool(r.unsent or r.retry) and server_version >= r.version

    def take(self, server_id: str) -> protocol.Assignment | None:
        """Lease the next eval assignment (re-issues first) to ``server_id``; None when none waits."""
        r = self.round
        if r is None:
            return None
        while r.retry:
            lease = r.retry.popleft()
            if self.leases.get(lease.assignment_id) is lease and lease.state is LeaseState.EXPIRED:
                return self._assignment(self.leases.reissue(lease, server_id))
            # else answered meanwhile by an earlier holder (the first copy wins)
        if r.unsent:
            aid, prompt = r.unsent.popleft()
            return self._assignment(self.leases.issue(aid, server_id, 1, payload=prompt, version=r.version))
        return None

    def _assignment(self, lease: Lease) -> protocol.Assignment:
        p = lease.payload
        return protocol.Assignment(
            assignment_id=lease.assignment_id, prompt_id=p["prompt_id"],
            prompt_token_ids=p["prompt_token_ids"], group_size=1, version=self.version(),
            prompt_text=p["prompt"], sampling=self.sampling,
            metadata={**({"answer": p["answer"]} if p["answer"] is not None else {}), **p.get("metadata", {})},
            deadline_s=self.lease_timeout_s, attempt=lease.attempt)

    # ---- losing leases (called by Admission) -----------------------------------------------------
    def _lost(self, lost: tuple[list[Lease], list[Lease]], reason: str) -> None:
        retry, exhausted = lost
        r = self.round
        if r is None:
            return
        r.retry.extend(retry)
        for lease in exhausted:
            r.dropped += 1
            self.log("eval_dropped", assignment_id=lease.assignment_id, reason=reason,
                     attempts=lease.attempt)
        if exhausted:
            self._maybe_finish()

    def release_holder(self, server_id: str) -> None:
        """``server_id`` is gone: its eval assignments are re-issued (or dropped when out of attempts)."""
        self._lost(self.leases.release_holder(server_id), "server_lost")

    def refused(self, server_id: str, assignment_id: str) -> None:
        self._lost(self.leases.release(assignment_id, server_id), "refused")

    def expire(self) -> None:
        self._lost(self.leases.expire(), "expired")

    # ---- results -------------------------------------------------------------------------------
    async def receive(self, msg: protocol.RolloutResult,
                      train: Callable[[protocol.RolloutResult], Awaitable[protocol.Ack]]) -> protocol.Ack:
        """The Ack for ``msg``: eval samples are taken here, the rest go to ``train`` (Intake)."""
        if not any(self.owns(s.assignment_id) for s in msg.samples):
            return await train(msg)
        rest = [s for s in msg.samples if not self.owns(s.assignment_id)]
        by_id: dict[str, str] = {}
        if rest:
            ack = await train(protocol.RolloutResult(server_id=msg.server_id, samples=rest))
            by_id = dict(zip(ack.sample_ids, ack.statuses))
        statuses = []
        bad = self.distrusted(msg.server_id)
        for s in msg.samples:
            if self.owns(s.assignment_id):
                status = self._take(s) if not (bad and self._unverified(s, bad, msg.server_id)) else "invalid"
                self.metrics.eval_samples.labels(status=status).inc()
            else:
                status = by_id[s.sample_id]
            statuses.append(status)
        self._maybe_finish()
        return protocol.Ack(sample_ids=[s.sample_id for s in msg.samples], statuses=statuses)

    def _unverified(self, s: protocol.Sample, bad: set[int], server_id: str) -> bool:
        """``s`` has a token of a version its server applied with a wrong checksum: refused, its
        lease re-issued now (True)."""
        if not len(s.token_versions) or bad.isdisjoint(np.unique(s.token_versions).tolist()):
            return False
        self.log("eval_sample_invalid", sample_id=s.sample_id[:200], server=server_id[:200],
                 reason="unverified_weights")
        if self.round is not None and self.leases.get(s.assignment_id) is not None:
            self._lost(self.leases.release(s.assignment_id, server_id), "unverified_weights")
        return True

    def _take(self, s: protocol.Sample) -> str:
        r = self.round
        lease = self.leases.get(s.assignment_id) if r is not None else None
        if lease is None:
            if r is not None and s.assignment_id.startswith(f"{self.prefix}{r.number}."):
                return "duplicate"             # this round's, already answered (or dropped)
            closed = any(s.assignment_id.startswith(p) for p in self._recent)
            return "duplicate" if closed else "stale"
        n = len(s.completion_token_ids)
        if (s.sample_id != protocol.sample_id(s.assignment_id, 0) or s.group_size != 1
                or n > (self.sampling.max_new_tokens if s.turn_spans is None else self.sampling.episode_tokens)
                or s.turns > self.sampling.max_turns
                or (n and int(np.max(s.token_versions)) > self.version())
                or not np.array_equal(s.prompt_token_ids, lease.payload["prompt_token_ids"])):
            self.log("eval_sample_invalid", sample_id=s.sample_id[:200])
            return "invalid"                   # the lease stays: it expires and is re-issued
        self.leases.complete(s.assignment_id)
        if s.failed:
            r.failed += 1
        else:
            r.rewards.append(float(s.reward))
        if n:
            r.token_versions += [int(np.min(s.token_versions)), int(np.max(s.token_versions))]
        return "accepted"

    def _maybe_finish(self) -> None:
        r = self.round
        if r is None or r.unsent or len(self.leases):
            return
        self.round = None
        self._recent.append(f"{self.prefix}{r.number}.")
        rewards = r.rewards
        nan = float("nan")
        mean = sum(rewards) / len(rewards) if rewards else nan
        accuracy = (sum(1 for x in rewards if x >= self.correct_threshold) / len(rewards)) if rewards else nan
        row = {"eval_version": r.version, "eval_reward_mean": mean, "eval_accuracy": accuracy,
               "eval_samples": len(rewards), "eval_failed": r.failed, "eval_dropped": r.dropped,
               "eval_token_version_min": min(r.token_versions, default=-1),
               "eval_token_version_max": max(r.token_versions, default=-1),
               "eval_seconds": self.clock() - r.started_s}
        self.last = row
        m = self.metrics
        m.eval_reward_mean.set(mean)
        m.eval_accuracy.set(accuracy)
        m.eval_version.set(r.version)
        m.eval_rounds.labels(outcome="complete").inc()
        self.record(row)
        self.log("eval", **{k: (round(v, 5) if isinstance(v, float) and math.isfinite(v) else v)
                            for k, v in row.items()})
        self.idle.set()

    def status(self) -> dict:
        r = self.round
        return {"rounds": self.rounds, "last": self.last,
                "open": None if r is None else {"version": r.version, "waiting": len(r.unsent) + len(r.retry),
                                                "open": self._open_count()}}
