"""``builtin:longtail``: "repeat digit d n times" (``7x12=`` -> ``777777777777``), n from 1 to 64.

The workload where asynchrony matters most: answer lengths with a long tail. ``n`` is drawn
log-uniformly, so most answers are a few tokens and a few are ~64 (the demo model's tokenizer is
one token per character); a synchronous trainer's generation phase lasts as long as the longest
completion of its batch. Scored by ``builtin:exact_match`` (the completion, stripped, equals the
answer: a float comparison would call two 64-digit strings equal when they differ past the 16th
digit). The built-in model ``builtin:tiny-longtail`` is warmed up on it.
"""

from __future__ import annotations

import math
import random

from learner.data.tasks import Example, Task

MAX_REPEAT = 64
"""The longest answer, in characters (= tokens for the built-in character tokenizer)."""


def example(rng: random.Random) -> Example:
    """One "dxn=" problem: d a digit, n log-uniform in [1, MAX_REPEAT] (median 8)."""
    d = rng.randint(0, 9)
    n = min(MAX_REPEAT, int(math.exp(rng.uniform(0.0, math.log(MAX_REPEAT + 1)))))
    n = max(1, n)
    return Example(prompt=f"{d}x{n}=", answer=str(d) * n)


TASK = Task(name="longtail", example=example, reward="builtin:exact_match",
            params={"max_repeat": MAX_REPEAT, "dist": "log-uniform"})
