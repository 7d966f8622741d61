"""Guess the number: the model guesses a digit, the environment answers ``up`` or ``down`` until
it is found or the turns run out (``rollout.environment: rollout_server.environments.guessing:GuessNumber``;
the task ``builtin:guess``).

The secret is the row's ``answer`` (a digit). A turn's guess is the first digit of the model's
text; a turn without one is a wasted turn (observation `` ?=``). Reward: ``solved`` 1 when the
secret is found, and ``turns`` -0.1 for each turn after the first, so finding it sooner is worth
more. Observations are a few characters ending in ``=`` (the demo model answers after ``=``), so
an episode fits the demo model's 64 positions.
"""

from __future__ import annotations

import re
from typing import Any

_DIGIT = re.compile(r"\d")


class GuessNumber:
    """``options``: ``turn_cost`` (0.1), the reward taken for each turn after the first; ``up``,
    ``down``, ``unknown``: the observations (the demo's; a chat model's preset says them in words)."""

    def __init__(self, turn_cost: float = 0.1, up: str = " up=", down: str = " down=", unknown: str = " ?="):
        self.turn_cost = float(turn_cost)
        self.up, self.down, self.unknown = up, down, unknown
        self.secret: int | None = None

    async def reset(self, prompt: str, metadata: dict[str, Any]) -> str | None:
        secret = str(metadata.get("answer", "")).strip()
        if not (len(secret) == 1 and secret.isdigit()):
            raise ValueError(f"the row's answer {secret!r} is not one digit")
        self.secret = int(secret)
        return None                              # the prompt says it all

    async def step(self, completion: str, state: Any) -> tuple[str | None, dict[str, float], bool, dict]:
        parts = {"turns": -self.turn_cost if state.turn > 0 else 0.0}
        m = _DIGIT.search(completion)
        if m is None:
            return self.unknown, parts, False, {}
        guess = int(m.group())
        if guess == self.secret:
            return None, {**parts, "solved": 1.0}, True, {}
        return (self.up if guess < self.secret else self.down), parts, False, {}
