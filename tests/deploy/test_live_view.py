"""The view of `slipstream run`: plain lines off a terminal, the rich live view on one, the summary."""

from __future__ import annotations

import io

from deploy.live import LiveView, StepRate, plain_header, plain_row, summary


def steps(n: int) -> list[dict]:
    return [{"step": i, "reward_mean": 0.1 * i, "entropy": 2.0, "mismatch_kl": 1e-3, "is_ess_ratio": 0.9,
             "staleness_mean": 0.5, "samples": 16.0, "step_s": 0.5, "ref_kl": float("nan"),
             "server_versions": {"rollout-0": i - 1, "rollout-1": i}} for i in range(1, n + 1)]


def test_plain_lines_off_a_terminal():
    out = io.StringIO()
    view = LiveView(total_steps=3, out=out)
    assert not view.live                       # a StringIO is not a terminal
    for ev in steps(3):
        view.step(ev)
    view.note("[learner] server_lost {}")
    view.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == plain_header() and "reward" in lines[0] and "idle L" in lines[0]
    assert len(lines) == 5 and lines[-1] == "[learner] server_lost {}"
    assert lines[3].split()[:2] == ["3", "0.300"] and "rollout-0:2 rollout-1:3" in lines[3]
    assert plain_row({"step": 1}).split()[1] == "-"          # missing values show as "-"


def test_live_view_renders_progress_and_the_latest_steps():
    out = io.StringIO()
    view = LiveView(total_steps=20, out=out, live=True, width=200)
    for ev in steps(15):
        view.step(ev)
    view.note("[learner] control_set {\"key\": \"max_staleness\"}")
    view.close()
    text = out.getvalue()
    assert "training" in text and "15/20" in text and "ETA" in text
    assert "mismatch KL" in text and "rollout-1:15" in text and "control_set" in text
    assert len(view.rows) == 12 and view.rows[0]["step"] == 4       # only the latest ROWS steps


def test_summary_and_rate():
    t = iter([10.0, 11.0])
    rate = StepRate(clock=lambda: next(t))
    assert rate.add({"samples": 16, "step_s": 1.0}) == 16.0          # 16 samples over 1 s
    assert rate.add({"samples": 16, "step_s": 1.0}) == 16.0          # 32 over 2 s
    evs = steps(4)
    evs[-1]["samples_per_s"] = 32.0
    text = summary(evs[0], evs[-1], run_dir="runs/x", checkpoint=None, report="runs/x/report/report.md")
    assert "reward         0.100 → 0.400" in text and "samples/s      32.0" in text
    assert "runs/x/report/report.md" in text and "checkpoint" not in text
    assert "no policy step" in summary(None, None)


def test_eval_rounds_show_in_the_steps_after_them_and_in_the_summary():
    out = io.StringIO()
    view = LiveView(total_steps=4, out=out)
    evs = steps(4)
    view.eval({"event": "eval", "eval_version": 0, "eval_accuracy": 0.0625})
    view.step(evs[0])
    view.step(evs[1])
    view.eval({"event": "eval", "eval_version": 2, "eval_accuracy": 0.8438})
    view.step(evs[2])
    rows = [line.split() for line in out.getvalue().splitlines()[1:]]
    assert [r[2] for r in rows] == ["0.062", "0.062", "0.844"]        # the eval acc column
    text = view.summary()
    assert "eval accuracy  0.062 (v0) → 0.844 (v2)" in text
