"""Intake: every returned sample is checked against the run before the buffer may accept it.

``protocol`` checks what a message can say about itself (types, finite log-probs, array lengths
that agree, non-negative versions); the buffer checks what it knows (the assignment exists, the
slot is free, the staleness limit, no token newer than the learner's version at its last token).
What only the learner knows is checked here, before ``buffer.put``, so a hostile or broken server
cannot get a sample into a training batch that the trainer cannot take (an out-of-vocabulary id
crashed the step once) or that is not what was asked for:

    sample_id    == protocol.sample_id(assignment_id, group_index)   (dedupe keys cannot be forged)
    group_size   == the run's group_size
    completion   <= the assignment's sampling.max_new_tokens tokens
    token ids    0 <= id < vocab_size, prompt and completion
    versions     every token's version <= the learner's version (all of them, not only the last)
    prompt       == the prompt the learner issued for the assignment (while the lease is open)
    reward       |reward| <= max_abs_reward (the protocol only asks for finite: one sample's 1e30
                 overflows the group statistics in float32 and makes the whole step NaN)

A sample that passes is stamped with the sampling temperature of the assignment the learner issued
(``metadata["sampling_temperature"]``, :meth:`Intake.stamp`), which the trainer's passes use.

A sample failing one is acknowledged ``invalid`` (final: the server forgets it) and counted in
``slipstream_samples_invalid_total{reason}``; its slot stays in flight, so the assignment is
re-issued when its lease expires — the gate does not drift, and the prompt is not lost.

Only an open assignment (one with a lease) can put a sample into the buffer; for any other the
buffer answers ``duplicate``, ``stale`` or ``invalid`` without keeping it, so the prompt check
needs the lease's assignment only while it exists.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

import protocol
from buffer import AckStatus, RolloutBuffer
from learner.batching import SAMPLING_TEMPERATURE
from learner.metrics import LearnerMetrics

REASONS = ("sample_id", "group_size", "length", "vocab", "version", "prompt", "reward")


class Intake:
    """Checks samples (see the module docstring) and puts the good ones into the buffer.

    Args:
        buffer: the run's RolloutBuffer.
        vocab_size: rows of the model's input embedding; every token id must be below it.
        max_new_tokens: the completion limit when the assignment is not known any more.
        version: the learner's policy version now.
    """

    def __init__(self, buffer: RolloutBuffer, *, vocab_size: int, max_new_tokens: Callable[[], int],
                 version: Callable[[], int], metrics: LearnerMetrics,
                 max_abs_reward: Callable[[], float] = lambda: 1e6,
                 log: Callable[..., None] = lambda event, **fields: None):
        self.buffer = buffer
        self.vocab_size = int(vocab_size)
        self.max_new_tokens = max_new_tokens
        self.version = version
        self.max_abs_reward = max_abs_reward
        self.metrics = metrics
        self.log = log
        self.invalid = Counter()          # reason -> samples refused here

    def check(self, s: protocol.Sample, version: int) -> tuple[str, str] | None:
        """``(reason, message)`` for a sample the run cannot take; None if it passes."""
        if s.sample_id != protocol.sample_id(s.assignment_id, s.group_index):
            return "sample_id", (f"sample_id {s.sample_id!r} is not "
                                 f"{protocol.sample_id(s.assignment_id, s.group_index)!r}")
        if s.group_size != self.buffer.group_size:
            return "group_size", f"group_size {s.group_size} != the run's {self.buffer.group_size}"
        lease = self.buffer.leases.get(s.assignment_id)
        assignment = lease.payload if lease is not None else None
        limit = (assignment.sampling.max_new_tokens if isinstance(assignment, protocol.Assignment)
                 else self.max_new_tokens())
        completion = s.completion_token_ids
        n = len(completion)
        if n > limit:
            return "length", f"{n} completion tokens > max_new_tokens {limit}"
        vocab = self.vocab_size
        for name, ids in (("completion", completion), ("prompt", s.prompt_token_ids)):
            if len(ids) and (int(np.min(ids)) < 0 or int(np.max(ids)) >= vocab):
                bad = int(ids[(ids < 0) | (ids >= vocab)][0])
                return "vocab", f"{name} token id {bad} outside the vocabulary [0, {vocab})"
        if n and int(np.max(s.token_versions)) > version:
            return "version", (f"token version {int(np.max(s.token_versions))} is newer than the "
                               f"learner's {version}")
        limit = self.max_abs_reward()
        if not abs(s.reward) <= limit:
            return "reward", f"reward {s.reward!r} is beyond ±{limit:g} (learner.max_abs_reward)"
        if isinstance(assignment, protocol.Assignment) and not np.array_equal(
                s.prompt_token_ids, assignment.prompt_token_ids):
            return "prompt", f"prompt_token_ids differ from assignment {s.assignment_id!r}'s prompt"
        return None

    def stamp(self, s: protocol.Sample) -> None:
        """Write the temperature the learner asked for into ``s.metadata`` (learner.batching's
        :data:`SAMPLING_TEMPERATURE`; a server's own value under that key is replaced): the
        trainer recomputes the sample's log-probs at the temperature it was sampled at, even after
        a live ``ctl set temperature``."""
        lease = self.buffer.leases.get(s.assignment_id)
        assignment = lease.payload if lease is not None else None
        if isinstance(assignment, protocol.Assignment):
            s.metadata = {**s.metadata, SAMPLING_TEMPERATURE: float(assignment.sampling.temperature)}
        elif SAMPLING_TEMPERATURE in s.metadata:      # no assignment of ours: no value of theirs
            s.metadata = {k: v for k, v in s.metadata.items() if k != SAMPLING_TEMPERATURE}

    async def receive(self, msg: protocol.RolloutResult) -> protocol.Ack:
        """Check and put every sample of ``msg``; the Ack to send back (one status per sample)."""
        version = self.version()
        statuses: list[str] = []
        refused: list[tuple[str, str, str]] = []
        m = self.metrics
        for sample in msg.samples:
            problem = self.check(sample, version)
            if problem is None:
                self.stamp(sample)
                status = str(await self.buffer.put(sample, version))
            else:
                status = str(AckStatus.INVALID)
                reason, _ = problem
                self.invalid[reason] += 1
                m.samples_invalid.labels(reason=reason).inc()
                refused.append((sample.sample_id, *problem))
            statuses.append(status)
            m.samples.labels(status=status).inc()
        m.rollouts_received.inc(len(msg.samples))
        if refused:
            sid, reason, why = refused[0]
            self.log("samples_invalid", server=msg.server_id, count=len(refused), reason=reason,
                     first=sid[:200], error=why)
        return protocol.Ack(sample_ids=[s.sample_id for s in msg.samples], statuses=statuses)
