"""When the learner saves and how it resumes: :class:`LearnerCheckpoints` between the service's steps
and :class:`learner.state.checkpoint.Checkpointer`'s files."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from pathlib import Path
from typing import Any

from learner.state.checkpoint import (
    EXIT_CHECKPOINT_FAILED,
    FORMAT,
    Checkpoint,
    Checkpointer,
    Pending,
    checkpoint_error,
)


class LearnerCheckpoints:
    """Checkpoints of one :class:`learner.serve.service.LearnerService` (duck-typed: ``svc`` has cfg,
    run_id, version, prompts, buffer, trainer, assignment_counter, stopping, log, metrics, run_dir).

    When: every ``save_every`` versions, on a stop (SIGTERM / SIGINT / ``ctl stop``) when a step
    was trained since the last one, at the end of training, and on ``ctl checkpoint``. Always
    between steps: the train loop takes its batches through :meth:`next_batch`, which saves when
    one is due and, once the learner is stopping, takes no batch any more, so a stop waits for a
    running step to finish (:meth:`on_stop`) and then saves what it trained.

    Two phases, both in threads (the sockets keep being served): the state is captured on the loop,
    then :meth:`Checkpointer.prepare` saves the policy and copies every other tensor to host
    memory while the train loop waits (``slipstream_checkpoint_pause_seconds``); the write of the
    rest (:meth:`Checkpointer.commit`: the optimizer moments, digests, fsync, rename, marker)
    goes on beside the next steps. One checkpoint at a time: the next one waits for it, and so
    do a stop and the end of training before they exit.
    """

    def __init__(self, svc: Any):
        self.svc = svc
        cfg = svc.cfg
        self.store = Checkpointer(cfg.checkpoint.dir or Path(cfg.run_dir) / "checkpoints", cfg.checkpoint.keep_last)
        self.saved_version = 0                # version 0 is the model as loaded: never saved
        self.failed_stop = False
        self.resumed_from: Path | None = None
        self.idle = asyncio.Event()           # the train loop waits for a batch, or is parked
        self.lock = asyncio.Lock()            # one checkpoint at a time (held until it is written)
        self.capturing = asyncio.Lock()       # held while the trainer is read: no step starts
        self.pending: asyncio.Task | None = None
        m = svc.metrics                       # a learner.metrics.LearnerMetrics: defined there
        self.m_seconds = m.checkpoint_seconds
        self.m_version = m.checkpoint_version
        self.m_failures = m.checkpoint_failures
        self.m_pause = m.checkpoint_pause_seconds
        self.m_load = m.checkpoint_load_seconds

    # -- resume --
    def resume(self, spec: str | None) -> Checkpoint:
        """Verify the checkpoint ``spec`` names (cheap checks before the model loads)."""
        path = self.store.resolve(spec)
        return self.store.read(path)

    def load_run_state(self, ckpt: Checkpoint, run: Any) -> None:
        """The checkpoint's run id, version and assignment counter into ``run`` (a
        :class:`learner.state.run_state.RunState`), first, before the service builds what reads them."""
        try:
            run.load_state_dict(ckpt.state)
        except (ValueError, KeyError, TypeError) as e:
            raise checkpoint_error(ckpt.path, f"state.json does not fit this learner: {str(e)[:300]}") from None

    def apply(self, ckpt: Checkpoint) -> None:
        """Into the service (after its trainer is built and :meth:`load_run_state`): everything
        else :meth:`capture` saved."""
        svc, st = self.svc, ckpt.state
        start = time.monotonic()
        self.store.restore_trainer(ckpt, svc.trainer)
        try:
            svc.prompts.load_state_dict(st["data"])
            svc.buffer.load_state_dict(st["buffer"])
            # The config given now wins for the runtime settings the buffer holds (η, stale policy).
            svc.buffer.set_max_staleness(svc.cfg.staleness.max_staleness)
            svc.buffer.set_stale_policy(svc.cfg.staleness.stale_policy)
        except (ValueError, KeyError, TypeError) as e:
            raise checkpoint_error(ckpt.path, f"state.json does not fit this learner: {str(e)[:300]}") from None
        self.saved_version = svc.version
        self.resumed_from = ckpt.path
        self.m_version.set(svc.version)
        seconds = time.monotonic() - start
        self.m_load.set(seconds)
        self.store.clean_temporary()
        svc.log("resumed", checkpoint=str(ckpt.path), resumed_version=svc.version,
                data_position=svc.prompts.state_dict().get("position"),
                assignment_counter=svc.assignment_counter, buffered_samples=svc.buffer.pending_samples,
                leases=len(svc.buffer.leases), load_s=round(seconds, 3))

    def mark_resumed(self, trained_ids: Any) -> None:
        """A ``resumed_at_version`` line in trained_ids.jsonl: steps of an earlier life at or past
        this version were rolled back (:func:`effective_trained_ids`)."""
        if self.resumed_from is not None:
            trained_ids.write({"run_id": self.svc.run_id, "resumed_at_version": self.svc.version,
                               "checkpoint": str(self.resumed_from)})

    # -- saving --
    def capture(self) -> dict:
        """The service's state (on the loop, between steps): plain data for state.json."""
        svc = self.svc
        return {"format": FORMAT, **svc.state.state_dict(),
                "data": svc.prompts.state_dict(), "buffer": svc.buffer.state_dict(binary=False),
                "saved_at": time.time()}

    async def save(self, reason: str, wait: bool = True) -> dict | None:
        """Checkpoint the current version (the caller makes sure no step runs). Returns what was
        written once it is complete (``wait``), or once the trainer was read (not ``wait``: the
        write goes on, :attr:`pending`); None when it failed (logged, counted, and under
        ``checkpoint_failure: stop`` the learner stops)."""
        svc = self.svc
        await self.lock.acquire()
        handed = False
        try:
            async with self.capturing:
                version = svc.version
                state = self.capture()
                start = time.monotonic()
                try:
                    # (the tensor copies on the train thread, where the steps run: see
                    # LearnerService.train_thread; the writing beside the next step, _commit)
                    pending = await asyncio.get_running_loop().run_in_executor(
                        getattr(svc, "train_thread", None), self.store.prepare, version, state,
                        svc.trainer)
                except Exception as e:  # noqa: BLE001 -- any failure to write is reported the same way
                    self.failed(e, version, reason)
                    return None
            paused = time.monotonic() - start
            self.pending = asyncio.create_task(self._commit(pending, reason, start, paused),
                                               name="checkpoint")
            handed = True                     # the commit releases the lock
        finally:
            if not handed:
                self.lock.release()
        if wait:
            return await self.pending
        return {"version": version, "reason": reason, "pause_s": round(paused, 3), "written": False}

    async def _commit(self, pending: Pending, reason: str, start: float, paused: float) -> dict | None:
        try:
            try:
                path = await asyncio.to_thread(self.store.commit, pending)
            except Exception as e:  # noqa: BLE001 -- any failure to write is reported the same way
                self.failed(e, pending.version, reason)
                return None
        finally:
            self.lock.release()
        version, seconds = pending.version, time.monotonic() - start
        self.saved_version = max(self.saved_version, version)
        self.m_seconds.observe(seconds)
        self.m_pause.set(paused)
        self.m_version.set(version)
        info = {"checkpoint": str(path), "version": version, "reason": reason,
                "seconds": round(seconds, 3), "pause_s": round(paused, 3)}
        self.svc.log("checkpoint", **info)
        return info

    async def settled(self) -> None:
        """Wait until no checkpoint is being written."""
        async with self.lock:
            pass

    def failed(self, e: BaseException, version: int, reason: str) -> None:
        svc = self.svc
        self.m_failures.inc()
        code = errno.errorcode.get(getattr(e, "errno", None) or -1, None)
        stop = svc.cfg.checkpoint.failure == "stop"
        svc.log("checkpoint_failed", level="error", version=version, reason=reason,
                directory=str(self.store.root), error=f"{type(e).__name__}: {e}"[:500], errno=code,
                action="stopping (checkpoint_failure: stop)" if stop else
                "training goes on; the previous checkpoint is intact",
                hint="free disk space or make the directory writable (learner.checkpoint.dir)")
        if stop:
            self.failed_stop = True
            svc.stopping.set()

    async def request(self) -> dict:
        """``ctl checkpoint``: write one as soon as no step runs."""
        await self.settled()
        while not (self.idle.is_set() and not self.lock.locked()):
            if self.svc.stopping.is_set():
                raise RuntimeError("the learner is stopping (its final checkpoint follows)")
            await self._wait_idle()
            if self.lock.locked():
                await self.settled()
        info = await self.save("ctl")
        if info is None:
            raise RuntimeError("the checkpoint could not be written (see the checkpoint_failed event)")
        return info

    async def _wait_idle(self) -> None:
        waiter = asyncio.ensure_future(self.idle.wait())
        stop = asyncio.ensure_future(self.svc.stopping.wait())
        try:
            await asyncio.wait([waiter, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            stop.cancel()
        if self.idle.is_set():
            await asyncio.sleep(0)            # let a lock holder finish its turn

    async def next_batch(self):
        """The train loop's batch: saves first when one is due; once stopping, parks for good (the
        stop cancels it there, where no batch is held)."""
        svc = self.svc
        every = svc.cfg.checkpoint.save_every
        if every and svc.version % every == 0 and svc.version > self.saved_version \
                and not svc.stopping.is_set():
            await self.save("periodic", wait=False)
        if svc.stopping.is_set():
            self.idle.set()
            await asyncio.Future()            # cancelled by the stop
        self.idle.set()
        try:
            batch = await svc.buffer.next_batch(svc.version)
        finally:
            self.idle.clear()
        if self.capturing.locked():           # a ctl checkpoint reads the trainer: no step yet
            async with self.capturing:
                pass
        return batch

    async def at_end(self) -> None:
        """After the last step (a checkpoint still being written is waited for)."""
        await self.settled()
        if self.svc.version > self.saved_version and not self.failed_stop:
            await self.save("end")

    async def on_stop(self, train: asyncio.Task) -> int:
        """The learner is stopping: let a running step finish (it is recorded and published), stop
        the train loop where it holds no batch, and save if a step was trained since the last
        checkpoint. Returns the exit code (:data:`EXIT_CHECKPOINT_FAILED` when a failed checkpoint
        stopped the run)."""
        svc = self.svc
        resumed = getattr(getattr(svc, "control", None), "resumed", None)
        if resumed is not None:
            resumed.set()                     # a paused train loop (ctl pause) must see the stop
        while not train.done() and not self.idle.is_set():
            done = asyncio.ensure_future(self.idle.wait())
            await asyncio.wait([done, train], return_when=asyncio.FIRST_COMPLETED)
            done.cancel()
        train.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await train
        await self.settled()
        if not self.failed_stop and svc.version > self.saved_version and svc.trainer is not None:
            await self.save("stop")
        return EXIT_CHECKPOINT_FAILED if self.failed_stop else 0
