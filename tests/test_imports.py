"""The import rule of DESIGN.md §2 that matters most: ``protocol`` and ``buffer`` never pull in
torch (rollout clients, tools and the buffer stay light). Checked in a fresh interpreter, over
every submodule, by looking at ``sys.modules`` after the imports."""

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
