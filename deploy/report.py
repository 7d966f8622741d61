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

matplotlib (``pip install 'slipstream[report]'``) draws through its Agg canvas only: no display,
no pyplot state, safe at the end of ``slipstream run``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from protocol.errors import StartupError

WINDOW_FRACTION = 0.1
"""The summary compares the mean of the first and of the last 10 % of steps (at least one step)."""
DPI = 100
FIGSIZE = (8.0, 4.0)


@dataclass
class Run:
    """The rows of one run, in file order."""

    run_id: str
    rows: list[dict] = field(default_factory=list)

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
        if row.get("kind") != "eval" and isinstance(step, (int, float)) and any(
                r.get("kind") != "eval" and isinstance(r.get("step"), (int, float)) and r["step"] >= step
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


def _plot_smoothed(ax, x: list[float], v: list[float], label: str, **kwargs) -> None:
    """The raw line, faint, under its rolling mean once the run is long enough."""
    if len(v) >= SMOOTH_FROM_STEPS:
        k = max(2, len(v) // 20)
        (raw,) = ax.plot(x, v, linewidth=0.8, alpha=0.3, **kwargs)
        ax.plot(x, rolling_mean(v, k), color=raw.get_color(), linewidth=1.6, label=f"{label} ({k}-step mean)")
    else:
        ax.plot(x, v, label=label, linewidth=1.2, **kwargs)


def _lines(ax, run: Run, columns: list[tuple[str, str]], x: list[float] | None = None,
           smooth: bool = True) -> bool:
    drawn = False
    x = run.steps if x is None else x
    for column, label in columns:
        if not run.has(column):
            continue
        if smooth:
            _plot_smoothed(ax, x, run.values(column), label)
        else:
            ax.plot(x, run.values(column), label=label, linewidth=1.2)
        drawn = True
    if drawn:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    return drawn


def _positive_log(ax, run: Run, columns: list[str]) -> None:
    """Log y when every drawn value is positive (KLs and weights span decades)."""
    vals = [v for c in columns for v in run.values(c) if math.isfinite(v)]
    if vals and min(vals) > 0 and max(vals) / min(vals) > 50:
        ax.set_yscale("log")
        # A first on-policy step measures ~1e-14 (float noise): keep 5 decades below the top.
        ax.set_ylim(bottom=max(min(vals), max(vals) * 1e-5) * 0.8)


def _draw_reward(fig, run: Run) -> bool:
    ax = fig.subplots()
    steps, mean = run.steps, run.values("reward_mean")
    cols = [("reward_mean", "reward mean")]
    if run.has("score_mean") and run.values("score_mean") != mean:     # shaping changed the reward
        cols.append(("score_mean", "score mean (before shaping)"))
    cols.append(("reward_std", "reward std (in the batch)"))
    drawn = _lines(ax, run, cols)
    evals = [c for c in run.columns() if c.startswith("eval_")]
    for c in evals:
        pts = [(s, v) for s, v in zip(steps, run.values(c)) if math.isfinite(v)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=c.replace("_", " "), markersize=3)
    if drawn or evals:
        ax.legend(fontsize=8, loc="best")
        ax.grid(True, alpha=0.3)
    ax.set_xlabel("policy step")
    return drawn or bool(evals)


def _draw_kl(fig, run: Run) -> bool:
    ax = fig.subplots()
    cols = [("ref_kl", "KL to reference"), ("pg_approx_kl", "approx KL of the update (PPO)")]
    drawn = _lines(ax, run, cols)
    if run.has("kl_coef") and drawn:
        twin = ax.twinx()
        twin.plot(run.steps, run.values("kl_coef"), color="gray", linestyle="--", linewidth=1, label="kl_coef")
        twin.set_ylabel("kl_coef")
        twin.legend(fontsize=8, loc="upper left")
    ax.set_xlabel("policy step")
    return drawn


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
    if tokens:
        ax.set_ylabel("samples/s")
    ax.set_xlabel("policy step")
    ax.grid(True, alpha=0.3)
    if not tokens:
        return True
    if any(math.isfinite(v) for v in tps):
        twin = ax.twinx()
        _plot_smoothed(twin, steps, tps, "completion tokens/s", color="tab:green")
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
    if run.has("lr"):
        twin = right.twinx()
        twin.plot(run.steps, run.values("lr"), color="gray", linestyle="--", linewidth=1, label="lr")
        twin.set_ylabel("lr")
        twin.legend(fontsize=7, loc="lower right")
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
    Plot("mismatch_kl", "Mismatch KL (behavior vs proximal policy)",
         _simple([("mismatch_kl", "mismatch KL")], "nats", log=True)),
    Plot("staleness", "Staleness", _draw_staleness),
    Plot("throughput", "Throughput", _draw_throughput),
    Plot("versions", "Policy versions: learner and each server", _draw_versions),
    Plot("step_time", "Step time by phase", _draw_step_time),
    Plot("loss", "Loss, gradient norm, learning rate", _draw_loss),
    Plot("idle", "Idle ratios", _draw_idle),
)
OVERVIEW = (("reward", _draw_reward), ("mismatch KL", _simple([("mismatch_kl", "mismatch KL")], log=True)),
            ("entropy", _simple([("entropy", "entropy")])),
            ("ESS ratio", _simple([("is_ess_ratio", "ESS ratio")], ylim=(-0.02, 1.02))),
            ("staleness", _simple([("staleness_mean", "mean"), ("staleness_max", "max")], smooth=False)),
            ("samples/s", None))


def _overview(run: Run, path: Path) -> bool:
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
    if drawn:
        fig.savefig(path)
    return drawn



def draw_plots(run: Run, out: Path) -> list[tuple[Plot, Path]]:
    """Write each plot that has data to ``out/NAME.png``; the plots written."""
    from matplotlib.figure import Figure

    written = []
    for plot in PLOTS:
        fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
        fig.suptitle(plot.title, fontsize=11)
        if plot.draw(fig, run):
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


def summary_rows(run: Run) -> list[tuple[str, float, float, float, float]]:
    """``(label, first window mean, last window mean, min, max)`` for the summary columns present,
    plus every ``eval_*`` column."""
    n = len(run.rows)
    k = max(1, int(n * WINDOW_FRACTION))
    cols = list(SUMMARY_COLUMNS) + [(c, c.replace("_", " ")) for c in run.columns() if c.startswith("eval_")]
    out = []
    for column, label in cols:
        if not run.has(column):
            continue
        v = run.values(column)
        finite = [x for x in v if math.isfinite(x)]
        first = [x for x in v if math.isfinite(x)][:k]
        last = [x for x in v if math.isfinite(x)][-k:]
        out.append((label, _mean(first), _mean(last), min(finite), max(finite)))
    return out


def markdown(run: Run, others: list[str], plots: list[tuple[Plot, Path]], bad_lines: int,
             overview: bool, note: str = "") -> str:
    step_rows = [r for r in run.rows if r.get("kind") != "eval"]   # eval rounds are rows, not steps
    n = len(step_rows)
    k = max(1, int(n * WINDOW_FRACTION))
    steps = [float(r["step"]) for r in step_rows if isinstance(r.get("step"), (int, float))]
    elapsed = [t for t in run.elapsed_s() if math.isfinite(t)]
    t0 = next((t for t in run.values("time") if math.isfinite(t)), None)
    lines = [f"# slipstream run `{run.run_id}`", ""]
    head = f"{n} policy steps"
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
    servers = server_versions(run)
    if servers:
        final = {s: v[-1] for s, v in servers.items()}
        facts.append("servers at the end: " + ", ".join(
            f"{s} v{int(v)}" if math.isfinite(v) else f"{s} (gone)" for s, v in final.items()))
    if run.has("corrected_samples"):
        facts.append(f"corrected (over-limit) samples: {int(sum(x for x in run.values('corrected_samples') if math.isfinite(x)))}")
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
        lines += [f"| statistic | first {k} steps | last {k} steps | min | max |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {label} | {_fmt(a)} | {_fmt(b)} | {_fmt(lo)} | {_fmt(hi)} |" for label, a, b, lo, hi in rows]
        lines.append("")
    if overview:
        lines += ["![overview](overview.png)", ""]
    if plots:
        lines += ["## Plots", ""]
        for plot, path in plots:
            lines += [f"### {plot.title}", "", f"![{plot.title}]({path.name})", ""]
    return "\n".join(lines)


def write_report(run_dir: Path | str, run_id: str | None = None, out: Path | str | None = None) -> Path:
    """Write the report of one run of ``run_dir/metrics.jsonl``; the path of its ``report.md``.

    Raises :class:`protocol.StartupError` (one line) for a missing file, an empty one or an
    unknown run id. Without matplotlib the summary is still written, saying how to get the plots.
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise StartupError(f"no metrics.jsonl in {run_dir}: give the run directory of a learner "
                           "(learner.run_dir)")
    runs, bad = read_runs(path)
    run = select_run(runs, run_id)
    out = Path(out) if out is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        plots, overview = [], False
        note = "no plots: matplotlib is not installed (pip install 'slipstream[report]')"
    else:
        plots = draw_plots(run, out)
        overview = _overview(run, out / "overview.png")
        note = ""
    others = [r for r in runs if r != run.run_id]
    report = out / "report.md"
    report.write_text(markdown(run, others, plots, bad, overview, note))
    return report
