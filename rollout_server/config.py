"""Rollout server configuration: one pydantic model, every field documented."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RolloutConfig(BaseModel):
    """Everything a rollout server needs besides the model path."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    learner: str = "tcp://127.0.0.1:5555"
    """The learner's rollout endpoint (its ROUTER); the weights endpoint comes in Welcome."""
    server_id: str | None = None
    """Stable name of this server (default: hostname-pid)."""
    engine: Literal["hf"] = "hf"
    """Generation engine."""
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
