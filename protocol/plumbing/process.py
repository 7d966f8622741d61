"""Process plumbing shared by the learner and the rollout server: event log, task supervision, fsync.

Every process writes one JSON object per line on stdout for each event (the launcher and log
collectors read these): ``{"proc", "event", "run_id", "version", ...fields}``. ``run_id`` and
``version`` come from callables, so a line always carries the values at the time of the event.
A non-finite float (a NaN loss, an infinite ratio) is written as the string ``"nan"``, ``"inf"`` or
``"-inf"`` (:func:`json_line`): ``NaN``/``Infinity`` are not JSON, and strict parsers (jq, most
log collectors) reject the whole line; the string keeps which one it was, and ``float()`` reads
it back.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

TRACE_ENV = "SLIPSTREAM_TRACE"
_trace_path = os.environ.get(TRACE_ENV) or None
_trace_file = None


def trace(point: str) -> None:
    """One point of the cross-process cycle timeline: ``<unix time> <pid> <point>`` appended to the
    file ``$SLIPSTREAM_TRACE`` names (read at import; nothing is done when it is unset). Lines are
    written whole with ``O_APPEND``, so the learner and its servers can share one file;
    ``tests/bench/bench_cycle.py`` turns it into the time between a step's end and the next one's
    start, part by part. A point that cannot be written turns tracing off; it never fails a caller."""
    global _trace_file, _trace_path
    if _trace_path is None:
        return
    try:
        if _trace_file is None:
            _trace_file = open(_trace_path, "a", buffering=1, encoding="ascii")
        _trace_file.write(f"{time.time():.6f} {os.getpid()} {point}\n")
    except (OSError, ValueError):
        _trace_path = None


def fsync_path(path) -> None:
    """fsync a file or a directory by name (a directory's fsync makes the names in it durable:
    a rename or a new file survives a crash only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (in dicts, lists and tuples too) replaced by its name:
    ``"nan"``, ``"inf"``, ``"-inf"`` (what ``float()`` reads back; numpy's float64 too)."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def json_line(record: Any) -> str:
    """``record`` as one line of strict JSON (no ``NaN``/``Infinity``; see :func:`finite`); other
    values that JSON has no type for are written as ``str()``. Finite records, nearly all of them,
    are encoded once; only one that holds a non-finite float is walked."""
    try:
        return json.dumps(record, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(finite(record), default=str, allow_nan=False)


_render: Callable[[dict], str | None] | None = None


def render_events(render: Callable[[dict], str | None] | None) -> None:
    """Show this process's events on stdout through ``render`` (the record -> a line, or None to
    leave it out) instead of as JSON lines: ``slipstream learner/rollout --log-format text``
    (deploy.logfmt). None: JSON again. An EventLog with its own stream always writes JSON."""
    global _render
    _render = render


class EventLog:
    """One-line JSON events: ``log("step", loss=0.1)``."""

    def __init__(self, proc: str, run_id: Callable[[], str | None] = lambda: None,
                 version: Callable[[], int | None] = lambda: None, stream=None):
        self.proc = proc
        self.run_id = run_id
        self.version = version
        self.stream = stream

    def __call__(self, event: str, **fields: Any) -> None:
        record = {"proc": self.proc, "event": event}
        run_id, version = self.run_id(), self.version()
        if run_id is not None:
            record["run_id"] = run_id
        if version is not None:
            record["version"] = version
        record.update(fields)
        if self.stream is None and _render is not None:
            text = _render(record)
            if text is not None:
                sys.stdout.write(text + "\n")
                sys.stdout.flush()
            return
        out = self.stream or sys.stdout
        out.write(json_line(record) + "\n")
        out.flush()


async def supervise(tasks: Iterable[asyncio.Task], stop: asyncio.Event,
                    log: Callable[..., None]) -> tuple[set[asyncio.Task], BaseException | None]:
    """Wait until ``stop`` is set or any task ends; return the finished tasks and the first error.

    A task that ended with an exception is logged as ``crashed`` (its ``get_name()`` and error).
    The caller decides what to do next (drain, finish, exit code); :func:`cancel_all` cleans up.
    """
    tasks = list(tasks)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    error = None
    for t in done:
        if t is waiter or t.cancelled():
            continue
        exc = t.exception()
        if exc is not None:
            log("crashed", task=t.get_name(), error=repr(exc))
            error = error or exc
    return {t for t in done if t is not waiter}, error


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait at most ``timeout_s`` for ``event``; True if it is set.

    Use this, not ``asyncio.wait_for(event.wait(), t)``: on Python 3.11 ``wait_for`` loses a
    cancellation that arrives as its awaitable completes (it returns the result instead), and a
    task that was being cancelled goes on; a rollout server's pipeline then waited for work for
    ever while its process stopped. ``asyncio.wait`` never swallows the cancellation.
    """
    if event.is_set():
        return True
    if timeout_s <= 0:
        return False
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait([waiter], timeout=timeout_s)
    finally:
        waiter.cancel()
    return event.is_set()


def raise_if_cancelling() -> None:
    """Raise ``CancelledError`` if the current task is being cancelled (Python 3.11+: a loop's
    safety net for a cancellation a library call swallowed, as ``wait_for`` can)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError


async def cancel_all(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel ``tasks`` and wait until every one has ended (errors swallowed: already logged)."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
