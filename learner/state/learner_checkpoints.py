"""When the learner saves and how it resumes: :class:`LearnerCheckpoints` between the train loop's steps
and :class:`learner.state.checkpoint.Checkpointer`'s files."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Protocol

from learner.state.checkpoint import (
    EXIT_CHECKPOINT_FAILED,
    FORMAT,
    Checkpoint,
    Checkpointer,
    Pending,
    checkpoint_error,
)
from protocol.errors import StartupError


class Stateful(Protocol):
    """A part of the run a checkpoint saves (torchtitan's ``CheckpointManager(states=...)``)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class BufferState:
    """The rollout buffer as a checkpoint part: its state as JSON-able data; after a load, η and
    the stale policy of ``staleness`` (the ``learner.staleness`` section: the config given at the
    resume) win over the saved ones."""

    def __init__(self, buffer: Any, staleness: Any):
        self.buffer, self.staleness = buffer, staleness

    def state_dict(self) -> dict:
        return self.buffer.state_dict(binary=False)

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state)
        self.buffer.staleness.set(self.staleness.max_staleness, "resume")   # η's owner (buffer.staleness)
        self.buffer.set_stale_policy(self.staleness.stale_policy)


class LearnerCheckpoints:
    """The learner's checkpoints: the trainer, the run state (:class:`learner.state.run_state.
    RunState`) and the parts handed to :meth:`attach` (the prompt stream, the buffer), each an
    object with ``state_dict`` / ``load_state_dict``; it never reaches into the service.

    When: every ``save_every`` versions, on a stop (SIGTERM / SIGINT / ``ctl stop``) when a step
    was trained since the last one, at the end of training, and on ``ctl checkpoint``. Always
    between steps: the train loop ends each step with :meth:`save` (which decides whether one is
    due) and waits for its next batch inside :meth:`between_steps`, where a ``ctl checkpoint``
    may save and where, once the learner is stopping, it parks for good; so a stop waits for a
    running step to finish (:meth:`on_stop`) and then saves what it trained.

    Two phases, both in threads (the sockets keep being served): the state is captured on the loop,
    then :meth:`Checkpointer.prepare` saves the policy and copies every other tensor to host
    memory while the train loop waits (``slipstream_checkpoint_pause_seconds``); the write of the
    rest (:meth:`Checkpointer.commit`: the optimizer moments, digests, fsync, rename, marker)
    goes on beside the next steps. One checkpoint at a time: the next one waits for it, and so
    do a stop and the end of training before they exit.
    """

    def __init__(self, settings: Any, run_dir: str | Path, *, run: Any, metrics: Any,
                 log: Callable[..., None], stopping: asyncio.Event, executor: Executor | None = None):
        """``settings``: the ``learner.checkpoint`` section (read at use time: save_every,
        failure); ``executor``: the thread the trainer's tensors are copied on (the steps' own)."""
        self.settings, self.run, self.log, self.stopping = settings, run, log, stopping
        self.executor = executor
        self.trainer: Any = None
        self.parts: dict[str, Stateful] = {}
        self.store = Checkpointer(settings.dir or Path(run_dir) / "checkpoints", settings.keep_last)
        self.saved_version = 0                # version 0 is the model as loaded: never saved
        self.failed_stop = False
        self.writing: tuple[str, int, float] | None = None
        """(what, version, since) while a checkpoint is copied or written (the watchdog's view)."""
        self.unsafe: str | None = None
        """Why the model in memory must not be saved (weights an update broke): no checkpoint then."""
        self.resumed_from: Path | None = None
        self.idle = asyncio.Event()           # the train loop waits for a batch, or is parked
        self.lock = asyncio.Lock()            # one checkpoint at a time (held until it is written)
        self.capturing = asyncio.Lock()       # held while the trainer is read: no step starts
        self.pending: asyncio.Task | None = None
        m = metrics                           # a learner.metrics.LearnerMetrics: defined there
        self.m_seconds = m.checkpoint_seconds
        self.m_version = m.checkpoint_version
        self.m_failures = m.checkpoint_failures
        self.m_pause = m.checkpoint_pause_seconds
        self.m_load = m.checkpoint_load_seconds

    def attach(self, trainer: Any, parts: dict[str, Stateful]) -> None:
        """What is saved besides the run state, once it exists: the trainer and the named parts
        (their names are state.json's keys)."""
        self.trainer, self.parts = trainer, dict(parts)

    # -- resume --
    def resume(self, spec: str | None) -> Checkpoint:
        """Verify the checkpoint ``spec`` names (cheap checks before the model loads). The latest
        (``spec`` None or "latest") is the newest that verifies: each newer one passed over is a
        ``checkpoint_skipped`` warning saying why (:meth:`Checkpointer.read_latest`)."""
        if spec is not None and str(spec) != "latest":
            return self.store.read(self.store.resolve(spec))
        ckpt, skipped = self.store.read_latest()
        for path, what in skipped:
            self.log("checkpoint_skipped", level="warning", checkpoint=str(path), reason=what,
                     resuming_from=str(ckpt.path), hint="a checkpoint that does not verify is never "
                     "used; --resume falls back to the newest one that does")
        return ckpt

    def load_run_state(self, ckpt: Checkpoint, run: Any) -> None:
        """The checkpoint's run id, version and assignment counter into ``run`` (a
        :class:`learner.state.run_state.RunState`), first, before the service builds what reads them."""
        try:
            run.load_state_dict(ckpt.state)
        except (ValueError, KeyError, TypeError) as e:
            raise checkpoint_error(ckpt.path, f"state.json does not fit this learner: {str(e)[:300]}") from None

    def apply(self, ckpt: Checkpoint, **describe) -> None:
        """Into the service (after its trainer is built and :meth:`load_run_state`): everything
        else :meth:`capture` saved; ``describe``: more fields for the ``resumed`` event (what the
        restored parts hold)."""
        st, run = ckpt.state, self.run
        start = time.monotonic()
        self.store.restore_trainer(ckpt, self.trainer)
        try:
            for name, part in self.parts.items():
                part.load_state_dict(st[name])
        except (ValueError, KeyError, TypeError) as e:
            raise checkpoint_error(ckpt.path, f"state.json does not fit this learner: {str(e)[:300]}") from None
        self.saved_version = run.version
        self.resumed_from = ckpt.path
        self.m_version.set(run.version)
        seconds = time.monotonic() - start
        self.m_load.set(seconds)
        self.store.clean_temporary()
        data = self.parts.get("data")
        self.log("resumed", checkpoint=str(ckpt.path), resumed_version=run.version,
                 data_position=data.state_dict().get("position") if data is not None else None,
                 assignment_counter=run.assignment_counter, **describe, load_s=round(seconds, 3))

    def mark_resumed(self, trained_ids: Any) -> None:
        """A ``resumed_at_version`` line in trained_ids.jsonl: steps of an earlier life at or past
        this version were rolled back (:func:`effective_trained_ids`)."""
        if self.resumed_from is None:
            return
        try:
            trained_ids.write({"run_id": self.run.run_id, "resumed_at_version": self.run.version,
                               "checkpoint": str(self.resumed_from)})
        except OSError as e:                  # without it, rolled-back steps would count as trained
            raise StartupError(f"cannot write {trained_ids.path} ({e.strerror or e}): free disk space "
                               "in the run directory, then --resume again") from None

    # -- saving --
    def capture(self) -> dict:
        """The run's state (on the loop, between steps): plain data for state.json."""
        return {"format": FORMAT, **self.run.state_dict(),
                **{name: part.state_dict() for name, part in self.parts.items()}, "saved_at": time.time()}

    async def write(self, reason: str, wait: bool = True) -> dict | None:
        """Checkpoint the current version (the caller makes sure no step runs). Returns what was
        written once it is complete (``wait``), or once the trainer was read (not ``wait``: the
        write goes on, :attr:`pending`); None when it failed (logged, counted, and under
        ``checkpoint_failure: stop`` the learner stops)."""
        await self.lock.acquire()
        handed = False
        try:
            async with self.capturing:
                version = self.run.version
                state = self.capture()
                start = time.monotonic()
                self.writing = ("copying the tensors", version, start)
                try:
                    # (the tensor copies on the train thread, where the steps run: see
                    # learner.app, the train thread; the writing beside the next step, _commit)
                    pending = await asyncio.get_running_loop().run_in_executor(
                        self.executor, self.store.prepare, version, state, self.trainer)
                except Exception as e:  # noqa: BLE001 -- any failure to write is reported the same way
                    self.writing = None
                    self.failed(e, version, reason)
                    return None
            self.writing = ("writing the files", version, start)
            paused = time.monotonic() - start
            self.pending = asyncio.create_task(self._commit(pending, reason, start, paused),
                                               name="checkpoint")
            handed = True                     # the commit releases the lock
        finally:
            if not handed:
                self.writing = None
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
            self.writing = None
            self.lock.release()
        version, seconds = pending.version, time.monotonic() - start
        self.saved_version = max(self.saved_version, version)
        self.m_seconds.observe(seconds)
        self.m_pause.set(paused)
        self.m_version.set(version)
        info = {"checkpoint": str(path), "version": version, "reason": reason,
                "seconds": round(seconds, 3), "pause_s": round(paused, 3)}
        self.log("checkpoint", **info)
        return info

    async def settled(self) -> None:
        """Wait until no checkpoint is being written."""
        async with self.lock:
            pass

    def failed(self, e: BaseException, version: int, reason: str) -> None:
        self.m_failures.inc()
        code = errno.errorcode.get(getattr(e, "errno", None) or -1, None)
        stop = self.settings.failure == "stop"
        self.log("checkpoint_failed", level="error", version=version, reason=reason,
                directory=str(self.store.root), error=f"{type(e).__name__}: {e}"[:500], errno=code,
                action="stopping (checkpoint_failure: stop)" if stop else
                "training goes on; the previous checkpoint is intact",
                hint="free disk space or make the directory writable (learner.checkpoint.dir)")
        if stop:
            self.failed_stop = True
            self.stopping.set()

    def write_failed(self, e: OSError) -> str:
        """A run-directory record could not be written (learner.serve.step_records: ``on_write_failure``):
        the same rule as a failed checkpoint, ``checkpoint_failure`` (a full disk fails both).
        ``stop``: the learner stops cleanly, exit :data:`EXIT_CHECKPOINT_FAILED`, without a final
        checkpoint (the disk is full); ``continue``: training goes on. Returns what happens, for
        the ``record_failed`` event."""
        if self.settings.failure != "stop":
            return "training goes on (checkpoint_failure: continue); the rows are lost until it can write"
        self.failed_stop = True
        self.stopping.set()
        return "stopping (checkpoint_failure: stop)"

    async def request(self) -> dict:
        """``ctl checkpoint``: write one as soon as no step runs."""
        await self.settled()
        while not (self.idle.is_set() and not self.lock.locked()):
            if self.stopping.is_set():
                raise RuntimeError("the learner is stopping (its final checkpoint follows)")
            await self._wait_idle()
            if self.lock.locked():
                await self.settled()
        info = await self.write("ctl")
        if info is None:
            raise RuntimeError("the checkpoint could not be written (see the checkpoint_failed event)")
        return info

    async def _wait_idle(self) -> None:
        waiter = asyncio.ensure_future(self.idle.wait())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait([waiter, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            stop.cancel()
        if self.idle.is_set():
            await asyncio.sleep(0)            # let a lock holder finish its turn

    async def save(self, version: int, last: bool = False) -> None:
        """The end of a train-loop step that made ``version``: a checkpoint when one is due (every
        ``save_every`` versions; the write goes on beside the next steps), or the final one
        (``last``, waited for); none once the learner is stopping (:meth:`on_stop` saves then)."""
        if self.stopping.is_set():
            return
        if last:
            await self.at_end()
            return
        every = self.settings.save_every
        if every and version % every == 0 and version > self.saved_version:
            await self.write("periodic", wait=False)

    def forbid(self, reason: str) -> None:
        """The model in memory must never be saved (an update broke the weights): no checkpoint
        from now on, the stop's included."""
        self.unsafe = reason

    @contextlib.asynccontextmanager
    async def between_steps(self):
        """The train loop waits for its next batch inside: a ``ctl checkpoint`` may save meanwhile
        (:attr:`idle`), and no step starts while one reads the trainer. Once the learner is
        stopping, the loop parks here for good (the stop cancels it where it holds no batch)."""
        self.idle.set()
        if self.stopping.is_set():
            await asyncio.Future()            # cancelled by the stop
        try:
            yield
        finally:
            self.idle.clear()
        if self.capturing.locked():           # a ctl checkpoint reads the trainer: no step yet
            async with self.capturing:
                pass

    async def at_end(self) -> None:
        """After the last step (a checkpoint still being written is waited for)."""
        await self.settled()
        if self.run.version > self.saved_version and not self.failed_stop and self.unsafe is None:
            await self.write("end")

    async def on_stop(self, train: asyncio.Task) -> int:
        """The learner is stopping: let a running step finish (it is recorded and published), stop
        the train loop where it holds no batch, and save if a step was trained since the last
        checkpoint. Returns the exit code (:data:`EXIT_CHECKPOINT_FAILED` when a failed checkpoint
        stopped the run). A paused train loop must have been released first (``Control.release``)."""
        while not train.done() and not self.idle.is_set():
            done = asyncio.ensure_future(self.idle.wait())
            await asyncio.wait([done, train], return_when=asyncio.FIRST_COMPLETED)
            done.cancel()
        train.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await train
        await self.settled()
        if (not self.failed_stop and self.unsafe is None and self.run.version > self.saved_version
                and self.trainer is not None):
            await self.write("stop")
        return EXIT_CHECKPOINT_FAILED if self.failed_stop else 0
