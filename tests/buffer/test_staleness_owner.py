"""η has one owner (issue 37 item 3): buffer.staleness.StalenessLimit. Read from the source (AST):
no module of the packages assigns η's value anywhere else, and the old setters are gone; then the
owner itself: ctl-like sets, the controller's decisions and a restore reach the gate and the
buffer, which hears every change but a restore."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from buffer import RolloutBuffer, StalenessController, StalenessGate, StalenessLimit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "ops", "buffer", "rollout_server", "learner", "deploy")
OWNER = ROOT / "buffer" / "staleness.py"
NAMES = {"_eta", "eta", "max_staleness"}


def assignments(path: Path) -> list[str]:
    """``x.eta = ...``-like assignments (an attribute named in NAMES) and calls of a
    ``set_max_staleness`` in one file."""
    found = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and el.attr in NAMES:
                    found.append(f"{where}:{node.lineno} assigns .{el.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr == "set_max_staleness"):
            found.append(f"{where}:{node.lineno} calls set_max_staleness")
        if isinstance(node, ast.FunctionDef) and node.name == "set_max_staleness":
            found.append(f"{where}:{node.lineno} defines set_max_staleness")
    return found


def test_no_other_module_assigns_eta():
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if p != OWNER]
    assert len(files) > 100
    offenders = [hit for p in files for hit in assignments(p)]
    assert offenders == [], offenders
    assert any("assigns ._eta" in hit for hit in assignments(OWNER))     # the owner does (sanity)


def test_the_check_finds_an_assignment(tmp_path):
    bad = tmp_path / "offender.py"
    bad.write_text("def f(gate, limit):\n    gate.max_staleness = 3\n    limit._eta += 1\n"
                   "    gate.set_max_staleness(2)\n")
    assert assignments(bad) == ["offender.py:2 assigns .max_staleness", "offender.py:3 assigns ._eta",
                                "offender.py:4 calls set_max_staleness"]


def test_the_owner_drives_the_gate_and_the_buffer():
    limit = StalenessLimit(2, controller=StalenessController(
        min_staleness=0, ess_min=0.5, mismatch_kl_max=0.1, ess_recover=0.8, mismatch_kl_recover=0.05,
        recover_steps=2))
    heard = []
    limit.subscribe(lambda previous, eta, reason: heard.append((previous, eta, reason)))
    buffer = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=limit)
    gate = buffer.gate
    assert buffer.staleness is limit and gate.staleness is limit
    assert (gate.max_staleness, buffer.max_staleness, gate.capacity(0)) == (2, 2, 12)
    assert limit.set(1, "ctl") == 2
    assert (gate.max_staleness, gate.capacity(0)) == (1, 8)
    decision = limit.after_step(2, {"is_ess_ratio": 0.2, "mismatch_kl": 0.0})     # ESS low: down one
    assert (decision.eta, decision.reason, limit.eta, gate.capacity(0)) == (0, "ess_low", 0, 4)
    assert limit.after_step(2, {"is_ess_ratio": 0.2, "mismatch_kl": 0.0}) is None  # at min_staleness
    state = gate.state_dict()
    limit.set(2, "ctl")
    gate.load_state_dict(state)                        # a checkpoint's η comes back quietly
    assert limit.eta == 0
    assert heard == [(2, 1, "ctl"), (1, 0, "ess_low"), (0, 2, "ctl")]
    assert StalenessLimit(3).after_step(5, {"is_ess_ratio": 0.0, "mismatch_kl": 9.0}) is None   # fixed
    with pytest.raises(ValueError, match="max_staleness"):
        limit.set(-1, "ctl")
    assert isinstance(StalenessGate(4, 1).staleness, StalenessLimit)
