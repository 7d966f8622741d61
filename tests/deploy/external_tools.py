"""Programs the deploy tests run (promtool, prometheus, shellcheck, hadolint), found or skipped.

They come from Debian packages or wheels that ``.ci/run`` installs; there
``SLIPSTREAM_REQUIRE_TOOLS=1`` turns a missing program into a failure, so CI cannot pass by skipping.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def require(name: str) -> str:
    """The path of program ``name``; skips the test when it is missing (fails under CI's flag).

    The venv's ``bin`` is searched too (hadolint comes as a wheel), without needing it on PATH."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return found
    if os.environ.get("SLIPSTREAM_REQUIRE_TOOLS") == "1":
        pytest.fail(f"{name} is not installed (.ci/run installs it)")
    pytest.skip(f"{name} is not installed")


def run_tool(cmd: list[str], timeout_s: float = 60, **kwargs) -> subprocess.CompletedProcess:
    """Run a checker; its output (stdout + stderr) is in ``.stdout`` for the assertion message."""
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout_s, **kwargs)
