"""The watchdog (issue 38): when a process stops making progress, one line says what it waits on.

Each process tells its :class:`Watchdog` of its progress (``progress("step")``: a learner's step
finished; a rollout server's assignment received, result sent, weights applied). The watchdog's
own thread looks every ``tick_s``; once nothing has happened for the stall limit it asks the
process what it waits on (``diagnose(idle_s)`` -> :class:`Waiting`, computed on the event loop
from the process's own state) and logs a ``stalled`` warning whose ``diagnosis`` is one line:

    no step for 95 s: waiting for samples: 2 rollout servers connected, none valid in 95 s ...

It logs again at growing intervals (the limit, then twice the time stalled each time) while the
stall lasts, at once when its cause changes (no server, then servers whose samples fail), and
``progress_resumed`` when progress comes back. The stall limit is
``stall_s()`` when above 0, else the larger of ``min_stall_s`` (60 s) and ``factor`` (10) times
the median time between progress events so far.

What else a stall triggers:

- a **stack dump** (:mod:`protocol.plumbing.stacks`) the first time a stall passes
  ``dump_after_s()`` (0 = never), logged as ``stacks_written``;
- a **hard stop** once it passes ``abort_after_s()`` (0 = never, the default): the diagnosis as
  the process's last line on stderr and exit :data:`EXIT_STALLED` at once (``os._exit``: a stalled
  process cannot be trusted to stop cleanly; the last checkpoint and the servers' outboxes are
  what a restart resumes from).

A blocked event loop is seen too: the thread stamps the loop every tick (``call_soon_threadsafe``);
a loop that has not run its stamp for ``loop_grace_s`` cannot diagnose itself, so the watchdog
names the Python frame the loop's thread is in (``the event loop has not run for 40 s: it is in
rewards.py:52 in slow: time.sleep(300)``).

A :class:`Waiting` marked ``expected`` (paused by ``ctl pause``, stopping, finished) is not a
stall: the clock restarts. ``state()`` / ``status()`` feed ``ctl status`` and the gauges
``slipstream_stalled_seconds`` and ``slipstream_waiting_on{reason}`` (:data:`REASONS`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import statistics
import sys
import sysconfig
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.plumbing.stacks import dump_stacks

__all__ = ["EXIT_STALLED", "REASONS", "Waiting", "Watchdog", "frame_of"]

EXIT_STALLED = 7
"""Exit code of a process ended by ``watchdog.abort_after_s`` (its diagnosis is its last line)."""

REASONS = ("no_servers", "samples", "step", "checkpoint", "publish", "rank", "learner", "generate",
           "reward", "weights", "work", "event_loop", "other")
"""What a process can be waiting on (the ``reason`` label of ``slipstream_waiting_on``):
learner: no_servers, samples, step, checkpoint, publish, rank (a DeepSpeed rank that stopped
beating; on a worker rank: rank 0's next command); rollout server: learner (no Welcome, link
down), generate, reward, weights, work (welcomed, no assignment); either: event_loop, other."""


@dataclass(frozen=True)
class Waiting:
    """What a process waits on: ``reason`` (one of :data:`REASONS`) and one line saying it."""

    reason: str
    line: str
    expected: bool = False
    """Paused, stopping, finished: waiting as it should, not a stall."""


_STDLIB = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])


def frame_of(thread_id: int | None) -> str:
    """Where a thread is: its innermost Python frame outside the standard library (the caller of
    a blocking ``time.sleep``, ``Event.wait``, ``socket.recv``...), ``file.py:52 in fn: code``,
    with the standard library's innermost frame after it when that is deeper ("" when unknown)."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return ""
    stack = traceback.extract_stack(frame, limit=40)

    def text(fs: traceback.FrameSummary) -> str:
        code = f": {fs.line.strip()}" if fs.line else ""
        return f"{Path(fs.filename).name}:{fs.lineno} in {fs.name}{code}"
    ours = next((fs for fs in reversed(stack) if not fs.filename.startswith(_STDLIB)
                 or "-packages" in fs.filename), None)
    if ours is None or ours is stack[-1]:
        return text(stack[-1])
    return f"{text(ours)} (in {text(stack[-1])})"


class Watchdog:
    """See the module docstring. ``start(loop)`` from inside the running loop; ``stop()`` at exit.
    ``noun`` names the progress in the line (``no step for 95 s``); settings are read at each
    tick, so ``ctl set watchdog.stall_s`` applies at once: the three callables, or ``settings``
    (a watchdog section with ``stall_s``, ``dump_after_s``, ``abort_after_s``). ``dump`` writes
    the stacks, or ``stacks`` names the directory :func:`protocol.plumbing.stacks.dump_stacks`
    writes them to."""

    def __init__(self, proc: str, *, diagnose: Callable[[float], Waiting], log: Callable[..., None],
                 noun: str = "progress", stall_s: Callable[[], float] = lambda: 0.0,
                 dump_after_s: Callable[[], float] = lambda: 0.0,
                 abort_after_s: Callable[[], float] = lambda: 0.0,
                 dump: Callable[[], Path] | None = None, settings: Any = None,
                 stacks: Path | None = None,
                 on_state: Callable[[str | None], None] = lambda reason: None,
                 abort: Callable[[int], None] = os._exit,
                 min_stall_s: float = 60.0, factor: float = 10.0, tick_s: float = 1.0,
                 loop_grace_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.proc, self.noun, self.log, self.diagnose = proc, noun, log, diagnose
        if settings is not None:              # a watchdog section, read at each tick
            stall_s = lambda: settings.stall_s                  # noqa: E731
            dump_after_s = lambda: settings.dump_after_s        # noqa: E731
            abort_after_s = lambda: settings.abort_after_s      # noqa: E731
        if stacks is not None and dump is None:   # where the stack dump goes
            dump = lambda: dump_stacks(stacks, proc, self.loop)  # noqa: E731
        self.stall_s, self.dump_after_s, self.abort_after_s = stall_s, dump_after_s, abort_after_s
        self.dump, self.on_state, self.abort = dump, on_state, abort
        self.min_stall_s, self.factor, self.tick_s = min_stall_s, factor, tick_s
        self.loop_grace_s, self.clock = loop_grace_s, clock
        self._lock = threading.RLock()
        self.last = clock()                       # the last progress (or start, or expected wait)
        self.intervals: deque[float] = deque(maxlen=101)
        self.waiting: Waiting | None = None       # set while stalled
        self.next_report = 0.0                    # idle seconds at which the next line is due
        self.dumped = False
        self.reports = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None
        self.loop_seen = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- progress, from the process ---------------------------------------------------------------
    def progress(self, what: str) -> None:
        """Something moved (``what``: step, assignment, result, weights). Ends a stall."""
        with self._lock:
            now = self.clock()
            self.intervals.append(now - self.last)
            was, stalled_s = self.waiting, now - self.last
            self.last = now
            if was is None:
                return
            self._clear()
        self.log("progress_resumed", process=self.proc, after=what, stalled_s=round(stalled_s, 1),
                 was=was.reason)

    def restart_clock(self) -> None:
        """Waiting from now on is new (a pause ended, the model finished loading): no stall so far,
        and the time before does not count as an interval."""
        with self._lock:
            self.last = self.clock()
            self._clear()

    def _clear(self) -> None:
        if self.waiting is not None:
            self.waiting = None
            self.on_state(None)
        self.dumped = False
        self.reports = 0

    # -- the limit ----------------------------------------------------------------------------------
    def limit(self) -> float:
        """Seconds without progress that count as a stall (the module docstring)."""
        configured = float(self.stall_s() or 0)
        if configured > 0:
            return configured
        if not self.intervals:
            return self.min_stall_s
        return max(self.min_stall_s, self.factor * statistics.median(self.intervals))

    def idle_s(self) -> float:
        return self.clock() - self.last

    def stalled_s(self) -> float:
        """Seconds without progress while stalled, 0 otherwise (``slipstream_stalled_seconds``)."""
        with self._lock:
            return self.clock() - self.last if self.waiting is not None else 0.0

    def status(self) -> dict[str, Any]:
        """For ``ctl status``: the limit, the time since progress and, while stalled, the diagnosis."""
        with self._lock:
            idle, waiting = self.idle_s(), self.waiting
        return {"stall_s": round(self.limit(), 3), "since_progress_s": round(idle, 3),
                "stalled": waiting is not None,
                "reason": waiting.reason if waiting else None,
                "waiting_on": self.line(waiting, idle) if waiting else None}

    def line(self, waiting: Waiting, idle: float) -> str:
        return f"no {self.noun} for {idle:.0f} s: {waiting.line}"

    def export(self, stalled: Any, waiting: Any) -> None:
        """Feed ``slipstream_stalled_seconds{process}`` (read at each scrape) and
        ``slipstream_waiting_on{process,reason}`` (1 for the reason of the stall, 0 for the others;
        every reason is exported from the start, so an alert's expression always has a series)."""
        stalled.labels(process=self.proc).set_function(self.stalled_s)
        children = {r: waiting.labels(process=self.proc, reason=r) for r in REASONS}
        for child in children.values():
            child.set(0)
        chained = self.on_state

        def on_state(reason: str | None) -> None:
            for r, child in children.items():
                child.set(1 if r == reason else 0)
            chained(reason)
        self.on_state = on_state

    # -- the thread ---------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None | bool = True) -> None:
        """Start watching from the thread to name when it blocks: inside the running loop
        (``loop=True``, the default: the diagnosis runs there), or ``loop=None`` for a process
        without one (the diagnosis runs on the watchdog's thread)."""
        self.loop = asyncio.get_running_loop() if loop is True else (loop or None)
        self.loop_thread = threading.get_ident()
        self.restart_clock()
        self.loop_seen = self.clock()
        self._thread = threading.Thread(target=self._run, name=f"slipstream-watchdog-{self.proc}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self._stamp_loop()
                self.check()
            except Exception as e:  # noqa: BLE001 -- the watchdog must outlive its own bugs
                self.log("watchdog_error", level="warning", error=f"{type(e).__name__}: {e}"[:300])

    def _stamp_loop(self) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._seen)
        except RuntimeError:              # closed between the check and the call
            pass

    def _seen(self) -> None:
        self.loop_seen = self.clock()

    def _ask(self, idle: float) -> Waiting:
        """The process's diagnosis, computed on its loop; or, when the loop does not run, the
        frame its thread is in."""
        blocked = self.clock() - self.loop_seen
        if self.loop is None:
            return self.diagnose(idle)
        if blocked < self.loop_grace_s + self.tick_s:
            future: concurrent.futures.Future = concurrent.futures.Future()

            def run() -> None:
                try:
                    future.set_result(self.diagnose(idle))
                except BaseException as e:  # noqa: BLE001 -- reported as the diagnosis
                    future.set_exception(e)
            try:
                self.loop.call_soon_threadsafe(run)
                return future.result(timeout=self.loop_grace_s)
            except concurrent.futures.TimeoutError:
                blocked = self.clock() - self.loop_seen
            except RuntimeError:          # the loop closed: the process is ending
                return Waiting("other", "the event loop has closed", expected=True)
            except Exception as e:  # noqa: BLE001 -- a diagnosis that fails still says something
                return Waiting("other", f"(diagnosis failed: {type(e).__name__}: {e})"[:300])
        where = frame_of(self.loop_thread)
        return Waiting("event_loop", f"the event loop has not run for {blocked:.0f} s"
                                     + (f": it is in {where}" if where else ""))

    def check(self) -> Waiting | None:
        """One look (the thread calls this every tick; tests call it with a fake clock)."""
        with self._lock:
            idle, limit = self.idle_s(), self.limit()
        if idle < limit:
            return None
        waiting = self._ask(idle)
        with self._lock:
            if self.clock() - self.last < idle:       # progress came while we asked
                return None
            if waiting.expected:
                self.last = self.clock()
                self._clear()
                return None
            changed = self.waiting is None or waiting.reason != self.waiting.reason
            if changed:
                self.on_state(waiting.reason)
            self.waiting = waiting
            report = changed or idle >= self.next_report     # a new cause is news at once
            if report:
                self.next_report = max(2 * idle, idle + limit)
                self.reports += 1
            dump_after, abort_after = float(self.dump_after_s() or 0), float(self.abort_after_s() or 0)
            dump = dump_after > 0 and idle >= dump_after and not self.dumped and self.dump is not None
            if dump:
                self.dumped = True
        line = self.line(waiting, idle)
        if report:
            self.log("stalled", level="warning", process=self.proc, reason=waiting.reason,
                     stalled_s=round(idle, 1), stall_s=round(limit, 1), diagnosis=line)
        if dump:
            try:
                path = self.dump()
            except OSError as e:
                self.log("stacks_failed", level="warning", error=f"{type(e).__name__}: {e}"[:300])
            else:
                self.log("stacks_written", path=str(path), why=f"stalled {idle:.0f} s")
        if abort_after > 0 and idle >= abort_after:
            self.log("stalled_abort", level="error", process=self.proc, reason=waiting.reason,
                     stalled_s=round(idle, 1), exit_code=EXIT_STALLED, diagnosis=line)
            sys.stdout.flush()
            print(f"slipstream {self.proc}: stalled {idle:.0f} s (watchdog.abort_after_s "
                  f"{abort_after:g}), exiting with code {EXIT_STALLED}: {line}",
                  file=sys.stderr, flush=True)
            self.abort(EXIT_STALLED)
        return waiting


