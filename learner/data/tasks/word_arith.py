"""``builtin:word_arith``: one-step arithmetic word problems with a whole-number answer.

"Tom has 3 apples and buys 4 more. How many apples does Tom have now?" — addition, subtraction
and small multiplication told as a short story, for a real small instruct model (the
``builtin:smollm2-135m`` preset).

The format follows from the reward. ``builtin:exact_numeric`` scores the number after ``####``
(GSM8K style), else the *first* number of the completion. Measured on SmolLM2-135M-Instruct
(greedy, 24 problems): asked for "just the number" it restates the story first ("Tom has 3 apples
and ...": first number wrong, 0 %), and answering at once it gets the sum wrong (0 %); but it
adds correctly when it writes the sum out ("3 + 4 = 7"). So every prompt carries one worked
example in GSM8K form (``2 + 3 = 5`` then ``#### 5``) and ends with ``A:``: the model then writes
the equation and, often but not always, the ``####`` line (12 % correct greedy, 4-8 % sampled at
temperature 1). Keeping to the format and getting the arithmetic right is what GRPO improves.
"""

from __future__ import annotations

import random

from learner.data.tasks import Example, Task

NAMES = ("Tom", "Anna", "Sam", "Lily", "Max", "Emma", "Ben", "Mia")
OBJECTS = ("apples", "books", "pencils", "stickers", "marbles", "cookies", "cards", "balloons")
MAX_OPERAND = 9
MAX_FACTOR = 5
EXAMPLE = ("Q: Sam has 2 pens and buys 3 more. How many pens does Sam have now?\n"
           "A: 2 + 3 = 5\n#### 5\n\n")
"""The worked example before every question (one shot, in the answer format the reward reads)."""


def _add(rng: random.Random, who: str, what: str) -> tuple[str, int]:
    a, b = rng.randint(1, MAX_OPERAND), rng.randint(1, MAX_OPERAND)
    story = rng.choice((
        f"{who} has {a} {what} and buys {b} more. How many {what} does {who} have now?",
        f"{who} has {a} {what}. A friend gives {who} {b} more. How many {what} does {who} have?",
    ))
    return story, a + b


def _sub(rng: random.Random, who: str, what: str) -> tuple[str, int]:
    a = rng.randint(2, 2 * MAX_OPERAND)
    b = rng.randint(1, a - 1)
    story = rng.choice((
        f"{who} has {a} {what} and gives away {b}. How many {what} does {who} have left?",
        f"{who} had {a} {what} and lost {b} of them. How many {what} does {who} have now?",
    ))
    return story, a - b


def _mul(rng: random.Random, who: str, what: str) -> tuple[str, int]:
    a, b = rng.randint(2, MAX_FACTOR), rng.randint(2, MAX_FACTOR)
    story = f"{who} has {a} boxes with {b} {what} in each box. How many {what} does {who} have?"
    return story, a * b


KINDS = (_add, _add, _sub, _mul)
"""Addition is drawn twice as often: it is the easiest, so early groups see some reward."""


def example(rng: random.Random) -> Example:
    """One word problem; the same rng state gives the same problem."""
    kind = rng.choice(KINDS)
    story, answer = kind(rng, rng.choice(NAMES), rng.choice(OBJECTS))
    return Example(prompt=f"{EXAMPLE}Q: {story}\nA:", answer=str(answer),
                   metadata={"kind": kind.__name__.lstrip("_")})


TASK = Task(name="word_arith", example=example, reward="builtin:exact_numeric",
            params={"max_operand": MAX_OPERAND, "max_factor": MAX_FACTOR, "revision": 2})
