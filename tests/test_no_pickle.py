"""No pickle anywhere (R5): a scan of every Python file of the repository (the packages, deploy,
tests, benches) for the ways code ends up unpickling: the pickle modules, pyzmq's
``recv_pyobj``/``send_pyobj``, ``torch.load`` without ``weights_only=True``, ``numpy.load`` with
``allow_pickle=True``, and the usual wrappers (joblib, dill, cloudpickle, shelve, marshal).

The scan reads the AST (imports, attribute and name uses, keyword arguments), so a docstring
that says "never pickled" does not count, and a call split over lines still does.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", ".git", "build", "dist", "__pycache__", ".cache", "runs", "node_modules"}
MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal",
           "pickletools", "copyreg"}
NAMES = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized", "Unpickler", "loads_pickle"}


def python_files() -> list[Path]:
    out = []
    for p in REPO.rglob("*.py"):
        rel = p.relative_to(REPO)
        if not SKIP_DIRS.intersection(rel.parts) and not any(part.endswith(".egg-info") for part in rel.parts):
            out.append(p)
    return out


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def findings(source: str, filename: str = "<src>") -> list[str]:
    found = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in MODULES:
                found.append(f"{where}: from {node.module} import ...")
            found += [f"{where}: imports {a.name}" for a in node.names if a.name in NAMES]
        elif isinstance(node, ast.Attribute) and node.attr in NAMES:
            found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            attr = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
            if attr == "load" and owner == "torch":
                wo = _keyword(node, "weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    found.append(f"{where}: torch.load without weights_only=True")
            if attr == "load" and owner in ("np", "numpy"):
                ap = _keyword(node, "allow_pickle")
                if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                    found.append(f"{where}: numpy.load with allow_pickle")
    return found


def test_the_scanner_finds_each_way_in():
    bad = """
import pickle
from cloudpickle import dumps
import zmq
x = sock.recv_pyobj()
torch.load(path)
torch.load(path, weights_only=False)
np.load(f, allow_pickle=True)
"""
    assert len(findings(bad)) == 6, findings(bad)
    good = '''
"""Never pickled; torch.load(p) would be wrong."""
torch.load(path, weights_only=True)
np.load(f)
sock.recv_multipart()
'''
    assert findings(good) == []


def test_no_pickle_anywhere_in_the_repository():
    files = python_files()
    assert len(files) > 50, "the scan found too few files: wrong root?"
    me = Path(__file__).resolve()
    found = [f for p in files if p.resolve() != me
             for f in findings(p.read_text(encoding="utf-8"), str(p.relative_to(REPO)))]
    assert found == [], "\n".join(found)
