"""What ``slipstream run`` shows while it runs, and the summary at its end.

On a terminal: a live view (rich) — a progress bar over ``total_steps`` with the elapsed time and
an ETA, and a table of the latest steps that refreshes in place: step, version, reward (and eval
accuracy when the run evaluates), KL to the reference, entropy, mismatch KL, ESS ratio, staleness,
samples/s, learner and rollout idle ratios, and each server's version. Notable events (a server
lost, a setting changed, ...) print above it. The bar says what the run is doing (:data:`STATUS`);
the table keeps the columns that fit the terminal (:func:`fitting_columns`), never a cut cell. Not a terminal (a log file, CI, ``| tee``): one
fixed-width table line per step, as plain text, and the events as ``[proc] event {json}`` lines.

At the end, both print a short summary (:func:`summary`): reward first → last, trained samples/s,
and where the run directory, the final policy, the latest checkpoint and the report are.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from typing import Any, TextIO

# (title, key in the step event, format); a missing or NaN value shows as "-".
COLUMNS = (("step", "step", "{:d}"), ("reward", "reward_mean", "{:.3f}"),
           ("eval acc", "eval_accuracy", "{:.3f}"), ("KL ref", "ref_kl", "{:.2e}"),
           ("entropy", "entropy", "{:.3f}"), ("mismatch KL", "mismatch_kl", "{:.2e}"),
           ("ESS", "is_ess_ratio", "{:.2f}"), ("stale", "staleness_mean", "{:.2f}"),
           ("samples/s", "samples_per_s", "{:.1f}"), ("idle L", "learner_idle_ratio", "{:.2f}"),
           ("idle R", "rollout_idle_ratio", "{:.2f}"))
ROWS = 12
"""Steps the live table keeps on screen."""
PRIORITY = ("step", "reward", "samples/s", "eval acc", "KL ref", "entropy", "stale", "mismatch KL",
            "ESS", "idle L", "idle R", "servers")
"""The live table's columns in the order they are kept when the terminal is narrow: the
lowest-priority ones go first, so at 80 columns every cell shows whole (issue 30.6)."""
STATUS = {"ready": "waiting for the first batch", "server_joined": "waiting for the first batch",
          "control_pause": "paused", "control_resume": "training", "finished": "finishing",
          "control_stop": "stopping", "diverged": "stopping", "no_valid_samples": "stopping"}
"""A learner event -> what the progress bar says from then on ("starting: loading the model"
before the learner is ready; "training" from the first step on)."""


def cell(ev: dict, key: str, fmt: str) -> str:
    value = ev.get(key)
    if value in ("nan", "inf", "-inf"):     # a non-finite float, as the event log writes it
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if fmt == "{:d}":
        return str(int(value))
    return fmt.format(value)


def servers_cell(ev: dict) -> str:
    versions = ev.get("server_versions") or {}
    return " ".join(f"{name}:{v}" for name, v in sorted(versions.items())) or "-"


def plain_header() -> str:
    return " ".join(f"{title:>11}" for title, _, _ in COLUMNS) + "  servers"


def plain_row(ev: dict) -> str:
    return " ".join(f"{cell(ev, key, fmt):>11}" for _, key, fmt in COLUMNS) + "  " + servers_cell(ev)


def fitting_columns(rows: list[dict], width: int) -> list[str]:
    """The titles of the columns the live table shows for ``rows`` in ``width`` characters.

    A column none of whose cells holds a value (eval acc without evaluation, KL ref without a
    reference) is left out; then columns are kept in :data:`PRIORITY` order while the table —
    each column its widest cell or title plus 2 of padding and 1 of border, and 1 border more —
    fits. Step and reward always stay."""
    cells = {title: [cell(ev, key, fmt) for ev in rows] for title, key, fmt in COLUMNS}
    cells["servers"] = [servers_cell(ev) for ev in rows]
    used, total = [], 1
    for title in PRIORITY:
        values = cells[title]
        if title not in ("step", "reward") and rows and all(v == "-" for v in values):
            continue
        need = max([len(title), *map(len, values)]) + 3
        if title in ("step", "reward") or total + need <= width:
            used.append(title)
            total += need
    return [title for title in (*(t for t, _, _ in COLUMNS), "servers") if title in used]


class StepRate:
    """Trained samples per second over the steps seen (from the step events' wall times)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.start: float | None = None
        self.samples = 0.0

    def add(self, ev: dict) -> float:
        now = self.clock()
        if self.start is None:
            self.start = now - float(ev.get("step_s", 0.0) or 0.0)
        self.samples += float(ev.get("samples", 0.0) or 0.0)
        return self.samples / max(now - self.start, 1e-9)


class LiveView:
    """The run's view: ``step(ev)`` per step event, ``note(text)`` per notable event, ``close()``.

    ``live`` chooses the rich view (default: when ``out`` is a terminal); ``width`` fixes its
    width (default: the terminal's).
    """

    def __init__(self, total_steps: int, out: TextIO | None = None, live: bool | None = None,
                 width: int | None = None):
        self.out = out or sys.stdout
        self.total_steps = total_steps
        self.live = self.out.isatty() if live is None else live
        self.rows: deque[dict] = deque(maxlen=ROWS)
        self.rate = StepRate()
        self.first: dict | None = None
        self.last: dict | None = None
        self.evals: list[dict] = []          # the learner's "eval" events (held-out rounds)
        self._header_shown = False
        self.waiting: str | None = None      # the learner's last stalled diagnosis, until progress
        self._live = None
        if self.live:
            from rich.console import Console
            from rich.live import Live
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.console = Console(file=self.out, width=width)
            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                     console=self.console)
            self.task = self.progress.add_task("starting: loading the model", total=total_steps)
            self._live = Live(self._render(), console=self.console, refresh_per_second=4,
                              transient=False)
            self._live.start()

    def _render(self):
        from rich.console import Group
        from rich.table import Table

        table = Table(expand=False, header_style="bold")
        shown = fitting_columns(list(self.rows), self.console.width)
        columns = [(title, key, fmt) for title, key, fmt in COLUMNS if title in shown]
        for title, _, _ in columns:
            table.add_column(title, justify="right", no_wrap=True)
        if "servers" in shown:
            table.add_column("servers", no_wrap=True)
        for ev in self.rows:
            row = [cell(ev, key, fmt) for _, key, fmt in columns]
            table.add_row(*row, *([servers_cell(ev)] if "servers" in shown else []))
        if self.waiting is None:
            return Group(self.progress, table)
        from rich.text import Text

        # A stall: its diagnosis in place of the empty table (below the steps so far), wrapped
        # to the terminal's width, never cut.
        waiting = Text(f"stalled: {self.waiting}", style="yellow")
        return Group(self.progress, table, waiting) if self.rows else Group(self.progress, waiting)

    def status(self, text: str) -> None:
        """What the progress bar says it is doing (``starting: ...``, ``paused``, ...)."""
        if self._live is not None:
            self.progress.update(self.task, description=text)
            self._live.update(self._render())

    def event(self, ev: dict) -> None:
        """A learner event: the progress bar's status follows it (:data:`STATUS`); a ``stalled``
        event's diagnosis shows under the table until progress resumes."""
        kind = ev.get("event")
        if kind == "stalled" and isinstance(ev.get("diagnosis"), str):
            self.waiting = ev["diagnosis"]
            self.status("stalled")
        elif kind in ("progress_resumed", "step") and self.waiting is not None:
            self.waiting = None
            self.status("training" if self.first is not None else STATUS["ready"])
        text = STATUS.get(kind)
        if text is not None and not (text.startswith("waiting") and self.first is not None):
            self.status(text)

    def eval(self, ev: dict) -> None:
        """A finished held-out round: its accuracy shows in the steps from now on."""
        self.evals.append(ev)

    def step(self, ev: dict) -> None:
        ev = dict(ev)
        ev["samples_per_s"] = self.rate.add(ev)
        if self.evals and "eval_accuracy" not in ev:
            ev["eval_accuracy"] = self.evals[-1].get("eval_accuracy")
        if self.first is None and self._live is not None:
            # The bar's rate starts at this step: after a resume at step N the steps before it
            # are not counted as done in no time (its ETA would start low and jump).
            self.progress.reset(self.task, completed=max(0, min(int(ev.get("step", 1)) - 1, self.total_steps)),
                                description="training")
        self.first = self.first or ev
        self.last = ev
        if self._live is not None:
            self.rows.append(ev)
            self.progress.update(self.task, completed=min(int(ev.get("step", 0)), self.total_steps))
            self._live.update(self._render())
            return
        if not self._header_shown:
            print(plain_header(), file=self.out, flush=True)
            self._header_shown = True
        print(plain_row(ev), file=self.out, flush=True)

    def note(self, text: str) -> None:
        if self._live is not None:
            self.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.out, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.stop()
            self._live = None

    def summary(self, **where: Any) -> str:
        text = summary(self.first, self.last, evals=self.evals, **where)
        self.note(text)
        return text


def summary(first: dict | None, last: dict | None, evals: list[dict] | None = None,
            **where: Any) -> str:
    """The end-of-run lines: reward first → last, held-out accuracy first → last (with the
    versions evaluated), samples/s, and where things are (``where``: name -> path or None)."""
    lines = ["[run] summary"]
    if first is None or last is None:
        lines.append("  no policy step was trained")
    else:
        lines.append(f"  steps          {int(first.get('step', 0))} → {int(last.get('step', 0))}")
        lines.append(f"  reward         {cell(first, 'reward_mean', '{:.3f}')} → "
                     f"{cell(last, 'reward_mean', '{:.3f}')}")
        if evals:
            a, b = evals[0], evals[-1]
            lines.append(f"  eval accuracy  {cell(a, 'eval_accuracy', '{:.3f}')} (v{a.get('eval_version', '?')})"
                         f" → {cell(b, 'eval_accuracy', '{:.3f}')} (v{b.get('eval_version', '?')})")
        lines.append(f"  samples/s      {cell(last, 'samples_per_s', '{:.1f}')}")
    for name, path in where.items():
        if path is not None:
            lines.append(f"  {name:<14} {path}")
    return "\n".join(lines)
