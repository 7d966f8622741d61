"""The cleanup fixture of tests/conftest.py: a test's subprocess and everything it started are
stopped together, at teardown and when a run times out (a launcher's children included)."""

from __future__ import annotations

import os
import select
import sys

import pytest

# A "launcher" that starts a child (which ignores nothing, but would outlive a killed parent),
# writes the child's pid to a file, then waits for it.
LAUNCHER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
print("child", child.pid, flush=True)
child.wait()
"""


def _dies(pid: int, timeout_s: float = 10.0) -> bool:
    """True once ``pid`` has exited (a pidfd turns readable then: no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout_s)
        return bool(readable)
    finally:
        os.close(fd)


def test_stop_kills_the_whole_group(process_groups):
    launcher = process_groups.watch([sys.executable, "-c", LAUNCHER, os.devnull])
    pid = int(launcher.wait_for_line(r"child (\d+)", 60).group(1))
    fd = os.pidfd_open(pid)
    try:
        assert not select.select([fd], [], [], 0)[0]           # the child is running
        process_groups.stop(launcher.proc, grace_s=5)
        assert select.select([fd], [], [], 10)[0], "the launcher's child outlived the stop"
    finally:
        os.close(fd)


def test_a_timed_out_run_fails_and_leaves_nothing_behind(process_groups, tmp_path):
    pid_file = tmp_path / "child.pid"
    # (10 s: the child's python must have started and written its pid before the timeout)
    with pytest.raises(pytest.fail.Exception, match="ran over 10s"):
        process_groups.run([sys.executable, "-c", LAUNCHER, str(pid_file)], timeout=10)
    assert _dies(int(pid_file.read_text()))
