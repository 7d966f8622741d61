"""Helpers shared by the buffer tests: samples, a fake clock, a driver for whole groups."""

from __future__ import annotations

import numpy as np

from protocol import Sample


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make_sample(assignment_id: str, group_index: int, group_size: int, versions=(0,), *,
                sample_id: str | None = None, prompt_len: int = 3, failed: str | None = None,
                reward: float = 0.0) -> Sample:
    """A sample whose completion has one token per entry of ``versions``."""
    tv = np.asarray(versions, dtype=np.int32)
    n = len(tv)
    return Sample(
        sample_id=sample_id or f"{assignment_id}/{group_index}",
        assignment_id=assignment_id,
        group_index=group_index,
        group_size=group_size,
        prompt_token_ids=np.arange(prompt_len, dtype=np.int32),
        completion_token_ids=np.arange(n, dtype=np.int32),
        behavior_logprobs=np.full(n, -1.0, dtype=np.float32),
        token_versions=tv,
        reward=reward,
        failed=failed,
    )


def group(assignment_id: str, group_size: int, versions=(0,), **kw) -> list[Sample]:
    return [make_sample(assignment_id, i, group_size, versions, **kw) for i in range(group_size)]


async def fill(buf, assignment_id: str, version: int, versions=None, holder: str = "s0",
               **kw) -> list:
    """Issue one assignment and put its whole group; returns the statuses."""
    buf.issue(assignment_id, holder, buf.group_size)
    vs = (version,) if versions is None else versions
    return [await buf.put(s, version) for s in group(assignment_id, buf.group_size, vs, **kw)]
