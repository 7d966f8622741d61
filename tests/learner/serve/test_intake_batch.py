"""Intake's per-result array checks (``_arrays_pass``) against the per-sample reference path.

``Intake.receive`` checks the token ids and versions of all of a result's samples in one pass and
hands the buffer each sample's oldest version; any failure sends every sample through
``Intake.check``, the per-sample reference. Both must give the same Ack, the same refusal reasons
and the same buffer, for a hostile sample anywhere in a group of 8, decoded from the wire or not.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from learner_testkit import samples_for

import learner.serve.intake as intake_module
import protocol
from buffer import RolloutBuffer
from learner.metrics import LearnerMetrics
from learner.serve.intake import Intake

VOCAB = 50
G = 8


def setup():
    buf = RolloutBuffer(batch_samples=2 * G, group_size=G, max_staleness=3)
    a = protocol.Assignment(assignment_id="a1", prompt_id="p", prompt_token_ids=np.array([1, 7, 9], np.int32),
                            group_size=G, version=0, sampling=protocol.SamplingParams(max_new_tokens=12))
    buf.issue("a1", "s", G, payload=a)
    intake = Intake(buf, vocab_size=VOCAB, sampling=SimpleNamespace(max_new_tokens=16), version=lambda: 2,
                    metrics=LearnerMetrics())
    return buf, a, intake


def group(a: protocol.Assignment) -> list[protocol.Sample]:
    """A valid group whose samples differ in length and versions (so a slice off by one shows)."""
    out = samples_for(a, version=0)
    for i, s in enumerate(out):
        n = 2 + i
        s.completion_token_ids = np.arange(4 + i, 4 + i + n, dtype=np.int32)
        s.behavior_logprobs = np.full(n, -1.0, np.float32)
        s.token_versions = np.array([i % 3] * (n - 1) + [2], np.int32)
    return out


def corrupt(s: protocol.Sample, how: str) -> None:
    n = len(s.completion_token_ids)
    if how == "vocab":
        s.completion_token_ids = np.array([4] * (n - 1) + [VOCAB], np.int32)
    elif how == "vocab_negative":
        s.completion_token_ids = np.array([-3] + [4] * (n - 1), np.int32)
    elif how == "vocab_prompt":
        s.prompt_token_ids = np.array([1, 7, VOCAB + 100], np.int32)
    elif how == "length":
        s.completion_token_ids = np.arange(13, dtype=np.int32)
        s.behavior_logprobs = np.full(13, -1.0, np.float32)
        s.token_versions = np.zeros(13, np.int32)
    elif how == "version_last_token":
        s.token_versions = np.array([0] * (n - 1) + [3], np.int32)
    elif how == "version_first_token":
        s.token_versions = np.array([3] + [0] * (n - 1), np.int32)
    elif how == "negative_version":
        s.token_versions = np.array([0] * (n - 1) + [-1], np.int32)
    elif how == "no_tokens":
        s.completion_token_ids = np.zeros(0, np.int32)
        s.behavior_logprobs = np.zeros(0, np.float32)
        s.token_versions = np.zeros(0, np.int32)
    elif how == "int64_ids":
        s.completion_token_ids = s.completion_token_ids.astype(np.int64)
    elif how == "int64_ids_out_of_range":
        s.completion_token_ids = np.array([4] * (n - 1) + [VOCAB], np.int64)
    elif how == "prompt":
        s.prompt_token_ids = np.array([1, 7, 8], np.int32)
    elif how == "group_size":
        s.group_size = 3
    elif how == "sample_id":
        s.sample_id = "a2/0"
    elif how == "reward":
        s.reward = 1e30
    else:
        raise AssertionError(how)


HOW = ["vocab", "vocab_negative", "vocab_prompt", "length", "version_last_token",
       "version_first_token", "negative_version", "no_tokens", "int64_ids",
       "int64_ids_out_of_range", "prompt", "group_size", "sample_id", "reward"]


async def receive_both(make, monkeypatch, make_setup=setup) -> list[tuple]:
    """The outcome of receiving the results ``make(a)`` builds, with the batch checks and with
    the per-sample reference only (``_arrays_pass`` answering None)."""
    out = []
    for reference in (False, True):
        buf, a, intake = make_setup()
        if reference:
            monkeypatch.setattr(intake_module, "_arrays_pass", lambda *args: None)
        statuses = []
        for msg in make(a):
            ack = await intake.receive(msg)
            assert ack.sample_ids == [s.sample_id for s in msg.samples]
            statuses.append(ack.statuses)
        monkeypatch.undo()
        groups = {aid: (g.mins, g.min_version, g.filled) for aid, g in buf._groups.items()}
        out.append((statuses, dict(intake.invalid), buf.counters, groups, buf.pending_samples,
                    buf.last_invalid_reason))
    return out


@pytest.mark.parametrize("position", [0, 3, G - 1])
@pytest.mark.parametrize("how", HOW)
async def test_one_bad_sample_of_eight_gets_the_reference_outcome(how, position, monkeypatch):
    def make(a):
        samples = group(a)
        corrupt(samples[position], how)
        return [protocol.RolloutResult(server_id="s", samples=samples)]

    batch, reference = await receive_both(make, monkeypatch)
    assert batch == reference
    statuses = batch[0][0]
    good = [st for i, st in enumerate(statuses) if i != position]
    assert good == ["accepted"] * (G - 1)          # the others are not refused with it


@pytest.mark.parametrize("how", ["vocab", "version_last_token", "negative_version", "no_tokens", "reward"])
async def test_decoded_results_get_the_reference_outcome(how, monkeypatch):
    """Through the wire: the samples' arrays are slices of one buffer per result (protocol's
    batch decode); the protocol refuses a negative version itself."""
    def make(a):
        samples = group(a)
        corrupt(samples[G - 1], how)
        return [protocol.decode(protocol.encode(protocol.RolloutResult(server_id="s", samples=samples[:3]))),
                protocol.decode(protocol.encode(protocol.RolloutResult(server_id="s", samples=samples[3:])))]

    if how == "negative_version":
        with pytest.raises(protocol.ProtocolError, match=r"samples\[4\]\.token_versions"):
            make(setup()[1])
        return
    batch, reference = await receive_both(make, monkeypatch)
    assert batch == reference


async def test_valid_group_in_one_result_fills_the_buffer_as_the_reference_does(monkeypatch):
    batch, reference = await receive_both(
        lambda a: [protocol.RolloutResult(server_id="s", samples=group(a))], monkeypatch)
    assert batch == reference
    assert batch[0] == [["accepted"] * G]
    # the ready group's per-slot oldest versions (what the staleness of the batch is made of)
    assert batch[2]["accepted"] == G and batch[4] == G


async def test_a_repeat_inside_one_result_after_its_group_completed(monkeypatch):
    """A ninth sample repeating index 0 with another prompt: its lease ended with the eighth, so
    it is a duplicate (the prompt is not compared once the lease is gone), in both paths."""
    def make(a):
        samples = group(a)
        extra = group(a)[0]
        corrupt(extra, "prompt")
        return [protocol.RolloutResult(server_id="s", samples=[*samples, extra])]

    batch, reference = await receive_both(make, monkeypatch)
    assert batch == reference
    assert batch[0] == [["accepted"] * G + ["duplicate"]]


def test_arrays_pass_gives_each_samples_oldest_version():
    _, a, _ = setup()
    samples = group(a)
    mins = intake_module._arrays_pass(samples, VOCAB, 2)
    assert mins == [int(s.token_versions.min()) for s in samples]
    assert intake_module._arrays_pass(samples[:1], VOCAB, 2) == [0]
    assert intake_module._arrays_pass(samples, VOCAB, 1) is None          # a token of version 2
    assert intake_module._arrays_pass(samples, 10, 2) is None             # ids up to 4 + 7 + 8
    assert intake_module._arrays_pass([], VOCAB, 2) == []


async def test_an_empty_result_gets_an_empty_ack():
    """The protocol accepts a result without samples; the intake answers it with an empty Ack
    (it raised IndexError, which would have ended the learner's rollout loop)."""
    buf, _, intake = setup()
    msg = protocol.decode(protocol.encode(protocol.RolloutResult(server_id="s", samples=[])))
    ack = await intake.receive(msg)
    assert ack.sample_ids == [] and ack.statuses == []
    assert buf.counters["accepted"] == 0 and intake.invalid == {}


@pytest.mark.parametrize("case", ["slot already filled", "stale", "repeated index", "shuffled",
                                  "two results of one group", "other assignment's sample"])
async def test_whole_group_results_get_the_reference_outcome(case, monkeypatch):
    """A result that is one whole group goes to the buffer at once (``put_group_nowait``) when
    it can; when it cannot (a slot already filled, a sample that would be stale, ...) sample by
    sample. Both end as the per-sample reference."""
    def make(a):
        samples = group(a)
        if case == "slot already filled":
            return [protocol.RolloutResult(server_id="s", samples=[group(a)[3]]),
                    protocol.RolloutResult(server_id="s", samples=samples)]
        if case == "stale":
            for s in samples[5:]:
                s.token_versions = np.full(len(s.token_versions), 0, np.int32)
            return [protocol.RolloutResult(server_id="s", samples=samples)]
        if case == "repeated index":
            samples[6] = group(a)[2]
        elif case == "shuffled":
            samples = samples[::-1]
        elif case == "two results of one group":
            return [protocol.RolloutResult(server_id="s", samples=samples[:4]),
                    protocol.RolloutResult(server_id="s", samples=samples[4:])]
        elif case == "other assignment's sample":
            samples[7].assignment_id = "a9"
        return [protocol.RolloutResult(server_id="s", samples=samples)]

    def stale_setup():
        buf, a, intake = setup()
        buf.staleness.set(1, "test")                # version 2 - 0 > 1: stale
        return buf, a, intake

    batch, reference = await receive_both(make, monkeypatch,
                                          stale_setup if case == "stale" else setup)
    assert batch == reference
    if case == "stale":
        assert "stale" in batch[0][0]
    if case == "shuffled":
        assert batch[0] == [["accepted"] * G] and batch[2]["accepted"] == G


async def test_whole_group_of_an_issued_prompt_outside_the_vocabulary(monkeypatch):
    """The issued prompt itself out of range (a prompt source bug): every sample of the group
    is refused ``vocab``, whole-group path or not."""
    def bad_prompt_setup():
        buf = RolloutBuffer(batch_samples=2 * G, group_size=G, max_staleness=3)
        a = protocol.Assignment(assignment_id="a1", prompt_id="p", group_size=G, version=0,
                                prompt_token_ids=np.array([1, VOCAB + 1, 9], np.int32),
                                sampling=protocol.SamplingParams(max_new_tokens=12))
        buf.issue("a1", "s", G, payload=a)
        return buf, a, Intake(buf, vocab_size=VOCAB, sampling=SimpleNamespace(max_new_tokens=16),
                              version=lambda: 2, metrics=LearnerMetrics())

    batch, reference = await receive_both(
        lambda a: [protocol.RolloutResult(server_id="s", samples=group(a))], monkeypatch,
        bad_prompt_setup)
    assert batch == reference
    assert batch[0] == [["invalid"] * G] and batch[1] == {"vocab": G}


def setup_three():
    """Three open assignments of one run (what a burst of a server's results answers)."""
    buf = RolloutBuffer(batch_samples=2 * G, group_size=G, max_staleness=3)
    assignments = []
    for k in (1, 2, 3):
        a = protocol.Assignment(assignment_id=f"a{k}", prompt_id=f"p{k}", group_size=G, version=0,
                                prompt_token_ids=np.array([1, 7, 9 + k], np.int32),
                                sampling=protocol.SamplingParams(max_new_tokens=12))
        buf.issue(a.assignment_id, "s", G, payload=a)
        assignments.append(a)
    intake = Intake(buf, vocab_size=VOCAB, sampling=SimpleNamespace(max_new_tokens=16), version=lambda: 2,
                    metrics=LearnerMetrics())
    return buf, assignments, intake


def outcome(buf, intake, statuses) -> tuple:
    groups = {aid: (g.mins, g.min_version, g.filled) for aid, g in buf._groups.items()}
    return (statuses, dict(intake.invalid), buf.counters, groups, buf.pending_samples,
            buf.last_invalid_reason)


@pytest.mark.parametrize("how", [None, *HOW])
@pytest.mark.parametrize("order", ["streamed", "interleaved", "groups", "uneven"])
async def test_a_merged_burst_ends_as_its_results_one_by_one(order, how):
    """The learner receives a burst of one server's results as one (ResultIngress.receive_held):
    every sample gets the status, and the buffer the state, of receiving the results one by one,
    for single samples of three groups in order or interleaved, whole groups, results that cut
    across groups, and a hostile sample in the middle of the burst."""
    def results(assignments):
        groups = [group(a) for a in assignments]
        if how is not None:
            corrupt(groups[1][3], how)
        if order == "streamed":              # one sample per result, group after group
            return [[s] for g in groups for s in g]
        if order == "interleaved":           # one sample per result, the groups taking turns
            return [[g[i]] for i in range(G) for g in groups]
        if order == "groups":                # what a rollout server sends: a group per result
            return groups
        flat = [s for g in groups for s in g]  # results of 5 samples, cutting across groups
        return [flat[i:i + 5] for i in range(0, len(flat), 5)]

    buf, assignments, intake = setup_three()
    one_by_one = []
    for samples in results(assignments):
        one_by_one += (await intake.receive(protocol.RolloutResult(server_id="s", samples=samples))).statuses
    reference = outcome(buf, intake, one_by_one)

    buf, assignments, intake = setup_three()
    merged = [s for samples in results(assignments) for s in samples]
    ack = await intake.receive(protocol.RolloutResult(server_id="s", samples=merged))
    assert ack.sample_ids == [s.sample_id for s in merged]
    assert outcome(buf, intake, ack.statuses) == reference
    if how is None:
        assert ack.statuses == ["accepted"] * 3 * G and buf.ready_samples == 3 * G


def test_runs_cut_at_each_new_assignment_and_at_a_groups_size():
    _, (a1, a2, _), _ = setup_three()
    s1, s2 = group(a1), group(a2)
    runs = intake_module._runs
    assert runs([], G) == []
    assert runs([*s1, *s2], G) == [(0, G), (G, 2 * G)]
    assert runs([s1[0], s2[0], s1[1], s1[2]], G) == [(0, 1), (1, 2), (2, 4)]
    assert runs([*s1, s1[0], *s2[:2]], G) == [(0, G), (G, G + 1), (G + 1, G + 3)]
