"""Precision ``auto`` (issue 40): bfloat16 only where the device computes it natively.

torch's CPU probe is checked against the kernel's CPU flags, then both kinds of CPU answer are
given to the resolvers by replacing the probe (``torch.cpu._is_avx512_bf16_supported`` and
``_is_amx_tile_supported``), and to a whole Trainer and rollout engine, which must then compute in
what ``auto`` chose. tests/conftest.py sets ``SLIPSTREAM_NATIVE_BF16=0`` for the suite; these
tests remove it to ask the probe, or set it to see the override.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from config_kit import nested
from test_trainer import make_batch, make_trainer

import ops
from learner.config import LearnerConfig
from learner.train.devices import resolve_runtime
from ops.precision import OVERRIDE_ENV
from rollout_server.engines import resolve_device as rollout_resolve


@pytest.fixture
def cpu(monkeypatch):
    """``cpu(avx512_bf16, amx)``: torch's CPU probe answers so, with no override in the way."""
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)

    def answer(avx512_bf16: bool, amx: bool = False) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    return answer


def test_the_cpu_probe_agrees_with_the_kernel_flags(monkeypatch):
    """What torch says of this CPU is what /proc/cpuinfo's flags say (the probe is not a guess)."""
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    info = Path("/proc/cpuinfo")
    if not info.exists():
        pytest.skip("no /proc/cpuinfo on this OS")
    flags = set(next(line for line in info.read_text().splitlines() if line.startswith("flags")).split())
    facts = ops.cpu_facts()
    assert facts["avx512_bf16"] == ("avx512_bf16" in flags)
    assert facts["amx"] == ("amx_tile" in flags)
    native, reason = ops.native_bfloat16("cpu")
    assert native == ("avx512_bf16" in flags or "amx_tile" in flags)
    assert ("natively" in reason) == native and ("no native bfloat16" in reason) == (not native)


@pytest.mark.parametrize("avx512_bf16, amx, native, named", [
    (False, False, False, "no native bfloat16 (no AVX512-BF16 or AMX)"),
    (True, False, True, "natively (AVX512-BF16)"),
    (False, True, True, "natively (AMX)"),
    (True, True, True, "natively (AVX512-BF16 and AMX)"),
])
def test_native_bfloat16_on_each_kind_of_cpu(cpu, avx512_bf16, amx, native, named):
    cpu(avx512_bf16, amx)
    got, reason = ops.native_bfloat16("cpu")
    assert got is native and named in reason


def test_the_override_wins_over_the_probe(cpu, monkeypatch):
    cpu(True)
    monkeypatch.setenv(OVERRIDE_ENV, "0")
    assert ops.native_bfloat16("cpu") == (False, f"{OVERRIDE_ENV}=0")
    cpu(False)
    monkeypatch.setenv(OVERRIDE_ENV, "1")
    assert ops.native_bfloat16("cpu") == (True, f"{OVERRIDE_ENV}=1")


def test_cuda_is_asked_without_emulation(monkeypatch):
    """On CUDA the device's own answer decides, emulation not counted (a T4 runs bfloat16 only
    emulated); no GPU is needed to see which question is asked."""
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: asked.append(including_emulation) or False)
    assert ops.native_bfloat16("cuda") == (False, "Tesla T4 has no native bfloat16")
    assert asked == [False]


def _runtime(**runtime):
    return resolve_runtime(LearnerConfig(**nested({"runtime": runtime} if runtime else {})).runtime)


def test_auto_on_a_cpu_without_native_bfloat16_is_plain_float32(cpu):
    cpu(False)
    rt = _runtime()
    assert (rt.device.type, rt.dtype, rt.autocast) == ("cpu", torch.float32, None)
    assert rt.why["autocast"] == "auto: this CPU has no native bfloat16 (no AVX512-BF16 or AMX)"
    assert rt.why["device"] == "auto: no CUDA device"           # a CUDA-less machine
    assert rt.why["dtype"] == "auto: float32 on this device"


def test_auto_on_a_cpu_with_native_bfloat16_is_mixed_precision(cpu):
    cpu(False, amx=True)
    rt = _runtime()
    assert (rt.dtype, rt.autocast) == (torch.float32, torch.bfloat16)
    assert rt.why["autocast"] == "auto: this CPU computes bfloat16 natively (AMX)"
    assert rt.why["dtype"] == "auto: float32 weights under autocast"


def test_auto_leaves_low_precision_weights_alone(cpu):
    """dtype bfloat16 with autocast auto (the default) is accepted and means no autocast: the
    weights already compute in bfloat16 (autocast: bfloat16 with them is still refused)."""
    cpu(True)
    rt = _runtime(dtype="bfloat16")
    assert (rt.dtype, rt.autocast) == (torch.bfloat16, None)
    assert rt.why["autocast"] == "auto: the weights are bfloat16 already"


def test_explicit_settings_win_and_carry_no_reason(cpu):
    cpu(False)
    rt = _runtime(autocast="bfloat16", device="cpu")
    assert (rt.dtype, rt.autocast) == (torch.float32, torch.bfloat16)
    assert "autocast" not in rt.why and "device" not in rt.why
    cpu(True)
    rt = _runtime(autocast="none", dtype="float32", device="cpu")
    assert (rt.dtype, rt.autocast, rt.why) == (torch.float32, None, {})


def test_auto_is_accepted_beside_deepspeed():
    """autocast auto (the default) with a deepspeed section is valid: DeepSpeed owns the
    precision (its strategy sets autocast none); an explicit bfloat16 autocast is refused."""
    LearnerConfig(**nested({"deepspeed": {}}))
    with pytest.raises(ValueError, match="deepspeed.precision"):
        LearnerConfig(**nested({"deepspeed": {}, "autocast": "bfloat16"}))


def _linear_dtypes(trainer) -> set[torch.dtype]:
    seen: set[torch.dtype] = set()
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
             for m in trainer.model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        trainer.step(make_batch())
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("native", [False, True], ids=["no-native-bf16", "native-bf16"])
def test_the_trainer_computes_in_what_auto_chose_and_says_why(cpu, tiny_model_dir, native):
    cpu(native)
    trainer = make_trainer(tiny_model_dir)               # every runtime setting at its default
    assert _linear_dtypes(trainer) == ({torch.bfloat16} if native else {torch.float32})
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    info = trainer.runtime.describe(trainer.model, trainer.cfg.runtime.attn_implementation)
    assert info["autocast"] == ("bfloat16" if native else "none")
    assert info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["threads"] == torch.get_num_threads() and info["attention"] in ("sdpa", "eager")
    assert info["avx512_bf16"] is native and info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    reason = "natively (AVX512-BF16)" if native else "no native bfloat16"
    assert f"autocast {info['autocast']} (auto: this CPU" in info["line"] and reason in info["line"]
    assert "attention " in info["line"] and "(auto: the model's default)" in info["line"]


@pytest.mark.parametrize("native, dtype", [(False, "float32"), (True, "bfloat16")])
def test_the_rollout_engine_dtype_follows_the_same_rule(cpu, native, dtype):
    cpu(native)
    device, got, why = rollout_resolve("auto", "auto")
    assert (device, got) == ("cpu", dtype)
    assert why["device"] == "auto: no CUDA device"
    assert why["dtype"].startswith("auto: this CPU ")
    assert rollout_resolve("cpu", "float16") == ("cpu", "float16", {})     # explicit: as written
