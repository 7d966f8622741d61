"""Rollout server configuration: one pydantic model, every field documented."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class VLLMOptions(BaseModel):
    """Options of the vLLM engine (``rollout.engine: vllm``)."""

    model_config = ConfigDict(extra="forbid")

    enforce_eager: bool = True
    """Skip CUDA graphs / torch.compile (engine starts in ~25 s instead of minutes on CPU)."""
    max_model_len: int = Field(2048, ge=16)
    """Longest prompt + completion the engine accepts."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (GPU builds)."""
    kv_cache_gib: float = Field(2.0, gt=0)
    """KV-cache size on the CPU build (VLLM_CPU_KVCACHE_SPACE)."""
    enable_lora: bool = False
    """Serve LoRA adapters (needed for weights kind "lora")."""
    max_lora_rank: int = Field(16, ge=1)
    """Largest LoRA rank the engine accepts."""
    max_loras: int = Field(2, ge=1)
    """Adapter versions kept loaded, so requests that started on version k can finish on k."""
    weight_transfer: Literal["zmq", "nccl"] = "zmq"
    """How full weights arrive: chunks over ZeroMQ (any machine) or NCCL (GPU clusters)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor parallelism (GPUs per server)."""


class RolloutConfig(BaseModel):
    """Everything a rollout server needs besides the model path."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    learner: str = "tcp://127.0.0.1:5555"
    """The learner's rollout endpoint (its ROUTER); the weights endpoint comes in Welcome."""
    server_id: str | None = None
    """Stable name of this server (default: hostname-pid)."""
    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: hf (transformers, CPU or GPU) or vllm."""
    inflight_update: Literal["continue", "finish", "resubmit"] = "finish"
    """Weights arriving while a request generates: continue (new tokens use the new weights),
    finish (the request finishes on its version), resubmit (abort, regenerate the rest)."""
    vllm: VLLMOptions = Field(default_factory=VLLMOptions)
    """vLLM engine options."""
    max_concurrency: int = Field(64, ge=1)
    """Samples this server generates at once (the credits it asks for)."""
    reward: str = "builtin:exact_numeric"
    """Reward function: builtin:exact_numeric or "module:function"."""
    metrics_host: str = "127.0.0.1"
    """Interface of the Prometheus /metrics endpoint."""
    metrics_port: int = Field(9401, ge=0, le=65535)
    """Port of the Prometheus /metrics endpoint (0 = any free port)."""
    ack_timeout_s: float = Field(30.0, gt=0)
    """Seconds to wait for an Ack before re-sending a result."""
    weights_wait_s: float = Field(10.0, ge=0)
    """Before starting new work, wait up to this long for announced newer weights to be applied."""
    seed: int = 0
    """Sampling seed (offset by the server's index in `slipstream run`)."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads (0 = torch's default)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Engine dtype (float32 on CPU)."""
