"""SampleWatch: failed and refused samples counted by reason, reported at most every few seconds,
and the run stopped (once) when no valid sample arrives for the timeout or the bad share is over
its limit. A slow learner or an idle fleet is waiting, not failing: only a bad arrival stops."""

from __future__ import annotations

from types import SimpleNamespace

from learner.metrics import LearnerMetrics
from learner.serve.sample_watch import SampleWatch, failure_reason


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(timeout_s=10.0, share=1.0, window=10):
    clock, stops, events = Clock(), [], []
    metrics = LearnerMetrics()
    servers = SimpleNamespace(no_valid_sample_timeout_s=timeout_s, max_refused_share=share,
                              refused_share_window=window)
    watch = SampleWatch(metrics=metrics, on_stop=stops.append, servers=servers,
                        log=lambda event, **f: events.append((event, f)), clock=clock)
    return watch, clock, stops, events, metrics


def test_failure_reasons():
    assert failure_reason("reward exact: timed out after 60s") == "reward_timeout"
    assert failure_reason("reward exact: ZeroDivisionError: x") == "reward"
    assert failure_reason("generate: engine died") == "generate"
    assert failure_reason("anything else") == "other"


def test_no_valid_sample_for_the_timeout_stops_once_with_the_reasons():
    watch, clock, stops, events, metrics = make(timeout_s=10.0)
    watch.observe(2, [], 0)                                  # valid ones first
    clock.t = 100.0                                          # a long quiet wait is not a failure
    watch.observe(0, ["reward r: SystemExit: 3"] * 2, 0)
    assert not stops and events[-1][0] == "samples_refused"
    clock.t = 109.0
    watch.observe(0, ["reward r: SystemExit: 3"], 1, "reward 1e9 beyond max_abs_reward")
    assert not stops
    clock.t = 110.5
    watch.observe(0, ["reward r: timed out after 60s"], 0)
    assert len(stops) == 1 and stops[0].startswith("no valid sample for 10 s")
    assert "[reward 3, reward_timeout 1, invalid 1]" in stops[0] and "timed out" in stops[0]
    watch.observe(0, ["reward r: x"], 0)
    assert len(stops) == 1                                   # once
    assert metrics.samples_failed.labels(reason="reward")._value.get() == 4
    assert watch.status()["since_valid"] == 6 and watch.status()["stopped"] == stops[0]


def test_a_valid_sample_resets_the_clock():
    watch, clock, stops, _, _ = make(timeout_s=10.0)
    watch.observe(0, ["reward r: x"], 0)
    clock.t = 9.0
    watch.observe(1, ["reward r: x"], 0)                     # one valid in the same result
    clock.t = 15.0
    watch.observe(0, ["reward r: x"], 0)
    assert not stops                                          # 6 s since the streak began
    clock.t = 25.5
    watch.observe(0, ["reward r: x"], 0)
    assert stops


def test_the_bad_share_of_the_window_stops_the_run():
    watch, clock, stops, _, _ = make(timeout_s=0.0, share=0.5, window=10)
    for _ in range(4):
        watch.observe(1, ["reward r: x"], 0)                 # 50 %: not more than the limit
    assert not stops and watch.share() == 0.5
    watch.observe(0, ["reward r: x"] * 3, 0)                 # window: last 10 = 3 valid, 7 bad
    assert watch.share() == 0.7 and stops and "70% of the last 10 samples" in stops[0]


def test_dynamic_sampling_dropping_every_group_stops_once():
    """issue 27.1: groups dropped in a row by dynamic sampling (all rewards equal) stop the run at
    learner.batch.dynamic_sampling_max_drops, once; 0 never stops."""
    metrics = LearnerMetrics()
    stops: list[str] = []
    servers = SimpleNamespace(no_valid_sample_timeout_s=0, max_refused_share=1.0, refused_share_window=10)
    batch = SimpleNamespace(dynamic_sampling_max_drops=5)
    watch = SampleWatch(metrics=metrics, on_stop=stops.append, servers=servers, batch=batch)
    for streak in range(1, 5):
        watch.uniform(streak)
    assert not stops
    watch.uniform(5)
    watch.uniform(6)
    assert len(stops) == 1 and "dropped 5 groups in a row" in stops[0] and "dynamic_sampling_max_drops 5" in stops[0]
    batch.dynamic_sampling_max_drops = 0
    never = SampleWatch(metrics=LearnerMetrics(), on_stop=stops.append, servers=servers, batch=batch)
    never.uniform(10**6)
    assert len(stops) == 1
