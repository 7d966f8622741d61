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
(``Sample.sampling_temperature``, :meth:`Intake.stamp`), which the trainer's passes use.

A sample failing one is acknowledged ``invalid`` (final: the server forgets it) and counted in
``slipstream_samples_invalid_total{reason}``; its slot stays in flight and its lease is released
at once (``release``: :meth:`learner.serve.admission.Admission.release_invalid`), so the
assignment is re-issued now, not at its deadline — at most ``max_attempts`` times, then given up
and counted failed. The gate does not drift, and the prompt is not lost to one bad answer. (The
buffer's own refusals, acked ``invalid`` too, release their lease the same way.)

Every result's outcome — valid samples, samples their server reported ``failed`` (a reward that
raised), invalid ones — goes to the :class:`learner.serve.sample_watch.SampleWatch` (``watch``),
which counts failures by reason, reports them, and stops a run that gets no valid sample.

Only an open assignment (one with a lease) can put a sample into the buffer; for any other the
buffer answers ``duplicate``, ``stale`` or ``invalid`` without keeping it, so the prompt check
needs the lease's assignment only while it exists.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

import protocol
from buffer import AckStatus, RolloutBuffer
from learner.metrics import LearnerMetrics

REASONS = ("sample_id", "group_size", "length", "turns", "vocab", "version", "prompt", "reward", "unverified_weights")


class Intake:
    """Checks samples (see the module docstring) and puts the good ones into the buffer.

    Args:
        buffer: the run's RolloutBuffer.
        vocab_size: rows of the model's input embedding; every token id must be below it.
        sampling: the ``learner.sampling`` section: its ``max_new_tokens`` is the completion
            limit when the assignment is not known any more (read at use).
        servers: the ``learner.servers`` section (``max_abs_reward``, read at use).
        version: the learner's policy version now.
        release: ``release(server_id, assignment_id)`` gives the lease of a refused sample back
            for re-issue (None: it waits for its deadline).
        watch: gets every result's outcome (a :class:`learner.serve.sample_watch.SampleWatch`).
        distrusted: ``distrusted(server_id)``, the versions that server applied with a wrong
            checksum (:meth:`learner.serve.admission.Admission.distrusted`): its samples with a
            token of one are refused (``unverified_weights``).
    """

    def __init__(self, buffer: RolloutBuffer, *, vocab_size: int, sampling: Any,
                 version: Callable[[], int], metrics: LearnerMetrics, servers: Any = None,
                 log: Callable[..., None] = lambda event, **fields: None,
                 release: Callable[[str, str], object] | None = None, watch: Any = None,
                 distrusted: Callable[[str], set[int] | None] | None = None):
        self.buffer = buffer
        self.vocab_size = int(vocab_size)
        self.sampling, self.servers = sampling, servers
        self.version = version
        self.metrics = metrics
        self.log = log
        self.invalid = Counter()          # reason -> samples refused here
        self._children: dict[str, object] = {}
        self.group_size = buffer.group_size
        self._in_range_assignment: protocol.Assignment | None = None
        self.release, self.watch, self.distrusted = release, watch, distrusted
        self._failed: list[str] = []      # Sample.failed of the failed samples of this result
        self._valid = 0                   # its samples accepted and not failed

    @property
    def max_abs_reward(self) -> float:
        """``learner.servers.max_abs_reward``, read at use (1e6 without a servers section)."""
        return 1e6 if self.servers is None else self.servers.max_abs_reward

    def check(self, s: protocol.Sample, version: int,
              assignment: protocol.Assignment | None | bool = False) -> tuple[str, str] | None:
        """``(reason, message)`` for a sample the run cannot take; None if it passes.
        ``assignment``: the open lease's Assignment (or None), when the caller looked it up."""
        if s.sample_id != protocol.sample_id(s.assignment_id, s.group_index):
            return "sample_id", (f"sample_id {s.sample_id!r} is not "
                                 f"{protocol.sample_id(s.assignment_id, s.group_index)!r}")
        if s.group_size != self.group_size:
            return "group_size", f"group_size {s.group_size} != the run's {self.group_size}"
        if assignment is False:
            assignment = self.assignment(s.assignment_id)
        sampling = assignment.sampling if assignment is not None else self.sampling
        completion = s.completion_token_ids
        n = len(completion)
        if s.turn_spans is None:
            limit = sampling.max_new_tokens
            if n > limit:
                return "length", f"{n} completion tokens > max_new_tokens {limit}"
        elif (problem := _episode_problem(s, sampling)) is not None:
            return problem
        vocab = self.vocab_size
        prompt = s.prompt_token_ids
        if n and not _in_range(completion, vocab):
            return _outside("completion", completion, vocab)
        # The prompt of an open lease is the one the learner issued: when it is the same, its
        # range check is that of the assignment's prompt, made once per assignment (the group's
        # samples arrive together) instead of once per sample.
        same_prompt = assignment is not None and _equal(prompt, assignment.prompt_token_ids)
        if (len(prompt) and not (same_prompt and self._prompt_in_range(assignment))
                and not _in_range(prompt, vocab)):
            return _outside("prompt", prompt, vocab)
        if n:
            tv = s.token_versions
            newest = int(tv.item(tv.argmax())) if tv.ndim == 1 else int(np.max(tv))
            if newest > version:
                return "version", f"token version {newest} is newer than the learner's {version}"
        limit = self.max_abs_reward
        if not abs(s.reward) <= limit:
            return "reward", f"reward {s.reward!r} is beyond ±{limit:g} (learner.servers.max_abs_reward)"
        if assignment is not None and not same_prompt:
            return "prompt", f"prompt_token_ids differ from assignment {s.assignment_id!r}'s prompt"
        return None

    def _prompt_in_range(self, assignment: protocol.Assignment) -> bool:
        """Every id of ``assignment``'s prompt is in the vocabulary (the last assignment found
        so is remembered; a re-issue is a new Assignment object, checked again)."""
        if assignment is self._in_range_assignment:
            return True
        prompt = assignment.prompt_token_ids
        if len(prompt) and not _in_range(prompt, self.vocab_size):
            return False
        self._in_range_assignment = assignment
        return True

    def assignment(self, assignment_id: str) -> protocol.Assignment | None:
        """The Assignment of the open lease ``assignment_id`` (None when there is none)."""
        lease = self.buffer.leases.get(assignment_id)
        payload = lease.payload if lease is not None else None
        return payload if isinstance(payload, protocol.Assignment) else None

    def stamp(self, s: protocol.Sample, assignment: protocol.Assignment | None | bool = False) -> None:
        """Write the temperature the learner asked for into ``s.sampling_temperature`` (the
        server's own value is replaced; no assignment of ours: no value of theirs, None): the
        trainer recomputes the sample's log-probs at the temperature it was sampled at, even after
        a live ``ctl set temperature``. ``s.metadata[protocol.DATASET_KEY]`` becomes the
        assignment's dataset of a mixture, or is removed: a server's word for it is not kept."""
        if assignment is False:
            assignment = self.assignment(s.assignment_id)
        s.sampling_temperature = (None if assignment is None
                                  else float(assignment.sampling.temperature))
        dataset = None if assignment is None else assignment.metadata.get(protocol.DATASET_KEY)
        if dataset is not None:              # a mixture's dataset: the learner's word, not the server's
            s.metadata = {**s.metadata, protocol.DATASET_KEY: dataset}
        elif protocol.DATASET_KEY in s.metadata:
            s.metadata = {k: v for k, v in s.metadata.items() if k != protocol.DATASET_KEY}

    async def receive(self, msg: protocol.RolloutResult) -> protocol.Ack:
        """Check and put every sample of ``msg``; the Ack to send back (one status per sample).

        The array checks of a result of several samples are made once (:func:`_arrays_pass`:
        one vocabulary and one version maximum over all the samples' tokens; :meth:`_put_each`).
        A result that fails them, and a result of one sample, go sample by sample through
        :meth:`check` (:meth:`_put_each` without ``mins``), which finds the first failing check
        of a sample, so the reasons are the same either way.
        """
        version = self.version()
        samples = msg.samples
        bad = self.distrusted(msg.server_id) if self.distrusted is not None else None
        if bad:
            hit = {i for i, x in enumerate(samples)
                   if len(x.token_versions) and not bad.isdisjoint(np.unique(x.token_versions).tolist())}
            if hit:
                return await self._receive_distrusted(msg, hit)
        # Each run of one assignment's samples, up to a group, is checked and put as a result of
        # those samples alone would be (several runs: a burst's results merged by
        # ResultIngress.receive_held). One sample: check() as it is (the batch pass would only
        # add to it); a whole group goes in at once where it can.
        statuses, refused, completed = [], [], False
        self._failed, self._valid = failed, _ = [], 0
        vocab, put_each = self.vocab_size, self._put_each
        for start, end in _runs(samples, self.group_size):
            run = samples[start:end]
            mins = _arrays_pass(run, vocab, version) if end - start > 1 else None
            st, rf, done = put_each(run, version, mins, msg.server_id)
            statuses += st
            refused += rf
            completed |= done
        if completed:           # one wake-up for the groups this result completed
            await self.buffer.wake()
        m = self.metrics
        counted = self._status_counters
        if statuses and (len(statuses) == 1 or all(x == statuses[0] for x in statuses)):
            counted(statuses[0]).inc(len(statuses))
        else:                       # several statuses, or none (an empty result)
            for status, k in Counter(statuses).items():
                counted(status).inc(k)
        m.rollouts_received.inc(len(samples))
        if refused:
            sid, reason, why = refused[0]
            self.log("samples_invalid", server=msg.server_id, count=len(refused), reason=reason,
                     first=sid[:200], error=why)
        invalid = statuses.count(INVALID)
        if invalid and self.release is not None:
            for aid in {s.assignment_id for s, st in zip(samples, statuses) if st == INVALID}:
                self.release(msg.server_id, aid)
        if self.watch is not None:
            error = refused[0][2] if refused else self.buffer.last_invalid_reason if invalid else ""
            self.watch.observe(self._valid, failed, invalid, error)
            if self.buffer.uniform_streak:
                self.watch.uniform(self.buffer.uniform_streak)
        return protocol.Ack(sample_ids=[s.sample_id for s in samples], statuses=statuses)

    async def _receive_distrusted(self, msg: protocol.RolloutResult, hit: set[int]) -> protocol.Ack:
        """A result some of whose samples (``hit``) carry tokens of a version the server applied
        with a wrong checksum: those are refused (``unverified_weights``), their leases released;
        the rest are received as a result of their own."""
        samples = msg.samples
        refused: list[tuple[str, str, str]] = []
        why = ("unverified_weights", "generated on weights whose checksum is not the published one")
        statuses = {i: self._refuse(samples[i], why, refused) for i in sorted(hit)}
        self._status_counters(INVALID).inc(len(hit))
        self.metrics.rollouts_received.inc(len(hit))
        sid, reason, message = refused[0]
        self.log("samples_invalid", server=msg.server_id, count=len(refused), reason=reason,
                 first=sid[:200], error=message)
        rest = [x for i, x in enumerate(samples) if i not in hit]
        if rest:
            ack = await self.receive(protocol.RolloutResult(server_id=msg.server_id, samples=rest))
            others = iter(ack.statuses)
        else:
            others = iter(())
        if self.release is not None:
            for aid in {samples[i].assignment_id for i in hit}:
                self.release(msg.server_id, aid)
        if self.watch is not None:
            self.watch.observe(0, [], len(hit), message)
        return protocol.Ack(sample_ids=[x.sample_id for x in samples],
                            statuses=[statuses[i] if i in statuses else next(others) for i in range(len(samples))])

    def _put_each(self, samples: list[protocol.Sample], version: int, mins: list[int] | None = None,
                  sender: str | None = None) -> tuple[list[str], list[tuple[str, str, str]], bool]:
        """Sample by sample into the buffer: the statuses, the refusals ``(sample_id, reason,
        message)``, and whether a group was completed. ``mins`` None (a one-sample result, or
        arrays that failed :func:`_arrays_pass`): each sample through :meth:`check`, the
        reference. ``mins`` given (the arrays passed; each sample's oldest version): a sample of
        an open lease is checked here for what :meth:`check` checks besides the arrays; any
        other, or one that fails, still goes through :meth:`check`. ``sender``: the server the
        result came from (only a lease's holder is credited with delivering it)."""
        if mins is not None and len(samples) == self.group_size:
            whole = self._put_group(samples, version, mins, sender)
            if whole is not None:
                return whole
        statuses: list[str] = []
        refused: list[tuple[str, str, str]] = []
        completed = False
        put = self.buffer.put_nowait
        assignment_of = self.assignment
        group_size = self.group_size
        reward_limit = self.max_abs_reward
        same = None                 # (assignment, prompt) last found equal, for the group's next
        for i, sample in enumerate(samples):
            # Per sample (a put that completes a group ends its lease), once for check and stamp.
            assignment = assignment_of(sample.assignment_id)
            oldest = None if mins is None else mins[i]
            problem = None
            if (oldest is not None and assignment is not None
                    and sample.sample_id == _sample_id(sample.assignment_id, sample.group_index)
                    and sample.group_size == group_size
                    and len(sample.completion_token_ids) <= assignment.sampling.max_new_tokens
                    and sample.turn_spans is None and abs(sample.reward) <= reward_limit):
                prompt = sample.prompt_token_ids
                if same is None or same[0] is not assignment or same[1] is not prompt:
                    if (_equal(prompt, assignment.prompt_token_ids)
                            and self._prompt_in_range(assignment)):
                        same = (assignment, prompt)
                    else:
                        problem = self.check(sample, version, assignment)
            else:
                problem = self.check(sample, version, assignment)
            if problem is None:
                self.stamp(sample, assignment)
                status, done = put(sample, version, oldest, sender)
                completed |= done
                if sample.failed is not None:         # reported failed (later members: duplicates)
                    self._failed.append(sample.failed)
                elif status is _ACCEPTED:
                    self._valid += 1
                # the member's str, without Enum's Python-level ``value`` property
                statuses.append(ACCEPTED if status is _ACCEPTED else status.value)
            else:
                statuses.append(self._refuse(sample, problem, refused))
        return statuses, refused, completed

    def _put_group(self, samples: list[protocol.Sample], version: int,
                   mins: list[int], sender: str | None = None) -> tuple[list[str], list, bool] | None:
        """A whole group of one open lease in one result (what a rollout server sends): every
        sample passes :meth:`check` (their arrays passed, ``mins``) and the buffer takes them at
        once (``RolloutBuffer.put_group_nowait``). None, with nothing changed, when any of that
        does not hold: :meth:`_put_each` then goes sample by sample. The same outcome as
        sample by sample: the lease stays open until the last of them completes the group, so
        each is checked against the same assignment."""
        aid = samples[0].assignment_id
        assignment = self.assignment(aid)
        if assignment is None:
            return None
        limit = assignment.sampling.max_new_tokens
        reward_limit = self.max_abs_reward
        group_size = self.group_size
        issued = assignment.prompt_token_ids
        same = None                             # the prompt array last found equal to issued
        for s in samples:
            if not (s.assignment_id == aid and s.sample_id == _sample_id(aid, s.group_index)
                    and s.group_size == group_size and len(s.completion_token_ids) <= limit
                    and s.turn_spans is None and abs(s.reward) <= reward_limit):
                return None
            prompt = s.prompt_token_ids
            if prompt is not same:
                if not _equal(prompt, issued):
                    return None
                same = prompt
        if not (self._prompt_in_range(assignment)
                and self.buffer.put_group_nowait(samples, version, mins, sender)):
            return None
        for s in samples:
            self.stamp(s, assignment)
        self._valid += len(samples)
        return [ACCEPTED] * len(samples), [], True

    def _refuse(self, sample: protocol.Sample, problem: tuple[str, str],
                refused: list[tuple[str, str, str]]) -> str:
        """Count a sample refused here (``problem``: reason, message); its status."""
        reason = problem[0]
        self.invalid[reason] += 1
        self.metrics.samples_invalid.labels(reason=reason).inc()
        refused.append((sample.sample_id, *problem))
        return INVALID

    def _status_counters(self, status: str):
        """``slipstream_samples_total{status}``'s child, looked up once per status (labels() costs
        a lock and a dict lookup per call, on every sample otherwise)."""
        child = self._children.get(status)
        if child is None:
            child = self._children[status] = self.metrics.samples.labels(status=status)
        return child


ACCEPTED, INVALID = AckStatus.ACCEPTED.value, AckStatus.INVALID.value
_ACCEPTED = AckStatus.ACCEPTED
_INT32, _UINT32 = np.dtype(np.int32), np.dtype(np.uint32)
_concatenate, _ndarray, _minimum_at = np.concatenate, np.ndarray, np.minimum.reduceat


_sample_id = protocol.sample_id


def _arrays_pass(samples: list[protocol.Sample], vocab: int, version: int) -> list[int] | None:
    """Each sample's oldest token version (-1 without tokens) if every completion id of every
    sample is in ``[0, vocab)`` and every token version is ``<= version`` (:meth:`Intake.check`'s
    two array checks); else None, and also None when the arrays are not all 1-D int32 (then each
    sample is checked on its own, which names the failing one). The arrays of each kind are
    concatenated: one vocabulary ``argmax``, one version ``argmax`` and one ``minimum.reduceat``
    for all the samples, instead of three passes a sample (the buffer's minimum is the third)."""
    if not samples:
        return []
    try:
        ids = _concatenate([s.completion_token_ids for s in samples])
        versions = _concatenate([s.token_versions for s in samples])
    except (ValueError, TypeError):
        return None
    if ids.dtype != _INT32 or versions.dtype != _INT32 or ids.ndim != 1 or versions.ndim != 1:
        return None
    if not len(versions):
        return [-1] * len(samples)
    if not (_in_range(ids, vocab) and versions.item(versions.argmax()) <= version):
        return None
    starts, start = [], 0
    for s in samples:
        n = len(s.token_versions)
        if not n:                   # reduceat takes an empty segment's next element
            return None
        starts.append(start)
        start += n
    return _minimum_at(versions, starts).tolist()


def _runs(samples: list[protocol.Sample], limit: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of consecutive samples with one assignment id, cut after
    ``limit`` samples (a group's size: a whole group in one run is put at once)."""
    runs = []
    start, aid = 0, samples[0].assignment_id if samples else None
    for i, s in enumerate(samples):
        if s.assignment_id != aid or i - start == limit:
            runs.append((start, i))
            start, aid = i, s.assignment_id
    if samples:
        runs.append((start, len(samples)))
    return runs


def _in_range(ids: np.ndarray, vocab: int) -> bool:
    """0 <= every id < vocab. For int32 ids one pass does both bounds: viewed as uint32, a
    negative id is >= 2**31 > any vocabulary size. ``argmax`` + ``item`` costs a third of
    ``max()`` on a 1k-token array (no reduction machinery); it is what the hot path needs."""
    if ids.dtype == _INT32 and ids.ndim == 1:
        u = ids.view(_UINT32)
        return u.item(u.argmax()) < vocab
    return int(np.min(ids)) >= 0 and int(np.max(ids)) < vocab


def _episode_problem(s: protocol.Sample, sampling: Any) -> tuple[str, str] | None:
    """A multi-turn sample (``turn_spans``) against its assignment's episode limits: at most
    ``max_turns`` turns, each at most ``max_new_tokens``, the whole at most ``episode_tokens``."""
    n, turns = len(s.completion_token_ids), s.turns
    if turns > sampling.max_turns:
        return "turns", f"{turns} turns > max_turns {sampling.max_turns}"
    if n > sampling.episode_tokens:
        return "length", f"{n} episode tokens > max_episode_tokens {sampling.episode_tokens}"
    spans = s.turn_spans
    longest = int((spans[1::2] - spans[0::2]).max())
    if longest > sampling.max_new_tokens:
        return "length", f"a turn of {longest} tokens > max_new_tokens {sampling.max_new_tokens}"
    return None


def _outside(name: str, ids: np.ndarray, vocab: int) -> tuple[str, str]:
    bad = int(ids[(ids < 0) | (ids >= vocab)][0])
    return "vocab", f"{name} token id {bad} outside the vocabulary [0, {vocab})"


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """np.array_equal for two 1-D int32 prompts, without its Python-level overhead."""
    if a.dtype == b.dtype == _INT32 and a.ndim == b.ndim == 1:
        return len(a) == len(b) and a.tobytes() == b.tobytes()
    return bool(np.array_equal(a, b))
