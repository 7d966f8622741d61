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

from learner.config import DeepSpeedSettings


def engine_config(ds: DeepSpeedSettings, max_grad_norm: float, world_size: int) -> dict:
    """The ``config`` of ``deepspeed.initialize`` for one engine (policy or critic)."""
    zero: dict = {"stage": ds.zero_stage, "reduce_bucket_size": ds.reduce_bucket_elements,
                  "allgather_bucket_size": ds.allgather_bucket_elements, "overlap_comm": False,
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
