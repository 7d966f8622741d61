"""`slipstream learner` launched apart, on a terminal, prints what `slipstream run` shows — the
step table and the notable events as one readable line each — not a 1.5 KB JSON object per step;
piped (or with --log-format json) it prints JSON lines for tools (issue 30.7; deploy/logfmt.py)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from config_kit import nested

from deploy.live import plain_header

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "deploy.cli"]
LOAD_CLIENT = Path(__file__).resolve().parent / "load_client.py"


def _config(tmp_path: Path, model: str) -> str:
    cfg = {"model": model, "learner": nested({
        "rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
        "total_steps": 10_000_000, "batch_prompts": 2, "group_size": 4, "max_new_tokens": 4,
        "run_dir": str(tmp_path / "run"), "save_every": 0, "threads": 1, "exit_on_finish": False})}
    path = tmp_path / "learner.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_on_a_terminal_the_learner_prints_the_step_table(tmp_path, tiny_model_dir, subprocess_env,
                                                         process_groups):
    master, slave = pty.openpty()
    proc = process_groups.popen([*CLI, "learner", "--config", _config(tmp_path, tiny_model_dir)],
                                stdout=slave, stderr=subprocess.DEVNULL, env=subprocess_env, cwd=tmp_path)
    os.close(slave)
    chunks: list[bytes] = []

    def pump():                          # read the terminal until the process closes it
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    text = lambda: b"".join(chunks).decode(errors="replace").replace("\r", "")  # noqa: E731
    clients, deadline = None, time.monotonic() + 180
    while text().count("\n") < 40:
        assert time.monotonic() < deadline and proc.poll() is None, text()
        if clients is None and "[learner] ready " in text():
            ready = json.loads(text().split("[learner] ready ", 1)[1].splitlines()[0])
            clients = process_groups.popen(
                [sys.executable, str(LOAD_CLIENT), ready["rollout"], "1", "60",
                 str(tmp_path / "clients.json"), "8"], env=subprocess_env, cwd=tmp_path)
        time.sleep(0.2)
    clients.kill()
    assert process_groups.stop(proc) == 0, text()[-3000:]
    reader.join(10)
    os.close(master)
    lines = text().splitlines()
    assert plain_header() in lines, lines[:20]
    rows = [line for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) >= 10, lines[:40]
    assert not any(line.startswith('{"proc"') for line in lines), "JSON on a terminal"
    assert max(len(line) for line in lines if not line.startswith("[")) < 200   # a row, not a record
