"""``builtin:calc``: two-digit multiplication with a calculator tool (issue 26, docs/agents.md).

The prompt is ``a*b=`` (a, b in 10..99); the answer is the product, too hard for the demo model to
compute. Its environment (``rollout_server.environments.calculator:Calculator``) is a calculator: a turn
``c<expression>.`` (the call syntax; ``learner.sampling.stop: ["."]`` ends the turn there) is
answered with `` <value>=``, and the next turn's number is the answer. A first turn that is a
number is the answer itself. Reward 1 for the right product, 0 otherwise: calling the tool is the
way to score.

The built-in model ``builtin:tiny-calc`` warms up on the turns of such episodes (:func:`warmup`):
half its first turns call the calculator, half write a number; after a call it copies
the result.
RL then raises the share of calls (the tool-use rate) and the reward with it.
"""

from __future__ import annotations

import random

from learner.data.tasks import Example, Task

LOW, HIGH = 10, 99
CALLS = 0.5
"""The share of the warm-up's first turns that call the calculator (the rest guess)."""


def example(rng: random.Random) -> Example:
    a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
    return Example(prompt=f"{a}*{b}=", answer=str(a * b))


def warmup(rng: random.Random) -> Example:
    """One turn of an episode: a first turn (a call, :data:`CALLS` of them, or a guess), or the
    turn after a call (the result copied), half and half."""
    a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
    stage = rng.random()
    if stage < CALLS / 2:
        return Example(prompt=f"{a}*{b}=", answer=f"c{a}*{b}.")
    if stage < 0.5:
        return Example(prompt=f"{a}*{b}=", answer=str(rng.randint(100, 9999)))
    return Example(prompt=f"{a}*{b}=c{a}*{b}. {a * b}=", answer=str(a * b))


TASK = Task(name="calc", example=example, reward="builtin:exact_numeric",
            params={"low": LOW, "high": HIGH, "calls": CALLS},
            environment="rollout_server.environments.calculator:Calculator", warmup=warmup)
