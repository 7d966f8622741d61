"""A reward for the R7 chaos variant: 0 normally; while the file named by $SLIPSTREAM_CHAOS_NAN_FILE
exists, 1e300 (finite as a double, so it passes every check on the way; infinite as float32 in
the learner, so the step's advantages and loss are NaN and the step must be skipped)."""

from __future__ import annotations

import os

HUGE = 1e300


def spiky(prompt: str, completion: str, metadata: dict) -> float:
    trigger = os.environ.get("SLIPSTREAM_CHAOS_NAN_FILE")
    return HUGE if trigger and os.path.exists(trigger) else 0.0
