"""The import rules of docs/design.md §2 at run time: ``protocol`` and ``buffer`` never pull in torch
(rollout clients, tools and the buffer stay light), and neither does ``slipstream ctl``. Checked in
a fresh interpreter by looking at ``sys.modules`` after the imports; ``tests/test_layering.py``
checks every import statement of every package against the table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "vllm", "deepspeed")

CHECK = """
import importlib, json, pkgutil, sys
imported = []
for name in {packages!r}:
    pkg = importlib.import_module(name)
    imported.append(name)
    for info in pkgutil.walk_packages(pkg.__path__, prefix=name + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
print(json.dumps({{"imported": imported, "heavy": heavy}}))
"""


@pytest.mark.parametrize("packages", [("protocol",), ("buffer",), ("protocol", "buffer")])
def test_import_does_not_pull_in_torch(packages):
    r = subprocess.run([sys.executable, "-c", CHECK.format(packages=packages, heavy=HEAVY)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["heavy"] == [], (
        f"importing {', '.join(report['imported'])} imported {', '.join(report['heavy'])}")


CTL = """
import json, sys
from deploy.cli import main
code = main(["ctl", "--endpoint", "tcp://127.0.0.1:{port}", "--timeout-s", "0.2", "status"])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
print(json.dumps({{"code": code, "heavy": heavy}}))
"""


def test_ctl_does_not_import_torch():
    """`slipstream ctl` talks to a learner over ZeroMQ: it must start in a fraction of a second,
    so the CLI imports the model stack only for the commands that need it."""
    import socket

    with socket.socket() as s:           # a port with nobody on it: ctl times out (exit 1)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-c", CTL.format(port=port, heavy=HEAVY)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["code"] == 1 and "no answer" in r.stderr
    assert report["heavy"] == [], f"slipstream ctl imported {', '.join(report['heavy'])}"
