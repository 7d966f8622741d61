"""``--log-format`` of ``slipstream learner`` and ``slipstream rollout``: what a person reads on
a terminal, or the JSON event lines that tools read (issue 30.7).

``auto`` (the default): text when stdout is a terminal, JSON when it is piped or redirected, so a
log collector, ``jq`` or ``slipstream run`` (which reads its children's JSON) get JSON unasked.
``text`` is what ``slipstream run`` shows: the learner's steps as rows of the live view's plain
table (deploy/live.py, its header again every :data:`HEADER_EVERY` rows), the events the launcher
shows (deploy/launcher.py ``SHOWN_EVENTS``) and every warning and error as one
``[proc] event {fields}`` line; the rest (per-message detail) only in JSON.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

FORMATS = ("auto", "text", "json")
HEADER_EVERY = 20


def chosen(fmt: str, stream=None) -> str:
    """``text`` or ``json`` for ``fmt`` (``auto``: text on a terminal)."""
    if fmt != "auto":
        return fmt
    stream = stream if stream is not None else sys.stdout
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError):
        return "json"


def text_renderer() -> Callable[[dict], str | None]:
    """A renderer for :func:`protocol.plumbing.process.render_events`."""
    from deploy.launcher import SHOWN_EVENTS, event_text
    from deploy.live import plain_header, plain_row

    rows = 0

    def render(ev: dict) -> str | None:
        nonlocal rows
        name, proc = ev.get("event"), ev.get("proc", "?")
        if name == "step" and proc == "learner":
            line = plain_row(ev)
            if rows % HEADER_EVERY == 0:
                line = plain_header() + "\n" + line
            rows += 1
            return line
        if name in SHOWN_EVENTS or ev.get("level") in ("warning", "error"):
            return f"[{proc}] {event_text(ev)}"
        return None

    return render


def apply(fmt: str) -> None:
    """Set this process's event format from ``--log-format``."""
    from protocol.plumbing.process import render_events

    render_events(text_renderer() if chosen(fmt) == "text" else None)
