"""An environment for the killed-mid-episode test (test_episodes_run.py): while the file
``$SLIPSTREAM_TEST_HOLD`` exists, an episode's first step says so (``held.<pid>`` beside it) and
waits; otherwise two turns, reward 1 for an even first digit."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path


class HeldOnce:
    async def reset(self, prompt, metadata):
        return None

    async def step(self, completion, state):
        hold = Path(os.environ["SLIPSTREAM_TEST_HOLD"])
        if state.turn == 0:
            if hold.exists():
                hold.with_name(f"held.{os.getpid()}").touch()
                while hold.exists():
                    await asyncio.sleep(0.05)
            return " more:", 0.0, False, {}
        digits = [c for c in "".join(state.completions) if c.isdigit()]
        return None, float(bool(digits) and int(digits[0]) % 2 == 0), True, {}
