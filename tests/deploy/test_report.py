"""`slipstream report`: runs told apart by run id, plots of the columns that exist, the summary's
numbers, one-line errors. On synthetic metrics.jsonl files here; on a real run's in
test_observability.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from deploy import report
from deploy.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _row(run_id: str | None, step: int, t0: float = 1000.0, **extra) -> dict:
    row = {"step": step, "version": step, "time": t0 + 0.5 * step, "samples": 64.0,
           "reward_mean": step / 100, "reward_std": 0.4, "entropy": 1.0 - step / 200,
           "mismatch_kl": 1e-3 * step, "is_ess_ratio": 0.9, "is_weight_max": 2.0, "is_weight_mean": 1.0,
           "staleness_mean": 0.5, "staleness_max": float(step % 3), "completion_tokens_mean": 3.0,
           "step_s": 0.3, "time_update_s": 0.25, "time_collate_s": 0.01, "publish_wait_s": 0.02,
           "pg_clip_fraction": 0.1, "server_versions": {"rollout-0": step - 1, "rollout-1": step - 2},
           **extra}
    if run_id is not None:
        row["run_id"] = run_id
    return row


@pytest.fixture
def run_dir(tmp_path):
    """Three runs appended to one file: an old-format one (no run id), 'old', then 'new' (60
    steps, with a reference KL); a line cut short by a crash between them."""
    rows = [_row(None, s) for s in range(1, 6)]
    rows += [_row("old", s, t0=2000.0) for s in range(1, 31)]
    lines = [json.dumps(r) for r in rows] + ['{"step": 31, "reward_me']
    lines += [json.dumps(_row("new", s, t0=3000.0, ref_kl=0.01 * s)) for s in range(1, 61)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_runs_are_told_apart_by_run_id_and_old_rows_by_step_resets(tmp_path):
    lines = [_row(None, 1), _row(None, 2), _row(None, 3), _row(None, 1), _row(None, 2), _row("x", 1)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    runs, bad = report.read_runs(tmp_path / "metrics.jsonl")
    assert bad == 0
    assert {k: [r["step"] for r in v.rows] for k, v in runs.items()} == {
        "legacy-1": [1, 2, 3], "legacy-2": [1, 2], "x": [1]}


def test_steps_trained_again_after_a_resume_replace_the_rolled_back_rows(tmp_path):
    """A learner killed at step 5 and resumed from its step-3 checkpoint trains steps 4 and 5
    again under the same run id: the report keeps the later life's rows."""
    first = [_row("r", s, reward_mean=0.1) for s in range(1, 6)]
    first.append({**_row("r", 4), "kind": "eval", "eval_accuracy": 0.5})
    again = [_row("r", s, t0=5000.0, reward_mean=0.9) for s in range(4, 8)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in first + again))
    runs, _ = report.read_runs(tmp_path / "metrics.jsonl")
    rows = runs["r"].rows
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["reward_mean"] for r in rows] == [0.1, 0.1, 0.1, 0.9, 0.9, 0.9, 0.9]
    assert not any(r.get("kind") == "eval" for r in rows)      # the eval of a rolled-back version


def test_the_report_is_of_the_last_run_with_plots_of_what_exists(run_dir):
    path = report.write_report(run_dir)
    out = run_dir / "report"
    assert path == out / "report.md"
    md = path.read_text()
    assert md.startswith("# slipstream run `new`")
    assert "60 policy steps (step 1 → 60) over 29.5 s of training" in md
    assert "other runs in this metrics.jsonl: legacy-1, old" in md
    assert "1 line(s) of metrics.jsonl were not JSON rows" in md
    assert "servers at the end: rollout-0 v59, rollout-1 v58" in md
    # Reward is step/100: the first and last 15 steps (a quarter) average 0.080 and 0.530.
    assert "| statistic | first 15 steps (1–15) | last 15 steps (46–60) | min | max |" in md
    assert "| reward mean | 0.080 | 0.530 | 0.010 | 0.600 |" in md
    # 64 samples every 0.5 s.
    assert "samples/s: 128.000 mean" in md
    written = {p.stem for p in out.glob("*.png")}
    assert written == {"reward", "kl", "entropy", "clip_fraction", "importance", "mismatch_kl",
                       "staleness", "throughput", "versions", "step_time", "overview"}
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5_000, png
        assert f"({png.name})" in md                       # linked from the summary
    from matplotlib.image import imread
    assert imread(out / "overview.png").shape[:2] == (650, 1200)     # 12 x 6.5 in at 100 dpi


def test_missing_columns_are_skipped(tmp_path):
    """A run that logged only step and reward: one plot, a one-row table, no error."""
    rows = [{"run_id": "r", "step": s, "reward_mean": 0.1 * s} for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    md = report.write_report(tmp_path, out=tmp_path / "rep").read_text()
    assert {p.name for p in (tmp_path / "rep").glob("*.png")} == {"reward.png", "overview.png"}
    assert "| reward mean | 0.100 | 0.300 | 0.100 | 0.300 |" in md
    assert "samples/s" not in md and "KL" not in md


def test_nan_values_do_not_break_the_report(tmp_path):
    rows = [{"run_id": "r", "step": s, "reward_mean": 0.5, "is_ess_ratio": math.nan,
             "mismatch_kl": math.nan if s % 2 else 0.01} for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    md = report.write_report(tmp_path).read_text()
    assert "| mismatch KL | 0.010 | 0.010 | 0.010 | 0.010 |" in md
    assert "ESS" not in md                                   # all NaN: the column does not exist
    assert (tmp_path / "report" / "mismatch_kl.png").exists()
    assert not (tmp_path / "report" / "importance.png").exists()


def test_cli_chooses_a_run_and_prints_the_report_path(tmp_path, capsys):
    rows = [{"run_id": rid, "step": s, "reward_mean": r} for rid, r in (("a", 0.1), ("b", 0.9))
            for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert main(["report", str(tmp_path), "--run-id", "a", "--out", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "a" / "report.md")
    md = (tmp_path / "a" / "report.md").read_text()
    assert md.startswith("# slipstream run `a`") and "| reward mean | 0.100 |" in md
    assert "other runs in this metrics.jsonl: b" in md


@pytest.mark.parametrize("args, says", [
    (["--run-id", "nope"], "--run-id 'nope' is not in metrics.jsonl; runs there: legacy-1, old, new"),
    (["/no/such/dir"], "no metrics.jsonl in /no/such/dir"),
])
def test_errors_are_one_line_and_exit_2(run_dir, capsys, args, says):
    argv = ["report", *args] if args[0].startswith("/") else ["report", str(run_dir), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err, err


def test_empty_file_is_an_error(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["report", str(tmp_path)]) == 2
    assert "no steps yet" in capsys.readouterr().err


def test_without_matplotlib_the_summary_is_written_and_says_why_there_are_no_plots(run_dir, monkeypatch,
                                                                                    capsys):
    """matplotlib is a base dependency; after a --no-deps install the terminal says in one line
    why there are no plots, as the summary does."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)             # import matplotlib -> ImportError
    md = report.write_report(run_dir, out=run_dir / "plain").read_text()
    says = "no plots: matplotlib is not installed (pip install 'matplotlib>=3.7')"
    assert says in md
    assert capsys.readouterr().err == f"slipstream report: {says}\n"
    assert "| reward mean |" in md
    assert not list((run_dir / "plain").glob("*.png"))


def test_slipstream_run_writes_the_report_of_its_own_run(tmp_path, capsys):
    """The launcher's end of run: the report of the learner's run id, or a line saying why not."""
    from deploy.launcher import _write_report

    rows = [{"run_id": "earlier", "step": 1, "reward_mean": 0.2}, {"run_id": "this", "step": 1, "reward_mean": 0.7}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    _write_report(tmp_path, "this")
    assert capsys.readouterr().out == f"[run] report: {tmp_path / 'report' / 'report.md'}\n"
    assert (tmp_path / "report" / "report.md").read_text().startswith("# slipstream run `this`")
    _write_report(tmp_path, "crashed-before-step-1")
    assert capsys.readouterr().out == "[run] no report: this run trained no step\n"


# ---- readable plots (issue 30.4, 30.5) -----------------------------------------------------------

def _split(tmp_path, rows: list[dict]) -> report.Run:
    """The report's view of one run written to a metrics.jsonl: steps, eval rounds, ctl changes."""
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    runs, _ = report.read_runs(tmp_path / "metrics.jsonl")
    return report.select_run(runs, None).split()


def _plot(name: str) -> report.Plot:
    return next(p for p in report.PLOTS if p.name == name)


def _labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


def _rendered(fig) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()                    # tick labels and offset texts exist once drawn


def _eval_row(version: int, accuracy: float) -> dict:
    return {"run_id": "r", "kind": "eval", "step": version, "version": version, "time": 1000.0 + version,
            "eval_version": version, "eval_accuracy": accuracy, "eval_reward_mean": accuracy / 2,
            "eval_samples": 32, "eval_seconds": 22.0, "eval_failed": 0, "eval_dropped": 0,
            "eval_token_version_min": version, "eval_token_version_max": version}


def test_the_reward_axis_holds_reward_and_accuracy_not_eval_counts_or_seconds(tmp_path):
    """An evaluation every 8 steps: the eval rows' sample count (32), seconds (22) and versions
    are not on the reward axis, in reward.png or the overview's panel, and an eval row is no hole
    in the per-step reward line."""
    rows = []
    for s in range(1, 25):
        rows.append(_row("r", s))
        if s % 8 == 0:
            rows.append(_eval_row(s, 0.1 + s / 100))
    run = _split(tmp_path, rows)
    fig = report.figure(_plot("reward"), run)
    overview = report.overview_figure(run)
    for ax in (fig.axes[0], overview.subfigs[0].axes[0]):
        assert _labels(ax) == ["reward mean", "reward std (in the batch)", "eval accuracy", "eval reward mean"]
        reward = ax.get_lines()[0]
        assert list(reward.get_xdata()) == list(range(1, 25))        # every step, none missing
        assert ax.get_ylim()[1] < 1.0                                # reward and accuracy fill the axis
    md = report.write_report(tmp_path).read_text()
    assert "| held-out evaluation | first round (v8) | last round (v24) | min | max |" in md
    assert "| eval accuracy | 0.180 | 0.340 | 0.180 | 0.340 |" in md
    assert "| eval samples | 32.000 |" in md and "eval version" not in md


def test_a_series_equal_to_another_is_drawn_once_and_named_in_its_legend(tmp_path):
    """loss is pg_loss without a critic or KL loss; approx KL is the mismatch KL under
    clip_anchor: behavior. A value 1e-6 apart is another series."""
    rows = [_row("r", s, loss=0.5 - s / 100, pg_loss=0.5 - s / 100 + 1e-15, kl_loss=0.5 - s / 100 + 1e-6,
                 pg_approx_kl=1e-3 * s, grad_norm=1.0) for s in range(1, 11)]
    run = _split(tmp_path, rows)
    assert _labels(report.figure(_plot("loss"), run).axes[0]) == ["loss = policy loss", "KL loss"]
    assert _labels(report.figure(_plot("kl"), run).axes[0]) == ["approx KL of the update (PPO) = mismatch KL"]
    assert _labels(report.figure(_plot("mismatch_kl"), run).axes[0]) == [
        "mismatch KL = approx KL of the update"]
    assert report.same_series([1.0, math.nan], [1.0 + 1e-13, math.nan])
    assert not report.same_series([1.0, math.nan], [1.0, 2.0])


def test_a_constant_setting_is_stated_and_a_changing_one_has_plain_ticks(tmp_path):
    """A fixed lr was a line on a 0.000285–0.000315 axis of float noise: it is said in the title;
    a scheduled lr keeps its twin axis, with values as tick labels (no offset)."""
    fixed = _split(tmp_path, [_row("r", s, grad_norm=1.0 + s, lr=3e-4, kl_coef=0.05, ref_kl=0.01 * s)
                              for s in range(1, 11)])
    fig = report.figure(_plot("loss"), fixed)
    assert len(fig.axes) == 2 and fig.axes[1].get_title() == "lr 0.0003 (constant)"
    kl = report.figure(_plot("kl"), fixed)
    assert len(kl.axes) == 1 and kl.axes[0].get_title() == "kl_coef 0.05 (constant)"

    ramp = _split(tmp_path, [_row("r", s, grad_norm=1.0 + s, lr=2.85e-4 + 3e-6 * s) for s in range(1, 11)])
    fig = report.figure(_plot("loss"), ramp)
    _rendered(fig)
    twin = fig.axes[2]
    assert twin.get_ylabel() == "lr" and twin.yaxis.get_offset_text().get_text() == ""

    # A constant statistic on an axis of its own: centred, with room (ESS 0.9 has its own 0-1).
    flat = _split(tmp_path, [{**_row("r", s), "staleness_mean": 2.0, "staleness_max": 2.0} for s in range(1, 6)])
    ax = report.figure(_plot("staleness"), flat).axes[0]
    assert _labels(ax) == ["mean = max"] and ax.get_ylim() == (1.0, 3.0)


def test_ctl_changes_are_marked_on_every_policy_step_axis_and_listed(tmp_path):
    """A change made after step 10 (a ``kind: control`` row) and one the event log recorded
    (``event: control_set``) are dotted lines between their step and the next on every plot over
    policy steps, listed in report.md, and roll back no step."""
    rows = [_row("r", s) for s in range(1, 11)]
    rows.append({"run_id": "r", "kind": "control", "step": 10, "time": 1005.2, "key": "optimizer.lr",
                 "value": 1e-4, "previous": 3e-4, "takes_effect": "next step"})
    rows += [_row("r", s) for s in range(11, 16)]
    rows.append({"proc": "learner", "event": "control_set", "run_id": "r", "version": 15,
                 "key": "staleness.max_staleness", "value": 1, "previous": 2, "takes_effect": "now"})
    rows += [_row("r", s) for s in range(16, 21)]
    run = _split(tmp_path, rows)
    assert [r["step"] for r in run.rows] == list(range(1, 21))
    assert [(c.step, c.key) for c in run.controls] == [(10.0, "optimizer.lr"), (15.0, "staleness.max_staleness")]

    def marks(ax) -> list[float]:
        return [line.get_xdata()[0] for line in ax.get_lines() if line.get_gid() == "ctl"]

    for name in ("reward", "entropy", "mismatch_kl", "step_time"):
        assert all(marks(ax) == [10.5, 15.5] for ax in report.figure(_plot(name), run).axes
                   if ax.get_xlabel() == "policy step"), name
    versions = report.figure(_plot("versions"), run).axes[0]      # over seconds: at its time
    assert versions.get_xlabel() == "seconds" and marks(versions) == [pytest.approx(4.7)]
    overview = report.overview_figure(run)
    assert all(marks(sub.axes[0]) == [10.5, 15.5] for sub in overview.subfigs)
    md = report.write_report(tmp_path).read_text()
    assert ("## Control changes\n\n- after step 10: `optimizer.lr` 0.0003 → 0.0001\n"
            "- after step 15: `staleness.max_staleness` 2 → 1\n") in md


def test_report_md_reads_plainly(tmp_path):
    """One step is "1 policy step" and a window of one is "first step"; a server that left says
    after which step; the windows are a quarter of the steps."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row("r", 1)))
    md = report.write_report(tmp_path).read_text()
    assert "1 policy step (step 1 → 1)" in md
    assert "| statistic | first step (1) | last step (1) | min | max |" in md
    rows = [_row("r", s) for s in range(1, 9)]
    for r in rows[5:]:
        del r["server_versions"]["rollout-1"]                     # left after step 5, at v3
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    md = report.write_report(tmp_path).read_text()
    assert "servers at the end: rollout-0 v7, rollout-1 left after step 5 (at v3)" in md
    assert "| statistic | first 2 steps (1–2) | last 2 steps (7–8) | min | max |" in md
    assert "gone" not in md


def test_matplotlib_is_a_base_dependency():
    """The first ``pip install -e .`` installs what the end-of-run report needs for its plots;
    the ``report`` extra stays, empty, for the commands that name it."""
    tomllib = pytest.importorskip("tomllib")                         # Python 3.11+
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert "matplotlib>=3.7" in project["dependencies"]
    assert project["optional-dependencies"]["report"] == []


def test_the_learner_runtime_line_is_in_the_report(tmp_path):
    """RUN_DIR/runtime.json (the learner writes it at start: device, dtype, autocast, and why each
    auto chose that, issue 40) is one line of the summary; a missing or damaged file is no line."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row("r", 1)))
    assert "runtime" not in report.write_report(tmp_path).read_text()
    line = "device cpu; dtype float32; autocast none (auto: this CPU has no native bfloat16); threads 2"
    (tmp_path / "runtime.json").write_text(json.dumps({"autocast": "none", "line": line}))
    assert f"- learner runtime: {line}\n" in report.write_report(tmp_path).read_text()
    (tmp_path / "runtime.json").write_text('{"line": "device cpu; dty')       # torn
    assert "runtime" not in report.write_report(tmp_path).read_text()
