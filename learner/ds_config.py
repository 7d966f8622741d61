"""The ``learner.deepspeed`` section: the policy (and critic) as DeepSpeed engines (issue 11).

Present, the learner trains data-parallel over the ranks of a ``torch.distributed`` group
(``slipstream learner --nproc N``, ``torchrun`` or the ``deepspeed`` launcher) with ZeRO sharding
of the optimizer state (stage 1), gradients (2) and parameters (3); absent (null), the plain
PyTorch path runs. :func:`engine_config` turns the section into the dict ``deepspeed.initialize``
takes; only that function knows DeepSpeed's key names.

What stays slipstream's. Micro-batches are the trainer's plan (``micro_batch_samples`` /
``mini_batch_samples``): DeepSpeed is told one sample per micro-batch and one accumulation step,
with ``managed_gradient_accumulation: false`` so every ``engine.step()`` is the accumulation
boundary the trainer decides. The optimizer is the trainer's torch AdamW (no fused Adam to
compile), its learning rate set by the trainer each step. Gradient clipping is DeepSpeed's
(``gradient_clipping`` = ``max_grad_norm`` / ``critic_max_grad_norm``), on the reduced gradients,
as the plain path clips once per optimizer step; a non-finite norm makes DeepSpeed skip the update
(``bf16.check_grad_overflow`` on, so bfloat16 does too), which the trainer reports as a skipped step.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ZERO_STAGES = (1, 2, 3)
PRECISIONS = ("fp32", "bf16", "fp16")


class DeepSpeedSettings(BaseModel):
    """ZeRO stage, precision and offload of the DeepSpeed engines (``learner.deepspeed``)."""

    model_config = ConfigDict(extra="forbid")

    zero_stage: Literal[ZERO_STAGES] = 2
    """ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also the parameters (gathered
    layer by layer in each pass, and bucket by bucket on rank 0 for a publish)."""
    precision: Literal[PRECISIONS] = "fp32"
    """Engine precision: fp32, bf16 (bfloat16 weights with float32 master weights in the optimizer
    partitions) or fp16 (dynamic loss scaling; an overflowing step is skipped; not on DeepSpeed's
    CPU accelerator, a StartupError there). learner.dtype must be float32 or auto (the engine casts)."""
    offload_optimizer: Literal["none", "cpu"] = "none"
    """Keep optimizer states (and the float32 master weights) in CPU memory (ZeRO-Offload); the
    trainer's torch AdamW updates them there (no DeepSpeedCPUAdam op to compile; slower)."""
    offload_param: Literal["none", "cpu"] = "none"
    """ZeRO-3 only: keep the parameter partitions in CPU memory between uses."""
    reduce_bucket_bytes: int = Field(50_000_000, ge=1024)
    """Elements per gradient reduce bucket (DeepSpeed's reduce_bucket_size)."""
    allgather_bucket_bytes: int = Field(50_000_000, ge=1024)
    """Elements per parameter all-gather bucket after a ZeRO-1/2 step (allgather_bucket_size)."""
    publish_bucket_bytes: int = Field(256 << 20, ge=1024)
    """ZeRO-3 publishing: bytes of parameters gathered at a time (each bucket is copied to the CPU
    on rank 0 and released before the next one is gathered)."""
    timeout_s: float = Field(600.0, gt=0)
    """Process-group timeout: a collective (or a worker rank waiting for its next command) that
    waits longer fails, and its rank exits non-zero, so no rank hangs forever."""
    heartbeat_s: float = Field(10.0, gt=0)
    """Rank 0 sends idle worker ranks a no-op this often while it waits for rollouts (well under
    timeout_s, so an idle wait is never taken for a dead rank 0)."""

    @model_validator(mode="after")
    def _check(self) -> DeepSpeedSettings:
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ValueError("deepspeed.offload_param needs zero_stage: 3 (stages 1 and 2 keep the "
                             "parameters whole on every rank)")
        if self.heartbeat_s * 3 > self.timeout_s:
            raise ValueError(f"deepspeed.heartbeat_s={self.heartbeat_s} must be at most a third of "
                             f"timeout_s={self.timeout_s}")
        return self


def engine_config(ds: DeepSpeedSettings, max_grad_norm: float, world_size: int) -> dict:
    """The ``config`` of ``deepspeed.initialize`` for one engine (policy or critic)."""
    zero: dict = {"stage": ds.zero_stage, "reduce_bucket_size": ds.reduce_bucket_bytes,
                  "allgather_bucket_size": ds.allgather_bucket_bytes, "overlap_comm": False,
                  "contiguous_gradients": True}
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": ds.offload_optimizer}
    if ds.offload_param != "none":
        zero["offload_param"] = {"device": ds.offload_param}
    if ds.zero_stage == 3:
        # No parameter is kept whole on every rank, however small: all are partitioned.
        zero.update({"stage3_param_persistence_threshold": 0,
                     "stage3_gather_16bit_weights_on_model_save": False})
    cfg = {
        # slipstream's own micro-batching: one sample per "micro-batch" as far as DeepSpeed's
        # bookkeeping goes, one accumulation step, and the trainer owns the boundary.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # ZeRO-Offload with the trainer's torch AdamW (the masters' update runs on the CPU in
        # torch): DeepSpeed refuses a client optimizer under offload unless told, and its own
        # DeepSpeedCPUAdam is a C++ op to compile.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if ds.precision == "bf16":
        cfg["bf16"] = {"enabled": True, "check_grad_overflow": True}
    elif ds.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return cfg
