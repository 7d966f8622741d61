"""Does a device compute bfloat16 natively: the one rule behind every ``auto`` precision setting
(``learner.runtime.autocast``, ``learner.runtime.dtype``, ``rollout.runtime.dtype``; issue 40).

bfloat16 pays only where the hardware multiplies it: a CUDA device with bfloat16 units (Ampere and
later), a CPU with AVX512-BF16 or AMX. Elsewhere torch emulates it through float32 conversions, and
a bfloat16 matmul costs more than the float32 one it replaces: on a 2-core AMD EPYC without either
flag the demo's learner step took 0.785 s under bfloat16 autocast against 0.066 s in float32.

Torch is asked, not ``/proc/cpuinfo``: ``torch.cpu._is_avx512_bf16_supported`` and
``torch.cpu._is_amx_tile_supported`` read the CPU through the same cpuinfo library its kernels
dispatch on, and ``torch.cuda.is_bf16_supported(including_emulation=False)`` the device's compute
capability. Each answer comes with the reason a start-up line shows.

``SLIPSTREAM_NATIVE_BF16=1`` (or ``0``) overrides the answer for every device: for a machine whose
probe is wrong, and for the tests, which set ``0`` so that ``auto`` means float32 on any CPU they
run on (they compare against float32 recomputes) and ``1`` to see a capable machine's choices.
"""

from __future__ import annotations

import os

import torch

__all__ = ["OVERRIDE_ENV", "cpu_facts", "native_bfloat16"]

OVERRIDE_ENV = "SLIPSTREAM_NATIVE_BF16"


def _ask(name: str) -> bool:
    """``torch.cpu.<name>()``, False where this torch has no such probe."""
    probe = getattr(torch.cpu, name, None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def cpu_facts() -> dict[str, object]:
    """What the CPU offers torch's kernels: its capability level and the bfloat16 features."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": _ask("_is_avx512_bf16_supported"), "amx": _ask("_is_amx_tile_supported")}


def native_bfloat16(device: torch.device | str) -> tuple[bool, str]:
    """(whether ``device`` computes bfloat16 natively, the reason in a few words)."""
    device = torch.device(device)
    forced = os.environ.get(OVERRIDE_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1", f"{OVERRIDE_ENV}={forced}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} computes bfloat16 natively"
        return False, f"{name} has no native bfloat16"
    if device.type == "cpu":
        facts = cpu_facts()
        found = [label for key, label in (("avx512_bf16", "AVX512-BF16"), ("amx", "AMX")) if facts[key]]
        if found:
            return True, f"this CPU computes bfloat16 natively ({' and '.join(found)})"
        return False, "this CPU has no native bfloat16 (no AVX512-BF16 or AMX)"
    return False, f"bfloat16 is not known to be native on {device.type}"
