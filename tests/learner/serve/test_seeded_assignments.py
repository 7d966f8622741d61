"""learner.sampling.seed_per_assignment (issue 27.9, groundwork for a resumed run that replays an
uninterrupted one): every assignment carries a seed of its own, a function of learner.seed and the
assignment's number alone; off by default (the engines' own randomness)."""

from __future__ import annotations

import pytest
from learner_testkit import FakeServer, learner_config, running_learner

import protocol

pytestmark = pytest.mark.slow


async def _assignments(cfg, model_dir, n: int) -> list[protocol.Assignment]:
    async with running_learner(cfg, model_dir) as svc:
        server = FakeServer(svc.endpoints["rollout"], "s", max_concurrency=2 * n)
        try:
            await server.hello()
            await server.work(2 * n)
            got = []
            while len(got) < n:
                msg = await server.recv(timeout_s=30)
                if isinstance(msg, protocol.Assignment):
                    got.append(msg)
            return got
        finally:
            server.close()


async def test_each_assignment_carries_its_own_seed(tmp_path, tiny_model_dir):
    cfg = learner_config(tmp_path / "a", seed=5, batch_prompts=2, max_staleness=1,
                         sampling={"seed_per_assignment": True})
    got = await _assignments(cfg, tiny_model_dir, 4)
    counters = [int(a.assignment_id.rsplit("-a", 1)[1]) for a in got]
    assert [a.sampling.seed for a in got] == [5 * 1_000_003 + c for c in counters]
    assert len({a.sampling.seed for a in got}) == 4
    plain = await _assignments(learner_config(tmp_path / "b", batch_prompts=2, max_staleness=1), tiny_model_dir, 2)
    assert all(a.sampling.seed is None for a in plain)


async def test_each_assignment_carries_the_stop_conditions(tmp_path, tiny_model_dir):
    """issue 26.3: learner.sampling.stop / stop_token_ids reach every assignment (and the HF and
    vLLM engines through GenRequest.from_sampling: tests/rollout_server/test_engine_*.py)."""
    from rollout_server.engine import GenRequest

    cfg = learner_config(tmp_path / "s", batch_prompts=2, max_staleness=1,
                         sampling={"stop": ["</tool>"], "stop_token_ids": [3]})
    got = await _assignments(cfg, tiny_model_dir, 2)
    assert all(a.sampling.stop == ["</tool>"] and a.sampling.stop_token_ids == [3] for a in got)
    req = GenRequest.from_sampling(got[0].prompt_token_ids, 2, got[0].sampling)
    assert req.stop == ("</tool>",) and req.stop_token_ids == (3,)


def test_bad_stop_conditions_are_config_errors():
    from pydantic import ValidationError

    from learner.config import SamplingSettings

    for bad in ({"stop": [""]}, {"stop": ["x" * 257]}, {"stop": ["x"] * 17}, {"stop_token_ids": [-1]},
                {"stop_token_ids": [2**31]}):
        with pytest.raises(ValidationError):
            SamplingSettings(**bad)
