"""``builtin:arith``: single-digit addition ``a+b=`` with the decimal sum as the answer.

Small enough for the 0.86 M-parameter demo model to learn in minutes on a CPU, with a reward that
is exact (``builtin:exact_numeric`` compares the completion's number with the answer).
"""

from __future__ import annotations

import random

from learner.data.tasks import Example, Task

MAX_OPERAND = 9


def example(rng: random.Random) -> Example:
    """One "a+b=" problem with a, b uniform in [0, MAX_OPERAND]."""
    a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    return Example(prompt=f"{a}+{b}=", answer=str(a + b))


TASK = Task(name="arith", example=example, reward="builtin:exact_numeric",
            params={"max_operand": MAX_OPERAND})
