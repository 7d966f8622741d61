"""builtin:longtail (the long-tail workload of bench_async.py) and its exact_match reward."""

from __future__ import annotations

import random
import statistics

from learner.data.tasks import get_task
from learner.data.tasks.longtail import MAX_REPEAT
from rollout_server.rewards import load_reward


def test_longtail_answers_repeat_a_digit_with_a_long_tail_of_lengths():
    task = get_task("builtin:longtail")
    assert task.reward == "builtin:exact_match"
    rng = random.Random(0)
    lengths = []
    for _ in range(2000):
        ex = task.example(rng)
        d, n = ex.prompt.rstrip("=").split("x")
        assert ex.answer == d * int(n) and 1 <= int(n) <= MAX_REPEAT
        lengths.append(int(n))
    assert statistics.median(lengths) <= 10 and max(lengths) == MAX_REPEAT   # short mostly, tail to 64
    assert sum(n >= 32 for n in lengths) / len(lengths) > 0.1


def test_exact_match_compares_strings_not_floats():
    reward = load_reward("builtin:exact_match")
    a = "7" * 40
    assert reward("7x40=", a + "\n", {"answer": a}) == 1.0
    # Equal as floats (they differ past the 16th digit), different as strings.
    assert reward("7x40=", "7" * 39 + "8", {"answer": a}) == 0.0
    assert reward("7x40=", "7" * 39, {"answer": a}) == 0.0
