"""The docs name only what exists (issue 37 item 8): every repository path and every
``package.module.Name`` written in README.md and docs/*.md, and every config key
(``learner.optimizer.lr``, ``rollout.network.learner_timeout_s``, ``launcher.num_rollout_servers``).

Names are found in the text (code spans or not). A path with a glob (``*``), a placeholder (``<x>``,
``NAME``) or a ``...`` is a pattern, not a name, and is skipped. A dotted name that starts with
``learner.`` is a config key when the config has it (or a section of it, or an old key that
moved: the docs say where it went), else a module path. A module path is resolved by importing
the module and looking the rest up on it; an attribute a class sets in its methods
(``self.x = ...``) counts as the class's.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("learner", "rollout_server", "protocol", "buffer", "ops", "deploy")
PATH_ROOTS = (*PACKAGES, "tests", "docs", ".ci")
SECTIONS = ("learner", "rollout", "launcher")

_ROOTS = "|".join(re.escape(p) for p in PATH_ROOTS)
_FIRSTS = "|".join(sorted({*PACKAGES, *SECTIONS}, key=len, reverse=True))
PATH = re.compile(r"(?<![\w./-])((?:" + _ROOTS + r")/[\w./*<>-]*[\w/*>])")
DOTTED = re.compile(r"(?<![\w./-])((?:" + _FIRSTS + r")(?:\.\w+)+)(?::(\w+))?(?![\w/-])")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".toml", ".txt", ".sh", ".jsonl", ".png",
                 ".key", ".key_secret")


def mentions(pattern: re.Pattern) -> list[tuple[str, re.Match]]:
    """(``file:line``, match) for every match of ``pattern`` in the docs."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in pattern.finditer(text):
            found.append((f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m))
    return found


def is_pattern(path: str) -> bool:
    return any(c in path for c in "*<>") or "..." in path or any(
        part.isupper() or part.split(".")[0].isupper() for part in path.split("/") if part)


def test_every_path_named_in_the_docs_exists():
    missing = []
    for where, m in mentions(PATH):
        path = m.group(1).rstrip(".")
        if not is_pattern(path) and not (ROOT / path).exists():
            missing.append(f"{where}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def config_keys() -> set[str]:
    """Every config key by dotted path, and every section on the way to one."""
    from deploy.config_file import SlipstreamConfig
    from learner.config.keys import field_paths

    keys = set()
    for path in field_paths(SlipstreamConfig):
        parts = path.split(".")
        keys.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    return keys


def moved_keys() -> set[str]:
    from learner.config.keys import MOVED_KEYS
    from rollout_server.config import MOVED_KEYS as ROLLOUT_MOVED_KEYS

    return {f"learner.{old}" for old in MOVED_KEYS} | {f"rollout.{old}" for old in ROLLOUT_MOVED_KEYS}


def self_attributes(cls: type) -> set[str]:
    """Names a class assigns on ``self`` in its own methods (its instances' attributes)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return set()
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "self"}


def resolves(name: str) -> bool:
    """True when ``name`` (``pkg.module``, ``pkg.module.Name`` or ``pkg.module.Class.attr``) exists."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        break
    else:
        return False
    for part in parts[i:]:
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif inspect.isclass(obj) and (part in self_attributes(obj)
                                       or part in getattr(obj, "__dataclass_fields__", {})
                                       or part in getattr(obj, "model_fields", {})):
            return True       # an instance attribute: nothing further to look up
        else:
            return False
    return True


def dotted_names() -> list[tuple[str, str]]:
    names = []
    for where, m in mentions(DOTTED):
        name = m.group(1)
        if name.endswith(FILE_SUFFIXES) or m.string[m.end():m.end() + 1] == "/":
            continue
        names.append((where, name + (f".{m.group(2)}" if m.group(2) else "")))
    return names


def test_the_docs_name_dotted_names():
    """The scan itself: it finds module paths and config keys (a regex that matched nothing
    would pass the tests below)."""
    names = {name for _, name in dotted_names()}
    assert "learner.optimizer.lr" in names
    assert any(n.startswith("ops.") for n in names)
    assert any(n.startswith("protocol.") for n in names)


@pytest.mark.parametrize("package", ["config keys", *PACKAGES])
def test_every_dotted_name_in_the_docs_exists(package):
    keys, moved = config_keys(), moved_keys()
    missing = []
    for where, name in dotted_names():
        first = name.split(".")[0]
        if package == "config keys":
            if first in SECTIONS and first not in PACKAGES and name not in keys and name not in moved:
                missing.append(f"{where}: {name}")
        elif first == package and name not in keys and name not in moved and not resolves(name):
            missing.append(f"{where}: {name}")
    assert not missing, f"names in the docs that do not exist ({package}):\n" + "\n".join(missing)


def test_the_checks_can_fail():
    assert not resolves("ops.no_such_function")
    assert not resolves("learner.no_such_module.Thing")
    assert resolves("ops.behavior_anchored_weights")
    assert resolves("protocol.plumbing.unfinished.UnfinishedGuard.max_bytes")
    assert not resolves("protocol.plumbing.unfinished.UnfinishedGuard.no_such_attribute")
    assert "learner.optimizer.lr" in config_keys() and "learner.optimizer" in config_keys()
    assert "learner.no_such_key" not in config_keys()
    assert is_pattern("deploy/configs/NAME.yaml") and not is_pattern("deploy/configs/demo.yaml")
