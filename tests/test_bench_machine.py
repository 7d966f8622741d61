"""Every benchmark says where it ran (issue 40): each script of tests/bench/ that writes a results
file records ``bench_machine.machine()`` in it and prints ``machine_line`` above its table; and the
record names this machine's CPU, its flags and what precision ``auto`` picks here."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent / "bench"
sys.path.insert(0, str(BENCH))
import bench_machine  # noqa: E402


def _writes_results(tree: ast.AST) -> bool:
    """A script with an ``--out`` option writes a results file."""
    return any(isinstance(n, ast.Constant) and n.value == "--out" for n in ast.walk(tree))


def _calls(tree: ast.AST) -> set[str]:
    return {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


SCRIPTS = sorted(p for p in BENCH.glob("*.py")
                 if p.name != "bench_machine.py" and _writes_results(ast.parse(p.read_text())))


def test_there_are_benchmarks_to_check():
    assert len(SCRIPTS) >= 15, [p.name for p in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_benchmark_records_and_prints_where_it_ran(script):
    calls = _calls(ast.parse(script.read_text()))
    assert {"machine", "machine_line"} <= calls, f"{script.name} does not record/print bench_machine's machine"


def test_the_record_describes_this_machine(monkeypatch):
    import torch

    import ops

    monkeypatch.delenv("SLIPSTREAM_NATIVE_BF16", raising=False)
    m = bench_machine.machine(threads=3)
    assert m["threads"] == 3 and m["cores"] >= 1 and m["torch"] == torch.__version__
    assert m["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    native, why = ops.native_bfloat16("cpu")
    assert m["auto_precision"] == ("bfloat16 autocast" if native else "float32") and m["auto_precision_why"] == why
    assert ("avx512_bf16" in m["flags"] or "amx_tile" in m["flags"]) == native
    line = bench_machine.machine_line(m)
    assert line.startswith(f"machine: {m['cpu']}, {m['cores']} cores, flags ") and why in line
