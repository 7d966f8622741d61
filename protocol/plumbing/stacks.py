"""Stacks on demand (issue 38 item 3): ``kill -USR1 PID`` makes a learner or a rollout server
write every thread's Python stack and every asyncio task's stack to a file, and say where.

One signal, two files, so a stack comes out whatever the process is stuck on:

- **the signal's Python handler** appends every thread's stack (``faulthandler.dump_traceback``)
  to ``stacks-<proc>-<pid>.threads.txt`` at once. It runs on the main thread between two
  bytecodes, and also in the middle of a blocking call that Python retries on a signal
  (``time.sleep``, a lock or ``Event.wait``, a socket read, ``select``: PEP 475), so a loop held by
  such a call is still seen, and the frame it is stuck in is named;
- it then asks the event loop (``call_soon_threadsafe``) for ``stacks-<proc>-<pid>-<n>.txt``: the
  threads by name and every asyncio task with its coroutine stack, logged as ``stacks_written``
  with the path — when the loop is alive to run it.

Why not faulthandler's C-level ``register(all_threads=True)``: it walks the other threads from
inside the signal, without the GIL, and CPython 3.11 crashes (SIGSEGV) when a thread starts or
ends during that walk — a Prometheus scrape's request thread is enough; tens of signals did it
(``tests/protocol/test_stacks.py`` has the case). A main thread stuck inside C code that never
returns to Python is the watchdog's case: its own thread names the frame and writes the stacks
(:mod:`protocol.plumbing.watchdog`).

The directory: ``SLIPSTREAM_STACKS_DIR`` when set (``slipstream run`` sets it to
``RUN_DIR/stacks`` for every process it starts), else ``RUN_DIR/stacks`` for a learner, else the
working directory. An empty threads file is removed at exit.
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

__all__ = ["STACKS_DIR_ENV", "dump_stacks", "install_stack_dump", "stacks_dir"]

STACKS_DIR_ENV = "SLIPSTREAM_STACKS_DIR"


def stacks_dir(default: str | os.PathLike | None = None) -> Path:
    """Where stack files go: ``SLIPSTREAM_STACKS_DIR``, else ``default``, else the working directory."""
    return Path(os.environ.get(STACKS_DIR_ENV) or default or os.getcwd())


def coroutine_chain(coro) -> list:
    """The frames of a suspended coroutine and of every coroutine it awaits, outermost first
    (``cr_await`` / ``gi_yieldfrom``): where a task waits, down to the innermost ``await``."""
    frames = []
    while coro is not None and len(frames) < 100:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


def format_stacks(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """Every thread's stack (by name) and every task of ``loop`` with its coroutine stack."""
    out = io.StringIO()
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    out.write(f"# {len(frames)} threads\n")
    for ident, frame in frames.items():
        out.write(f"\n## thread {names.get(ident, '?')} ({ident})\n")
        out.write("".join(traceback.format_stack(frame)))
    if loop is not None:
        tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
        out.write(f"\n# {len(tasks)} asyncio tasks\n")
        for task in tasks:
            out.write(f"\n## task {task.get_name()}: {task.get_coro()!r}\n")
            frames = coroutine_chain(task.get_coro())
            if frames:
                out.write("".join(traceback.StackSummary.extract(
                    (f, f.f_lineno) for f in frames).format()))
            else:
                out.write("  (not started or done)\n")
    return out.getvalue()


def dump_stacks(directory: Path, proc: str, loop: asyncio.AbstractEventLoop | None = None) -> Path:
    """Write :func:`format_stacks` to a new file in ``directory``; its path."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = directory / f"stacks-{proc}-{os.getpid()}-{stamp}-{time.monotonic_ns() % 10**6:06d}.txt"
    path.write_text(f"# {proc} pid {os.getpid()} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
                    + format_stacks(loop))
    return path


def install_stack_dump(proc: str, directory: Path, log: Callable[..., None]) -> Callable[[], None]:
    """SIGUSR1 -> stacks (module docstring). Call from inside the running loop, on the main
    thread; returns the function that restores the previous handler (and closes the threads file)."""
    loop = asyncio.get_running_loop()
    threads_path = directory / f"stacks-{proc}-{os.getpid()}.threads.txt"

    def write_file() -> None:                 # on the loop
        try:
            path = dump_stacks(directory, proc, loop)
        except OSError as e:
            log("stacks_failed", level="warning", error=f"{type(e).__name__}: {e}"[:300])
            return
        log("stacks_written", path=str(path), threads_file=str(threads_path))

    def on_signal(signum, frame) -> None:     # on the main thread, wherever it was
        if threads_file is not None:
            try:
                faulthandler.dump_traceback(threads_file, all_threads=True)
                threads_file.flush()
            except (OSError, ValueError):     # a full disk: the loop's file will say so
                pass
        try:
            loop.call_soon_threadsafe(write_file)
        except RuntimeError:                  # the loop is closed: the threads file is all there is
            pass

    try:       # a directory that cannot be written: the loop's handler will say so when asked
        directory.mkdir(parents=True, exist_ok=True)
        threads_file = open(threads_path, "a")              # noqa: SIM115 - held for the handler
    except OSError:
        threads_file = None
    previous = signal.signal(signal.SIGUSR1, on_signal)

    def remove() -> None:
        signal.signal(signal.SIGUSR1, previous if previous is not None else signal.SIG_DFL)
        if threads_file is None:
            return
        threads_file.close()
        try:
            if threads_path.stat().st_size == 0:      # never asked: leave nothing behind
                threads_path.unlink()
        except OSError:
            pass
    return remove
