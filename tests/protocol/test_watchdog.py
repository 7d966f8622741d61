"""The watchdog (protocol.plumbing.watchdog): the stall limit, the lines and when they come, the
gauges, an expected wait, the dump and the hard stop with a fake clock; a blocked event loop named
by its frame with a real loop and the real thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
from prometheus_client import CollectorRegistry, Gauge

from protocol.plumbing.watchdog import EXIT_STALLED, REASONS, Waiting, Watchdog, frame_of


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(clock, waiting=None, **kw):
    events: list[tuple[str, dict]] = []
    waiting = waiting or [Waiting("samples", "waiting for samples: nobody sends")]
    dog = Watchdog("learner", noun="step", diagnose=lambda idle: waiting[0],
                   log=lambda event, **f: events.append((event, f)), clock=clock, **kw)
    return dog, events


def names(events):
    return [e for e, _ in events]


def test_the_limit_is_the_setting_else_ten_median_intervals_at_least_60_s():
    clock = Clock()
    stall = [0.0]
    dog, _ = make(clock, stall_s=lambda: stall[0])
    assert dog.limit() == 60.0                    # no progress yet
    for _ in range(5):
        clock.t += 12.0
        dog.progress("step")
    assert dog.limit() == pytest.approx(120.0)    # 10 x the median of 12 s
    stall[0] = 7.5                                # ctl set watchdog.stall_s 7.5: read at once
    assert dog.limit() == 7.5


def test_stall_lines_at_growing_intervals_then_progress_resumed():
    clock = Clock()
    dog, events = make(clock, stall_s=lambda: 10.0)
    clock.t += 9.0
    assert dog.check() is None and events == []
    clock.t += 1.0                               # 10 s: the first line
    assert dog.check().reason == "samples"
    assert names(events) == ["stalled"]
    fields = events[0][1]
    assert fields["diagnosis"] == "no step for 10 s: waiting for samples: nobody sends"
    assert fields["reason"] == "samples" and fields["process"] == "learner"
    assert dog.status()["waiting_on"].startswith("no step for 10 s")
    for _ in range(9):                           # 11..19 s: quiet
        clock.t += 1.0
        dog.check()
    assert names(events) == ["stalled"]
    clock.t += 1.0                               # 20 s: again (twice the time stalled)
    dog.check()
    clock.t += 19.0                              # 39 s: quiet; 40 s: again
    dog.check()
    assert names(events) == ["stalled", "stalled"]
    clock.t += 1.0
    dog.check()
    assert [f["stalled_s"] for e, f in events] == [10.0, 20.0, 40.0]
    clock.t += 2.0
    dog.progress("step")
    assert events[-1] == ("progress_resumed", {"process": "learner", "after": "step",
                                               "stalled_s": 42.0, "was": "samples"})
    assert dog.status()["stalled"] is False and dog.stalled_s() == 0.0


def test_gauges_follow_the_stall():
    clock = Clock()
    registry = CollectorRegistry()
    stalled = Gauge("slipstream_stalled_seconds", "s", ["process"], registry=registry)
    waiting = Gauge("slipstream_waiting_on", "w", ["process", "reason"], registry=registry)
    kind = [Waiting("no_servers", "no server")]
    dog, _ = make(clock, waiting=kind, stall_s=lambda: 5.0)
    dog.export(stalled, waiting)

    def value(name, **labels):
        return registry.get_sample_value(name, {"process": "learner", **labels})
    assert all(value("slipstream_waiting_on", reason=r) == 0 for r in REASONS)
    clock.t += 6.0
    dog.check()
    assert value("slipstream_stalled_seconds") == 6.0
    assert value("slipstream_waiting_on", reason="no_servers") == 1
    kind[0] = Waiting("samples", "servers, no samples")       # the cause changed
    clock.t += 1.0
    dog.check()
    assert value("slipstream_waiting_on", reason="no_servers") == 0
    assert value("slipstream_waiting_on", reason="samples") == 1
    dog.progress("step")
    assert value("slipstream_stalled_seconds") == 0
    assert value("slipstream_waiting_on", reason="samples") == 0


def test_an_expected_wait_is_no_stall_and_restarts_the_clock():
    clock = Clock()
    kind = [Waiting("other", "paused (slipstream ctl resume)", expected=True)]
    dog, events = make(clock, waiting=kind, stall_s=lambda: 5.0, abort_after_s=lambda: 6.0,
                       abort=lambda code: pytest.fail("a paused process was aborted"))
    for _ in range(30):
        clock.t += 1.0
        assert dog.check() is None
    assert events == [] and dog.idle_s() < 5.0


def test_dump_once_and_the_hard_stop(capsys):
    clock = Clock()
    dumps, codes = [], []
    dog, events = make(clock, stall_s=lambda: 5.0, dump_after_s=lambda: 8.0, abort_after_s=lambda: 12.0,
                       dump=lambda: dumps.append(1) or "/tmp/stacks-x.txt", abort=codes.append)
    for _ in range(11):
        clock.t += 1.0
        dog.check()
    assert len(dumps) == 1 and ("stacks_written", {"path": "/tmp/stacks-x.txt", "why": "stalled 8 s"}) in events
    assert codes == []
    clock.t += 1.0
    dog.check()
    assert codes == [EXIT_STALLED]
    assert events[-1][0] == "stalled_abort" and events[-1][1]["exit_code"] == 7
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("slipstream learner: stalled 12 s (watchdog.abort_after_s 12), exiting with code 7: "
                   "no step for 12 s: waiting for samples: nobody sends")


def test_a_blocked_event_loop_is_named_by_its_frame():
    """A real loop whose thread blocks inside a callback: the watchdog's thread cannot get a
    diagnosis from it and names the frame instead (this file's line, under threading's wait)."""
    stalled = threading.Event()
    lines: list[str] = []

    def log(event, **fields):
        if event == "stalled":
            lines.append(fields["diagnosis"])
            stalled.set()

    async def main():
        dog = Watchdog("rollout-0", diagnose=lambda idle: Waiting("work", "idle"), log=log,
                       stall_s=lambda: 0.3, tick_s=0.05, loop_grace_s=0.2)
        dog.start()
        try:
            await asyncio.sleep(0.1)
            assert stalled.wait(10)               # the loop's thread blocks right here
        finally:
            dog.stop()

    asyncio.run(main())
    assert len(lines) == 1
    assert "the event loop has not run for" in lines[0]
    assert "test_watchdog.py" in lines[0] and "in main: assert stalled.wait(10)" in lines[0]
    assert "threading.py" in lines[0]


def test_frame_of_an_unknown_thread_is_empty():
    assert frame_of(None) == "" and frame_of(-1) == ""
