"""The sections of the learner's config, one pydantic model per component, every field documented
by its attribute docstring (``slipstream config --keys`` lists them; docs/configuration.md).

The algorithm keys (docs/design.md §4) in the order a policy step uses them: the no-grad passes
(``algorithm.recompute_logprobs``, the reference for ``kl.coef``, the critic for
``algorithm.advantage: gae``), the rewards (``reward.*``, ``kl.in_reward``), the advantages
(``algorithm.advantage``, ``algorithm.whiten_advantages``, ``critic.targets``), the batch filter
(``reward.batch_filter``), the importance weights (``algorithm.is_mode``,
``algorithm.m2po_threshold``) and the updates (``batch.ppo_epochs`` over
``batch.mini_batch_samples``, each in ``batch.micro_batch_samples``; clips, coefficients, schedules).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from buffer import STALE_POLICIES
from ops import (
    ADVANTAGE_METHODS,
    CLIP_ANCHORS,
    IS_MODES,
    KL_KINDS,
    LOSS_AGG_MODES,
    PF_PPO_METHODS,
    POLICY_LOSSES,
)
from protocol.messages import MAX_NEW_TOKENS_LIMIT

__all__ = [
    "AlgorithmSettings",
    "BatchSettings",
    "CheckpointSettings",
    "CriticSettings",
    "DataSettings",
    "DatasetMix",
    "DeepSpeedSettings",
    "EvaluationSettings",
    "FSYNC_POLICIES",
    "KlSettings",
    "LearnerSecurity",
    "LoraSettings",
    "METRICS_SINKS",
    "NetworkSettings",
    "OptimizerSettings",
    "RewardSettings",
    "RolloutLogSettings",
    "RuntimeSettings",
    "SamplingSettings",
    "ServersSettings",
    "StalenessSettings",
    "WatchdogSettings",
    "WeightsSettings",
]

LR_SCHEDULES = ("constant", "linear", "cosine")
REWARD_NORMS = ("none", "batch", "running")
BATCH_FILTERS = ("none", "pf_ppo")
KL_CONTROLLERS = ("fixed", "adaptive")
CRITIC_TARGETS = ("gae", "vtrace")
DTYPES = ("auto", "float32", "bfloat16", "float16")
AUTOCAST_DTYPES = ("auto", "none", "bfloat16")
ATTN_IMPLEMENTATIONS = ("auto", "eager", "sdpa", "flash_attention_2")
CHECKPOINT_FAILURES = ("continue", "stop")
STALENESS_CONTROLLERS = ("fixed", "adaptive")
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"



ZERO_STAGES = (1, 2, 3)


PRECISIONS = ("fp32", "bf16", "fp16")

class DeepSpeedSettings(BaseModel):
    """ZeRO stage, precision and offload of the DeepSpeed engines (``learner.deepspeed``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    zero_stage: Literal[ZERO_STAGES] = 2
    """ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also the parameters (gathered
    layer by layer in each pass, and bucket by bucket on rank 0 for a publish)."""
    precision: Literal[PRECISIONS] = "fp32"
    """Engine precision: fp32, bf16 (bfloat16 weights with float32 master weights in the optimizer
    partitions) or fp16 (dynamic loss scaling; an overflowing step is skipped; not on DeepSpeed's
    CPU accelerator, a StartupError there). learner.runtime.dtype must be float32 or auto (the engine casts)."""
    offload_optimizer: Literal["none", "cpu"] = "none"
    """Keep optimizer states (and the float32 master weights) in CPU memory (ZeRO-Offload); the
    trainer's torch AdamW updates them there (no DeepSpeedCPUAdam op to compile; slower)."""
    offload_param: Literal["none", "cpu"] = "none"
    """ZeRO-3 only: keep the parameter partitions in CPU memory between uses."""
    reduce_bucket_elements: int = Field(50_000_000, ge=1024)
    """Elements (not bytes) per gradient reduce bucket (DeepSpeed's reduce_bucket_size)."""
    allgather_bucket_elements: int = Field(50_000_000, ge=1024)
    """Elements (not bytes) per parameter all-gather bucket after a ZeRO-1/2 step
    (DeepSpeed's allgather_bucket_size)."""
    publish_bucket_bytes: int = Field(256 << 20, ge=1024)
    """ZeRO-3 publishing: bytes of parameters gathered at a time (each bucket is copied to the CPU
    on rank 0 and released before the next one is gathered)."""
    timeout_s: float = Field(600.0, gt=0)
    """Process-group timeout: a collective (or a worker rank waiting for its next command) that
    waits longer fails, and its rank exits non-zero, so no rank hangs forever."""
    heartbeat_s: float = Field(10.0, gt=0)
    """Rank 0 sends idle worker ranks a no-op this often while it waits for rollouts (well under
    timeout_s, so an idle wait is never taken for a dead rank 0)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        """The bucket sizes count elements: the old ``*_bucket_bytes`` names are refused."""
        for old in ("reduce_bucket_bytes", "allgather_bucket_bytes"):
            if isinstance(data, dict) and old in data:
                raise ValueError(f"deepspeed.{old} is now deepspeed.{old.replace('_bytes', '_elements')} "
                                 "(DeepSpeed counts that bucket in elements, not bytes)")
        return data

    @model_validator(mode="after")
    def _check(self) -> DeepSpeedSettings:
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ValueError("deepspeed.offload_param needs zero_stage: 3 (stages 1 and 2 keep the "
                             "parameters whole on every rank)")
        if self.heartbeat_s * 3 > self.timeout_s:
            raise ValueError(f"deepspeed.heartbeat_s={self.heartbeat_s} must be at most a third of "
                             f"timeout_s={self.timeout_s}")
        return self


FSYNC_POLICIES = ("step", "record")


class RolloutLogSettings(BaseModel):
    """``learner.rollout_log``: where the durable log of accepted results goes (learner.state.rollout_log)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    path: str | None = None
    """Directory of the segment files (null = RUN_DIR/rollout_log)."""
    segment_bytes: int = Field(64 << 20, ge=4096)
    """A new segment file starts when the next record would make the current one larger."""
    fsync: Literal[FSYNC_POLICIES] = "step"
    """step: records reach the OS before their Ack and the disk once per policy step (a machine
    crash may lose the last step's acks); record: every record reaches the disk before its Ack."""


class LearnerSecurity(BaseModel):
    """CURVE on the learner's sockets (off by default; the sockets bind to 127.0.0.1 anyway)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    curve: bool = False
    """Encrypt the rollout, weights and control sockets (CURVE) and accept only allow-listed keys."""
    secret_key_file: str | None = None
    """The learner's secret key file (NAME.key_secret from `slipstream keys`, or a mounted Secret
    holding the 40-character Z85 secret key); its public key goes to learner.json for ctl."""
    allowed_clients_dir: str | None = None
    """Directory of the *.key public keys accepted on the rollout and weights sockets (rollout
    servers); re-read when it changes, so keys can be added without a restart."""
    control_allowed_dir: str | None = None
    """Directory of the *.key public keys accepted on the control socket (operators running
    `slipstream ctl`); null = the same as allowed_clients_dir."""

    @model_validator(mode="after")
    def _check(self) -> LearnerSecurity:
        if self.curve:
            missing = [k for k in ("secret_key_file", "allowed_clients_dir") if not getattr(self, k)]
            if missing:
                raise ValueError(f"security.curve needs {' and '.join(missing)} (create keys with "
                                 "`slipstream keys DIR`)")
        return self


METRICS_SINKS = ("jsonl", "tensorboard", "wandb")

class LoraSettings(BaseModel):
    """LoRA adapters through PEFT (``learner.lora``): only the adapter is trained and published."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    r: int = Field(16, ge=1)
    """Adapter rank."""
    alpha: float = Field(32.0, gt=0)
    """LoRA alpha (the update is scaled by alpha / r)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (0 keeps the sanity check exact)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names (or suffixes) that get an adapter, or all-linear (every linear layer but the
    output head)."""


class NetworkSettings(BaseModel):
    """``learner.network``: Where the learner listens and how much a peer may send (its sockets and /metrics)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    bind_host: str = "127.0.0.1"
    """Interface the learner's ZeroMQ sockets bind to. 127.0.0.1 keeps them off the network;
    0.0.0.0 (every interface) or one address of this host serves rollout servers on other hosts."""
    advertise_host: str | None = None
    """The host the learner names in the endpoints it tells peers (the weights endpoint in
    Welcome, learner.json): null = bind_host, or for a wildcard bind 127.0.0.1, which a server on
    another host replaces with the address it reached the learner at. Set it where that address
    is not the one to use (NAT, a DNS name)."""
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
    """Largest message the rollout socket accepts: a larger frame (ZMQ_MAXMSGSIZE) disconnects
    its peer before it is buffered, an unfinished message whose frames together pass it is cut
    within a check (protocol.plumbing.unfinished). Keep it above the largest RolloutResult."""
    control_max_message_bytes: int = Field(64 << 10, ge=1024)
    """Largest message the control socket accepts (a ControlRequest is a few hundred bytes)."""
    weights_max_message_bytes: int = Field(64 << 10, ge=1024)
    """Largest message the weights socket accepts (a WeightChunkRequest is under 100 bytes)."""
    unfinished_timeout_s: float = Field(30.0, gt=0)
    """How long a peer's message may stay unfinished (frames sent, the last one not) before its
    connection is cut, on every socket; a connection that delivers messages is never cut by it."""
    send_hwm: int = Field(1000, ge=1)
    """Messages queued per peer of the rollout and control sockets (ZMQ_SNDHWM and RCVHWM); a
    rollout server with this many unread is too slow and is dropped (credits keep an honest one
    far below it)."""
    weights_send_hwm: int = Field(16, ge=1)
    """Weight chunks queued per fetching peer (ZMQ_SNDHWM on the weights socket). An honest server
    keeps only its chunk window in flight; a chunk for a peer over this limit is not sent."""


class ServersSettings(BaseModel):
    """``learner.servers``: How the learner treats rollout servers: timeouts, leases, refusals, the weights circuit breaker."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

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
    lease_timeout_s: float = Field(120.0, gt=0)
    """Seconds a rollout server has to return an assignment before it is re-issued."""
    max_abs_reward: float = Field(1e6, gt=0)
    """A sample whose |reward| is above this is refused (acked invalid, counted): one broken
    reward of 1e30 would overflow the batch's float32 statistics and skip the whole step."""
    max_inflight_per_server: int = Field(0, ge=0)
    """Samples one rollout server may be generating at once, below what it offers (0 = what it
    offers: its max_concurrency). Lowering it live takes effect as its leases finish."""
    weights_failure_limit: int = Field(3, ge=1)
    """Circuit breaker: a rollout server reporting this many weight fetches or updates failed in a
    row gets no new work (an event says so) until it applies a published version."""
    max_attempts: int = Field(3, ge=1)
    """Issues of one assignment (the first and its re-issues after a lost lease) before it is
    given up and its samples counted failed."""
    dedupe_window: int = Field(100_000, ge=1024)
    """Sample ids (and finished assignment ids) the buffer remembers to refuse a duplicate; keep
    it above the samples buffered plus in flight."""
    max_servers: int = Field(256, ge=1)
    """Rollout servers known at once; a Hello from one more identity is refused
    (too_many_servers, counted), so a flood of identities cannot take the run's work."""
    initial_allowance: int = Field(16, ge=0)
    """Samples a rollout server may hold unreturned before it has returned any; each lease it
    completes raises its allowance by a group, up to its max_concurrency (0 = its max_concurrency
    from the start). A server that takes work and never returns it holds at most this."""
    silent_factor: float = Field(4.0, gt=1)
    """A server holding work that returned nothing for this many times its mean issue-to-result
    time (every server's mean until it has one) loses its leases while another server waits for
    work: they are re-issued at once without using an attempt, and it gets no new work for a
    probation that doubles with each such loss in a row."""
    silent_min_s: float = Field(5.0, gt=0)
    """The least silence that counts (see silent_factor). A server that has returned nothing yet
    shares its threshold with the idle servers waiting for work (x holders / (holders + idle)), so
    that each waiting server gets a trial within about one threshold however many identities wait."""
    trial_share: float = Field(0.25, gt=0, le=1)
    """Share of the staleness gate ((max_staleness + 1) x batch samples) that the servers which
    have returned nothing hold at most, together, while a server that has returned work is known
    (at least one group; off with initial_allowance 0): identities that never return work cannot
    take the gate from the servers that do."""
    no_valid_sample_timeout_s: float = Field(120.0, ge=0)
    """Stop the run (exit code 5, one line saying why) when samples keep arriving failed or refused
    (a reward that raises, rewards beyond max_abs_reward) and none valid for this long (0 = never)."""
    max_refused_share: float = Field(1.0, gt=0, le=1)
    """Stop the run when more than this share of the last refused_share_window samples failed or
    were refused (1 = never)."""
    refused_share_window: int = Field(1000, ge=1)
    """Samples max_refused_share looks at."""


class BatchSettings(BaseModel):
    """``learner.batch``: What one policy step trains on and how it is cut into passes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    batch_prompts: int = Field(8, ge=1)
    """Prompts per policy step; the batch holds batch_prompts * group_size samples."""
    group_size: int = Field(8, ge=1)
    """Completions per prompt (GRPO/RLOO groups)."""
    micro_batch_samples: int = Field(32, ge=1)
    """Samples per forward/backward pass (gradient accumulation within a mini-batch)."""
    micro_batch_tokens: int = Field(0, ge=0)
    """Padded tokens per forward/backward pass (0 = off): each mini-batch's samples, longest
    first, cut into passes of at most micro_batch_samples samples whose count times the longest's
    prompt + completion tokens stays within this (a longer sample goes alone), so short
    completions are not padded to long ones. The gradient is the same; where lengths vary
    (long tails) a step computes less. verl's use_dynamic_bsz with ppo_max_token_len_per_gpu."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch; every pass reshuffles it into mini-batches, one optimizer step each."""
    mini_batch_samples: int = Field(0, ge=0)
    """Samples per optimizer step (0 = the whole batch: one optimizer step per epoch)."""
    length_bucketing: bool = False
    """When more than a batch of groups is ready, take the groups about to go stale first, then
    the oldest, then those closest to it in length (buffer.groups.select_groups), so a batch pads
    less; false: the oldest groups."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal (all its group advantages 0:
    it teaches nothing) is dropped when it completes and another prompt is issued in its place, so
    every batch is full of groups that carry a gradient. Counted (buffer counter dropped_uniform,
    the step stat dynamic_sampling_dropped_groups); the staleness gate's bound holds as for any
    dropped work."""
    dynamic_sampling_max_drops: int = Field(1000, ge=0)
    """Stop the run (exit code 5, one line) when dynamic sampling has dropped this many groups in
    a row without completing a batch: every prompt gets the same reward on all its completions
    (a reward that is constant, a task far too easy or too hard). 0 = never."""

    @property
    def batch_samples(self) -> int:
        """Samples of one policy step: batch_prompts * group_size."""
        return self.batch_prompts * self.group_size


class OptimizerSettings(BaseModel):
    """``learner.optimizer``: The policy's AdamW and its learning-rate schedule."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    lr: float = Field(3e-4, gt=0)
    """AdamW learning rate of the policy (the peak, when a schedule is set)."""
    lr_schedule: Literal[LR_SCHEDULES] = "constant"
    """Policy learning-rate schedule over total_steps policy steps, after lr_warmup_steps."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Policy steps of linear learning-rate warm-up from 0 to lr."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where linear and cosine schedules end, as a fraction of the peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay (policy and critic)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Policy gradient clipping by global norm, once per optimizer step (after accumulation)."""


class AlgorithmSettings(BaseModel):
    """``learner.algorithm``: Advantages, the PPO loss, importance correction of stale samples and the sanity check."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    advantage: Literal[ADVANTAGE_METHODS] = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo (groups), gae (critic), reinforce_pp (whitened returns)."""
    whiten_advantages: bool = False
    """Whiten the advantages over the batch's completion tokens (reinforce_pp always is)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per token (gae, reinforce_pp, vtrace)."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    policy_loss: Literal[POLICY_LOSSES] = "ppo"
    """The policy loss. ppo: the clipped surrogate (with clip_low/clip_high asymmetric, DAPO's
    clip-higher). gspo: the ratio is the sequence's geometric mean, clipped per sequence (Zheng
    et al. 2025; its clip range is that of a mean per-token ratio: the paper uses clip_low 3e-4,
    clip_high 4e-4, and seq_mean_token_mean). cispo: REINFORCE weighted by the clipped ratio
    without a gradient through it, so a clipped token still learns (MiniMax-M1; it sets a large
    clip_low, e.g. 0.99, and tunes clip_high). Each works with every advantage estimator,
    is_mode and loss_agg; gspo and cispo refuse dual_clip, gspo refuses clip_anchor: behavior."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """Ratio clip below 1 (epsilon_low)."""
    clip_high: float = Field(0.2, ge=0)
    """Ratio clip above 1 (epsilon_high)."""
    dual_clip: float | None = Field(None, gt=1)
    """PPO dual-clip c > 1 bounding the loss of negative advantages at c·|A| (null = off)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: the policy loss minus entropy_coef times the aggregated entropy."""
    loss_agg: Literal[LOSS_AGG_MODES] = "token_mean"
    """How token losses are aggregated: token_mean (every token weighs the same, DAPO),
    seq_mean_token_sum, seq_mean_token_mean (GRPO), seq_mean_token_sum_norm (Dr. GRPO: a
    sequence's token sum over a constant, loss_norm_tokens)."""
    loss_norm_tokens: int | None = Field(None, ge=1)
    """The constant of loss_agg: seq_mean_token_sum_norm (null = sampling.max_new_tokens, the
    longest completion, as in Dr. GRPO)."""
    target_kl: float | None = Field(None, gt=0)
    """Stop the step's remaining updates once a mini-batch's approx KL exceeds this (null = never)."""
    recompute_logprobs: bool = True
    """Proximal log-probs from the learner's weights at step start (docs/design.md §4); false: behavior's."""
    is_mode: Literal[IS_MODES] = "tis"
    """Behavior importance-weight correction mode."""
    is_cap: float = Field(5.0, gt=1)
    """Cap C of the importance weights (tis: min(w, C); mis, geo_mis: keep 1/C <= w <= C). 5, not
    verl's 2 (set for engine mismatch): data 4 versions stale has weights of 3-12, and capping them
    at 2 kept 0.59 of eta 0's learning per sample on the demo, 5 kept 0.81 (5 seeds each;
    uncapped 0.66). At eta <= 2 the weights stay below 2 and the cap rarely binds."""
    clip_anchor: Literal[CLIP_ANCHORS] = "proximal"
    """Where the PPO clip (the trust region) is centred. proximal: on pi_prox, the policy at the
    step's start (decoupled PPO, AReaL): a step of one update then has no trust region at all,
    since pi_theta = pi_prox where its gradient is taken. behavior: on the policy that sampled
    each token, with the is_mode weights kept (ops.behavior_anchored_weights): a token whose
    probability already moved past 1 +- clip of the sampler's in its advantage's direction gets
    no gradient, so stale data cannot push the policy on past where the data's own policy was.
    On the demo at eta 4 (tis, one update a step, 200 steps, 4 seeds) proximal kept 0.29 of eta
    0's gain in the policy's reward and behavior 1.48 (1.27-1.70 per seed; tests/bench/
    bench_staleness_reward.py). At eta 0 the two are the same update. pg_* ratio stats are taken
    against the anchor; refused beside target_kl."""
    icepop_low: float = Field(0.5, gt=0, le=1)
    """is_mode icepop: a token whose weight pi_prox/mu is below this is masked (IcePop's alpha;
    0.5 as in INTELLECT-3)."""
    icepop_high: float = Field(5.0, ge=1)
    """is_mode icepop: a token whose weight is above this is masked (IcePop's beta)."""
    is_veto: float = Field(1e-4, gt=0, lt=1)
    """geo_mis per-token veto: a sequence with one token of weight below this is masked whole."""
    m2po_threshold: float | None = Field(None, ge=0)
    """M2PO: mask tokens of largest (log w)^2 until its batch mean is <= this (null = off; paper: 0.04)."""
    sanity_every: int = Field(16, ge=0)
    """The sanity check without a separate proximal pass (one update a step, the default): at
    every version divisible by this, one no-grad eval-mode forward of the step's first
    micro-batch is compared with the gradient forward (ratio 1, KL 0), so a train-mode forward
    that differs from eval mode (dropout left on) is caught in the default setup too; amortised
    over 16 steps it costs the demo's step ~1 %. 0 = never. With a separate pass the check runs
    every step."""
    sanity_ratio_tolerance: float = Field(1e-3, gt=0)
    """Sanity check (first mini-batch, proximal pass): a max |ratio - 1| above this warns."""
    sanity_kl_tolerance: float = Field(1e-6, gt=0)
    """Sanity check: a KL(current || proximal) above this (nats per token) warns."""
    rollback_nonfinite: bool | None = None
    """After every optimizer update the trained weights are checked (one norm per tensor): a
    weight that is not finite, or so large that the float32 norm overflows, means the update broke
    the model. On: a copy of the trained weights and optimizer state is kept before each step, and
    such a step is rolled back and skipped. Off: it stops the run (exit 6) without publishing or
    checkpointing the broken model; --resume goes on from the last checkpoint. null = on for a
    LoRA adapter and for up to 300M trained parameters (the copy is 3x their size), off above."""
    max_consecutive_skips: int = Field(10, ge=0)
    """Steps skipped in a row (a non-finite loss, gradient or update) after which the run stops,
    exit 6, with the last reason on one line: a model or a setting that keeps failing never
    trains again by itself (0 = never stop)."""

    @property
    def uses_critic(self) -> bool:
        return self.advantage == "gae"


class KlSettings(BaseModel):
    """``learner.kl``: The KL term to the reference policy."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    coef: float = Field(0.0, ge=0)
    """KL-to-reference coefficient beta (0 = no reference model); the start value if adaptive."""
    in_reward: bool = False
    """true: -beta * KL per token in the reward (InstructGPT); false: beta * KL as a loss term (GRPO)."""
    kind: Literal[KL_KINDS] = "k3"
    """KL estimator (Schulman): k1 log-ratio, k2 squared, k3 low variance; k1 is usual in the reward."""
    controller: Literal[KL_CONTROLLERS] = "fixed"
    """fixed beta, or adaptive toward kl_target (Ziegler et al. 2019)."""
    target: float = Field(0.1, gt=0)
    """Adaptive controller target: mean over samples of the summed per-token KL, in nats."""
    horizon: float = Field(10000.0, gt=0)
    """Adaptive controller time constant, in samples."""
    reference_on_cpu: bool = False
    """Keep the reference model on the CPU (saves accelerator memory; slower reference pass)."""

    @property
    def uses_reference(self) -> bool:
        """A KL term to the reference exists (in the reward or in the loss)."""
        return self.coef > 0


class RewardSettings(BaseModel):
    """``learner.reward``: What the trainer does to rewards before the advantages."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    length_penalty: float = Field(0.0, ge=0)
    """Reward minus length_penalty * completion_tokens / max_new_tokens."""
    overlong_buffer_tokens: int = Field(0, ge=0)
    """DAPO's soft overlong punishment: a completion longer than max_new_tokens minus this many
    tokens loses overlong_penalty * (its excess / this), up to overlong_penalty at the limit
    (0 = off; verl's overlong_buffer.len)."""
    overlong_penalty: float = Field(1.0, ge=0)
    """The most the overlong punishment takes (verl's overlong_buffer.penalty_factor)."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: a completion cut at max_new_tokens (finish_reason length) is
    not trained on (loss mask 0); its reward still counts in its group's baseline."""
    clip: float | None = Field(None, gt=0)
    """Clip rewards to [-reward_clip, reward_clip] after the length penalty (null = off)."""
    norm: Literal[REWARD_NORMS] = "none"
    """Normalize rewards by the batch's mean and std, or by running moments over the run."""
    batch_filter: Literal[BATCH_FILTERS] = "none"
    """pf_ppo: resample the batch by reward (PF-PPO, as verl's use_pf_ppo) after the advantages."""
    pf_ppo_method: Literal[PF_PPO_METHODS] = "pow"
    """PF-PPO weights: pow (|score|^p), max_min, max_random."""
    pf_ppo_weight_pow: float = Field(2.0, ge=0)
    """PF-PPO pow exponent p."""


class CriticSettings(BaseModel):
    """``learner.critic``: The critic (advantage: gae): its model, optimizer and targets."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    model: str | None = None
    """Backbone of the critic (advantage: gae), with a linear value head; null = the policy's path."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate of the critic (the peak, when a schedule is set)."""
    lr_schedule: Literal[LR_SCHEDULES] = "constant"
    """Critic learning-rate schedule (as lr_schedule)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Policy steps of linear critic learning-rate warm-up."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Critic gradient clipping by global norm, once per optimizer step."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clip of the critic's new values around the step-start values (null = plain squared error)."""
    warmup_steps: int = Field(0, ge=0)
    """First policy steps that train the critic only (the policy is unchanged; versions still move)."""
    targets: Literal[CRITIC_TARGETS] = "gae"
    """Critic regression targets: GAE returns, or V-trace targets (corrected for stale data)."""
    vtrace_rho_bar: float = Field(1.0, gt=0)
    """V-trace truncation of the TD-error weights rho."""
    vtrace_c_bar: float = Field(1.0, gt=0)
    """V-trace truncation of the trace coefficients c."""


class StalenessSettings(BaseModel):
    """``learner.staleness``: How old a sample may be (eta) and the adaptive controller that may move it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    max_staleness: int = Field(1, ge=0)
    """eta: how many policy steps behind the learner a sample may be (0 = strict on-policy)."""
    stale_policy: Literal[STALE_POLICIES] = "drop"
    """What happens to buffered samples that exceed max_staleness after it shrinks."""
    controller: Literal[STALENESS_CONTROLLERS] = "fixed"
    """fixed: eta is max_staleness. adaptive: eta moves within [min_staleness, max_staleness],
    down when the importance weights degrade, back up when they recover (buffer/staleness.py)."""
    min_staleness: int = Field(0, ge=0)
    """Adaptive controller: the lowest eta it goes to."""
    ess_min: float = Field(0.5, gt=0, le=1)
    """Adaptive controller: a step whose importance-weight ESS ratio is below this cuts eta by one."""
    mismatch_kl_max: float = Field(0.1, gt=0)
    """Adaptive controller: a step whose mismatch KL (behavior to proximal, nats per token) is above
    this cuts eta by one."""
    ess_recover: float = Field(0.7, gt=0, le=1)
    """Adaptive controller: a healthy step has an ESS ratio at least this (>= staleness_ess_min)."""
    mismatch_kl_recover: float = Field(0.05, gt=0)
    """Adaptive controller: a healthy step has a mismatch KL at most this (<= staleness_mismatch_kl_max)."""
    recover_steps: int = Field(5, ge=1)
    """Adaptive controller: healthy steps in a row before eta grows back by one."""


DATASET_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
"""A mixture entry's name: it labels metrics and metadata."""


class DatasetMix(BaseModel):
    """One dataset of ``learner.data.datasets``: a prompt source with its share of the mixture."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    path: str
    """The prompt source, as learner.data.dataset takes it (builtin:NAME, a file, a datasets directory)."""
    name: str | None = Field(None, pattern=DATASET_NAME)
    """Its name in metrics (dataset_reward_mean/NAME) and in each prompt's metadata
    (slipstream_dataset); null = the built-in task's name or the file's stem."""
    weight: float = Field(1.0, gt=0)
    """Its share of the prompts: weight / the sum of the weights (a seeded draw per prompt)."""
    reward: str | list[str] | None = None
    """The rollout servers' reward for its prompts (a rollout.reward.fn value); `slipstream run`
    and a config file with both sections put it into rollout.reward.by_dataset. null = the
    servers' reward (a built-in task's own reward when it is one)."""
    prompt_key: str | None = None
    """Its prompt column (null = learner.data.prompt_key)."""
    answer_key: str | None = None
    """Its answer column (null = learner.data.answer_key)."""
    split: str | None = None
    """Its split of a datasets directory (null = learner.data.dataset_split)."""

    @property
    def label(self) -> str:
        """The name, or one made from the path."""
        if self.name:
            return self.name
        from pathlib import PurePath
        stem = self.path.split(":", 1)[1] if self.path.startswith("builtin:") else PurePath(self.path).stem
        return "".join(c if c.isalnum() or c in "_.-" else "_" for c in stem)[:64] or "dataset"


PRESET_ANSWER_KEYS: dict[str, str | None] = {"verl": "reward_model.ground_truth", "trl": None}
"""learner.data.preset: the answer_key each preset implies (prompt_key is "prompt" in both)."""


class DataSettings(BaseModel):
    """``learner.data``: The training prompts: where they come from and how they are formatted and ordered."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    dataset: str = "builtin:arith"
    """Prompt source: builtin:arith, a .jsonl / .json / .parquet file, or a directory written by
    datasets' save_to_disk; each row needs prompt_key and answer_key."""
    dataset_split: str = "train"
    """Split to read from a datasets directory holding a DatasetDict."""
    preset: Literal["trl", "verl"] | None = None
    """A dataset laid out as another trainer's, read as it is: verl (verl's RL parquet: prompt
    chat messages, the answer at reward_model.ground_truth, data_source / ability / extra_info
    passed on) or trl (TRL's prompt-only and conversational formats: a prompt column and no
    answer column; every other column reaches the reward). It sets prompt_key and answer_key
    where they are not given."""
    prompt_key: str = "prompt"
    """Column (key) of a row holding the prompt: a string, or a list of chat messages; a dotted
    name reaches into a nested column."""
    answer_key: str | None = "answer"
    """Column (key) of a row holding the answer the reward function checks (the reward's
    metadata["answer"]); a dotted name reaches into a nested column (verl's RL parquet:
    reward_model.ground_truth); null: the rows have no answer column (TRL's datasets: the reward
    reads its own columns)."""
    chat_template: Literal["auto", "always", "never"] = "auto"
    """Format prompts with the tokenizer's chat template: auto (when the prompt is a list of
    messages, or system_prompt is set, and the tokenizer has a template), always (refuse to start
    without one), never (the prompt text as it is)."""
    system_prompt: str | None = None
    """A system message put before every prompt (with the chat template)."""
    max_prompt_tokens: int = Field(0, ge=0)
    """Prompts longer than this many tokens (after the chat template) are skipped and counted in
    slipstream_prompts_skipped_total (0 = no limit)."""
    shuffle: bool = True
    """Shuffle the rows of a file dataset, with a new seeded order every epoch."""
    epochs: int = Field(0, ge=0)
    """Passes over a file dataset (0 = endless; built-in tasks always are); the run ends after the
    last full batch when they are used up (a partial last batch is never generated)."""
    length_buckets: int = Field(0, ge=0)
    """Sample prompts of similar length together: rows (or a built-in task's draws) are sorted
    into this many length buckets, each batch's prompts come from one bucket, and the learner
    trains each batch of one bucket whatever order its groups complete in (0 = off)."""
    datasets: list[DatasetMix] = Field(default_factory=list)
    """A mixture instead of dataset: [{path, weight, name, reward, prompt_key, answer_key}, ...];
    each prompt is drawn from one of them with probability weight / total (seeded; the position
    of every dataset is in the checkpoint), tagged with its name for the per-dataset reward and
    metrics. Each dataset is endless (a file starts a new seeded order when it is used up), so
    epochs and length_buckets stay 0 beside it, and dataset is not used."""

    @model_validator(mode="after")
    def _preset(self) -> DataSettings:
        if self.preset is not None and "answer_key" not in self.model_fields_set:
            # object.__setattr__: no validate_assignment recursion, and answer_key stays unset (a
            # later preset change sets it again).
            object.__setattr__(self, "answer_key", PRESET_ANSWER_KEYS[self.preset])
        return self

    @model_validator(mode="after")
    def _mixture(self) -> DataSettings:
        if not self.datasets:
            return self
        if self.dataset != DataSettings.model_fields["dataset"].default:   # (a resolved config has the default)
            raise ValueError("set learner.data.dataset or learner.data.datasets (a mixture), not both")
        for key in ("epochs", "length_buckets"):
            if getattr(self, key):
                raise ValueError(f"learner.data.{key} is not available with learner.data.datasets (each "
                                 f"dataset of a mixture is endless); set {key}: 0")
        labels = [d.label for d in self.datasets]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise ValueError(f"learner.data.datasets: the name {twice[0]!r} is used twice; give each a "
                             "distinct name")
        return self


class EvaluationSettings(BaseModel):
    """``learner.evaluation``: Held-out evaluation rounds."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    data: str | None = None
    """Held-out prompts (same formats as dataset) for evaluation; never trained on."""
    every: int = Field(0, ge=0)
    """Evaluate every this many policy steps (0 = never), greedily, outside the staleness gate."""
    prompts: int = Field(0, ge=0)
    """Prompts per evaluation, the same ones every round (0 = all of eval_data; a built-in task
    needs a number)."""
    temperature: float = Field(1e-6, ge=1e-6, le=1e6)
    """Sampling temperature of evaluation assignments (1e-6, the wire's smallest: greedy on both
    engines; vLLM samples greedily below 1e-5)."""
    correct_threshold: float = 1.0
    """An evaluation sample counts as correct (eval_accuracy) when its reward is at least this
    (1.0: an exact-match reward's full score)."""


class SamplingSettings(BaseModel):
    """``learner.sampling``: What every training assignment asks the engines for."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    temperature: float = Field(1.0, ge=1e-6, le=1e6)
    """Sampling temperature sent with every assignment."""
    top_p: float = Field(1.0, ge=1e-9, le=1)
    """Nucleus sampling threshold; only 1.0 (the recompute has no truncation: see the validator)."""
    max_new_tokens: int = Field(4, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    """Completion length limit sent with every assignment; a longer completion is refused."""
    seed_per_assignment: bool = False
    """Each assignment's completions are drawn from a seed of their own (learner.seed and the
    assignment's number; completion i from a generator seeded by it and i): the same assignment
    on the same weights gives the same completions whatever else a server generates, so a
    resumed run replays an uninterrupted one's samples. vLLM draws seeded requests on a slower
    path; false: the engines' own randomness."""
    stop: list[str] = Field(default_factory=list, max_length=16)
    """Stop strings: a completion ends with the token whose decoding completes one (kept in the
    completion and trained, finish_reason stop), e.g. a tool call's closing tag (at most 16, each
    1-256 characters)."""
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    """Token ids that end a completion besides the model's EOS (kept, finish_reason stop)."""
    max_turns: int = Field(1, ge=1, le=1024)
    """Turns of the model an episode may have on a server that runs an environment
    (``rollout.environment``): each turn is one completion of at most ``max_new_tokens``, the
    environment's observations come between them (docs/agents.md). 1: single completions."""
    max_episode_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    """Tokens an episode may hold after its prompt, the model's and the environment's together;
    longer, it ends (finish_reason length). None: max_turns × max_new_tokens."""

    @property
    def episode_tokens(self) -> int:
        """The most tokens a sample may hold after its prompt."""
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        return self.max_new_tokens * self.max_turns

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: list[str]) -> list[str]:
        if any(not 1 <= len(x) <= 256 for x in v):
            raise ValueError("each stop string has 1 to 256 characters")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(not 0 <= x < 2**31 for x in v):
            raise ValueError("stop token ids are in [0, 2^31)")
        return v


class WeightsSettings(BaseModel):
    """``learner.weights``: How published weights travel."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    chunk_bytes: int = Field(64 << 20, ge=1024)
    """Size of one weight chunk on the wire (bucket size)."""
    delta: bool = True
    """Answer a server that holds an older kept version with deltas (xor-zstd against its chunk,
    when smaller; docs/design.md §5): at RL learning rates in bf16 a few percent of the bytes."""
    relay_fanout: int = Field(1, ge=0, le=64)
    """Peer relay (servers with rollout.relay.port set serve the chunks they hold): each version
    reaches the relaying servers through a tree with this many children per node (1: a chain),
    the first server fetching from the learner, so the learner sends about one copy whatever the
    number of servers; 0: every server fetches from the learner. On links of one speed a node
    feeding k children takes k times as long: a chain with 8 MiB chunks (chunk_bytes) pipelines
    best (docs/benchmarks.md, weights across hosts)."""


class RuntimeSettings(BaseModel):
    """``learner.runtime``: Where and in what precision the policy (and critic, reference) compute."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """Where the policy (and critic, reference) train: auto (cuda when there is one, else cpu),
    cpu, cuda, cuda:N."""
    dtype: Literal[DTYPES] = "auto"
    """Training dtype of the weights: auto (float32 under autocast; else bfloat16 on a cuda device
    with native bfloat16, float32 elsewhere), float32, bfloat16, float16. Full-weight publishes
    send tensors in this dtype."""
    autocast: Literal[AUTOCAST_DTYPES] = "auto"
    """Mixed precision: bfloat16 runs the policy's and the reference's forward (and so their
    backward) under torch.autocast, matrix multiplications in bfloat16, while the weights, the
    optimizer and the log-probs stay float32 (dtype auto then means float32). Only faster where
    the device computes bfloat16 natively (a GPU since Ampere, a CPU with AVX512-BF16 or AMX;
    elsewhere it is emulated, ~12x slower on the demo's step). auto: bfloat16 where native, else
    none (and none when dtype is bfloat16/float16 or DeepSpeed owns the precision); none: plain
    dtype. The learner's runtime event and ctl status say what auto chose and why."""
    attn_implementation: Literal[ATTN_IMPLEMENTATIONS] = "auto"
    """The attention of the policy, reference and critic (transformers' ``attn_implementation``):
    auto (the model's default, sdpa where it can), eager, sdpa, flash_attention_2. On CPU with
    short sequences eager trains faster: PyTorch's CPU flash kernel behind sdpa costs more than
    the matrix products it saves (the demo's step ~20 % less on one thread, tests/bench)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, about a third more compute)."""
    disable_dropout: bool = True
    """Zero every dropout of policy and critic (else the ratio is not 1 at the first mini-batch)."""


class CheckpointSettings(BaseModel):
    """``learner.checkpoint``: When checkpoints are written, how many are kept, and what a failed one does."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    save_every: int = Field(50, ge=0)
    """Write a checkpoint every this many policy steps (0 = only on SIGTERM / ctl stop and at the end)."""
    keep_last: int = Field(5, ge=1)
    """Complete checkpoints kept; older ones are deleted after a new one is complete."""
    dir: str | None = None
    """Where checkpoints go (null = RUN_DIR/checkpoints)."""
    failure: Literal[CHECKPOINT_FAILURES] = "continue"
    """A checkpoint that cannot be written (disk full, not writable): log an error event and go on
    training (the previous checkpoint stays), or stop the run cleanly."""


class WatchdogSettings(BaseModel):
    """``learner.watchdog``: When no step comes, one line says what the learner waits on; a stack
    dump, an optional hard stop (protocol/plumbing/watchdog.py; docs/operations.md "When it hangs")."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    stall_s: float = Field(0.0, ge=0)
    """Seconds without a policy step before a stalled line says what the learner waits on (0 = the
    larger of 60 s and 10x the median step-to-step time so far)."""
    dump_after_s: float = Field(300.0, ge=0)
    """Write every thread's and task's stack to RUN_DIR/stacks (as ctl stacks does) the first time
    a stall lasts this long (0 = never)."""
    abort_after_s: float = Field(0.0, ge=0)
    """End a learner stalled this long with exit code 7, its diagnosis as its last line, for a
    supervisor to restart with --resume (0 = never)."""
