"""``LearnerConfig``: the run-wide keys, one section per component, and the checks that span
sections; a key of the flat layout (before the sections) is refused with its new place."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from learner.config.sections import (
    METRICS_SINKS,
    AlgorithmSettings,
    BatchSettings,
    CheckpointSettings,
    CriticSettings,
    DataSettings,
    DeepSpeedSettings,
    EvaluationSettings,
    KlSettings,
    LearnerSecurity,
    LoraSettings,
    NetworkSettings,
    OptimizerSettings,
    RewardSettings,
    RolloutLogSettings,
    RuntimeSettings,
    SamplingSettings,
    ServersSettings,
    StalenessSettings,
    WatchdogSettings,
    WeightsSettings,
)
from ops import (
    GROUP_ADVANTAGE_METHODS,
)

# The flat layout's keys (before the sections) and where each went: ``old`` (same name in the
# section) or ``old:new``. A config or ctl that uses an old key is told its new place.
_FLAT_LAYOUT = {
    "network": ("bind_host rollout_port weights_port control_port metrics_host metrics_port "
              "max_message_bytes control_max_message_bytes weights_max_message_bytes send_hwm "
              "weights_send_hwm"),
    "servers": ("server_timeout_s expiry_interval_s reannounce_s final_sync_s lease_timeout_s "
              "max_abs_reward max_inflight_per_server weights_failure_limit"),
    "batch": ("batch_prompts group_size micro_batch_samples micro_batch_tokens ppo_epochs "
              "mini_batch_samples"),
    "optimizer": "lr lr_schedule lr_warmup_steps min_lr_ratio weight_decay max_grad_norm",
    "algorithm": ("advantage whiten_advantages gamma lam clip_low clip_high dual_clip entropy_coef loss_agg "
              "target_kl recompute_logprobs is_mode is_cap clip_anchor is_veto m2po_threshold "
              "sanity_ratio_tolerance sanity_kl_tolerance"),
    "kl": ("kl_coef:coef kl_in_reward:in_reward kl_kind:kind kl_controller:controller "
              "kl_target:target kl_horizon:horizon reference_on_cpu"),
    "reward": ("length_penalty reward_clip:clip reward_norm:norm batch_filter pf_ppo_method "
              "pf_ppo_weight_pow"),
    "critic": ("critic_model:model critic_lr:lr critic_lr_schedule:lr_schedule "
              "critic_lr_warmup_steps:lr_warmup_steps critic_max_grad_norm:max_grad_norm value_clip "
              "critic_warmup_steps:warmup_steps critic_targets:targets vtrace_rho_bar vtrace_c_bar"),
    "staleness": ("max_staleness stale_policy staleness_controller:controller min_staleness "
              "staleness_ess_min:ess_min staleness_mismatch_kl_max:mismatch_kl_max "
              "staleness_ess_recover:ess_recover staleness_mismatch_kl_recover:mismatch_kl_recover "
              "staleness_recover_steps:recover_steps"),
    "data": ("dataset dataset_split prompt_key answer_key chat_template system_prompt "
              "max_prompt_tokens shuffle epochs length_buckets"),
    "evaluation": ("eval_data:data eval_every:every eval_prompts:prompts eval_temperature:temperature "
              "eval_correct_threshold:correct_threshold"),
    "sampling": "temperature top_p max_new_tokens",
    "weights": "weights_chunk_bytes:chunk_bytes",
    "runtime": "device dtype autocast attn_implementation gradient_checkpointing disable_dropout",
    "checkpoint": "save_every keep_last checkpoint_dir:dir checkpoint_failure:failure",
}
MOVED_KEYS: dict[str, str] = {
    old: f"{section}.{new or old}"
    for section, keys in _FLAT_LAYOUT.items()
    for old, _, new in (item.partition(":") for item in keys.split())
}
"""``lr`` -> ``optimizer.lr``, ``kl_coef`` -> ``kl.coef``, ...: every key of the flat layout."""



class LearnerConfig(BaseModel):
    """Everything the learner process needs besides the model path: a few run-wide keys and one
    section per component (docs/configuration.md lists every key; ``slipstream config --keys``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    total_steps: int = Field(200, ge=1)
    """Policy steps to train; the learner (and `slipstream run`) stops after the last one."""
    run_dir: str = "runs/default"
    """Directory for metrics.jsonl and the learner's endpoint file."""
    seed: int = 0
    """Seed for the prompt order and torch."""
    exit_on_finish: bool = True
    """Exit after the last step; false keeps /metrics and control up until SIGTERM or `ctl stop`."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads (0 = torch's default)."""
    metrics_sinks: list[Literal[METRICS_SINKS]] = Field(default_factory=lambda: ["jsonl"])
    """Where step statistics go besides Prometheus: jsonl (RUN_DIR/metrics.jsonl, always written),
    tensorboard (RUN_DIR/tensorboard/<run id>/, needs the tensorboard extra) and wandb (Weights &
    Biases, the wandb extra; WANDB_MODE=offline keeps it on disk under RUN_DIR/wandb/)."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter (PEFT) instead of the full model; the reference is the base model
    (adapter disabled) and publishes carry the adapter only (null = full fine-tuning)."""
    deepspeed: DeepSpeedSettings | None = None
    """Train the policy (and critic) as DeepSpeed engines, data-parallel over the ranks of the
    launch (ZeRO stage, precision, offload: learner/train/ds_config.py); null = plain PyTorch."""
    security: LearnerSecurity = Field(default_factory=LearnerSecurity)
    """CURVE encryption and client allow-lists on the rollout, weights and control sockets (off by
    default; see learner/serve/security.py)."""
    rollout_log: RolloutLogSettings | None = None
    """Durable log of every accepted result, written before its Ack; after a crash and --resume the
    accepted-but-untrained samples come back from it (null = off; see learner/state/rollout_log.py)."""

    watchdog: WatchdogSettings = Field(default_factory=WatchdogSettings)
    """When no step comes, one line says what the learner waits on; a stack dump, an optional
    hard stop (protocol/plumbing/watchdog.py; docs/operations.md "When it hangs")."""
    network: NetworkSettings = Field(default_factory=NetworkSettings)
    """Where the learner listens and how much a peer may send (its sockets and /metrics)."""
    servers: ServersSettings = Field(default_factory=ServersSettings)
    """How the learner treats rollout servers: timeouts, leases, refusals, the weights circuit breaker."""
    batch: BatchSettings = Field(default_factory=BatchSettings)
    """What one policy step trains on and how it is cut into passes."""
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings)
    """The policy's AdamW and its learning-rate schedule."""
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    """Advantages, the PPO loss, importance correction of stale samples and the sanity check."""
    kl: KlSettings = Field(default_factory=KlSettings)
    """The KL term to the reference policy."""
    reward: RewardSettings = Field(default_factory=RewardSettings)
    """What the trainer does to rewards before the advantages."""
    critic: CriticSettings = Field(default_factory=CriticSettings)
    """The critic (advantage: gae): its model, optimizer and targets."""
    staleness: StalenessSettings = Field(default_factory=StalenessSettings)
    """How old a sample may be (eta) and the adaptive controller that may move it."""
    data: DataSettings = Field(default_factory=DataSettings)
    """The training prompts: where they come from and how they are formatted and ordered."""
    evaluation: EvaluationSettings = Field(default_factory=EvaluationSettings)
    """Held-out evaluation rounds."""
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    """What every training assignment asks the engines for."""
    weights: WeightsSettings = Field(default_factory=WeightsSettings)
    """How published weights travel."""
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)
    """Where and in what precision the policy (and critic, reference) compute."""
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    """When checkpoints are written, how many are kept, and what a failed one does."""

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """A key of the flat layout (before the sections) is refused with its new place."""
        if isinstance(data, dict):
            for key in data:
                if key in MOVED_KEYS:
                    raise ValueError(f"{key} moved to {MOVED_KEYS[key]}")
        return data

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        alg, batch, kl, critic, st, rt = (self.algorithm, self.batch, self.kl, self.critic,
                                          self.staleness, self.runtime)
        if alg.advantage in GROUP_ADVANTAGE_METHODS and batch.group_size < 2:
            raise ValueError(f"batch.group_size must be >= 2 for algorithm.advantage={alg.advantage} "
                             "(a group of one has no baseline)")
        # Sampling below neutral: refused rather than recomputed with the same truncation. The
        # engines report log-probs of the truncated, renormalized distribution; a recompute of the
        # full one would make every weight w = π/μ < 1, and truncating in the learner would put the
        # gradient through the nucleus boundary (and give −inf where the two nuclei differ). top_k
        # has no key: the learner always sends 0 (neutral).
        if self.sampling.top_p < 1.0:
            raise ValueError(f"sampling.top_p={self.sampling.top_p} is not supported: the learner "
                             "recomputes log-probs of the untruncated distribution; set top_p: 1.0")
        if alg.advantage != "gae":
            for key, value, neutral in (("critic.warmup_steps", critic.warmup_steps, 0),
                                        ("critic.targets", critic.targets, "gae")):
                if value != neutral:
                    raise ValueError(f"{key}={value!r} needs a critic: set algorithm.advantage: gae "
                                     f"(or {key}: {neutral!r})")
        if st.controller == "adaptive":
            if st.min_staleness > st.max_staleness:
                raise ValueError(f"staleness.min_staleness={st.min_staleness} is above "
                                 f"staleness.max_staleness={st.max_staleness}")
            if st.ess_recover < st.ess_min or st.mismatch_kl_recover > st.mismatch_kl_max:
                raise ValueError("the adaptive staleness controller's recover thresholds must be at "
                                 "least as strict as its shrink ones (staleness.ess_recover >= "
                                 "staleness.ess_min, staleness.mismatch_kl_recover <= "
                                 "staleness.mismatch_kl_max)")
        if kl.controller == "adaptive" and kl.coef == 0:
            raise ValueError("kl.controller=adaptive needs kl.coef > 0 (its start value; "
                             "the controller scales it)")
        if rt.autocast == "bfloat16" and rt.dtype not in ("auto", "float32"):
            raise ValueError(f"runtime.autocast={rt.autocast} computes in {rt.autocast} over float32 "
                             f"weights, but runtime.dtype={rt.dtype}: set dtype: float32 (or auto), "
                             "or autocast: none")
        if rt.autocast == "bfloat16" and self.deepspeed is not None:
            raise ValueError(f"runtime.autocast={rt.autocast} with deepspeed: DeepSpeed owns the "
                             "precision; set deepspeed.precision: bf16 and runtime.autocast: auto or none")
        if alg.clip_anchor == "behavior" and alg.target_kl is not None:
            raise ValueError("algorithm.target_kl stops a step by its distance from pi_prox, but with "
                             "clip_anchor: behavior the ratio is taken against the behavior policy; "
                             "set target_kl: null or clip_anchor: proximal")
        if alg.policy_loss != "ppo" and alg.dual_clip is not None:
            raise ValueError(f"algorithm.dual_clip bounds PPO's surrogate, which "
                             f"policy_loss: {alg.policy_loss} does not have; set dual_clip: null or "
                             "policy_loss: ppo")
        if alg.policy_loss == "gspo" and alg.clip_anchor == "behavior":
            raise ValueError("algorithm.clip_anchor: behavior reweighs each token by mu/pi_prox, "
                             "which a sequence ratio (policy_loss: gspo) cannot take; set "
                             "clip_anchor: proximal or policy_loss: ppo")
        if self.reward.overlong_buffer_tokens > self.sampling.max_new_tokens:
            raise ValueError(f"reward.overlong_buffer_tokens={self.reward.overlong_buffer_tokens} is more "
                             f"than sampling.max_new_tokens={self.sampling.max_new_tokens}: the "
                             "penalty starts that many tokens before the limit")
        if self.evaluation.every and self.evaluation.data is None:
            raise ValueError("evaluation.every > 0 needs evaluation.data (held-out prompts); set "
                             "evaluation.data, or evaluation.every: 0")
        if batch.mini_batch_samples > batch.batch_samples:
            raise ValueError(f"batch.mini_batch_samples={batch.mini_batch_samples} is larger than the "
                             f"batch ({batch.batch_samples} samples); set it <= batch_prompts * "
                             "group_size, or 0 for the whole batch")
        return self




TRAINER_KEYS = ("seed", "threads", "total_steps", "batch", "optimizer", "algorithm", "kl", "reward",
                "critic", "sampling", "runtime", "lora", "deepspeed")
"""The parts of the learner's config a trainer reads (the run-wide keys and sections by name)."""


class _TrainerConfig(BaseModel):
    """What the trainer is given: the sections of a (validated) :class:`LearnerConfig` that a
    policy step reads, under the same paths (``optimizer.lr``, ``algorithm.is_mode``), so ``ctl``'s
    step settings land on it as they do on the learner's (learner.serve.control.Control.before_step).
    The service, the sockets, the data and the checkpoints' settings are not in it. Its fields are
    LearnerConfig's own (:data:`TRAINER_KEYS`), defined once there."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)

    @classmethod
    def of(cls, cfg: LearnerConfig) -> TrainerConfig:
        """The trainer's own copy of ``cfg``'s training sections (a deep copy: ``ctl set`` changes
        the learner's at once and reaches this one between steps)."""
        return cls.model_validate({k: getattr(cfg, k) for k in TRAINER_KEYS}).model_copy(deep=True)


TrainerConfig = create_model(
    "TrainerConfig", __base__=_TrainerConfig, __module__=__name__,
    **{k: (LearnerConfig.model_fields[k].annotation, LearnerConfig.model_fields[k]) for k in TRAINER_KEYS})
