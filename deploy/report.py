"""``slipstream report RUN_DIR``: PNG plots and a markdown summary of a run's ``metrics.jsonl``.

The learner appends one row per policy step (``learner/serve/service.py`` ``record_step``): the step's
statistics, ``run_id``, ``time`` and ``server_versions``. Several runs may share a run directory
(a rerun appends), so rows are grouped by ``run_id`` and the report is of one run: the last one in
the file unless ``--run-id`` names another. Rows written before run ids existed are split where
the step number stops increasing (``legacy-1``, ``legacy-2``, ...).

Each plot is drawn from the columns that exist in the run (a column exists when some row has a
finite number in it): a run without a reference model has no KL-to-reference line, a run without a
critic no value loss, and a plot none of whose columns exist is left out. Columns a plot reads:
``PLOTS`` below and the functions it names. Written to ``RUN_DIR/report/`` (``--out`` elsewhere):
``report.md``, one PNG per plot and ``overview.png`` (the six main plots on one page).

A plot is meant to be read, so: the reward axis holds reward-like series only (an eval round's
sample count or seconds would squash reward and accuracy flat, :func:`reward_like`); a series equal
to one already drawn on the same axes is named in that one's legend, not drawn again
(:func:`same_series`); a constant setting such as a fixed learning rate is stated, not drawn on an
axis of float noise (:func:`constant`); and each ``ctl`` change is a dotted mark on every
policy-step axis (:func:`control_changes` says which rows carry them).

matplotlib (a base dependency: the report is part of ``slipstream run``) draws through its Agg
canvas only: no display, no pyplot state, safe at the end of ``slipstream run``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from protocol.errors import StartupError

WINDOW_FRACTION = 0.25
"""The summary compares the mean of the first and of the last quarter of steps (at least one step;
a tenth of a short run was its single first and last step, which says nothing of a noisy reward)."""
SAME_TOLERANCE = 1e-12
"""Two series closer than this everywhere (relative above 1) are one series drawn twice."""
DPI = 100
FIGSIZE = (8.0, 4.0)


def is_step(row: dict) -> bool:
    """A policy step's row: no ``kind`` (eval rounds and control changes have one) and not an
    event record."""
    return row.get("kind") is None and "event" not in row


@dataclass
class Change:
    """One ``ctl set``: after which policy step it was made, and when (learner clock, if known)."""

    step: float
    key: str
    value: object
    previous: object
    time: float = math.nan


def control_changes(rows: list[dict]) -> list[Change]:
    """The ``ctl`` changes among ``rows``.

    The report reads only ``metrics.jsonl``. The learner's ``control_set`` event goes to its event
    log (stdout), so a change reaches the report when a row records it; two shapes are read:
    ``{"kind": "control", "step": V, "key", "value", "previous", "time"}`` (``step``: the learner's
    version when the change was made, the last step trained) and the event line itself
    (``{"event": "control_set", "version": V, "key", "value", "previous"}``), for a file that
    gathered the learner's events. A change is drawn between step V and V + 1, where it took effect.
    """
    out = []
    for r in rows:
        if not (r.get("kind") == "control" or r.get("event") == "control_set"):
            continue
        step = r.get("step", r.get("version"))
        if not isinstance(step, (int, float)) or not isinstance(r.get("key"), str):
            continue
        t = r.get("time")
        out.append(Change(float(step), r["key"], r.get("value"), r.get("previous"),
                          float(t) if isinstance(t, (int, float)) else math.nan))
    return out


@dataclass
class Run:
    """The rows of one run, in file order."""

    run_id: str
    rows: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    """Evaluation rounds (``kind: eval``) once :meth:`split`: not steps, drawn at their version."""
    controls: list[Change] = field(default_factory=list)
    """``ctl`` changes once :meth:`split` (:func:`control_changes`)."""

    def split(self) -> Run:
        """The run with ``rows`` its policy steps only, the evaluation rounds in ``evals`` and the
        control changes in ``controls``: a per-step line has no hole at every eval row, and
        throughput is measured between steps."""
        return Run(self.run_id, [r for r in self.rows if is_step(r)],
                   [r for r in self.rows if r.get("kind") == "eval"], control_changes(self.rows))

    def values(self, column: str) -> list[float]:
        """The column as floats, NaN where a row lacks it or holds something else."""
        out = []
        for r in self.rows:
            v = r.get(column)
            out.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan)
        return out

    def has(self, column: str) -> bool:
        return any(math.isfinite(v) for v in self.values(column))

    def columns(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.rows:
            seen.update(dict.fromkeys(r))
        return [c for c in seen if self.has(c)]

    @property
    def steps(self) -> list[float]:
        return self.values("step")

    def elapsed_s(self) -> list[float]:
        """Seconds since the run's first row (its first step's end)."""
        t = self.values("time")
        t0 = next((x for x in t if math.isfinite(x)), 0.0)
        return [x - t0 for x in t]


def read_runs(path: Path) -> tuple[dict[str, Run], int]:
    """The runs of a metrics.jsonl file in order of first appearance, and how many lines were not
    JSON objects (a line cut short by a crash is skipped, not fatal). Steps trained again after a
    resume from an earlier checkpoint replace the rolled-back rows of the same run."""
    runs: dict[str, Run] = {}
    bad = 0
    legacy = 0
    last_legacy_step = math.inf
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if not isinstance(row, dict):
            bad += 1
            continue
        run_id = row.get("run_id")
        if not isinstance(run_id, str):
            step = row.get("step", 0)
            if not isinstance(step, (int, float)) or step <= last_legacy_step:
                legacy += 1
            last_legacy_step = step if isinstance(step, (int, float)) else math.inf
            run_id = f"legacy-{legacy}"
        run = runs.setdefault(run_id, Run(run_id))
        step = row.get("step")
        if is_step(row) and isinstance(step, (int, float)) and any(
                is_step(r) and isinstance(r.get("step"), (int, float)) and r["step"] >= step
                for r in run.rows):
            # A resume from an earlier checkpoint trains these steps again: the later life wins
            # (the earlier life's rows from this step on were rolled back, learner/state/checkpoint.py).
            run.rows = [r for r in run.rows
                        if not (isinstance(r.get("step"), (int, float)) and r["step"] >= step)]
        run.rows.append(row)
    return runs, bad


def select_run(runs: dict[str, Run], run_id: str | None) -> Run:
    """``run_id``'s run, or the run of the file's last row (the latest) when None."""
    if not runs:
        raise StartupError("metrics.jsonl has no steps yet: nothing to report")
    if run_id is None:
        return max(runs.values(), key=lambda r: _last_index(runs, r))
    if run_id not in runs:
        raise StartupError(f"--run-id {run_id!r} is not in metrics.jsonl; runs there: {', '.join(runs)}")
    return runs[run_id]


def _last_index(runs: dict[str, Run], run: Run) -> float:
    """Position of a run's last row: the time of its last row (file order as the tie-break)."""
    t = [x for x in run.values("time") if math.isfinite(x)]
    return t[-1] if t else list(runs).index(run.run_id)


# ---- plots --------------------------------------------------------------------------------------

@dataclass
class Plot:
    """One PNG: its file stem, title, and a function drawing it on a figure (False: nothing to draw)."""

    name: str
    title: str
    draw: Callable[[object, Run], bool]


SMOOTH_FROM_STEPS = 40
"""Runs this long also get a rolling mean over ``steps // 20`` steps drawn over the faint raw line."""


def rolling_mean(values: list[float], k: int) -> list[float]:
    """Mean of the last ``k`` finite values at each point (NaN until there is one)."""
    out, window = [], []
    for v in values:
        if math.isfinite(v):
            window.append(v)
            if len(window) > k:
                window.pop(0)
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def _finite_points(x: list[float], v: list[float]) -> tuple[list[float], list[float]]:
    """The points where both coordinates are numbers: a row without the column is no hole in
    the line (a line broken at every other point shows nothing but dots)."""
    pts = [(a, b) for a, b in zip(x, v) if math.isfinite(a) and math.isfinite(b)]
    return [a for a, _ in pts], [b for _, b in pts]


def _plot_smoothed(ax, x: list[float], v: list[float], label: str, **kwargs) -> None:
    """The raw line, faint, under its rolling mean once the run is long enough."""
    x, v = _finite_points(x, v)
    if len(v) >= SMOOTH_FROM_STEPS:
        k = max(2, len(v) // 20)
        (raw,) = ax.plot(x, v, linewidth=0.8, alpha=0.3, **kwargs)
        ax.plot(x, rolling_mean(v, k), color=raw.get_color(), linewidth=1.6, label=f"{label} ({k}-step mean)")
    else:
        ax.plot(x, v, label=label, linewidth=1.2, **kwargs)


def same_series(a: list[float], b: list[float]) -> bool:
    """Whether two columns are one series: missing at the same rows and within
    :data:`SAME_TOLERANCE` at every other (``pg_approx_kl`` is ``mismatch_kl`` under
    ``clip_anchor: behavior``; ``loss`` is ``pg_loss`` without a critic, KL loss or bonus)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if math.isfinite(x) != math.isfinite(y):
            return False
        if math.isfinite(x) and abs(x - y) > SAME_TOLERANCE * max(1.0, abs(x), abs(y)):
            return False
    return True


def distinct(run: Run, columns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The columns that exist, each column equal to an earlier one left out and named in that
    one's label ("loss = policy loss"): drawn twice, one line hides the other and the legend
    claims two measurements."""
    kept: list[list] = []
    for column, label in columns:
        if not run.has(column):
            continue
        values = run.values(column)
        twin = next((k for k in kept if same_series(k[2], values)), None)
        if twin is not None:
            twin[1] += f" = {label}"
        else:
            kept.append([column, label, values])
    return [(c, label) for c, label, _ in kept]


def constant(values: list[float]) -> float | None:
    """The value of a column that never changes (a fixed learning rate or KL coefficient), None
    when it changes or is missing."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    c = finite[0]
    return c if all(abs(v - c) <= SAME_TOLERANCE * max(1.0, abs(c)) for v in finite) else None


def _plain_y(ax, values: list[float]) -> None:
    """Tick labels that read as values: no offset ("+2.85e-4" under ticks of 1e-5), and a
    constant series centred on an axis of its own size rather than ±5 % of float noise."""
    ax.ticklabel_format(axis="y", useOffset=False)
    c = constant(values)
    if c is not None:
        d = abs(c) * 0.5 if c else 1.0
        ax.set_ylim(c - d, c + d)


def _lines(ax, run: Run, columns: list[tuple[str, str]], x: list[float] | None = None,
           smooth: bool = True) -> bool:
    x = run.steps if x is None else x
    columns = distinct(run, columns)
    for column, label in columns:
        if smooth:
            _plot_smoothed(ax, x, run.values(column), label)
        else:
            ax.plot(*_finite_points(x, run.values(column)), label=label, linewidth=1.2)
    if columns:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        _plain_y(ax, [v for c, _ in columns for v in run.values(c)])
    return bool(columns)


def _setting(ax, run: Run, column: str, label: str, loc: str) -> None:
    """A setting beside the plot's own lines: a constant one is stated in the axes' title (an axis
    of its own would show float noise), a changing one gets a dashed line on a twin axis."""
    if not run.has(column):
        return
    c = constant(run.values(column))
    if c is not None:
        title = ax.get_title()
        ax.set_title(f"{title}; {label} {c:.3g} (constant)" if title else f"{label} {c:.3g} (constant)",
                     fontsize=9)
        return
    twin = ax.twinx()
    twin.plot(*_finite_points(run.steps, run.values(column)), color="gray", linestyle="--", linewidth=1,
              label=label)
    twin.set_ylabel(label)
    twin.ticklabel_format(axis="y", useOffset=False)
    twin.legend(fontsize=7, loc=loc)


def _positive_log(ax, run: Run, columns: list[str]) -> None:
    """Log y when every drawn value is positive (KLs and weights span decades)."""
    vals = [v for c in columns for v in run.values(c) if math.isfinite(v)]
    if vals and min(vals) > 0 and max(vals) / min(vals) > 50:
        ax.set_yscale("log")
        # A first on-policy step measures ~1e-14 (float noise): keep 5 decades below the top.
        ax.set_ylim(bottom=max(min(vals), max(vals) * 1e-5) * 0.8)


REWARD_COLUMNS = (("reward_mean", "reward mean"), ("score_mean", "score mean (before shaping)"),
                  ("reward_std", "reward std (in the batch)"))
"""The step columns on the reward axis."""


def reward_like(column: str) -> bool:
    """Whether an evaluation column is on the reward axis: accuracies, rewards and scores are;
    counts, seconds and versions (``eval_samples`` 32, ``eval_seconds`` 20) are not, they would
    squash reward and accuracy flat at the bottom. They stay in the summary's table."""
    return column.startswith("eval_") and column.endswith(("accuracy", "reward_mean", "score_mean"))


def _draw_reward(fig, run: Run) -> bool:
    ax = fig.subplots()
    drawn = _lines(ax, run, list(REWARD_COLUMNS))
    evals = Run(run.run_id, run.evals)
    cols = distinct(evals, [(c, c.replace("_", " ")) for c in evals.columns() if reward_like(c)])
    for c, label in cols:
        ax.plot(*_finite_points(evals.steps, evals.values(c)), "o-", label=label, markersize=3)
    if drawn or cols:
        ax.legend(fontsize=8, loc="best")
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xlabel("policy step")
    return drawn or bool(cols)


def _approx_kl_label(run: Run) -> str:
    """The update's approx KL, said to be the mismatch KL when it is (``clip_anchor: behavior``:
    the anchor is the behavior policy), since the mismatch plot draws the same line."""
    label = "approx KL of the update (PPO)"
    if run.has("mismatch_kl") and same_series(run.values("pg_approx_kl"), run.values("mismatch_kl")):
        label += " = mismatch KL"
    return label


def _draw_kl(fig, run: Run) -> bool:
    ax = fig.subplots()
    drawn = _lines(ax, run, [("ref_kl", "KL to reference"), ("pg_approx_kl", _approx_kl_label(run))])
    if drawn:
        _setting(ax, run, "kl_coef", "kl_coef", "upper left")
    ax.set_xlabel("policy step")
    return drawn


def _draw_mismatch(fig, run: Run) -> bool:
    label = "mismatch KL"
    if run.has("pg_approx_kl") and same_series(run.values("pg_approx_kl"), run.values("mismatch_kl")):
        label += " = approx KL of the update"
    return _simple([("mismatch_kl", label)], "nats", log=True)(fig, run)


def _simple(columns: list[tuple[str, str]], ylabel: str = "", log: bool = False, ylim=None,
            smooth: bool = True):
    def draw(fig, run: Run) -> bool:
        ax = fig.subplots()
        drawn = _lines(ax, run, columns, smooth=smooth)
        if log:
            _positive_log(ax, run, [c for c, _ in columns])
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_xlabel("policy step")
        ax.set_ylabel(ylabel)
        return drawn
    return draw


def _draw_importance(fig, run: Run) -> bool:
    left, right = fig.subplots(1, 2)
    w = [("is_weight_mean", "mean"), ("is_weight_max", "max"), ("is_weight_min", "min")]
    a = _lines(left, run, w)
    _positive_log(left, run, [c for c, _ in w])
    left.set_title("importance weights w", fontsize=9)
    b = _lines(right, run, [("is_ess_ratio", "ESS ratio (Σw)²/(n·Σw²)"),
                            ("is_truncated_fraction", "truncated"), ("is_masked_fraction", "masked"),
                            ("is_veto_fraction", "vetoed")])
    right.set_ylim(-0.02, 1.02)
    right.set_title("effective sample size, truncation", fontsize=9)
    for ax in (left, right):
        ax.set_xlabel("policy step")
    return a or b


def _draw_staleness(fig, run: Run) -> bool:
    left, right = fig.subplots(1, 2)
    drawn = _lines(left, run, [("staleness_mean", "mean"), ("staleness_max", "max")], smooth=False)
    left.set_xlabel("policy step")
    left.set_ylabel("policy steps behind")
    if run.has("staleness_max"):
        counts: dict[int, int] = {}
        for v in run.values("staleness_max"):
            if math.isfinite(v):
                counts[int(v)] = counts.get(int(v), 0) + 1
        keys = sorted(counts)
        right.bar([str(k) for k in keys], [counts[k] for k in keys], color="tab:orange")
        right.set_xlabel("oldest sample of the batch (policy steps)")
        right.set_ylabel("steps")
        right.set_title("steps by their batch's max staleness", fontsize=9)
    return drawn


def throughput(run: Run) -> tuple[list[float], list[float], list[float]]:
    """Per row: samples/s and completion tokens/s since the previous row (NaN for the first)."""
    t, n, tok = run.values("time"), run.values("samples"), run.values("completion_tokens_mean")
    sps, tps = [math.nan], [math.nan]
    for i in range(1, len(t)):
        dt = t[i] - t[i - 1]
        ok = math.isfinite(dt) and dt > 0
        sps.append(n[i] / dt if ok else math.nan)
        tps.append(n[i] * tok[i] / dt if ok else math.nan)
    return run.steps, sps, tps


def _draw_throughput(fig, run: Run, tokens: bool = True) -> bool:
    """Samples/s per step (and completion tokens/s on a second axis unless ``tokens`` is False:
    the overview's small panel)."""
    if not (run.has("time") and run.has("samples")) or len(run.rows) < 2:
        return False
    ax = fig.subplots()
    steps, sps, tps = throughput(run)
    _plot_smoothed(ax, steps, sps, "samples/s")
    _plain_y(ax, sps)
    if tokens:
        ax.set_ylabel("samples/s")
    ax.set_xlabel("policy step")
    ax.grid(True, alpha=0.3)
    if not tokens:
        return True
    if any(math.isfinite(v) for v in tps):
        twin = ax.twinx()
        _plot_smoothed(twin, steps, tps, "completion tokens/s", color="tab:green")
        _plain_y(twin, tps)
        twin.set_ylabel("tokens/s")
        twin.legend(fontsize=8, loc="upper right")
    ax.legend(fontsize=8, loc="upper left")
    return True


def server_versions(run: Run) -> dict[str, list[float]]:
    """Each server's reported version at every row (NaN before it joined or after it left)."""
    servers: dict[str, None] = {}
    for r in run.rows:
        if isinstance(r.get("server_versions"), dict):
            servers.update(dict.fromkeys(r["server_versions"]))
    out = {}
    for s in servers:
        out[s] = [float(r["server_versions"][s])
                  if isinstance(r.get("server_versions"), dict) and s in r["server_versions"] else math.nan
                  for r in run.rows]
    return out


def _draw_versions(fig, run: Run) -> bool:
    from matplotlib.ticker import MaxNLocator

    servers = server_versions(run)
    if not servers:
        return False
    left, right = fig.subplots(1, 2)
    x = run.elapsed_s() if run.has("time") else run.steps
    left.plot(x, run.values("version") if run.has("version") else run.steps, color="black",
              linewidth=2, label="learner")
    lag = {}
    version = run.values("version") if run.has("version") else run.steps
    for s, v in servers.items():
        left.plot(x, v, linewidth=1, label=s)
        lag[s] = [a - b for a, b in zip(version, v)]
        right.plot(run.steps, lag[s], linewidth=1, label=s)
    left.set_xlabel("seconds" if run.has("time") else "policy step")
    left.set_ylabel("policy version")
    left.set_title("versions", fontsize=9)
    right.set_xlabel("policy step")
    right.set_ylabel("versions behind the learner")
    right.set_title("lag per server", fontsize=9)
    finite_lag = [x for v in lag.values() for x in v if math.isfinite(x)]
    if finite_lag:
        right.set_ylim(min(-0.5, min(finite_lag) - 0.5), max(finite_lag) + 0.5)
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if len(servers) <= 8:
            ax.legend(fontsize=7, loc="best")
    return True


PHASES = (("time_collate_s", "collate"), ("time_reference_s", "reference"), ("time_values_s", "values"),
          ("time_proximal_s", "proximal"), ("time_advantages_s", "advantages"),
          ("time_update_s", "update"), ("publish_wait_s", "publish wait"))


def _draw_step_time(fig, run: Run) -> bool:
    phases = [(c, label) for c, label in PHASES
              if run.has(c) and any(v > 0 for v in run.values(c) if math.isfinite(v))]
    if not phases and not run.has("step_s"):
        return False
    ax = fig.subplots()
    if phases:
        ys = [[v if math.isfinite(v) else 0.0 for v in run.values(c)] for c, _ in phases]
        ax.stackplot(run.steps, *ys, labels=[label for _, label in phases], alpha=0.7)
    if run.has("step_s"):
        ax.plot(run.steps, run.values("step_s"), color="black", linewidth=1, label="train step (step_s)")
    ax.set_xlabel("policy step")
    ax.set_ylabel("seconds")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    return True


def _draw_loss(fig, run: Run) -> bool:
    left, right = fig.subplots(1, 2)
    a = _lines(left, run, [("loss", "loss"), ("pg_loss", "policy loss"), ("vf_loss", "value loss"),
                           ("kl_loss", "KL loss"), ("entropy_bonus", "entropy bonus")])
    b = _lines(right, run, [("grad_norm", "grad norm"), ("critic_grad_norm", "critic grad norm")])
    _setting(right, run, "lr", "lr", "lower right")
    for ax in (left, right):
        ax.set_xlabel("policy step")
    return a or b


def _draw_idle(fig, run: Run) -> bool:
    ax = fig.subplots()
    cols = [(c, c.replace("_", " ")) for c in run.columns() if c.endswith("idle_ratio")]
    drawn = _lines(ax, run, cols)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("policy step")
    return drawn


PLOTS = (
    Plot("reward", "Reward", _draw_reward),
    Plot("kl", "KL", _draw_kl),
    Plot("entropy", "Entropy (nats per token)", _simple([("entropy", "entropy")], "nats")),
    Plot("clip_fraction", "PPO clip fraction",
         _simple([("pg_clip_fraction", "clip fraction"), ("pg_dual_clip_fraction", "dual-clip fraction")],
                 "fraction of tokens")),
    Plot("importance", "Importance weights and ESS", _draw_importance),
    Plot("mismatch_kl", "Mismatch KL (behavior vs proximal policy)", _draw_mismatch),
    Plot("staleness", "Staleness", _draw_staleness),
    Plot("throughput", "Throughput", _draw_throughput),
    Plot("versions", "Policy versions: learner and each server", _draw_versions),
    Plot("step_time", "Step time by phase", _draw_step_time),
    Plot("loss", "Loss, gradient norm, learning rate", _draw_loss),
    Plot("idle", "Idle ratios", _draw_idle),
)
OVERVIEW = (("reward", _draw_reward), ("mismatch KL", _draw_mismatch),
            ("entropy", _simple([("entropy", "entropy")])),
            ("ESS ratio", _simple([("is_ess_ratio", "ESS ratio")], ylim=(-0.02, 1.02))),
            ("staleness", _simple([("staleness_mean", "mean"), ("staleness_max", "max")], smooth=False)),
            ("samples/s", None))


CONTROL_COLOR = "tab:purple"


def mark_controls(fig, run: Run) -> None:
    """A dotted line at each ``ctl`` change on every axes of ``fig`` over policy steps (between the
    step after which it was made and the next, where it took effect) or over seconds (at its
    time), with the key and the new value at the top; twin axes share the x axis and are skipped."""
    if not run.controls:
        return
    t0 = next((t for t in run.values("time") if math.isfinite(t)), math.nan)
    for ax in fig.axes:
        xlabel = ax.get_xlabel()
        for change in run.controls:
            x = (change.step + 0.5 if xlabel == "policy step"
                 else change.time - t0 if xlabel == "seconds" else math.nan)
            if not math.isfinite(x):
                continue
            ax.axvline(x, color=CONTROL_COLOR, linestyle=":", linewidth=1.2, gid="ctl")
            ax.text(x, 0.98, f" {change.key.rsplit('.', 1)[-1]}={_value(change.value)}",
                    transform=ax.get_xaxis_transform(), rotation=90, va="top", ha="left",
                    fontsize=6, color=CONTROL_COLOR)


def _value(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def figure(plot: Plot, run: Run):
    """The Figure of one plot of a :meth:`Run.split` run, None when it has nothing to draw."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    fig.suptitle(plot.title, fontsize=11)
    if not plot.draw(fig, run):
        return None
    mark_controls(fig, run)
    return fig


def overview_figure(run: Run):
    """The six main plots on one page (a :meth:`Run.split` run), None when none has data."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 6.5), dpi=DPI, layout="constrained")
    fig.suptitle(f"slipstream run {run.run_id}", fontsize=11)
    subfigs = fig.subfigures(2, 3)
    drawn = False
    for sub, (title, draw) in zip(subfigs.flat, OVERVIEW):
        sub.suptitle(title, fontsize=9)
        if draw is None:
            drawn |= _draw_throughput(sub, run, tokens=False)
        else:
            drawn |= bool(draw(sub, run))
        mark_controls(sub, run)
    return fig if drawn else None


def _overview(run: Run, path: Path) -> bool:
    fig = overview_figure(run)
    if fig is not None:
        fig.savefig(path)
    return fig is not None


def draw_plots(run: Run, out: Path) -> list[tuple[Plot, Path]]:
    """Write each plot that has data to ``out/NAME.png``; the plots written."""
    written = []
    for plot in PLOTS:
        fig = figure(plot, run)
        if fig is not None:
            path = out / f"{plot.name}.png"
            fig.savefig(path)
            written.append((plot, path))
    return written


# ---- summary ------------------------------------------------------------------------------------

SUMMARY_COLUMNS = (("reward_mean", "reward mean"), ("reward_std", "reward std"), ("ref_kl", "KL to reference"),
                   ("pg_approx_kl", "approx KL (update)"), ("entropy", "entropy"),
                   ("pg_clip_fraction", "clip fraction"), ("is_ess_ratio", "ESS ratio"),
                   ("is_weight_max", "max importance weight"), ("mismatch_kl", "mismatch KL"),
                   ("staleness_mean", "staleness mean"), ("staleness_max", "staleness max"),
                   ("completion_tokens_mean", "completion tokens"), ("step_s", "step seconds"),
                   ("loss", "loss"), ("grad_norm", "grad norm"))


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return "–"
    if x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e4):
        return f"{x:.2e}"
    return f"{x:.3f}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def window(n: int) -> int:
    """How many of ``n`` steps (or eval rounds) each end of the summary averages."""
    return max(1, int(n * WINDOW_FRACTION))


def _stats(run: Run, cols: list[tuple[str, str]], k: int) -> list[tuple[str, float, float, float, float]]:
    out = []
    for column, label in cols:
        if not run.has(column):
            continue
        finite = [x for x in run.values(column) if math.isfinite(x)]
        out.append((label, _mean(finite[:k]), _mean(finite[-k:]), min(finite), max(finite)))
    return out


def summary_rows(run: Run) -> list[tuple[str, float, float, float, float]]:
    """``(label, first window mean, last window mean, min, max)`` for the summary columns present
    in the steps of a :meth:`Run.split` run (windows: :func:`window` of its steps)."""
    return _stats(run, list(SUMMARY_COLUMNS), window(len(run.rows)))


def eval_rows(run: Run) -> list[tuple[str, float, float, float, float]]:
    """The same over the evaluation rounds (windows of rounds), accuracy and reward first; the
    versions a round evaluated are the table's header, not a statistic."""
    evals = Run(run.run_id, run.evals)
    cols = [c for c in evals.columns() if c.startswith("eval_") and "version" not in c]
    cols.sort(key=lambda c: not reward_like(c))
    return _stats(evals, [(c, c.replace("_", " ")) for c in cols], window(len(evals.rows)))


def _window_header(which: str, k: int, unit: str, names: list[str]) -> str:
    """``first 15 steps (1–15)``, ``last step (60)``: what a column of the table averages."""
    span = names[:k] if which == "first" else names[-k:]
    where = f" ({span[0]}–{span[-1]})" if len(span) > 1 else f" ({span[0]})" if span else ""
    return (f"{which} {unit}" if k == 1 else f"{which} {k} {unit}s") + where


def _table(head: str, first: str, last: str, rows: list[tuple[str, float, float, float, float]]) -> list[str]:
    return ([f"| {head} | {first} | {last} | min | max |", "|---|---:|---:|---:|---:|"]
            + [f"| {label} | {_fmt(a)} | {_fmt(b)} | {_fmt(lo)} | {_fmt(hi)} |" for label, a, b, lo, hi in rows]
            + [""])


def _servers_at_the_end(run: Run) -> str:
    """Each server's version at the last step, or when it left: the last step it reported at."""
    parts = []
    steps = run.steps
    for s, v in server_versions(run).items():
        if math.isfinite(v[-1]):
            parts.append(f"{s} v{int(v[-1])}")
            continue
        seen = [i for i, x in enumerate(v) if math.isfinite(x)]
        step = steps[seen[-1]] if seen else math.nan
        parts.append(f"{s} left after step {int(step)} (at v{int(v[seen[-1]])})"
                     if seen and math.isfinite(step) else f"{s} left")
    return "servers at the end: " + ", ".join(parts)


def markdown(run: Run, others: list[str], plots: list[tuple[Plot, Path]], bad_lines: int,
             overview: bool, note: str = "", runtime: str | None = None) -> str:
    """``report.md`` of a :meth:`Run.split` run; ``runtime``: the learner's :func:`read_runtime` line."""
    n = len(run.rows)
    k = window(n)
    steps = [float(r["step"]) for r in run.rows if isinstance(r.get("step"), (int, float))]
    elapsed = [t for t in run.elapsed_s() if math.isfinite(t)]
    t0 = next((t for t in run.values("time") if math.isfinite(t)), None)
    lines = [f"# slipstream run `{run.run_id}`", ""]
    head = _plural(n, "policy step")
    if steps:
        head += f" (step {int(steps[0])} → {int(steps[-1])})"
    if elapsed:
        head += f" over {elapsed[-1]:.1f} s of training"
    if t0 is not None:
        head += f", started {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(t0))}"
    lines += [head + ".", ""]
    _, sps, tps = throughput(run)
    facts = []
    if any(math.isfinite(x) for x in sps):
        facts.append(f"samples/s: {_fmt(_mean(sps))} mean")
    if any(math.isfinite(x) for x in tps):
        facts.append(f"completion tokens/s: {_fmt(_mean(tps))} mean")
    if server_versions(run):
        facts.append(_servers_at_the_end(run))
    if run.has("corrected_samples"):
        facts.append(f"corrected (over-limit) samples: {int(sum(x for x in run.values('corrected_samples') if math.isfinite(x)))}")
    if runtime:
        facts.append(f"learner runtime: {runtime}")
    lines += [f"- {f}" for f in facts]
    if others:
        lines.append(f"- other runs in this metrics.jsonl: {', '.join(others)} (`slipstream report --run-id ID`)")
    if bad_lines:
        lines.append(f"- {bad_lines} line(s) of metrics.jsonl were not JSON rows and were skipped")
    if note:
        lines.append(f"- {note}")
    lines.append("")
    rows = summary_rows(run)
    if rows:
        names = [str(int(s)) for s in steps]
        lines += _table("statistic", _window_header("first", k, "step", names),
                        _window_header("last", k, "step", names), rows)
    evals = eval_rows(run)
    if evals:
        versions = [f"v{int(r['step'])}" for r in run.evals if isinstance(r.get("step"), (int, float))]
        ke = window(len(run.evals))
        lines += _table("held-out evaluation", _window_header("first", ke, "round", versions),
                        _window_header("last", ke, "round", versions), evals)
    if run.controls:
        lines += ["## Control changes", ""]
        lines += [f"- after step {int(c.step)}: `{c.key}` {_value(c.previous)} → {_value(c.value)}"
                  for c in run.controls]
        lines.append("")
    if overview:
        lines += ["![overview](overview.png)", ""]
    if plots:
        lines += ["## Plots", ""]
        for plot, path in plots:
            lines += [f"### {plot.title}", "", f"![{plot.title}]({path.name})", ""]
    return "\n".join(lines)


NO_PLOTS = "no plots: matplotlib is not installed (pip install 'matplotlib>=3.7')"


def write_report(run_dir: Path | str, run_id: str | None = None, out: Path | str | None = None) -> Path:
    """Write the report of one run of ``run_dir/metrics.jsonl``; the path of its ``report.md``.

    Raises :class:`protocol.StartupError` (one line) for a missing file, an empty one or an
    unknown run id. Without matplotlib the summary is still written, and it and one line on stderr
    (the terminal of ``slipstream run``) say why there are no plots and how to get them.
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise StartupError(f"no metrics.jsonl in {run_dir}: give the run directory of a learner "
                           "(learner.run_dir)")
    runs, bad = read_runs(path)
    run = select_run(runs, run_id).split()
    out = Path(out) if out is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib  # noqa: F401
    except ImportError:                  # a base dependency; missing after a --no-deps install
        plots, overview = [], False
        note = NO_PLOTS
        print(f"slipstream report: {NO_PLOTS}", file=sys.stderr, flush=True)
    else:
        plots = draw_plots(run, out)
        overview = _overview(run, out / "overview.png")
        note = ""
    others = [r for r in runs if r != run.run_id]
    report = out / "report.md"
    report.write_text(markdown(run, others, plots, bad, overview, note, runtime=read_runtime(run_dir)))
    return report


def read_runtime(run_dir: Path) -> str | None:
    """The learner's runtime line (device, dtype, autocast, attention, threads, and why each
    ``auto`` chose that) from ``RUN_DIR/runtime.json``, written at its start; None without one."""
    try:
        line = json.loads((run_dir / "runtime.json").read_text()).get("line")
    except (OSError, ValueError, AttributeError):
        return None
    return line if isinstance(line, str) else None
