"""``SLIPSTREAM_TRACE``: a real `slipstream run` at η = 0 writes every point of its cycle, from the
learner and from the server, into one file, and tests/bench/bench_cycle.py reads the cycles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_cycle  # noqa: E402

pytestmark = pytest.mark.slow

FREE_PORTS = ["--set", "learner.rollout_port=0", "--set", "learner.weights_port=0",
              "--set", "learner.control_port=0", "--set", "learner.metrics_port=0",
              "--set", "rollout.metrics_port=0"]


def test_an_eta0_run_traces_every_point_of_its_cycle(tmp_path, subprocess_env, process_groups):
    trace = tmp_path / "trace.txt"
    steps = 8
    r = process_groups.run([sys.executable, "-m", "deploy.cli", "run", *FREE_PORTS,
                            "--set", f"learner.total_steps={steps}", "--set", "learner.max_staleness=0",
                            "--set", "learner.save_every=0", "--set", f"learner.run_dir={tmp_path / 'run'}"],
                           timeout=600, env=dict(subprocess_env, SLIPSTREAM_TRACE=str(trace)),
                           cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [line.split() for line in trace.read_text().splitlines()]
    by_pid: dict[str, set[str]] = {}
    for _, pid, point in lines:
        by_pid.setdefault(pid, set()).add(point)
    # Two processes wrote to the one file, each its own points (the launcher traces nothing).
    points = {p for p, _ in bench_cycle.POINTS}
    assert sorted(sorted(seen) for seen in by_pid.values()) == [
        sorted(p for p in points if p.startswith("learner.")),
        sorted(p for p in points if p.startswith("rollout."))]
    assert sum(p == "learner.step_end" for _, _, p in lines) == steps

    cycles = bench_cycle.cycles(bench_cycle.read_trace(trace), skip=1)
    assert len(cycles) == steps - 2                # cycles between step ends, the first left out
    names = [p for p, _ in bench_cycle.POINTS]
    serial = ["learner.published", "rollout.manifest", "rollout.fetched", "rollout.applied",
              "rollout.generate", "rollout.generated", "learner.batch"]
    for c in cycles:
        assert None not in c
        at = dict(zip(names[:-1], c))
        # η = 0 is serial: the weights reach the engine, then it generates, then the batch forms.
        assert [at[p] for p in serial] == sorted(at[p] for p in serial), at
        assert at["learner.batch"] < c[-1]
    s = bench_cycle.summarize(cycles)
    assert s["cycles"] == steps - 2
    assert 0 < s["idle_ms"] < s["cycle_ms"] == pytest.approx(s["at_ms"][-1])
