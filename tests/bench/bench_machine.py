"""Where a benchmark ran (issue 40): every script of tests/bench/ puts :func:`machine` in its JSON
(key ``machine``) and prints :func:`machine_line` above its table, so a figure is never read
without the CPU, its bfloat16 features, torch's CPU capability, the threads and the precision that
``auto`` picks there. A ratio measured with bfloat16 emulated (no AVX512-BF16 or AMX) and one
measured with it native are different experiments; docs/benchmarks.md keeps the line beside each.

Importable without the rest of the suite (``sys.path`` holds tests/bench when a script runs).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
"""The CPU flags that decide which kernels torch runs and whether bfloat16 is native."""


def _cpuinfo() -> tuple[str, set[str]]:
    """(the CPU's model name, its flags) from /proc/cpuinfo; platform's answer elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model or platform.machine(), flags


def machine(threads: int | None = None) -> dict[str, object]:
    """The machine a benchmark ran on; ``threads``: the torch threads it used (default: torch's)."""
    import torch

    from ops.precision import OVERRIDE_ENV, native_bfloat16

    model, flags = _cpuinfo()
    native, reason = native_bfloat16("cpu")
    return {"cpu": model, "cores": os.cpu_count(), "flags": [f for f in FLAGS if f in flags],
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": threads if threads is not None else torch.get_num_threads(),
            "auto_precision": "bfloat16 autocast" if native else "float32",
            "auto_precision_why": reason, "override": os.environ.get(OVERRIDE_ENV)}


def machine_line(m: dict[str, object] | None = None) -> str:
    """:func:`machine` as the one line printed above a table."""
    m = m if m is not None else machine()
    flags = " ".join(m["flags"]) or "none of " + " ".join(FLAGS)
    return (f"machine: {m['cpu']}, {m['cores']} cores, flags {flags}, torch {m['torch']} "
            f"({m['cpu_capability']}), {m['threads']} threads; precision auto = "
            f"{m['auto_precision']} ({m['auto_precision_why']})")


if __name__ == "__main__":
    print(machine_line())
