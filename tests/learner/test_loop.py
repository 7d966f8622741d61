"""learner.loop.TrainLoop: the whole policy step in one place, in its order, with its exits; and
LearnerCheckpoints.save deciding privately whether a checkpoint is due at a step's end.

The loop's collaborators are recording stand-ins here (the loop is what is under test); the
checkpointer of the second half is the real one, on a tiny tensor-free trainer."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from buffer import Batch, StalenessDecision
from learner.loop import Batches, TrainLoop, TrainThread
from learner.metrics import LearnerMetrics
from learner.state.learner_checkpoints import LearnerCheckpoints
from learner.train.trainer import BrokenWeights, SkippedStep


class Calls(list):
    def __call__(self, name: str):
        self.append(name)


class Trainer:
    named_tensors = None

    def __init__(self, calls: Calls, fail: list):
        self.calls, self.fail = calls, fail

    def step(self, batch):
        self.calls("step")
        if self.fail:
            raise self.fail.pop(0)
        return {"step_s": 0.0}


class Parts:
    """Every collaborator of the loop, each method recording its name."""

    def __init__(self, total_steps: int, fail: list | None = None, skips: int = 0):
        self.calls = calls = Calls()
        self.run = SimpleNamespace(version=0)
        self.cfg = SimpleNamespace(total_steps=total_steps, algorithm=SimpleNamespace(max_consecutive_skips=skips),
                                   staleness=SimpleNamespace(max_staleness=3))
        self.trainer = Trainer(calls, fail or [])
        self.forbidden: list[str] = []
        self.saves: list[tuple[int, bool]] = []
        self.bounds: list[int] = []
        parts = self

        class Checkpoints:
            @contextlib.asynccontextmanager
            async def between_steps(self):
                calls("between_steps")
                yield

            async def save(self, version, last=False):
                calls("checkpoints.save")
                parts.saves.append((version, last))

            def forbid(self, reason):
                parts.forbidden.append(reason)

        class Source:
            prompts = SimpleNamespace(status=dict)
            buffer = SimpleNamespace(pending_samples=0)

            async def next_batch(self, version):
                calls("next_batch")
                return Batch(samples=[], version=version)

            def check(self):
                return False

        class Publisher:
            async def publish(self, version, tensors):
                calls(f"publish v{version}")
                return 0.0

            async def drain(self):
                calls("drain")

        class Staleness:
            def after_step(self, bound, stats):
                calls("staleness.after_step")
                parts.bounds.append(bound)
                return None

        class Records:
            def batch_versions(self, batch):
                return {}

            def batch_datasets(self, batch):
                return {}

            def trained(self, batch):
                calls("records.trained")

            def skipped(self, batch, reason):
                calls("records.skipped")

            def idle_stats(self, idle_s, cycle_s):
                return {}

            def staleness_changed(self, decision, stats, bound):
                assert decision is None or isinstance(decision, StalenessDecision)

            def step(self, stats):
                calls("records.step")

        class Admission:
            async def dispatch(self):
                calls("dispatch")

        class Control:
            resumed = asyncio.Event()

            def before_step(self, trainer):
                calls("before_step")

        Control.resumed.set()
        nothing = SimpleNamespace(enter=lambda phase: None, progress=lambda what: None)
        self.loop = TrainLoop(self.cfg, run=self.run, trainer=self.trainer,
                              thread=TrainThread(ThreadPoolExecutor(1)), batches=Source(),
                              checkpoints=Checkpoints(), control=Control(), publisher=Publisher(),
                              staleness=Staleness(), records=Records(), admission=Admission(),
                              rollout_log=None, evaluation=None, waiting=nothing, watchdog=nothing,
                              log=lambda event, **fields: calls(event))


async def test_one_policy_step_runs_in_its_order_and_ends_with_the_checkpointers_save():
    p = Parts(total_steps=2)
    assert await p.loop.run_steps() is None
    one = ["between_steps", "next_batch", "before_step", "step", "records.trained", "publish v{}",
           "staleness.after_step", "records.step", "dispatch", "checkpoints.save"]
    assert p.calls == [c.format(1) for c in one] + [c.format(2) for c in one] + ["drain"]
    assert p.saves == [(1, False), (2, True)]          # the last step says so (torchtitan's last_step)
    assert p.bounds == [3, 3] and p.run.version == 2


async def test_skipped_steps_give_no_version_and_end_the_run_at_the_limit():
    p = Parts(total_steps=5, fail=[SkippedStep("nan loss", {}), SkippedStep("nan loss", {})], skips=2)
    reason = await p.loop.run_steps()
    assert reason is not None and "2 steps in a row skipped" in reason and "nan loss" in reason
    assert p.run.version == 0 and p.saves == [] and p.calls.count("records.skipped") == 2
    assert "publish v1" not in p.calls


async def test_a_skip_streak_is_broken_by_a_trained_step():
    p = Parts(total_steps=2, fail=[SkippedStep("a", {})], skips=2)
    assert await p.loop.run_steps() is None and p.run.version == 2 and p.loop.skip_streak == 0


async def test_broken_weights_forbid_every_later_checkpoint():
    p = Parts(total_steps=5, fail=[BrokenWeights("non-finite weights after the update")])
    reason = await p.loop.run_steps()
    assert reason.startswith("non-finite weights") and p.forbidden == ["non-finite weights after the update"]
    assert p.saves == [] and p.run.version == 0


# ---- LearnerCheckpoints.save: the checkpointer decides ----------------------------------------

class NoTensors:
    """A trainer with nothing to save but the files the Checkpointer writes for any trainer."""


def checkpointer(tmp_path, save_every: int, stopping: asyncio.Event) -> tuple[LearnerCheckpoints, list]:
    written: list = []
    settings = SimpleNamespace(dir=None, keep_last=2, failure="continue", save_every=save_every)
    lc = LearnerCheckpoints(settings, tmp_path, run=SimpleNamespace(version=0), metrics=LearnerMetrics(),
                            log=lambda *a, **k: None, stopping=stopping)

    async def write(reason, wait=True):
        written.append((lc.run.version, reason, wait))
        lc.saved_version = lc.run.version
        return {}
    lc.write = write
    return lc, written


@pytest.mark.parametrize("every", [0, 2])
async def test_a_periodic_checkpoint_only_when_due_and_the_last_one_always(tmp_path, every):
    stopping = asyncio.Event()
    lc, written = checkpointer(tmp_path, every, stopping)
    for v in range(1, 6):
        lc.run.version = v
        await lc.save(v, last=v == 5)
    periodic = [(2, "periodic", False), (4, "periodic", False)] if every else []
    assert written == periodic + [(5, "end", True)]


async def test_no_checkpoint_at_a_steps_end_once_stopping_and_a_stop_parks_between_steps(tmp_path):
    stopping = asyncio.Event()
    lc, written = checkpointer(tmp_path, 1, stopping)
    stopping.set()
    lc.run.version = 1
    await lc.save(1, last=True)
    assert written == []                               # on_stop saves then, with reason "stop"
    entered = asyncio.ensure_future(lc.between_steps().__aenter__())
    await asyncio.sleep(0.05)
    assert lc.idle.is_set() and not entered.done()     # parked where no batch is held
    entered.cancel()


async def test_batches_end_when_a_finite_dataset_is_used_up():
    from buffer import RolloutBuffer

    buffer = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=1)
    prompts = SimpleNamespace(finite=True, exhausted=False)
    batches = Batches(buffer, prompts, SimpleNamespace(batch_samples=4))
    waiting = asyncio.ensure_future(batches.next_batch(0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    prompts.exhausted = True                           # every prompt drawn, nothing in flight
    assert batches.check()
    assert await asyncio.wait_for(waiting, 5) is None
