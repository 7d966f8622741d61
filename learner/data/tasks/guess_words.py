"""``builtin:guess_words``: :mod:`builtin:guess <learner.data.tasks.guess>` told in words, for a
real instruct model (the ``smollm2-guess.yaml`` preset): the prompt explains the game, the
environment's answers come as the user's next message under the chat template (its options in
the preset: "Higher." / "Lower.")."""

from __future__ import annotations

import random

from learner.data.tasks import Example, Task

PROMPT = ("Let's play a game. I picked a digit from 0 to 9. Guess it: reply with one digit only. "
          "After each wrong guess I will tell you whether my digit is higher or lower.")


def example(rng: random.Random) -> Example:
    return Example(prompt=PROMPT, answer=str(rng.randint(0, 9)))


TASK = Task(name="guess_words", example=example, reward="builtin:exact_numeric",
            params={"digits": 10}, environment="rollout_server.environments.guessing:GuessNumber")
