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


def _live(total: int, width: int):
    out = io.StringIO()
    return LiveView(total_steps=total, out=out, live=True, width=width), out


def test_at_80_columns_every_shown_cell_is_whole():
    """A narrow terminal drops the lowest-priority columns (deploy.live.PRIORITY) instead of
    cutting every cell ("0.6…", "ro…"); columns with no value (KL ref here) are left out."""
    from deploy.live import fitting_columns

    rows = steps(15)
    for ev in rows:
        ev.update(samples_per_s=1234.5, learner_idle_ratio=0.5, rollout_idle_ratio=0.25)
    shown = fitting_columns(rows, 80)
    assert shown == ["step", "reward", "entropy", "mismatch KL", "ESS", "stale", "samples/s", "idle L"]
    assert fitting_columns(rows, 400) == ["step", "reward", "entropy", "mismatch KL", "ESS", "stale",
                                          "samples/s", "idle L", "idle R", "servers"]   # no eval, no KL ref
    assert fitting_columns(rows, 20) == ["step", "reward"]         # these two always
    view, out = _live(20, 80)
    for ev in steps(15):
        view.step(ev)
    view.close()
    table = [line for line in out.getvalue().splitlines() if "│" in line or "┃" in line]
    assert table and all(len(line) <= 80 for line in table)
    assert "…" not in out.getvalue()
    assert "0.700" in out.getvalue() and "2.000" in out.getvalue()   # whole cells (reward, entropy)


def test_the_bar_says_what_the_run_is_doing():
    """Before the first step it says it is loading, then waiting; "paused" while paused."""
    view, out = _live(20, 120)
    assert view.progress.tasks[0].description == "starting: loading the model"
    view.event({"event": "ready"})
    assert view.progress.tasks[0].description == "waiting for the first batch"
    view.step(steps(1)[0])
    assert view.progress.tasks[0].description == "training"
    view.event({"event": "server_joined"})                       # a later join: still training
    assert view.progress.tasks[0].description == "training"
    view.event({"event": "control_pause"})
    assert view.progress.tasks[0].description == "paused"
    view.event({"event": "control_resume"})
    assert view.progress.tasks[0].description == "training"
    view.event({"event": "control_stop"})
    view.close()
    assert view.progress.tasks[0].description == "stopping" and "stopping" in out.getvalue()


def test_after_a_resume_the_eta_counts_only_the_steps_trained_now():
    """A run resumed at step 150 of 200 at one step per 10 s: its ETA is about 490 s, not the
    seconds a rate of 150 steps in no time would give."""
    view, _ = _live(200, 120)
    now = [0.0]
    view.progress.get_time = lambda: now[0]
    evs = steps(152)
    now[0] = 10.0
    view.step(evs[149])                                           # step 150
    now[0] = 20.0
    view.step(evs[150])                                           # step 151
    task = view.progress.tasks[0]
    view.close()
    assert task.completed == 151 and 400 < task.time_remaining < 600, task.time_remaining


def test_a_stall_shows_its_diagnosis_in_place_of_the_empty_table():
    """The learner's stalled line replaces the empty table (wrapped at 80 columns, never cut);
    after steps it shows under them; progress clears it."""
    from rich.console import Console

    view, _ = _live(20, 80)
    view.event({"event": "ready"})
    diagnosis = ("no step for 95 s: waiting for samples: 2 rollout servers connected, no valid sample yet; "
                 "failed samples: 4812 reward (4812 since the last valid one); last error: reward grade: "
                 "ValueError: no answer key")
    view.event({"event": "stalled", "diagnosis": diagnosis})
    assert view.progress.tasks[0].description == "stalled"

    def screen() -> str:
        console = Console(file=io.StringIO(), width=80)
        console.print(view._render())
        return console.file.getvalue()
    shown = screen()
    assert "step" not in shown.split("stalled:")[0].splitlines()[-1]         # no empty table header
    assert " ".join(shown.split("stalled:", 1)[1].split()) == diagnosis      # whole, wrapped
    assert all(len(line) <= 80 for line in shown.splitlines())
    view.event({"event": "progress_resumed"})
    assert view.waiting is None and view.progress.tasks[0].description == "waiting for the first batch"
    view.step(steps(1)[0])
    view.event({"event": "stalled", "diagnosis": "no step for 70 s: a policy step has run 70 s"})
    shown = screen()
    assert "reward" in shown and shown.rstrip().endswith("stalled: no step for 70 s: a policy step has run 70 s")
    view.event({"event": "step"})
    assert view.waiting is None and view.progress.tasks[0].description == "training"
    view.close()
