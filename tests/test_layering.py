"""The import rules of docs/design.md §2, for every pair of packages, read from the source (AST).

Every ``import``/``from ... import`` of every ``.py`` file of the six packages is checked, at
module level and inside functions, ``try`` blocks and ``if TYPE_CHECKING`` alike, and so is
``importlib.import_module("...")`` / ``__import__("...")`` with a literal name. A package may import
the standard library, itself, the first-party packages its row names, and the third-party
packages its row allows:

| package          | first party                      | third party                          |
|------------------|----------------------------------|--------------------------------------|
| protocol         | -                                | msgpack, numpy, zmq, xxhash, zstandard (never torch) |
| ops              | -                                | torch                                |
| buffer           | protocol                         | numpy                                |
| rollout_server   | protocol, ops                    | any (engines, rewards, metrics)      |
| learner          | protocol, buffer, ops            | any                                  |
| deploy           | all                              | any                                  |

Nothing imports ``deploy`` (only tests do). ``tests/test_imports.py`` checks the runtime side
(importing ``protocol``/``buffer`` never loads torch) in a fresh interpreter.

Inside ``learner`` the wings (docs/design.md §8) have rules of their own; a wing may always import
itself and the two shared modules ``learner.config`` and ``learner.metrics``:

| wing            | may not import                         |
|-----------------|----------------------------------------|
| learner.serve   | - (it ties the others together)        |
| learner.loop    | learner.serve, learner.app (the train loop: learner/loop.py) |
| learner.app     | - (the composition root: learner/app.py; only learner.serve.service imports it) |
| learner.train   | learner.serve, learner.app, learner.loop |
| learner.state   | learner.serve, learner.app, learner.loop, learner.train |
| learner.data    | learner.serve, learner.app, learner.loop, learner.train, learner.state |
| learner.models  | learner.serve, learner.app, learner.loop, learner.train, learner.state |
| config (package), metrics | any wing                     |
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("protocol", "ops", "buffer", "rollout_server", "learner", "deploy", "tests")
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}
ANY = None   # any third-party package


@dataclass(frozen=True)
class Rule:
    first_party: frozenset[str]
    """First-party packages it may import (itself included)."""
    third_party: frozenset[str] | None
    """Third-party top-level packages it may import (None: any)."""


RULES = {
    "protocol": Rule(frozenset({"protocol"}), frozenset({"msgpack", "numpy", "zmq", "xxhash", "zstandard"})),
    "ops": Rule(frozenset({"ops"}), frozenset({"torch"})),
    "buffer": Rule(frozenset({"buffer", "protocol"}), frozenset({"numpy"})),
    "rollout_server": Rule(frozenset({"rollout_server", "protocol", "ops"}), ANY),
    "learner": Rule(frozenset({"learner", "protocol", "buffer", "ops"}), ANY),
    "deploy": Rule(frozenset(FIRST_PARTY) - {"tests"}, ANY),
}


def imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in ``tree`` (relative ones resolve into
    ``package``; dynamic imports count when their name is a string literal)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:                       # from . import x / from ..a import b
                base = ".".join(package.split(".")[:len(package.split(".")) - (node.level - 1)])
                found.append((node.lineno, base + ("." + node.module if node.module else "")))
            elif node.module:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return sorted(found)


def violations(package: str, path: Path, rule: Rule) -> list[str]:
    """What ``path`` (a file of ``package``) imports against ``rule``, one line per import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for line, module in imported_modules(tree, package):
        top = module.split(".")[0]
        if top in STDLIB:
            continue
        if top in FIRST_PARTY:
            allowed = top in rule.first_party
        else:
            allowed = rule.third_party is ANY or top in rule.third_party
        if not allowed:
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            out.append(f"{shown}:{line}: {package} imports {module}")
    return out


WINGS = ("serve", "train", "state", "data", "models")
WING_BANS = {
    "serve": frozenset(),
    "app": frozenset(),                  # learner/app.py: the composition root, builds every wing's parts
    "loop": frozenset({"serve", "app"}),  # learner/loop.py: the train loop, called by the service
    "train": frozenset({"serve", "app", "loop"}),
    "state": frozenset({"serve", "app", "loop", "train"}),
    "data": frozenset({"serve", "app", "loop", "train", "state"}),
    "models": frozenset({"serve", "app", "loop", "train", "state"}),
    "config": frozenset({*WINGS, "app", "loop"}),   # learner/config/: the settings every wing reads
    "shared": frozenset({*WINGS, "app", "loop"}),   # learner/metrics.py, learner/__init__.py
}


def wing_of(path: Path) -> str:
    """The wing of a file under learner/ ("shared" for the package's top-level modules)."""
    parts = path.relative_to(ROOT / "learner").parts
    if parts in (("loop.py",), ("app.py",)):
        return parts[0][:-3]
    return parts[0] if len(parts) > 1 else "shared"


def wing_violations(path: Path, wing: str) -> list[str]:
    """What ``path`` (a file of learner wing ``wing``) imports from a wing it may not."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.parent.relative_to(ROOT).parts)      # the file's own package
    out = []
    for line, module in imported_modules(tree, package):
        parts = module.split(".")
        if parts[0] == "learner" and len(parts) > 1 and parts[1] in WING_BANS[wing]:
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            out.append(f"{shown}:{line}: learner.{wing} imports {module}")
    return out


def package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", list(RULES))
def test_package_keeps_the_import_rules(package):
    files = package_files(package)
    assert files, f"no .py files under {package}/"       # the walk really reads something
    found = [v for f in files for v in violations(package, f, RULES[package])]
    assert not found, "docs/design.md §2 import rules broken:\n" + "\n".join(found)


def test_every_package_has_a_rule():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(RULES), "a new top-level package needs a row in RULES (and docs/design.md §2)"


BAD = '''
import json
from . import sibling
from protocol import encode          # not allowed in ops
import numpy as np                   # not allowed in ops

def later():
    import torch.nn                  # allowed in ops
    from rollout_server.engine import x
    try:
        import vllm
    except ImportError:
        pass
    importlib.import_module("deploy.cli")
    importlib.import_module(name)    # not a literal: not checked
'''


def test_the_check_catches_bad_imports_anywhere_in_a_file(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text(BAD)
    assert violations("ops", f, RULES["ops"]) == [
        "bad.py:4: ops imports protocol", "bad.py:5: ops imports numpy",
        "bad.py:9: ops imports rollout_server.engine", "bad.py:11: ops imports vllm",
        "bad.py:14: ops imports deploy.cli"]
    # The same file read as learner code: only the rollout_server and deploy imports are wrong.
    assert violations("learner", f, RULES["learner"]) == [
        "bad.py:9: learner imports rollout_server.engine", "bad.py:14: learner imports deploy.cli"]


def test_protocol_may_not_import_torch_even_inside_a_function(tmp_path):
    f = tmp_path / "codec.py"
    f.write_text("import msgpack\n\ndef fast():\n    import torch\n    return torch\n")
    assert violations("protocol", f, RULES["protocol"]) == ["codec.py:4: protocol imports torch"]


def test_every_learner_file_is_in_a_wing_or_shared():
    top = sorted(p.name for p in (ROOT / "learner").glob("*.py"))
    assert top == ["__init__.py", "app.py", "loop.py", "metrics.py"], top
    wings = sorted(p.name for p in (ROOT / "learner").iterdir() if (p / "__init__.py").exists())
    assert wings == sorted([*WINGS, "config"]), "a new learner wing needs a row in WING_BANS (and docs/design.md §8)"


@pytest.mark.parametrize("wing", [*WINGS, "app", "loop", "config", "shared"])
def test_learner_wings_keep_their_import_rules(wing):
    files = [f for f in package_files("learner") if wing_of(f) == wing]
    assert files, f"no .py files in learner wing {wing}"
    found = [v for f in files for v in wing_violations(f, wing)]
    assert not found, "learner wing rules (docs/design.md §8) broken:\n" + "\n".join(found)


def test_the_wing_check_catches_a_planted_violation(tmp_path):
    train = ROOT / "learner" / "train"
    planted = train / "_planted_violation.py"
    planted.write_text("from learner.serve.service import LearnerService\n"
                       "from learner.state import checkpoint  # allowed\n"
                       "def later():\n    import learner.serve.router\n"
                       "    from ..serve import admission\n")
    try:
        assert wing_of(planted) == "train"
        assert wing_violations(planted, "train") == [
            "learner/train/_planted_violation.py:1: learner.train imports learner.serve.service",
            "learner/train/_planted_violation.py:4: learner.train imports learner.serve.router",
            "learner/train/_planted_violation.py:5: learner.train imports learner.serve"]
    finally:
        planted.unlink()


# ---- no import cycles (issue 37 item 5) ----------------------------------------------------------

PACKAGES = tuple(RULES)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the first-party modules it imports, read from the source: every import, at module
    level, in functions and under ``TYPE_CHECKING`` alike (a lazy or type-only import is still an
    edge a reader follows). ``from pkg import name`` is an edge to ``pkg.name`` where that is a
    module, else to ``pkg``."""
    files = {module_name(p, root): p for package in packages for p in sorted((root / package).rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    edges.add(full if full in files else known(base))
        graph[name] = {e for e in edges if e is not None and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_modules_import_each_other_directly_or_in_a_loop():
    graph = module_graph()
    assert len(graph) > 100 and "learner.train.trainer" in graph["learner.train.distributed"]
    found = cycles(graph)
    assert not found, "import cycles (each line: modules that reach each other by imports):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_finds_planted_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.c import X\n")
    (pkg / "sub" / "c.py").write_text("def f():\n    from ..a import g\n")
    (pkg / "d.py").write_text("import pkg.a\nfrom pkg.sub import c\n")     # into the loop, not part of it
    (pkg / "e.py").write_text("from pkg import f\n")
    (pkg / "f.py").write_text("from . import e\n")
    graph = module_graph(tmp_path, ("pkg",))
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.e", "pkg.f"]]


# -- Private attributes ----------------------------------------------------------------------------
# A component's underscore attributes are its own (issue 37: evaluation once charged Admission's
# credits and called its _send). Reaching into a library's internals is allowed where it has no
# public twin: these roots only.
LIBRARY_ROOTS = frozenset({"torch", "sys", "os"})


def private_reaches(path: Path, source: str | None = None) -> list[str]:
    """``x._name`` where ``x`` is not ``self``/``cls`` (nor a library root), anywhere in a file."""
    tree = ast.parse(path.read_text() if source is None else source)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if isinstance(root, ast.Name) and root.id in LIBRARY_ROOTS:
            continue
        out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_component_reaches_into_another_ones_private_attributes():
    files = [f for package in PACKAGES for f in package_files(package)]
    assert len(files) > 100
    found = [v for f in files for v in private_reaches(f)]
    assert not found, "private attributes of another object:\n" + "\n".join(found)


def test_the_private_attribute_check_catches_a_planted_one(tmp_path):
    planted = ("def dispatch(admission, srv):\n    srv.credits -= 1\n    self._ok = admission._send\n"
               "    torch._foreach_norm\n    return self.owner._state\n")
    path = tmp_path / "planted.py"
    path.write_text(planted)
    assert private_reaches(path) == ["planted.py:3: admission._send", "planted.py:5: self.owner._state"]


# -- File names ------------------------------------------------------------------------------------
# Files are cut along concepts (issue 37 item 5): two source files share a name only when they do
# the same job for the two sides (the learner's and the rollout server's).
TWO_SIDES = {
    "metrics.py": {"learner/metrics.py", "rollout_server/metrics.py"},
    "service.py": {"learner/serve/service.py", "rollout_server/service.py"},
    "weights.py": {"learner/train/weights.py", "rollout_server/weights.py"},   # publish layout in / out
}


def test_no_two_source_files_share_a_name_unless_they_are_two_sides_of_one_job():
    by_name: dict[str, set[str]] = {}
    for package in PACKAGES:
        for f in package_files(package):
            if f.name != "__init__.py":
                by_name.setdefault(f.name, set()).add(f.relative_to(ROOT).as_posix())
    assert len(by_name) > 100
    shared = {name: sorted(paths) for name, paths in by_name.items()
              if len(paths) > 1 and TWO_SIDES.get(name) != paths}
    assert not shared, f"source files that share a name: {shared}"
