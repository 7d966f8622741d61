"""The adaptive staleness controller: a scripted sequence of step statistics (unit), and a real run
(learner + a real rollout server, tiny model) where a forced learning-rate jump drives the mismatch
KL up and η comes down."""

from __future__ import annotations

import json
import math

import pytest
from learner_testkit import ctl, learner_config, metric, real_server, running_learner, wait_until

from buffer.staleness import StalenessController


def controller(**kw) -> StalenessController:
    args = dict(min_staleness=1, ess_min=0.5, mismatch_kl_max=0.1, ess_recover=0.7,
                mismatch_kl_recover=0.05, recover_steps=3)
    args.update(kw)
    return StalenessController(**args)


def run(c: StalenessController, eta: int, high: int, script: list[tuple[float, float]]) -> list[int]:
    """η after each step of ``script`` ((ess_ratio, mismatch_kl) per step)."""
    out = []
    for ess, kl in script:
        d = c.update(eta, high, {"is_ess_ratio": ess, "mismatch_kl": kl})
        eta = d.eta if d is not None else eta
        out.append(eta)
    return out


GOOD, BAD_ESS, BAD_KL, MIDDLING = (0.9, 0.01), (0.3, 0.01), (0.9, 0.5), (0.6, 0.07)


def test_shrinks_at_once_and_grows_back_after_healthy_steps():
    c = controller()
    assert run(c, 4, 4, [GOOD, BAD_ESS, BAD_KL, BAD_KL, BAD_KL, GOOD, GOOD, GOOD, GOOD, GOOD, GOOD]) == \
        [4, 3, 2, 1, 1, 1, 1, 2, 2, 2, 3]          # floor at min_staleness 1; +1 per 3 healthy steps


def test_hysteresis_middling_steps_neither_shrink_nor_count_as_healthy():
    c = controller()
    # Between the two pairs of thresholds: no shrink, and the healthy streak restarts.
    assert run(c, 2, 4, [MIDDLING, GOOD, GOOD, MIDDLING, GOOD, GOOD, GOOD]) == [2, 2, 2, 2, 2, 2, 3]
    # A statistic hovering around the shrink bound flaps at most downwards, never back up at once.
    c = controller(recover_steps=2)
    assert run(c, 3, 3, [(0.49, 0.0), (0.51, 0.0), (0.49, 0.0), (0.51, 0.0)]) == [2, 2, 1, 1]


def test_never_above_the_bound_and_ignores_steps_without_statistics():
    c = controller(recover_steps=1)
    assert run(c, 2, 2, [GOOD, GOOD]) == [2, 2]
    assert c.update(3, 2, {"is_ess_ratio": 0.9, "mismatch_kl": 0.0}).eta == 2      # bound lowered
    assert c.update(2, 3, {}) is None
    assert c.update(2, 3, {"is_ess_ratio": float("nan"), "mismatch_kl": 0.0}) is None
    with pytest.raises(ValueError, match="at least as strict"):
        controller(ess_recover=0.4)


def test_state_round_trip():
    c = controller()
    run(c, 2, 4, [GOOD, GOOD])
    d = controller()
    d.load_state_dict(c.state_dict())
    assert run(d, 2, 4, [GOOD]) == [3]


@pytest.mark.slow
async def test_a_learning_rate_jump_brings_eta_down(tmp_path, tiny_model_dir):
    cfg = learner_config(tmp_path, max_staleness=2, staleness_controller="adaptive",
                         staleness_recover_steps=1000, batch_prompts=2)
    async with running_learner(cfg, tiny_model_dir) as svc:
        async with real_server(svc, tiny_model_dir) as (_, task):
            await wait_until(lambda: svc.version >= 2 or task.done(), 240, "two steps")
            assert svc.buffer.max_staleness == 2                 # healthy so far: η untouched
            assert (await ctl(svc.endpoints["control"], "set", key="optimizer.lr", value=0.05)).ok
            await wait_until(lambda: svc.buffer.max_staleness < 2 or task.done(), 240, "η down")
            assert not task.done()
            assert metric(svc, "slipstream_max_staleness") == svc.buffer.max_staleness
            assert metric(svc, "slipstream_staleness_changes_total", reason="mismatch_kl_high") + \
                metric(svc, "slipstream_staleness_changes_total", reason="ess_low") >= 1
            assert svc.cfg.staleness.max_staleness == 2                    # the operator's bound stays
            # The idle ratios ride along in every step row (and the server's heartbeats).
            rows = [json.loads(line) for line in (svc.run_dir / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in rows if "learner_idle_ratio" in r]
            # (the servers' ratio is NaN until the first Heartbeat: unknown, not busy)
            assert steps and all(0 <= r["learner_idle_ratio"] <= 1 for r in steps)
            assert all(math.isnan(r["rollout_idle_ratio"]) or 0 <= r["rollout_idle_ratio"] <= 1
                       for r in steps)
            assert 0 <= metric(svc, "slipstream_learner_idle_ratio") <= 1
