"""The learner's diagnosis (learner.serve.waiting): each state named on one line, read from real
components (Admission, RolloutBuffer, SampleWatch) with a fake clock; what is expected is no stall."""

from __future__ import annotations

from types import SimpleNamespace

import protocol
from buffer import RolloutBuffer
from learner.config import ServersSettings
from learner.metrics import LearnerMetrics
from learner.serve.admission import Admission
from learner.serve.sample_watch import SampleWatch
from learner.serve.waiting import SERVERS_SHOWN, LearnerWaiting


class Clock:
    t = 500.0

    def __call__(self) -> float:
        return self.t


def setup(expected=None):
    clock, metrics = Clock(), LearnerMetrics()
    buffer = RolloutBuffer(batch_samples=8, group_size=4)

    async def send(identity, msg):
        return True

    def welcome():
        return protocol.Welcome(learner_id="l", run_id="r", version=0, weights_endpoint="tcp://10.0.0.1:5556",
                                weights_kind="full")
    admission = Admission(buffer, SimpleNamespace(send=send),
                          SimpleNamespace(welcome=welcome, next_assignment=lambda: None), version=lambda: 0,
                          servers=ServersSettings(), metrics=metrics, log=lambda *a, **k: None, clock=clock)
    servers = SimpleNamespace(no_valid_sample_timeout_s=0, max_refused_share=1.0, refused_share_window=100)
    watch = SampleWatch(metrics=metrics, on_stop=lambda reason: None, servers=servers, clock=clock)
    checkpoints = SimpleNamespace(writing=None, store=SimpleNamespace(root="/runs/x/checkpoints"))
    process = SimpleNamespace(expected_wait=lambda: expected, stale_ranks=list)
    waiting = LearnerWaiting(admission=admission, buffer=buffer, sample_watch=watch, checkpoints=checkpoints,
                             batch=SimpleNamespace(batch_samples=8), endpoints={"rollout": "tcp://10.0.0.1:5555"},
                             process=process, clock=clock)
    return clock, admission, watch, checkpoints, waiting


async def join(admission, name: str, clock) -> None:
    await admission.hello(name.encode(), protocol.Hello(server_id=name, engine="hf", model="m", version=0,
                                                       max_concurrency=8))


def test_no_server_and_expected_waits():
    clock, admission, watch, checkpoints, waiting = setup()
    w = waiting(70.0)
    assert w.reason == "no_servers" and not w.expected
    assert w.line == ("waiting for samples: no rollout server is connected to tcp://10.0.0.1:5555 (none "
                      "has since the start); the buffer holds 0 of the 8 samples a step needs")
    *_, paused = setup(expected="paused (slipstream ctl resume)")
    assert paused(70.0).expected and paused(70.0).line == "paused (slipstream ctl resume)"


def test_phases_and_a_checkpoint_write():
    clock, admission, watch, checkpoints, waiting = setup()
    waiting.enter("step")
    clock.t += 400
    assert (waiting(400).reason, waiting(400).line) == ("step", "a policy step has run 400 s")
    waiting.enter("publish")
    clock.t += 61
    assert (waiting(61).reason, waiting(61).line) == ("publish", "publishing the new weights has run 61 s")
    waiting.enter("batch")
    checkpoints.writing = ("writing the files", 200, clock.t - 300)
    w = waiting(300)
    assert (w.reason, w.line) == ("checkpoint", "a checkpoint write (writing the files, version 200) has "
                                                "run 300 s in /runs/x/checkpoints")


async def test_servers_their_leases_and_failed_samples():
    clock, admission, watch, checkpoints, waiting = setup()
    await join(admission, "rollout-0", clock)
    clock.t += 30
    await join(admission, "rollout-1", clock)
    watch.observe(0, ["reward grade: ValueError: no answer key"] * 3, 0)
    clock.t += 5
    w = waiting(35)
    assert w.reason == "samples"
    assert w.line == ("waiting for samples: 2 rollout servers connected, no valid sample yet; the buffer "
                      "holds 0 of the 8 samples a step needs; failed samples: 3 reward (3 since the last "
                      "valid one); last error: reward grade: ValueError: no answer key; rollout-0: 0 "
                      "samples leased, 0 credits, last message 35 s ago; rollout-1: 0 samples leased, "
                      "0 credits, last message 5 s ago")
    watch.observe(4, [], 0)
    clock.t += 12
    assert "the last valid sample came 12 s ago" in waiting(12).line
    for i in range(2, SERVERS_SHOWN + 3):
        await join(admission, f"rollout-{i}", clock)
    assert waiting(12).line.endswith(f"and {SERVERS_SHOWN + 3 - SERVERS_SHOWN} more servers")
    for name in list(admission.servers):
        admission.servers.pop(name)
    assert "(none has since the start)" not in waiting(12).line       # it had servers


def test_a_deepspeed_rank_that_stopped_beating_comes_first(tmp_path):
    """A worker's liveness file (learner.train.ds_group.RankBeat, a real thread and file) older
    than RANK_STALE_S names that rank, whatever phase rank 0 is in."""
    import time

    from learner.train.ds_group import RANK_STALE_S, RankBeat, stale_ranks

    beat = RankBeat(tmp_path / "ranks", 1)
    beat.command = ("step", time.time())
    beat.write()
    assert stale_ranks(tmp_path / "ranks", world=2) == []
    later = time.time() + RANK_STALE_S + 5
    stale = stale_ranks(tmp_path / "ranks", world=2, now=later)
    assert [(r["rank"], r["command"], round(r["age_s"])) for r in stale] == [(1, "step", RANK_STALE_S + 5)]
    assert stale_ranks(tmp_path / "ranks", world=1, now=later) == []        # a rank past the world
    clock, admission, watch, checkpoints, waiting = setup()
    waiting.process.stale_ranks = lambda: stale_ranks(tmp_path / "ranks", world=2, now=later)
    waiting.enter("step")
    w = waiting(20)
    assert w.reason == "rank"
    assert w.line == (f"waiting on DeepSpeed rank 1 (pid {stale[0]['pid']} on {stale[0]['host']}): no "
                      f"heartbeat for {RANK_STALE_S + 5:.0f} s, its last command step")
    beat.stop()                                  # a clean exit removes the file: nothing to judge
    assert stale_ranks(tmp_path / "ranks", world=2, now=later) == []
