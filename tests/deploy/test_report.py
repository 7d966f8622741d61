"""`slipstream report`: runs told apart by run id, plots of the columns that exist, the summary's
numbers, one-line errors. On synthetic metrics.jsonl files here; on a real run's in
test_observability.py."""

from __future__ import annotations

import json
import math
import sys

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
    # Reward is step/100: the first and last 6 steps (10 %) average 0.035 and 0.575.
    assert "| reward mean | 0.035 | 0.575 | 0.010 | 0.600 |" in md
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


def test_without_matplotlib_the_summary_is_written_and_says_why_there_are_no_plots(run_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)             # import matplotlib -> ImportError
    md = report.write_report(run_dir, out=run_dir / "plain").read_text()
    assert "no plots: matplotlib is not installed (pip install 'slipstream[report]')" in md
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
