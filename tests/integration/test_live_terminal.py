"""`slipstream run` on a real terminal (a pty of 80 × 30), stopped with Ctrl-C (issue 30.6): the
bar says what the run is doing (loading, then waiting, then stopping), and the final frame left on
the screen holds the latest steps with every shown cell whole in 80 columns."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time

import pytest

pytestmark = pytest.mark.slow

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]")
STEP_ROW = re.compile(r"^│ +(\d+) │")


def _read_until(fd: int, buf: bytearray, done, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not done(bytes(buf)):
        assert time.monotonic() < end, bytes(buf)[-3000:].decode(errors="replace")
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:                  # the other side closed
                return
            if not data:
                return
            buf += data


def test_the_live_view_on_an_80_column_terminal_through_ctrl_c(tmp_path, subprocess_env, process_groups):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 80, 0, 0))
    env = {k: v for k, v in subprocess_env.items() if k not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"
    proc = process_groups.popen(
        [sys.executable, "-m", "deploy.cli", "run", "--set", f"learner.run_dir={tmp_path / 'run'}",
         "--set", "learner.total_steps=100000", "--set", "learner.network.rollout_port=0",
         "--set", "learner.network.weights_port=0", "--set", "learner.network.control_port=0",
         "--set", "learner.network.metrics_port=0", "--set", "rollout.network.metrics_port=0"],
        stdin=slave, stdout=slave, stderr=slave, env=env, cwd=tmp_path)
    os.close(slave)
    buf = bytearray()
    try:
        _read_until(master, buf, lambda b: re.search(rb"\xe2\x94\x82 +12 \xe2\x94\x82", b), 300)   # "│   12 │"
        os.killpg(proc.pid, signal.SIGINT)           # Ctrl-C: the terminal signals the whole group
        _read_until(master, buf, lambda b: b"[run] summary" in b and b"resume" in b.split(b"[run] summary")[-1], 120)
        assert proc.wait(timeout=60) == 130
    finally:
        os.close(master)
    text = ANSI.sub(b"", bytes(buf)).decode(errors="replace")
    assert "starting: loading the model" in text and "stopping" in text
    lines = [line.strip("\r") for line in text.replace("\r\n", "\n").split("\n")]
    top = max(i for i, line in enumerate(lines) if line.startswith("┏"))      # the final frame
    bottom = next(i for i in range(top, len(lines)) if lines[i].startswith("└"))
    frame = lines[top:bottom + 1]
    steps = [int(m.group(1)) for line in frame if (m := STEP_ROW.match(line))]
    assert len(steps) >= 10 and steps == sorted(steps) and steps[-1] >= 12, frame
    assert all(len(line) <= 80 for line in frame), frame
    assert "…" not in "\n".join(frame)
    header = frame[1]
    assert "step" in header and "reward" in header and "samples/s" in header
