"""Pipeline without a socket or a model: admission limits, one generate call per batch, sampling
passed through unchanged, sample ids, failures per sample (engine, reward, reward timeout)."""

from __future__ import annotations

import asyncio
import sys
import time
import types

import numpy as np
import pytest
from fake_learner import assignment

import protocol
from rollout_server.engine import Completion
from rollout_server.metrics import RolloutMetrics
from rollout_server.pipeline import Limits, Pipeline, Refused
from rollout_server.rewards import Rewarder

LIMITS = Limits(max_concurrency=8, max_new_tokens=32, max_prompt_tokens=16, vocab_size=100)


class Engine:
    """Completions of ``max_new_tokens`` tokens counting up from the prompt's last id."""

    def __init__(self, fail: bool = False):
        self.calls: list[list] = []
        self.fail = fail

    async def generate(self, requests):
        self.calls.append(requests)
        if self.fail:
            raise RuntimeError("device lost")
        out = []
        for r in requests:
            toks = np.arange(r.max_new_tokens, dtype=np.int32) + int(r.prompt_token_ids[-1])
            out.append([Completion(toks, np.full(len(toks), -0.5, np.float32),
                                   np.zeros(len(toks), np.int32), "length") for _ in range(r.n)])
        return out

    @staticmethod
    def decode(token_ids) -> str:
        return " ".join(str(t) for t in token_ids)


class Harness:
    def __init__(self, engine=None, rewarder=None, limits=LIMITS):
        self.engine = engine or Engine()
        self.rewarder = rewarder or Rewarder("builtin:exact_numeric")
        self.metrics = RolloutMetrics()
        self.emitted: list[protocol.RolloutResult] = []
        self.released: list[int] = []
        self.order: list[str] = []
        self.done = asyncio.Event()

        async def emit(result):
            self.order.append("emit")
            self.emitted.append(result)

        async def release(n):
            self.released.append(n)
            self.done.set()

        async def before_batch(batch):
            self.order.append("weights")

        async def generate(requests):
            self.order.append("generate")
            return await self.engine.generate(requests)

        self.pipeline = Pipeline(server_id="s", limits=limits, generate=generate,
                                 decode=self.engine.decode, score=self.rewarder.score_many,
                                 emit=emit, release=release, before_batch=before_batch,
                                 metrics=self.metrics, log=lambda *a, **k: None)

    def samples(self) -> dict[str, protocol.Sample]:
        return {s.sample_id: s for r in self.emitted for s in r.samples}


async def test_assignments_queued_together_share_one_generate_call():
    h = Harness()
    for aid in ("a1", "a2", "a3"):
        h.pipeline.admit(assignment(aid, [1, 7], group_size=2, max_new_tokens=3))
    assert h.pipeline.assigned == 6
    task = asyncio.create_task(h.pipeline.run())   # starts after all three are queued
    try:
        await asyncio.wait_for(h.done.wait(), 30)
    finally:
        task.cancel()
    assert len(h.engine.calls) == 1 and len(h.engine.calls[0]) == 3
    assert h.order == ["weights", "generate", "emit", "emit", "emit"]
    assert h.released == [6] and h.pipeline.assigned == 0
    assert sorted(h.samples()) == ["a1/0", "a1/1", "a2/0", "a2/1", "a3/0", "a3/1"]
    s = h.samples()["a2/1"]
    assert (s.assignment_id, s.group_index, s.group_size) == ("a2", 1, 2)
    assert s.completion_text == "7 8 9" and s.failed is None


def _with_window(h: Harness, seconds: float) -> Harness:
    h.pipeline.batch_wait_s = seconds
    return h


async def test_a_burst_joins_one_generate_call_and_starts_on_its_last_assignment():
    """Assignment.burst_left: the learner's burst of 3 arrives one by one (the loop runs between
    them); all three share one generate call, which starts when the one saying "none follow"
    arrives, not after the window (60 s here: waiting it out would time the test out)."""
    h = _with_window(Harness(), 60.0)
    task = asyncio.create_task(h.pipeline.run())
    try:
        for i, left in enumerate((2, 1)):
            h.pipeline.admit(assignment(f"a{i}", [1, 7], group_size=2, max_new_tokens=3, burst_left=left))
            for _ in range(5):
                await asyncio.sleep(0)                # the pipeline runs, and must keep waiting
            assert h.engine.calls == []
        h.pipeline.admit(assignment("a2", [1, 7], group_size=2, max_new_tokens=3, burst_left=0))
        await asyncio.wait_for(h.done.wait(), 30)
    finally:
        task.cancel()
    assert len(h.engine.calls) == 1 and len(h.engine.calls[0]) == 3


async def test_work_that_does_not_say_waits_the_window_and_a_lost_tail_cannot_hold_it_longer():
    """burst_left -1 (a 3.1 learner, evaluation work) waits the whole window for more, as before;
    a burst whose last assignment never comes (refused, or lost) waits no longer than the window."""
    for first in (-1, 5):
        h = _with_window(Harness(), 1.0)
        h.pipeline.admit(assignment("a", [1, 7], group_size=2, max_new_tokens=3, burst_left=first))
        task = asyncio.create_task(h.pipeline.run())
        try:
            started = time.monotonic()
            await asyncio.sleep(0.01)
            h.pipeline.admit(assignment("b", [1, 7], group_size=2, max_new_tokens=3, burst_left=first))
            await asyncio.wait_for(h.done.wait(), 30)
        finally:
            task.cancel()
        assert len(h.engine.calls) == 1 and len(h.engine.calls[0]) == 2, first
        assert time.monotonic() - started >= 0.99, first


async def test_sampling_reaches_the_engine_unchanged():
    h = Harness()
    a = assignment("a", [1, 2], max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=5)
    await h.pipeline.run_batch([a])
    (r,) = h.engine.calls[0]
    assert (r.temperature, r.top_p, r.top_k, r.max_new_tokens, r.n) == (0.7, 0.9, 5, 7, 2)
    # One set of defaults: an assignment that leaves sampling out gets the protocol's.
    default = protocol.Assignment(assignment_id="d", prompt_id="d",
                                  prompt_token_ids=np.array([1], np.int32), group_size=1, version=0)
    await h.pipeline.run_batch([default])
    (r,) = h.engine.calls[1]
    d = protocol.SamplingParams()
    assert (r.temperature, r.top_p, r.top_k, r.max_new_tokens) == (
        d.temperature, d.top_p, d.top_k, d.max_new_tokens)


@pytest.mark.parametrize("kind, make", [
    ("assignment_group_size", lambda: assignment("x", [1], group_size=9)),
    ("assignment_max_new_tokens", lambda: assignment("x", [1], max_new_tokens=33)),
    ("assignment_prompt", lambda: assignment("x", [])),
    ("assignment_prompt", lambda: assignment("x", [1] * 17)),
    ("assignment_prompt", lambda: assignment("x", [1, 100])),
    ("assignment_prompt", lambda: assignment("x", [-1, 5])),
])
def test_admission_refuses_what_this_server_does_not_run(kind, make):
    h = Harness()
    with pytest.raises(Refused) as e:
        h.pipeline.admit(make())
    assert e.value.kind == kind
    assert h.pipeline.assigned == 0 and h.pipeline.queue == []


def test_admission_refuses_work_beyond_the_credits_granted():
    h = Harness()
    for i in range(4):
        h.pipeline.admit(assignment(f"a{i}", [1], group_size=2))       # 8 of 8 credits
    with pytest.raises(Refused) as e:
        h.pipeline.admit(assignment("more", [1], group_size=1))
    assert e.value.kind == "assignment_over_credit" and h.pipeline.assigned == 8


def test_admission_keeps_room_in_the_engine_context():
    h = Harness(limits=Limits(max_concurrency=8, max_new_tokens=32, max_prompt_tokens=16,
                              vocab_size=100, max_model_len=10))
    h.pipeline.admit(assignment("ok", [1] * 9))
    with pytest.raises(Refused, match=r"1\.\.9"):
        h.pipeline.admit(assignment("long", [1] * 10))


async def test_an_engine_failure_fails_the_samples_not_the_pipeline():
    h = Harness(engine=Engine(fail=True))
    h.pipeline.admit(assignment("a", [1], group_size=3))
    await h.pipeline.run_batch(h.pipeline.queue)
    samples = h.samples()
    assert sorted(samples) == ["a/0", "a/1", "a/2"]
    for s in samples.values():
        assert s.finish_reason == "error" and "device lost" in s.failed
        assert len(s.completion_token_ids) == 0
    assert h.metrics.error_count("generate") == 3
    assert h.released == [3]
    protocol.decode(protocol.encode(h.emitted[0]))     # failed samples are valid on the wire


@pytest.fixture
def slow_reward():
    mod = types.ModuleType("slipstream_pipeline_rewards")
    release = __import__("threading").Event()

    def slow(prompt, completion, metadata):
        release.wait(10)              # returns once the test is done with it
        return 1.0

    def boom(prompt, completion, metadata):
        raise RuntimeError("judge exploded")

    mod.slow, mod.boom = slow, boom
    sys.modules[mod.__name__] = mod
    yield mod.__name__
    release.set()
    del sys.modules[mod.__name__]


async def test_reward_failures_and_timeouts_fail_their_samples(slow_reward):
    m = slow_reward
    h = Harness(rewarder=Rewarder([f"{m}:slow"], threads=2, timeout_s=0.2))
    start = time.monotonic()
    await h.pipeline.run_batch([assignment("t", [1], group_size=2)])
    assert time.monotonic() - start < 5                           # not the reward's 10 s
    for s in h.samples().values():
        assert "timed out after 0.2s" in s.failed
    assert h.metrics.error_count("reward_timeout") == 2 and h.metrics.error_count("reward") == 0
    h2 = Harness(rewarder=Rewarder([f"{m}:boom"]))
    await h2.pipeline.run_batch([assignment("b", [1], group_size=2)])
    assert all("judge exploded" in s.failed for s in h2.samples().values())
    assert h2.metrics.error_count("reward") == 2


async def test_idle_ratio_is_the_time_not_generating_since_the_last_call():
    now = {"t": 100.0}
    release = asyncio.Event()

    async def generate(requests):
        now["t"] += 3.0                    # the engine works 3 s
        await release.wait()
        return [[Completion(np.array([5], np.int32), np.array([-0.5], np.float32),
                            np.zeros(1, np.int32), "length")] * r.n for r in requests]

    async def noop(*_):
        return None
    p = Pipeline(server_id="s", limits=LIMITS, generate=generate, decode=str,
                 score=Rewarder("builtin:exact_numeric").score_many, emit=noop, release=noop,
                 metrics=RolloutMetrics(), log=lambda *a, **k: None, clock=lambda: now["t"])
    now["t"] += 10.0                       # 10 s with nothing to do
    assert p.idle_ratio() == 1.0
    task = asyncio.create_task(p.run_batch([assignment("a", [1, 2], group_size=1)]))
    while not p.generating:
        await asyncio.sleep(0)
    now["t"] += 1.0                        # mid-generate: 4 s window, 4 s busy (ongoing call counts)
    assert p.idle_ratio() == 0.0
    release.set()
    await task
    now["t"] += 4.0                        # 4 s of idle after it ended
    assert p.idle_ratio() == 1.0
    assert p.busy_s == 4.0                 # clock moved 3 s inside generate, then 1 s mid-call
