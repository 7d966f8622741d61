"""Intake without a socket or a model: every check against the run, and nothing invalid buffered."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from learner_testkit import samples_for

import protocol
from buffer import RolloutBuffer
from learner.metrics import LearnerMetrics
from learner.serve.intake import REASONS, Intake

VOCAB = 50


def setup(version: int = 1, max_new_tokens: int = 4):
    buf = RolloutBuffer(batch_samples=2, group_size=2, max_staleness=3)
    a = protocol.Assignment(assignment_id="a1", prompt_id="p", prompt_token_ids=np.array([1, 7, 9], np.int32),
                            group_size=2, version=0,
                            sampling=protocol.SamplingParams(max_new_tokens=max_new_tokens))
    buf.issue("a1", "s", 2, payload=a)
    intake = Intake(buf, vocab_size=VOCAB, sampling=SimpleNamespace(max_new_tokens=16), version=lambda: version,
                    metrics=LearnerMetrics())
    return buf, a, intake


def corrupt(a: protocol.Assignment, how: str) -> protocol.Sample:
    s = samples_for(a, version=0)[0]
    if how == "vocab":
        s.completion_token_ids = np.array([4, VOCAB, 5], np.int32)
    elif how == "vocab_negative":
        s.completion_token_ids = np.array([4, -3, 5], np.int32)
    elif how == "vocab_prompt":
        s.prompt_token_ids = np.array([1, 7, VOCAB + 100], np.int32)
    elif how == "length":
        s.completion_token_ids = np.arange(5, dtype=np.int32)
        s.behavior_logprobs = np.full(5, -1.0, np.float32)
        s.token_versions = np.zeros(5, np.int32)
    elif how == "version":
        s.token_versions = np.array([0, 2, 0], np.int32)    # newest token not last: all are checked
    elif how == "prompt":
        s.prompt_token_ids = np.array([1, 7, 8], np.int32)
    elif how == "group_size":
        s.group_size = 3
    elif how == "sample_id":
        s.sample_id = "a2/0"                                  # would poison a2's dedupe slot
    elif how == "reward_huge":
        s.reward = 1e30                                       # finite, but NaN statistics in fp32
    elif how == "reward_negative":
        s.reward = -2e6
    return s


REASON_OF = {"vocab": "vocab", "vocab_negative": "vocab", "vocab_prompt": "vocab", "length": "length",
             "version": "version", "prompt": "prompt", "group_size": "group_size",
             "sample_id": "sample_id", "reward_huge": "reward", "reward_negative": "reward"}


@pytest.mark.parametrize("how", list(REASON_OF))
async def test_invalid_sample_is_acked_invalid_counted_and_never_buffered(how):
    buf, a, intake = setup()
    s = corrupt(a, how)
    ack = await intake.receive(protocol.RolloutResult(server_id="s", samples=[s]))
    assert ack.statuses == ["invalid"] and ack.sample_ids == [s.sample_id]
    reason = REASON_OF[how]
    assert reason in REASONS
    assert intake.invalid == {reason: 1}
    assert intake.metrics.value("slipstream_samples_invalid_total", {"reason": reason}) == 1
    assert intake.metrics.value("slipstream_samples_total", {"status": "invalid"}) == 1
    assert buf.pending_samples == 0 and buf.counters["accepted"] == 0
    assert buf.inflight_samples == 2                          # the slot waits for re-issue


async def test_valid_group_is_accepted_next_to_an_invalid_copy():
    buf, a, intake = setup()
    good = samples_for(a, version=1)
    ack = await intake.receive(protocol.RolloutResult(server_id="s",
                                                      samples=[corrupt(a, "vocab"), *good]))
    assert ack.statuses == ["invalid", "accepted", "accepted"]
    batch = buf.poll_batch(1)
    assert batch is not None and all(int(s.completion_token_ids.max()) < VOCAB for s in batch.samples)


async def test_length_limit_is_the_assignments_or_the_config_once_it_is_gone():
    buf, a, intake = setup(max_new_tokens=4)
    s = samples_for(a, version=0, tokens=4)[0]
    assert intake.check(s, 1) is None                          # 4 <= the assignment's 4
    buf.cancel("a1")                                           # no lease any more: config's 16
    long = samples_for(a, version=0, tokens=16)[0]
    assert intake.check(long, 1) is None
    longer = samples_for(a, version=0, tokens=17)[0]
    assert intake.check(longer, 1)[0] == "length"


async def test_prompt_is_not_checked_without_a_lease_but_nothing_is_buffered():
    buf, a, intake = setup()
    buf.cancel("a1")
    s = corrupt(a, "prompt")
    ack = await intake.receive(protocol.RolloutResult(server_id="s", samples=[s]))
    assert ack.statuses == ["duplicate"] and buf.pending_samples == 0


async def test_a_prompt_equal_to_the_assignments_is_range_checked_through_the_assignment():
    """The range check of a prompt that is the lease's own is made once per Assignment object:
    an issued prompt outside the vocabulary still refuses every sample that carries it, and a
    sample whose prompt differs is checked itself (vocab before prompt)."""
    buf = RolloutBuffer(batch_samples=2, group_size=2, max_staleness=3)
    good = protocol.Assignment(assignment_id="a1", prompt_id="p", group_size=2, version=0,
                               prompt_token_ids=np.array([1, 7, 9], np.int32))
    bad = protocol.Assignment(assignment_id="a2", prompt_id="q", group_size=2, version=0,
                              prompt_token_ids=np.array([1, VOCAB, 9], np.int32))
    buf.issue("a1", "s", 2, payload=good)
    buf.issue("a2", "s", 2, payload=bad)
    intake = Intake(buf, vocab_size=VOCAB, sampling=SimpleNamespace(max_new_tokens=16), version=lambda: 1,
                    metrics=LearnerMetrics())
    g0, g1 = samples_for(good, version=0)
    assert intake.check(g0, 1) is None and intake._in_range_assignment is good
    assert intake.check(g1, 1) is None
    for s in samples_for(bad, version=0):                 # the issued prompt itself is out of range
        assert intake.check(s, 1)[0] == "vocab"
        assert intake._in_range_assignment is good
    stray = samples_for(good, version=0, prompt_token_ids=np.array([1, -1, 9], np.int32))[0]
    assert intake.check(stray, 1)[0] == "vocab"
    other = samples_for(good, version=0, prompt_token_ids=np.array([1, 7, 8], np.int32))[0]
    assert intake.check(other, 1)[0] == "prompt"
    ack = await intake.receive(protocol.RolloutResult(server_id="s", samples=[g0, g1]))
    assert ack.statuses == ["accepted", "accepted"]


async def test_samples_made_on_distrusted_weights_are_refused_and_the_rest_received():
    """issue 28.4: a sample with a token of a version its server applied with a wrong checksum is
    refused (unverified_weights) wherever it sits in a result; the others are received as usual."""
    buf = RolloutBuffer(batch_samples=2, group_size=2, max_staleness=3)
    issued = []
    for aid in ("a1", "a2"):
        a = protocol.Assignment(assignment_id=aid, prompt_id="p", prompt_token_ids=np.array([1, 7, 9], np.int32),
                                group_size=2, version=0)
        buf.issue(aid, "s", 2, payload=a)
        issued.append(a)
    released = []
    intake = Intake(buf, vocab_size=VOCAB, sampling=SimpleNamespace(max_new_tokens=16), version=lambda: 2,
                    metrics=LearnerMetrics(), release=lambda server, aid: released.append((server, aid)),
                    distrusted=lambda server: {2} if server == "s" else None)
    good = samples_for(issued[0], version=1)
    bad = samples_for(issued[1], version=1)
    bad[1].token_versions = np.array([1, 2, 2], np.int32)          # one token made on the wrong weights
    ack = await intake.receive(protocol.RolloutResult(server_id="s", samples=[good[0], bad[1], good[1], bad[0]]))
    assert ack.statuses == ["accepted", "invalid", "accepted", "accepted"], ack
    assert intake.invalid == {"unverified_weights": 1} and released == [("s", "a2")]
    # Another server's samples of the same version are its own business.
    other = Intake(buf, vocab_size=VOCAB, sampling=SimpleNamespace(max_new_tokens=16), version=lambda: 2,
                   metrics=LearnerMetrics(), distrusted=lambda server: {2} if server == "s" else None)
    a3 = protocol.Assignment(assignment_id="a3", prompt_id="p", prompt_token_ids=np.array([1, 7, 9], np.int32),
                             group_size=2, version=0)
    buf.issue("a3", "t", 2, payload=a3)
    b = samples_for(a3, version=2)
    assert (await other.receive(protocol.RolloutResult(server_id="t", samples=b[:1]))).statuses == ["accepted"]


def episode(a: protocol.Assignment, spans: list[int], n: int) -> protocol.Sample:
    s = samples_for(a, version=0, tokens=n)[0]
    s.turn_spans = np.array(spans, np.int32)
    return s


async def test_a_multi_turn_sample_is_held_to_its_assignments_episode_limits():
    """An episode (turn_spans, issue 26) may be longer than max_new_tokens: up to the
    assignment's max_episode_tokens, each turn at most max_new_tokens, at most max_turns turns;
    a single-turn sample keeps the max_new_tokens limit. The fast paths leave episodes to check."""
    buf = RolloutBuffer(batch_samples=2, group_size=2, max_staleness=3)
    a = protocol.Assignment(assignment_id="a1", prompt_id="p", prompt_token_ids=np.array([1, 7, 9], np.int32),
                            group_size=2, version=0, sampling=protocol.SamplingParams(
                                max_new_tokens=4, max_turns=3, max_episode_tokens=12))
    buf.issue("a1", "s", 2, payload=a)
    intake = Intake(buf, vocab_size=VOCAB, sampling=SimpleNamespace(max_new_tokens=16), version=lambda: 1,
                    metrics=LearnerMetrics())
    assert intake.check(episode(a, [0, 4, 6, 10, 11, 12], 12), 1) is None
    assert intake.check(episode(a, [0, 4, 6, 10, 11, 12, 12, 13], 13), 1)[0] == "turns"
    assert intake.check(episode(a, [0, 4, 6, 10], 13), 1) == ("length", "13 episode tokens > max_episode_tokens 12")
    assert intake.check(episode(a, [0, 5], 6), 1) == ("length", "a turn of 5 tokens > max_new_tokens 4")
    assert intake.check(samples_for(a, version=0, tokens=5)[0], 1)[0] == "length"   # one turn: 4
    good = [episode(a, [0, 3, 5, 8], 9) for _ in range(2)]
    good[1].sample_id, good[1].group_index = "a1/1", 1
    bad = episode(a, [0, 4, 5, 10], 10)                       # a turn of 5, within 12 in all
    ack = await intake.receive(protocol.RolloutResult(server_id="s", samples=[bad, *good]))
    assert ack.statuses == ["invalid", "accepted", "accepted"] and intake.invalid == {"length": 1}
    batch = buf.poll_batch(1)
    assert [s.turn_spans.tolist() for s in batch.samples] == [[0, 3, 5, 8]] * 2
