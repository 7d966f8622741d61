"""`kill -USR1` on the processes of a real `slipstream run` (issue 38 item 3): each writes its
threads' and asyncio tasks' stacks into RUN_DIR/stacks and says where, and keeps training."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

RUN = [sys.executable, "-m", "deploy.cli", "run", "--set", "learner.network.rollout_port=0",
       "--set", "learner.network.weights_port=0", "--set", "learner.network.control_port=0",
       "--set", "learner.network.metrics_port=0", "--set", "rollout.network.metrics_port=0"]


def test_sigusr1_writes_each_processes_stacks_into_the_run_directory(tmp_path, subprocess_env, process_groups):
    run_dir = tmp_path / "run"
    run = process_groups.watch([*RUN, "--set", "learner.total_steps=100000", "--set", f"learner.run_dir={run_dir}"],
                               env=subprocess_env, cwd=tmp_path)
    pids = {name: int(run.wait_for_line(rf"\[run\] {name} pid (\d+)", 300).group(1))
            for name in ("learner", "rollout-0")}
    run.wait_for_line(r"^\s+3\s", 300)                       # training
    files = {}
    for name, task in (("learner", "train"), ("rollout-0", "pipeline")):
        os.kill(pids[name], signal.SIGUSR1)
        m = run.wait_for_line(rf"\[{name}\] stacks_written .*\"path\": \"([^\"]+)\"", 60)
        files[name] = Path(m.group(1))
        text = files[name].read_text()
        assert files[name].parent == run_dir / "stacks", files[name]
        assert f"## task {task}" in text and "## thread MainThread" in text, text[:2000]
        threads = run_dir / "stacks" / f"stacks-{name}-{pids[name]}.threads.txt"
        assert "Thread" in threads.read_text()                  # faulthandler's part too
    step = int(run.wait_for_line(r"^\s+(\d+)\s+\d", 60).group(1))
    later = int(run.wait_for_line(r"^\s+(\d+)\s+\d", 60).group(1))
    assert later > step                                       # still training
    run.proc.send_signal(signal.SIGINT)
    assert run.proc.wait(timeout=60) == 130, run.output()
    assert re.search("learner", files["learner"].name) and "rollout-0" in files["rollout-0"].name
