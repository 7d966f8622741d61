"""Values that cross the wire travel as typed protocol fields, never as magic metadata keys.

Protocol 3.3 made the sample's sampling temperature ``Sample.sampling_temperature`` and a LoRA
publish's adapter ``WeightsAvailable.lora`` (a ``LoraSpec``); 3.2 carried them as
``metadata["sampling_temperature"]`` and ``metadata["lora"]``. No process reads or writes those
keys any more: the AST of every source file of the processes is searched for them (a
subscript, ``get``/``pop``/``setdefault`` or ``in`` on anything named ``*metadata``, a dict
literal given to one, a name given the string ``"sampling_temperature"``), and a planted use
shows the search bites. The behaviour (intake stamps the typed field, the receiver hands the
typed adapter to its engine) is tested in tests/learner and tests/rollout_server.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("learner", "rollout_server", "buffer", "deploy", "protocol")
MAGIC_KEYS = frozenset({"sampling_temperature", "lora"})


def _is_metadata(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name.endswith("metadata")


def _key(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and node.value in MAGIC_KEYS else None


def magic_key_uses(source: str, filename: str = "<source>") -> list[str]:
    """``line: key`` for every use of a magic metadata key in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        keys: list[ast.AST] = []
        if isinstance(node, ast.Subscript) and _is_metadata(node.value):
            keys = [node.slice]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "pop", "setdefault") and _is_metadata(node.func.value)):
            keys = node.args[:1]
        elif isinstance(node, ast.Compare) and any(_is_metadata(c) for c in node.comparators):
            keys = [node.left]
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            if any(_is_metadata(t) for t in node.targets):
                keys = [k for k in node.value.keys if k is not None]
        elif isinstance(node, ast.keyword) and isinstance(node.value, ast.Dict):
            if (node.arg or "").endswith("metadata"):
                keys = [k for k in node.value.keys if k is not None]
        if isinstance(node, ast.Assign) and _key(node.value) == "sampling_temperature":
            keys = [node.value]             # a name for the key (3.2's SAMPLING_TEMPERATURE)
        found += [f"{node.lineno}: {key}" for key in map(_key, keys) if key is not None]
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_process_reads_or_writes_a_magic_metadata_key(package):
    uses = [f"{path.relative_to(ROOT)}:{use}" for path in sorted((ROOT / package).rglob("*.py"))
            for use in magic_key_uses(path.read_text(), str(path))]
    assert uses == [], "use the typed fields Sample.sampling_temperature / WeightsAvailable.lora"


@pytest.mark.parametrize("planted", [
    'def f(s):\n    return s.metadata["sampling_temperature"]\n',
    'def f(m):\n    return m.metadata.get("lora", {})\n',
    'def f(s):\n    return "lora" in s.metadata\n',
    'def f(s, t):\n    s.metadata = {**s.metadata, "sampling_temperature": t}\n',
    'def f(m, c):\n    return make(metadata={"lora": c})\n',
    'KEY = "sampling_temperature"\n',
])
def test_the_search_finds_a_planted_use(planted):
    assert magic_key_uses(planted) != []


def test_the_typed_fields_and_other_keys_are_not_flagged():
    ok = ('def f(s, m, a):\n    s.sampling_temperature = a.sampling.temperature\n'
          '    x = m.lora.r if m.kind == "lora" else s.metadata["answer"]\n'
          '    return {"lora": x}\n')
    assert magic_key_uses(ok) == []
