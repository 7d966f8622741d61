"""Learner configuration: one pydantic model, every field documented where it is defined."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from buffer import STALE_POLICIES
from ops import ADVANTAGE_METHODS, IS_MODES, LOSS_AGG_MODES
from protocol.messages import MAX_NEW_TOKENS_LIMIT


class LearnerConfig(BaseModel):
    """Everything the learner process needs besides the model path."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    bind_host: str = "127.0.0.1"
    """Interface the learner's ZeroMQ sockets bind to. 127.0.0.1 keeps them off the network."""
    rollout_port: int = Field(5555, ge=0, le=65535)
    """ROUTER port for Hello / WorkRequest / RolloutResult traffic (0 = any free port)."""
    weights_port: int = Field(5556, ge=0, le=65535)
    """ROUTER port serving weight chunks (0 = any free port)."""
    control_port: int = Field(5557, ge=0, le=65535)
    """ROUTER port for `slipstream ctl` (0 = any free port)."""
    metrics_host: str = "127.0.0.1"
    """Interface of the Prometheus /metrics endpoint."""
    metrics_port: int = Field(9400, ge=0, le=65535)
    """Port of the HTTP endpoint serving Prometheus /metrics and /healthz (0 = any free port)."""
    max_message_bytes: int = Field(64 << 20, ge=1024)
    """Largest frame the rollout socket accepts (ZMQ_MAXMSGSIZE); a peer sending a larger one is
    disconnected before the frame is buffered. Keep it above the largest RolloutResult body."""
    control_max_message_bytes: int = Field(64 << 10, ge=1024)
    """Largest frame the control socket accepts (a ControlRequest is a few hundred bytes)."""
    weights_max_message_bytes: int = Field(64 << 10, ge=1024)
    """Largest frame the weights socket accepts (a WeightChunkRequest is under 100 bytes)."""
    send_hwm: int = Field(1000, ge=1)
    """Messages queued per peer of the rollout and control sockets (ZMQ_SNDHWM and RCVHWM); a
    rollout server with this many unread is too slow and is dropped (credits keep an honest one
    far below it)."""
    weights_send_hwm: int = Field(16, ge=1)
    """Weight chunks queued per fetching peer (ZMQ_SNDHWM on the weights socket). An honest server
    keeps only its chunk window in flight; a chunk for a peer over this limit is not sent."""
    server_timeout_s: float = Field(30.0, gt=0)
    """Seconds without any message from a rollout server before it counts as lost and its leases
    are re-issued (servers send a heartbeat every few seconds)."""
    expiry_interval_s: float = Field(1.0, gt=0)
    """Seconds between checks for expired leases and lost servers."""
    reannounce_s: float = Field(10.0, gt=0)
    """A server still behind the newest weights this many seconds after they were announced to it
    gets the manifest again with the reply to its next heartbeat."""
    final_sync_s: float = Field(30.0, ge=0)
    """After the last step, seconds to wait for connected servers to apply the final weights."""

    total_steps: int = Field(200, ge=1)
    """Policy steps to train; the learner (and `slipstream run`) stops after the last one."""
    batch_prompts: int = Field(8, ge=1)
    """Prompts per policy step; the batch holds batch_prompts * group_size samples."""
    group_size: int = Field(8, ge=1)
    """Completions per prompt (GRPO/RLOO groups)."""
    micro_batch_samples: int = Field(32, ge=1)
    """Samples per forward/backward pass (gradient accumulation over the batch)."""
    lr: float = Field(3e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping by global norm."""

    advantage: Literal[ADVANTAGE_METHODS] = "grpo"
    """Group advantage estimator."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """PPO ratio clip below 1 (epsilon_low)."""
    clip_high: float = Field(0.2, ge=0)
    """PPO ratio clip above 1 (epsilon_high)."""
    loss_agg: Literal[LOSS_AGG_MODES] = "token_mean"
    """How token losses are aggregated."""
    recompute_logprobs: bool = True
    """Recompute proximal log-probs with the learner's weights at step start (DESIGN §4)."""
    is_mode: Literal[IS_MODES] = "tis"
    """Behavior importance-weight correction mode."""
    is_cap: float = Field(2.0, gt=1)
    """Cap C of the importance weights (tis: min(w, C); mis: keep 1/C <= w <= C)."""

    max_staleness: int = Field(1, ge=0)
    """eta: how many policy steps behind the learner a sample may be (0 = strict on-policy)."""
    stale_policy: Literal[STALE_POLICIES] = "drop"
    """What happens to buffered samples that exceed max_staleness after it shrinks."""
    lease_timeout_s: float = Field(120.0, gt=0)
    """Seconds a rollout server has to return an assignment before it is re-issued."""

    dataset: str = "builtin:arith"
    """Prompt source: builtin:arith or a JSONL file with {"prompt", "answer"} per line."""
    temperature: float = Field(1.0, ge=1e-6, le=1e6)
    """Sampling temperature sent with every assignment."""
    top_p: float = Field(1.0, ge=1e-9, le=1)
    """Nucleus sampling threshold sent with every assignment."""
    max_new_tokens: int = Field(4, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    """Completion length limit sent with every assignment; a longer completion is refused."""

    weights_chunk_bytes: int = Field(64 << 20, ge=1024)
    """Size of one weight chunk on the wire (bucket size)."""
    run_dir: str = "runs/default"
    """Directory for metrics.jsonl and the learner's endpoint file."""
    seed: int = 0
    """Seed for the prompt order and torch."""
    exit_on_finish: bool = True
    """Exit after the last step; false keeps /metrics and control up until SIGTERM or `ctl stop`."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads (0 = torch's default)."""

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        if self.advantage in ADVANTAGE_METHODS and self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for advantage={self.advantage} "
                             "(a group of one has no baseline)")
        return self

    @property
    def batch_samples(self) -> int:
        return self.batch_prompts * self.group_size
