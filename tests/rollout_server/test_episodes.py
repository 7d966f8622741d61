"""Multi-turn episodes on the real HF engine (issue 26 items 1, 2, 7): one sample per episode,
token for token what the engine sampled and was fed; the environment's tokens masked; a bad
environment ends its episode, counted, never the runner."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

import protocol
from learner.train.batching import collate
from ops import token_logprobs
from rollout_server.config import EnvironmentSettings
from rollout_server.engine_hf import HFEngine
from rollout_server.episodes import EPISODE_FAILURES, EpisodeRunner, ObservationTokens, load_environment
from rollout_server.metrics import RolloutMetrics

GUESS = "rollout_server.environments.guessing:GuessNumber"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return HFEngine(tiny_model_dir, seed=3)


class Recorded:
    """The engine's generate, every (request, completion) it served kept."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    async def __call__(self, requests):
        out = await self.engine.generate(requests)
        for r, group in zip(requests, out):
            self.calls.append((r, group[0]))
        return out

    def by_prompt(self) -> dict[tuple, list]:
        """prompt ids -> the completions served for it (episodes of one prompt share the first)."""
        out: dict[tuple, list] = {}
        for r, c in self.calls:
            out.setdefault(tuple(r.prompt_token_ids.tolist()), []).append(c)
        return out


def runner(engine, settings: EnvironmentSettings, generate=None, metrics=None):
    return EpisodeRunner(generate=generate or engine.generate, decode=engine.decode,
                         observations=ObservationTokens(engine.tokenizer, role=settings.role,
                                                        chat_template=settings.chat_template),
                         settings=settings, metrics=metrics or RolloutMetrics(), log=lambda *a, **k: None,
                         max_model_len=64)


def assignment(engine, text="guess:", *, answer="7", group=4, max_turns=4, max_new_tokens=3,
               episode=40, seed=11) -> protocol.Assignment:
    tok = engine.tokenizer
    ids = np.array([tok.bos_token_id, *tok.encode(text, add_special_tokens=False)], dtype=np.int32)
    return protocol.Assignment(
        assignment_id="a-1", prompt_id="p", prompt_token_ids=ids, group_size=group, version=0,
        prompt_text=text, metadata={"answer": answer},
        sampling=protocol.SamplingParams(max_new_tokens=max_new_tokens, max_turns=max_turns,
                                         max_episode_tokens=episode, seed=seed))


def spans_of(s: protocol.Sample) -> list[tuple[int, int]]:
    return [tuple(x) for x in s.turn_spans.reshape(-1, 2).tolist()]


def test_an_episode_is_exactly_the_tokens_the_engine_sampled_and_was_fed(engine):
    recorded = Recorded(engine)
    a = assignment(engine)
    samples = asyncio.run(runner(engine, EnvironmentSettings(class_name=GUESS), recorded).run_group(a, GUESS))
    assert len(samples) == 4 and {s.group_index for s in samples} == {0, 1, 2, 3}
    served = recorded.by_prompt()
    prompt = a.prompt_token_ids.tolist()
    turns_seen = 0
    for s in samples:
        assert s.failed is None and s.turn_spans is not None, s.failed
        s.cross_check("sample")                               # the wire's own checks pass
        ids = s.completion_token_ids.tolist()
        spans = spans_of(s)
        turns_seen += len(spans)
        assert s.metadata["turns"] == len(spans) <= 4
        for k, (start, end) in enumerate(spans):
            # The engine was fed exactly the issued prompt and everything before this turn, and
            # the sample holds exactly what it sampled, with its log-probs and versions.
            (c,) = [c for c in served[tuple(prompt + ids[:start])] if c.token_ids.tolist() == ids[start:end]]
            assert np.array_equal(s.behavior_logprobs[start:end], c.logprobs)
            assert np.array_equal(s.token_versions[start:end], c.versions)
            gap_end = spans[k + 1][0] if k + 1 < len(spans) else len(ids)
            env = ids[end:gap_end]                           # the observation after it, if any
            if env:
                text = engine.tokenizer.decode(env)
                assert text in (" up=", " down=", " ?="), text
                assert env == engine.tokenizer.encode(text, add_special_tokens=False)
                assert not s.behavior_logprobs[end:gap_end].any()
                assert (s.token_versions[end:gap_end] == s.token_versions[end - 1]).all()
        mask = s.loss_mask()
        assert mask.sum() == sum(e - b for b, e in spans)
        solved = s.reward_parts.get("solved", 0.0)
        assert s.reward == pytest.approx(solved - 0.1 * (len(spans) - 1))
        assert (solved == 1.0) == (not s.metadata["truncated"])       # found, or out of turns
        assert s.finish_reason == "length" or not s.metadata["truncated"]
    assert turns_seen > 4                                    # some episodes took several turns


def test_the_learner_recomputes_the_behavior_logprobs_across_turn_boundaries(engine):
    a = assignment(engine, group=4, seed=5)
    samples = asyncio.run(runner(engine, EnvironmentSettings(class_name=GUESS)).run_group(a, GUESS))
    bt = collate(samples, engine.pad_id)
    with torch.no_grad():
        logits = engine.model(input_ids=bt.input_ids, attention_mask=bt.attention_mask).logits[:, :-1]
    lp = token_logprobs(logits, bt.targets, temperature=1.0)
    mask = bt.mask.bool()
    assert int(mask.sum()) == sum(int(s.loss_mask().sum()) for s in samples)
    assert int(mask.sum()) < sum(len(s.completion_token_ids) for s in samples)   # holes: the env's
    assert torch.allclose(lp[mask], bt.behavior_logprobs[mask], atol=2e-4)


# ---- the crafted re-tokenization case -------------------------------------------------------
MERGED = [c + "?" for c in "0123456789abcdefghijklmnopqrstuvwxyz"]


class Questions:
    """Answers every turn with an observation that starts with '?' (three turns)."""

    async def reset(self, prompt, metadata):
        return None

    async def step(self, completion, state):
        return "?=", {"reward": 0.0}, state.turn >= 2, {}


@pytest.fixture(scope="module")
def merging_engine(tmp_path_factory):
    """The demo's character tokenizer plus one token for every 'x?' pair: text that ends in a
    letter or digit and continues with '?' encodes differently from its two halves encoded."""
    from learner.models.builtin import build_model, build_tokenizer

    tok = build_tokenizer()
    tok.add_tokens(MERGED)
    path = tmp_path_factory.mktemp("merging-model")
    build_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return HFEngine(str(path), seed=3)


def test_re_encoding_the_history_would_differ_and_the_trajectory_does_not(merging_engine):
    engine = merging_engine
    spec = f"{__name__}:Questions"
    recorded = Recorded(engine)
    a = assignment(engine, "q:", group=6, max_turns=3, max_new_tokens=4, seed=2)
    samples = asyncio.run(runner(engine, EnvironmentSettings(class_name=spec), recorded).run_group(a, spec))
    tok = engine.tokenizer
    merged_ids = set(tok.convert_tokens_to_ids(MERGED))
    served = recorded.by_prompt()
    prompt = a.prompt_token_ids.tolist()
    boundaries = 0
    for s in samples:
        assert s.failed is None, s.failed
        ids = s.completion_token_ids.tolist()
        spans = spans_of(s)
        for start, end in spans:                       # token-exact, as above
            assert ids[start:end] in [c.token_ids.tolist() for c in served[tuple(prompt + ids[:start])]]
        # What a framework that keeps text would train on: the history decoded, then encoded.
        history = prompt + ids
        again = tok.encode(tok.decode(history, skip_special_tokens=True), add_special_tokens=False)
        for _, end in spans[:-1]:
            last = tok.convert_ids_to_tokens(ids[end - 1])
            if last + "?" in MERGED:                    # the model's turn ended on a letter or digit
                boundaries += 1
                assert tok.convert_tokens_to_ids(last + "?") in again      # re-encoding merges it...
                assert ids[end:end + 1] == tok.convert_tokens_to_ids(["?"])   # ...the sample did not
    assert boundaries >= 2, "no turn ended on a letter or digit: the crafted case did not arise"
    assert not any(i in merged_ids for s in samples for i in s.completion_token_ids[s.loss_mask() == 0])


# ---- limits ---------------------------------------------------------------------------------
class Forever:
    """Never done: every turn gets the same observation."""

    async def reset(self, prompt, metadata):
        return None

    async def step(self, completion, state):
        return " no:", 0.5, False, {"tool_calls": 1, "tool_errors": int(state.turn == 0)}


def test_an_episode_ends_at_max_turns_or_its_token_budget_marked_truncated(engine):
    spec = f"{__name__}:Forever"
    metrics = RolloutMetrics()
    run = runner(engine, EnvironmentSettings(class_name=spec), metrics=metrics)
    (s,) = asyncio.run(run.run_group(assignment(engine, group=1, max_turns=3, episode=40), spec))
    assert len(spans_of(s)) == 3 and s.finish_reason == "length" and s.metadata["truncated"]
    assert s.reward == pytest.approx(1.5) and s.reward_parts == {"reward": 1.5}
    assert s.metadata["tool_calls"] == 3 and s.metadata["tool_errors"] == 1
    # A budget of 10 tokens: 3 + 4 + 3, the last turn cut to what is left.
    (s,) = asyncio.run(run.run_group(assignment(engine, group=1, max_turns=8, episode=10, max_new_tokens=3), spec))
    assert len(s.completion_token_ids) <= 10 and s.finish_reason == "length" and s.metadata["truncated"]
    assert s.loss_mask().sum() == sum(e - b for b, e in spans_of(s))
    value = metrics.registry.get_sample_value
    assert value("slipstream_episodes_truncated_total") == 2
    assert value("slipstream_tool_calls_total") == 3 + len(spans_of(s))
    assert value("slipstream_episode_turns_count") == 2


# ---- bad environments -----------------------------------------------------------------------
class Raises:
    async def reset(self, prompt, metadata):
        return None

    async def step(self, completion, state):
        raise KeyError("the tool table is empty")


class RaisesInReset(Raises):
    async def reset(self, prompt, metadata):
        raise RuntimeError("no such game")


class CannotStart(Raises):
    def __init__(self):
        raise OSError("the sandbox is down")


class Hangs(Raises):
    async def step(self, completion, state):
        await asyncio.sleep(30)


class BlocksAThread(Raises):
    def step(self, completion, state):               # a plain function: on a worker thread
        import time
        time.sleep(1.0)
        return None, 0.0, True, {}


class Huge(Raises):
    async def step(self, completion, state):
        return "x" * 5000, 0.0, False, {}


class NotText(Raises):
    async def step(self, completion, state):
        return 42, 0.0, False, {}


class NaNReward(Raises):
    async def step(self, completion, state):
        return None, {"score": math.nan}, True, {}


class NotATuple(Raises):
    async def step(self, completion, state):
        return "done"


@pytest.mark.parametrize("cls, reason, words", [
    (Raises, "error", "step raised KeyError"),
    (RaisesInReset, "error", "reset raised RuntimeError: no such game"),
    (CannotStart, "error", "OSError: the sandbox is down"),
    (Hangs, "timeout", "step ran past rollout.environment.step_timeout_s (0.3 s)"),
    (BlocksAThread, "timeout", "step ran past"),
    (Huge, "observation_too_long", "an observation of 5000 tokens > rollout.environment.max_observation_tokens 100"),
    (NotText, "observation", "not int"),
    (NaNReward, "reward", "'score' is nan"),
    (NotATuple, "error", "step returned str"),
])
def test_a_bad_environment_ends_its_episode_failed_and_counted(engine, cls, reason, words):
    spec = f"{__name__}:{cls.__name__}"
    metrics = RolloutMetrics()
    settings = EnvironmentSettings(class_name=spec, step_timeout_s=0.3, max_observation_tokens=100)
    samples = asyncio.run(runner(engine, settings, metrics=metrics).run_group(assignment(engine, group=2), spec))
    for s in samples:
        assert s.failed is not None and s.failed.startswith(f"environment {reason}: ") and words in s.failed, s.failed
        assert s.finish_reason == "error" and len(s.completion_token_ids) == 0
        s.cross_check("sample")
    value = metrics.registry.get_sample_value
    assert value("slipstream_episodes_failed_total", {"reason": reason}) == 2
    assert sum(value("slipstream_episodes_failed_total", {"reason": r}) for r in EPISODE_FAILURES) == 2


@pytest.mark.parametrize("spec, words", [
    ("no_colon", "expected 'module:Class'"),
    ("no.such.module:Env", "cannot import module 'no.such.module'"),
    (f"{__name__}:Missing", "has no class 'Missing'"),
    (f"{__name__}:Recorded", "Recorded has no reset() method"),
    (f"{__name__}:WrongStep", "WrongStep.step cannot be called as step(completion, state)"),
])
def test_an_environment_that_cannot_work_is_named_at_start_up(spec, words):
    with pytest.raises(ValueError, match=None) as e:
        load_environment(spec)
    assert words in str(e.value), str(e.value)


class WrongStep(Raises):
    async def step(self, completion):
        return None, 0.0, True, {}


def test_a_plain_string_environment_is_the_class_name():
    assert EnvironmentSettings.model_validate(GUESS).class_name == GUESS
    s = EnvironmentSettings(class_name=GUESS, named={"maze": "m:Maze", "math": "m:Tools"})
    assert s.spec_for({"environment": "maze"}) == "m:Maze"
    assert s.spec_for({protocol.DATASET_KEY: "math"}) == "m:Tools"
    assert s.spec_for({"environment": "other"}) == GUESS
    assert EnvironmentSettings().spec_for({}) is None


# ---- a turn after a weight update -------------------------------------------------------------
class Pauses:
    """Turn 0's step waits for the test (which publishes new weights meanwhile); turn 1 ends it."""

    entered: asyncio.Event | None = None
    resume: asyncio.Event | None = None

    async def reset(self, prompt, metadata):
        return None

    async def step(self, completion, state):
        if state.turn == 0:
            Pauses.entered.set()
            await Pauses.resume.wait()
            return " go:", 0.0, False, {}
        return None, 1.0, True, {}


def test_a_turn_after_a_weight_update_carries_the_new_version(tiny_model_dir):
    """Turns are separate generate calls: the one after an update runs on the new weights, its
    tokens say so (the staleness gate and the correction read them per token), the environment's
    tokens keep the version of the turn before them, and the new turn's behavior log-probs are
    the new weights' over the whole trajectory."""
    from rollout_server.engine import WeightUpdate

    eng = HFEngine(tiny_model_dir, seed=5, inflight_update="finish")
    spec = f"{__name__}:Pauses"
    run = runner(eng, EnvironmentSettings(class_name=spec))
    a = assignment(eng, group=1, max_turns=2, max_new_tokens=4, episode=20)
    g = torch.Generator().manual_seed(0)
    new = {n: p.detach() + 0.2 * torch.randn(p.shape, generator=g) for n, p in eng.model.named_parameters()}

    async def main():
        Pauses.entered, Pauses.resume = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(run.run_group(a, spec))
        await Pauses.entered.wait()
        await eng.update_weights(WeightUpdate(version=1, kind="full", tensors=new))
        Pauses.resume.set()
        return await task

    (s,) = asyncio.run(main())
    assert s.failed is None and eng.version == 1
    (b0, e0), (b1, e1) = spans_of(s)
    assert (s.token_versions[b0:e0] == 0).all() and (s.token_versions[e0:b1] == 0).all()
    assert (s.token_versions[b1:e1] == 1).all() and s.min_version == 0
    bt = collate([s], eng.pad_id)
    with torch.no_grad():
        logits = eng.model(input_ids=bt.input_ids, attention_mask=bt.attention_mask).logits[:, :-1]
    lp = token_logprobs(logits, bt.targets, temperature=1.0)
    p = len(s.prompt_token_ids) - 1
    cols = slice(p + b1, p + e1)                       # turn 1, recomputed under version 1
    assert torch.allclose(lp[0, cols], bt.behavior_logprobs[0, cols], atol=2e-4)
    cols = slice(p + b0, p + e0)                       # turn 0 was version 0's: it differs now
    assert not torch.allclose(lp[0, cols], bt.behavior_logprobs[0, cols], atol=2e-4)


# ---- asynchrony across episodes ---------------------------------------------------------------
class FirstWaitsForTheOthers:
    """The first episode's first step waits until every other episode has finished its turns:
    with one episode's environment busy, the others must still generate (a bounded wait: a
    runner that held generation for it would time out here and fail the episode)."""

    created = 0
    others_done: asyncio.Event | None = None
    finished = 0

    def __init__(self):
        cls = FirstWaitsForTheOthers
        self.first = cls.created == 0
        cls.created += 1

    async def reset(self, prompt, metadata):
        return None

    async def step(self, completion, state):
        cls = FirstWaitsForTheOthers
        if self.first and state.turn == 0:
            await asyncio.wait_for(cls.others_done.wait(), 60)
            return None, 1.0, True, {}
        if state.turn < 2:
            return " more:", 0.0, False, {}
        cls.finished += 1
        if cls.finished == 3:
            cls.others_done.set()
        return None, 1.0, True, {}


def test_an_environment_step_never_holds_the_other_episodes(engine):
    spec = f"{__name__}:FirstWaitsForTheOthers"
    run = runner(engine, EnvironmentSettings(class_name=spec, step_timeout_s=120))

    async def main():
        FirstWaitsForTheOthers.created, FirstWaitsForTheOthers.finished = 0, 0
        FirstWaitsForTheOthers.others_done = asyncio.Event()
        return await run.run_group(assignment(engine, group=4, max_turns=3, episode=30), spec)

    samples = asyncio.run(main())
    assert [s.failed for s in samples] == [None] * 4
    assert sorted(s.turns for s in samples) == [1, 3, 3, 3]


# ---- what a failed episode becomes (rollout.environment.on_failure) ---------------------------
class FailsOnItsSecondStep(Raises):
    async def step(self, completion, state):
        if state.turn == 0:
            return " more:", 0.0, False, {}
        raise RuntimeError("the sandbox crashed")


def test_on_failure_train_sends_the_turns_it_had_at_the_failure_reward(engine):
    spec = f"{__name__}:FailsOnItsSecondStep"
    metrics = RolloutMetrics()
    settings = EnvironmentSettings(class_name=spec, on_failure="train", failure_reward=-0.5)
    samples = asyncio.run(runner(engine, settings, metrics=metrics).run_group(assignment(engine, group=2), spec))
    for s in samples:
        s.cross_check("sample")
        assert s.failed is None and s.reward == -0.5 and s.reward_parts == {"failure": -0.5}
        assert s.turns == 2 and len(s.completion_token_ids) == spans_of(s)[-1][1]
        assert s.metadata["failed"].startswith("environment error: step raised RuntimeError"), s.metadata
    value = metrics.registry.get_sample_value
    assert value("slipstream_episodes_failed_total", {"reason": "error"}) == 2
    # One that failed before its first turn has nothing to train: sent failed, as under fail.
    spec = f"{__name__}:RaisesInReset"
    settings = EnvironmentSettings(class_name=spec, on_failure="train")
    (s,) = asyncio.run(runner(engine, settings).run_group(assignment(engine, group=1), spec))
    assert s.failed is not None and "no such game" in s.failed


def test_on_failure_reissue_gives_the_group_back_instead_of_sending_it(engine):
    """Through the pipeline: a group with a failed episode is handed back (the service sends
    the learner an assignment_refused for it, which re-issues the lease), nothing of it is sent,
    its credits are free again; a group that did not fail is sent as usual."""
    from rollout_server.pipeline import Limits, Pipeline

    spec = f"{__name__}:FailsOnItsSecondStep"
    metrics = RolloutMetrics()
    settings = EnvironmentSettings(class_name=spec, on_failure="reissue", named={"fair": GUESS})
    emitted, given_back, released = [], [], []

    async def main():
        all_back = asyncio.Event()

        async def emit(result):
            emitted.append(result)

        async def release(n):
            released.append(n)
            if sum(released) == 4:
                all_back.set()

        async def give_back(a, reason):
            given_back.append((a.assignment_id, reason))

        pipeline = Pipeline(server_id="s", limits=Limits(8, 8, 64, engine.vocab_size, 64),
                            generate=engine.generate, decode=engine.decode, score=None, emit=emit,
                            release=release, metrics=metrics, log=lambda *a, **k: None,
                            episodes=runner(engine, settings, metrics=metrics), give_back=give_back)
        task = asyncio.create_task(pipeline.run())
        bad = assignment(engine, group=2)
        fair = assignment(engine, group=2)
        fair.assignment_id, fair.metadata["environment"] = "a-2", "fair"
        pipeline.admit(bad)
        pipeline.admit(fair)
        await asyncio.wait_for(all_back.wait(), 60)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert [aid for aid, _ in given_back] == ["a-1"], given_back
    assert "an episode failed, its group goes back for re-issue: environment error" in given_back[0][1]
    assert [s.assignment_id for r in emitted for s in r.samples] == ["a-2", "a-2"]
    assert sum(released) == 4
    assert metrics.registry.get_sample_value("slipstream_episode_groups_reissued_total") == 1
