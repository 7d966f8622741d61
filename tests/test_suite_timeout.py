"""The suite's per-test timeout (pytest-timeout, ``timeout`` in pyproject.toml): a test that hangs
fails with the stack of where it waits, instead of stalling the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HANGS = '''
import threading

def test_waits_forever():
    threading.Event().wait()
'''


def test_a_hanging_test_fails_with_its_stack(tmp_path):
    (tmp_path / "test_hang.py").write_text(HANGS)
    # The repository's own pytest settings (-c), with the limit shortened to keep this test fast.
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path),
                        "-o", "timeout=2", "-o", "pythonpath=", str(tmp_path / "test_hang.py")],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Timeout" in out and "test_waits_forever" in out and "wait" in out, out


def test_the_limit_is_set_for_every_test():
    text = (REPO / "pyproject.toml").read_text()
    assert "\ntimeout = " in text and '"pytest-timeout' in text
