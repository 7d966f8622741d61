"""Rollout server configuration: a few server-wide keys and one pydantic section per concern, every field documented."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.codec import MAX_BODY_BYTES, MAX_HEADER_BYTES
from rollout_server.engine import INFLIGHT_POLICIES


class WatchdogOptions(BaseModel):
    """``rollout.watchdog``: when no assignment, ack or weights come, one line says what the
    server waits on (protocol/plumbing/watchdog.py; docs/operations.md "When it hangs")."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    stall_s: float = Field(0.0, ge=0)
    """Seconds without progress (an assignment received, a result acknowledged, weights applied)
    before a stalled line says what the server waits on: the learner, its engine, a reward, a
    weights fetch (0 = the larger of 60 s and 10x the median time between them so far)."""
    dump_after_s: float = Field(300.0, ge=0)
    """Write every thread's and task's stack (as SIGUSR1 does) the first time a stall lasts this
    long (0 = never)."""
    abort_after_s: float = Field(0.0, ge=0)
    """End a server stalled this long with exit code 7, its diagnosis as its last line (slipstream
    run restarts it; 0 = never)."""


class VLLMOptions(BaseModel):
    """Options of the vLLM engine (``rollout.engine: vllm``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

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
    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor parallelism (GPUs per server)."""

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        """``weight_transfer`` (its one value was "zmq") is gone: say so rather than "unknown key"."""
        if isinstance(data, dict) and "weight_transfer" in data:
            raise ValueError("weight_transfer was removed (full weights always travel over ZeroMQ): "
                             "delete rollout.vllm.weight_transfer from the config")
        return data


class RewardOptions(BaseModel):
    """Options of the built-in rewards (see rollout_server/rewards.py)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    format_regex: str = r"####\s*-?[\d,]+(\.\d+)?|\\boxed\{[^}]*\}"
    """builtin:format: the pattern (re.search, DOTALL) a well-formatted completion contains."""
    format_reward: float = 1.0
    """builtin:format: the reward when format_regex matches (0 otherwise)."""
    length_penalty_per_token: float = Field(0.001, ge=0)
    """builtin:length_penalty: reward subtracted per completion token beyond length_free_tokens."""
    length_free_tokens: int = Field(0, ge=0)
    """builtin:length_penalty: completion tokens that cost nothing."""
    reward_model: str | None = None
    """builtin:reward_model: directory of an AutoModelForSequenceClassification + its tokenizer."""
    rm_chat_template: Literal["auto", "always", "never"] = "auto"
    """builtin:reward_model: format (prompt, completion) with the RM's chat template: auto (when it
    has one), always (refuse to start without one), never (plain prompt + completion text)."""
    rm_probe_text: str = "The answer is 42. Therefore, x = 7 and y = 3.5."
    """builtin:reward_model: text the RM tokenizer must round-trip exactly, or the server refuses to
    start (catches a tokenizer that would garble inputs into unknown tokens)."""
    rm_max_length: int = Field(2048, ge=8)
    """builtin:reward_model: longest RM input in tokens (longer inputs lose their *start*)."""
    rm_batch_size: int = Field(16, ge=1)
    """builtin:reward_model: texts per RM forward pass."""


class RolloutSecurity(BaseModel):
    """CURVE to the learner (learner.security.curve on): this server's key pair, the learner's key."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    curve: bool = False
    """Connect to the learner's rollout and weights sockets with CURVE (encrypted, authenticated)."""
    secret_key_file: str | None = None
    """This server's secret key file (NAME.key_secret from `slipstream keys`, or a mounted Secret
    with the bare Z85 secret key); its public key must be in the learner's allowed_clients_dir."""
    learner_public_key_file: str | None = None
    """The learner's public key file (learner.key from `slipstream keys`, or the bare Z85 key)."""

    @model_validator(mode="after")
    def _check(self) -> RolloutSecurity:
        if self.curve:
            missing = [k for k in ("secret_key_file", "learner_public_key_file") if not getattr(self, k)]
            if missing:
                raise ValueError(f"security.curve needs {' and '.join(missing)} (create keys with "
                                 "`slipstream keys DIR`)")
        return self


class RolloutNetwork(BaseModel):
    """``rollout.network``: the link to the learner and the /metrics endpoint."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    metrics_host: str = "127.0.0.1"
    """Interface of the Prometheus /metrics endpoint."""
    metrics_port: int = Field(9401, ge=0, le=65535)
    """Port of the Prometheus /metrics and /healthz endpoint (0 = any free port)."""
    reconnect_ivl_s: float = Field(0.1, gt=0)
    """First delay before reconnecting to a lost learner (ZMQ RECONNECT_IVL)."""
    reconnect_ivl_max_s: float = Field(5.0, gt=0)
    """Reconnect backoff cap: delays double up to this (ZMQ RECONNECT_IVL_MAX)."""
    heartbeat_interval_s: float = Field(2.0, gt=0)
    """Seconds between Heartbeats to the learner (also the ZeroMQ ping interval on that link)."""
    learner_timeout_s: float = Field(10.0, gt=0)
    """The learner counts as lost (/healthz 503, connected: false) when its link is down, or when
    it has sent nothing for this long once it is known to answer heartbeats."""
    ack_timeout_s: float = Field(30.0, gt=0)
    """Seconds to wait for an Ack before re-sending a result."""
    max_message_bytes: int = Field(MAX_BODY_BYTES + MAX_HEADER_BYTES, ge=1 << 16)
    """Largest message accepted from the learner (its frames together; a larger frame is refused
    by libzmq before it is buffered). The default is the largest frame the codec takes."""
    unfinished_timeout_s: float = Field(30.0, gt=0)
    """How long a message from the learner may stay unfinished (frames sent, the last one not)
    before the connection is cut (protocol.plumbing.unfinished; its size is bounded too)."""


class GenerationOptions(BaseModel):
    """``rollout.generation``: how much this server generates at once and what it accepts."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    max_concurrency: int = Field(64, ge=1)
    """Samples this server generates at once (the credits it asks for)."""
    batch_wait_s: float = Field(0.005, ge=0)
    """At most this long after work arrives for the rest of the learner's burst to join the same
    generate call (each Assignment says how many more follow; work that does not say, from an
    older learner, waits the whole window)."""
    inflight_update: Literal[INFLIGHT_POLICIES] = "finish"
    """Weights arriving while a request generates: continue (new tokens use the new weights),
    finish (the request finishes on its version), resubmit (abort, regenerate the rest)."""
    max_new_tokens_limit: int = Field(4096, ge=1)
    """Longest completion this server generates; an assignment asking for more is refused."""
    max_prompt_tokens: int = Field(8192, ge=1)
    """Longest prompt this server accepts; an assignment with a longer one is refused."""


class WeightsOptions(BaseModel):
    """``rollout.weights``: fetching the learner's published weights."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    wait_s: float = Field(10.0, ge=0)
    """Before starting new work, wait up to this long for announced newer weights to be applied,
    and for the version the work was issued at (older weights can make its samples too stale)."""
    chunk_timeout_s: float = Field(30.0, gt=0)
    """A weights fetch fails (counted, old weights kept) when no chunk arrives for this long."""
    chunk_window: int = Field(4, ge=1)
    """Weight chunk requests in flight at once during a fetch."""
    chunk_retries: int = Field(3, ge=1)
    """Requests per chunk (a corrupted or wrong reply is fetched again) before the fetch fails."""
    max_bytes: int = Field(0, ge=0)
    """Largest weights version accepted, in bytes; a bigger manifest is refused before anything is
    allocated (0 = twice the size of the model's weight files)."""
    delta: bool = True
    """Keep the applied full-weights version's bytes in host memory (one copy of the model) and
    ask the learner for the next version as deltas against it (learner.weights.delta); false:
    every fetch is the full version."""


class RelayOptions(BaseModel):
    """``rollout.relay``: serving the weight chunks this server holds to its peers
    (rollout_server/relay.py), so the learner sends each version about once."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    port: int | None = Field(None, ge=0, le=65535)
    """Port of this server's relay socket (0 = a free port); null: it relays nothing (its peers
    fetch from the learner or other relays)."""
    bind_host: str = "0.0.0.0"
    """Interface the relay socket binds to (its peers are on other hosts)."""
    advertise_host: str | None = None
    """The host peers reach the relay at (told to the learner in Hello); null: this host's
    address on the route to the learner."""
    wait_s: float = Field(10.0, gt=0)
    """How long a peer's request waits for a chunk this server is still fetching."""
    timeout_s: float = Field(15.0, gt=0)
    """A peer that answers nothing for this long is skipped for the rest of a fetch (its
    chunks come from the next source, the learner last)."""


class RewardSettings(BaseModel):
    """``rollout.reward``: the reward function(s), how their parts are weighed, where they run.
    A bare string or list stands for ``fn`` (``reward: builtin:format``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    fn: str | list[str] = "builtin:exact_numeric"
    """Reward function(s): builtin:exact_numeric|format|length_penalty|reward_model,
    "module:function" (fn(prompt, completion, metadata), sync or async), "trl:module:function" (a
    TRL GRPOTrainer reward, called as TRL calls it, once per group) or "verl:module:function" (a
    verl compute_score); a list adds their parts."""
    weights: dict[str, float] = Field(default_factory=dict)
    """Weight per reward part name (e.g. {exact_numeric: 1.0, format: 0.1}); unnamed parts weigh 1."""
    threads: int = Field(4, ge=1)
    """Worker threads for synchronous reward functions (they never run on the event loop)."""
    timeout_s: float = Field(60.0, gt=0)
    """Seconds one reward call may take; a slower one marks its sample failed (counted)."""
    options: RewardOptions = Field(default_factory=RewardOptions)
    """Options of the built-in rewards."""
    by_dataset: dict[str, str | list[str]] = Field(default_factory=dict)
    """The reward of each dataset of a learner's mixture (learner.data.datasets), by its name:
    a prompt whose assignment names one (metadata slipstream_dataset) is scored by it, any other by
    fn. A config file with both sections fills it from the datasets' reward keys."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"fn": data} if isinstance(data, (str, list)) else data


class EnvironmentSettings(BaseModel):
    """``rollout.environment``: multi-turn episodes (docs/agents.md). An assignment whose
    environment is set runs as episodes: the model's turn, the environment's observation, the
    model's next turn, ... up to the assignment's ``max_turns`` and ``max_episode_tokens``; each
    episode is one sample, token for token what the engine sampled and was fed. A bare string
    stands for ``class_name`` (``environment: mymodule:GuessEnv``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    class_name: str | None = None
    """The environment of every assignment: "module:Class" (a module may be a path/to/file.py),
    instantiated once per episode with ``options``, or "agent:module:function", an agent program
    that talks to the server's OpenAI-compatible endpoint; None: single completions scored by
    rollout.reward (unless ``named`` picks one)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the class (every episode gets its own instance)."""
    named: dict[str, str] = Field(default_factory=dict)
    """Environments by name, "module:Class" each: a prompt whose row has an ``environment``
    column naming one, or that comes from a dataset of a mixture of that name, runs in it."""
    step_timeout_s: float = Field(60.0, gt=0)
    """Seconds one reset or step may take; a slower one ends the episode, failed (counted)."""
    agent_timeout_s: float = Field(600.0, gt=0)
    """Seconds an agent program (agent:module:function) may take for its whole episode."""
    agent_port: int = Field(0, ge=0, le=65535)
    """Loopback port of the OpenAI-compatible endpoint agent programs talk to (0: a free one)."""
    max_observation_tokens: int = Field(2048, ge=1)
    """Tokens one observation may have; a longer one ends the episode, failed (counted)."""
    role: str = Field("user", min_length=1)
    """The chat role of an observation given as a plain string ("tool" for tool results), when
    the tokenizer has a chat template."""
    chat_template: Literal["auto", "never"] = "auto"
    """auto: observations are rendered as messages with the tokenizer's chat template (closing
    the model's turn as the template does); never: an observation's text is appended as it is."""
    on_failure: Literal["fail", "reissue", "train"] = "fail"
    """A failed episode (its environment raised, hung, gave a bad observation or reward; counted
    in slipstream_episodes_failed_total either way): fail: its sample is sent failed and nothing
    of its group is trained; reissue: the server gives its group back to the learner, which
    issues it again (to any server; learner.servers.max_attempts bounds the tries, then it counts
    failed); train: the turns it had are trained with reward ``failure_reward`` (an episode that
    failed before its first turn has nothing to train: sent failed)."""
    failure_reward: float = 0.0
    """The reward of a failed episode under on_failure: train (its only reward part, ``failure``)."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"class_name": data} if isinstance(data, str) else data

    def spec_for(self, metadata: dict) -> str | None:
        """The "module:Class" an assignment with ``metadata`` runs in (None: a single completion)."""
        for key in ("environment", "slipstream_dataset"):
            name = metadata.get(key)
            if isinstance(name, str) and name in self.named:
                return self.named[name]
        return self.class_name


class RolloutRuntime(BaseModel):
    """``rollout.runtime``: where and in what precision the engine computes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """HF engine device: auto (cuda when there is one, else cpu), cpu, cuda, cuda:N (vLLM picks
    its own)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype: auto (bfloat16 where the device computes it natively: a GPU since Ampere, a
    CPU with AVX512-BF16 or AMX; else float32; vLLM on a GPU: the model's own), float32,
    bfloat16, float16. The server's runtime event says what auto chose and why."""


class ShutdownOptions(BaseModel):
    """``rollout.shutdown``: what a stopping server still finishes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)

    drain_timeout_s: float = Field(20.0, ge=0)
    """On SIGTERM: seconds to finish queued work and wait for its acks before exiting."""
    drain_disconnected_s: float = Field(2.0, ge=0)
    """On SIGTERM: stop waiting for acks once the learner link has been down this long."""


_FLAT_LAYOUT = {
    "network": ("metrics_host metrics_port reconnect_ivl_s reconnect_ivl_max_s heartbeat_interval_s "
                "learner_timeout_s ack_timeout_s learner_max_message_bytes:max_message_bytes "
                "unfinished_timeout_s"),
    "generation": "max_concurrency batch_wait_s inflight_update max_new_tokens_limit max_prompt_tokens",
    "weights": ("weights_wait_s:wait_s chunk_timeout_s chunk_window chunk_retries "
                "max_weights_bytes:max_bytes"),
    "reward": ("reward_weights:weights reward_threads:threads reward_timeout_s:timeout_s "
               "reward_options:options"),
    "runtime": "device dtype",
    "shutdown": "drain_timeout_s drain_disconnected_s",
}
MOVED_KEYS: dict[str, str] = {
    old: f"{section}.{new or old}"
    for section, keys in _FLAT_LAYOUT.items()
    for old, _, new in (item.partition(":") for item in keys.split())
}
"""``metrics_port`` -> ``network.metrics_port``, ``reward_weights`` -> ``reward.weights``, ...: every
key of the flat layout (before the rollout config had sections)."""


class RolloutConfig(BaseModel):
    """Everything a rollout server needs besides the model path: a few server-wide keys and one
    section per concern, like the learner's (docs/configuration.md lists every key)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True, use_attribute_docstrings=True)

    learner: str = "tcp://127.0.0.1:5555"
    """The learner's rollout endpoint (its ROUTER); the weights endpoint comes in Welcome."""
    server_id: str | None = None
    """Stable name of this server (default: hostname-pid)."""
    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: hf (transformers, CPU or GPU) or vllm."""
    seed: int = 0
    """Sampling seed (offset by the server's index in `slipstream run`)."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads (0 = torch's default; under `slipstream run`, 0 = this server's share
    of the cores, see deploy/cores.py)."""
    exit_on_learner_finished: bool = True
    """Exit (code 0) once the learner says its run has finished, after the last acks."""
    network: RolloutNetwork = Field(default_factory=RolloutNetwork)
    """The link to the learner (heartbeats, timeouts, message limits) and the /metrics endpoint."""
    generation: GenerationOptions = Field(default_factory=GenerationOptions)
    """Concurrency, batching of the learner's bursts, in-flight weight updates, length limits."""
    weights: WeightsOptions = Field(default_factory=WeightsOptions)
    """Fetching published weights: waits, chunk windows and retries, the size limit."""
    relay: RelayOptions = Field(default_factory=RelayOptions)
    """Serving weight chunks to peers (off unless a port is set)."""
    reward: RewardSettings = Field(default_factory=RewardSettings)
    """Reward function(s), their weights, threads, timeout and the built-ins' options."""
    environment: EnvironmentSettings = Field(default_factory=EnvironmentSettings)
    """Multi-turn episodes: the environment class (or one per row / dataset), its options, the
    per-step timeout, how observations are tokenized (docs/agents.md)."""
    runtime: RolloutRuntime = Field(default_factory=RolloutRuntime)
    """The engine's device and dtype."""
    shutdown: ShutdownOptions = Field(default_factory=ShutdownOptions)
    """What a stopping server still finishes (queued work, acks)."""
    vllm: VLLMOptions = Field(default_factory=VLLMOptions)
    """vLLM engine options."""
    watchdog: WatchdogOptions = Field(default_factory=WatchdogOptions)
    """When no assignment, result or weights come, one line says what the server waits on (the
    learner, the engine, a reward, a weights fetch); a stack dump, an optional hard stop."""
    security: RolloutSecurity = Field(default_factory=RolloutSecurity)
    """CURVE keys for the link to the learner (off by default)."""

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """A key of the flat layout (before the sections) is refused with its new place."""
        if isinstance(data, dict):
            for key in data:
                if key in MOVED_KEYS:
                    raise ValueError(f"{key} moved to {MOVED_KEYS[key]}")
        return data
