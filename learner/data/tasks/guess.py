"""``builtin:guess``: guess a digit in a few turns, told ``up`` or ``down`` after each miss.

A multi-turn task (issue 26, docs/agents.md): the prompt is always ``g=``; the row's answer is the
secret digit, which only the environment (``rollout_server.environments.guessing:GuessNumber``) sees.
Each turn the model writes a number; the environment answers `` up=`` or `` down=`` (ending in
``=`` as the arithmetic prompts of the demo model's warm-up do) until it is found or the turns run
out. Guessing at random finds it within three turns about 3 times in 10; halving the interval
each turn finds 7 of the 10 digits, so the reward has room to rise only by using the answers.
"""

from __future__ import annotations

import random

from learner.data.tasks import Example, Task


def example(rng: random.Random) -> Example:
    return Example(prompt="g=", answer=str(rng.randint(0, 9)))


TASK = Task(name="guess", example=example, reward="builtin:exact_numeric",
            params={"digits": 10}, environment="rollout_server.environments.guessing:GuessNumber")
