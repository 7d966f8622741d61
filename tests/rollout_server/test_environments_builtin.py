"""The built-in environments (issue 26 item 8): the calculator tool and the guessing game, and the
tasks that name them fill rollout.environment."""

from __future__ import annotations

import asyncio
import random

import pytest

from deploy.config_file import SlipstreamConfig
from learner.data.tasks import get_task
from rollout_server.environments.calculator import Calculator
from rollout_server.environments.guessing import GuessNumber
from rollout_server.episodes import EpisodeState, load_environment


def play(env, metadata: dict, turns: list[str]) -> list[tuple]:
    async def main():
        await env.reset("p", metadata)
        state = EpisodeState(prompt="p", metadata=metadata)
        out = []
        for i, text in enumerate(turns):
            state.turn = i
            out.append(await env.step(text, state))
        return out
    return asyncio.run(main())


def test_the_calculator_answers_calls_and_scores_the_answer():
    (call, answer) = play(Calculator(), {"answer": "1776"}, ["c37*48.", "1776"])
    assert call == (" 1776=", {"correct": 0.0}, False, {"tool_calls": 1})
    assert answer == (None, {"correct": 1.0}, True, {})
    (bad, wrong) = play(Calculator(), {"answer": "1776"}, ["c37x48.", "1777"])
    assert bad == (" error=", {"correct": 0.0}, False, {"tool_calls": 1, "tool_errors": 1})
    assert wrong[1] == {"correct": 0.0} and wrong[2]
    assert play(Calculator(), {"answer": "5"}, ["c2+3."])[0][0] == " 5="
    assert play(Calculator(), {"answer": "5"}, ["5"])[0] == (None, {"correct": 1.0}, True, {})


def test_the_guessing_game_says_up_or_down_and_charges_a_turn_after_the_first():
    steps = play(GuessNumber(), {"answer": "6"}, ["3", "8", "6"])
    assert [s[0] for s in steps] == [" up=", " down=", None]
    assert [s[2] for s in steps] == [False, False, True]
    assert sum(sum(s[1].values()) for s in steps) == pytest.approx(1.0 - 0.2)
    assert play(GuessNumber(), {"answer": "6"}, ["x"])[0][0] == " ?="
    with pytest.raises(ValueError, match="not one digit"):
        play(GuessNumber(), {"answer": "12"}, [])


@pytest.mark.parametrize("task", ["calc", "guess"])
def test_a_multi_turn_task_names_a_loadable_environment_and_the_config_uses_it(task):
    t = get_task(f"builtin:{task}")
    load_environment(t.environment)
    cfg = SlipstreamConfig.model_validate({"learner": {"data": {"dataset": f"builtin:{task}"}}})
    assert cfg.rollout.environment.class_name == t.environment
    own = SlipstreamConfig.model_validate({"learner": {"data": {"dataset": f"builtin:{task}"}},
                                           "rollout": {"environment": "my:Env"}})
    assert own.rollout.environment.class_name == "my:Env"                 # the config's own wins


def test_the_calc_warm_up_teaches_both_first_turns_and_the_copy():
    rng = random.Random(0)
    kinds = {"call": 0, "guess": 0, "copy": 0}
    for _ in range(400):
        ex = get_task("builtin:calc").warmup(rng)
        if ex.answer.startswith("c"):
            kinds["call"] += 1
            a, b = ex.prompt[:-1].split("*")
            assert ex.answer == f"c{a}*{b}."
        elif "c" in ex.prompt:
            kinds["copy"] += 1
            assert ex.prompt.endswith(f" {ex.answer}=")
        else:
            kinds["guess"] += 1
    assert 70 < kinds["call"] < 130 and 70 < kinds["guess"] < 130 and 160 < kinds["copy"] < 240, kinds
