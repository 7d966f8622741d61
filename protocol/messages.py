"""Message types for the whole flow of docs/design.md §1/§6.

Flow (rollout server = DEALER, learner = ROUTER):

    server -> learner   Hello            on connect (again after every reconnect)
    learner -> server   Welcome          run id, learner version, weights kind
    server -> learner   WorkRequest      "I can take `credits` more samples"
    learner -> server   Assignment       one prompt, `group_size` completions wanted (a lease)
    server -> learner   RolloutResult    one or more scored Samples
    learner -> server   Ack              per-sample status (accepted / duplicate / stale / invalid)
    learner -> server   WeightsAvailable new version's manifest (tensor specs, chunking, checksum)
    server -> learner   WeightChunkRequest  (weights socket) fetch chunk i of version v
    learner -> server   WeightChunk      chunk bytes in their own frame + checksum
    server -> learner   WeightsApplied   version, checksum and seconds, only once applied
    either              Heartbeat        liveness and current version
    ctl -> learner      ControlRequest / ControlReply  (control socket)
    either              Error            a refused message, with the id it refers to

All fields are required unless they have a default. Each field is declared once, with its wire
kind (``name: type = wire(kind, default=...)``, see ``schema.record``); on the wire a message is an
array of its field values in declaration (``FIELDS``) order (``protocol.codec``), so that order is
part of the protocol:
append new fields at the end, with a default, and never reorder, remove or retype one within a
major version (tests/protocol pins it). Field kinds (see ``schema``) define the wire form and the
validation applied on decode (``Struct.to_wire_checked`` / ``from_wire_checked``, the reference
path). ``Sample`` and ``RolloutResult``, the messages that carry every token, also
have hand-written ``to_wire`` / ``from_wire``: the same wire form, and on decode the same checks
in one pass over all of a result's samples (``_samples_fast`` at the bottom, the one fast check of
a Sample), handing anything unusual to the reference path.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, ClassVar

import numpy as np

from protocol.errors import ProtocolError
from protocol.schema import (
    MAX_ARRAY_ITEMS,
    MAX_LIST_ITEMS,
    MAX_MAP_ITEMS,
    MAX_STR_CHARS,
    PLAIN_TYPES,
    Array,
    Bool,
    Float,
    FloatMap,
    Frame,
    Int,
    IntList,
    Nested,
    Optional,
    PlainMap,
    Str,
    StrList,
    Struct,
    StructList,
    is_plain,
    record,
    wire,
)

# Bytes per element of every dtype a weights manifest may name (torch dtype names).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
               "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}

_STR, _INT, _NAT, _FLOAT, _BOOL = Str(), Int(), Int(min_value=0), Float(), Bool()
_MAP, _FMAP = PlainMap(), FloatMap()
_I32, _F32_FINITE = Array("int32"), Array("float32", finite=True)
_I32_NON_NEGATIVE = Array("int32", non_negative=True)
_TEMPERATURE_MIN, _TEMPERATURE_MAX = 1e-6, 1e6
_TEMPERATURE = Float(min_value=_TEMPERATURE_MIN, max_value=_TEMPERATURE_MAX)
_INT32, _FLOAT32 = _I32.dtype, _F32_FINITE.dtype     # np.dtype("<i4"), np.dtype("<f4")
SEED_MAX = (1 << 63) - 1     # SamplingParams.seed: what msgpack and torch.Generator both take
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 64   # SamplingParams.stop, stop_token_ids
MAX_TURNS = 1024                   # SamplingParams.max_turns, and the turns a Sample may hold
_ndarray = np.ndarray

FINISH_REASONS = ("stop", "length", "abort", "error")
BUCKET_KEY = "slipstream_bucket"
"""An assignment's metadata key holding the length bucket of its prompt (``learner.data.length_buckets``):
the learner's buffer makes each batch of one bucket."""
DATASET_KEY = "slipstream_dataset"
"""An assignment's metadata key naming the dataset of a mixture its prompt came from
(``learner.data.datasets``): the rollout server picks the reward by it
(``rollout.reward.by_dataset``), the learner counts per-dataset statistics by it."""
PROMPT_MESSAGES_KEY = "slipstream_prompt_messages"
"""An assignment's metadata key holding its prompt's chat messages as the dataset has them (set
when the row's prompt is a list of messages; ``prompt_text`` is them after the chat template):
TRL-style rewards get them as ``prompts``."""
SAMPLE_ARRAY_DTYPES = "<i4,<i4,<f4,<i4"   # prompt ids, completion ids, behavior log-probs, versions
ACK_STATUSES = ("accepted", "duplicate", "stale", "invalid")
WEIGHT_KINDS = ("full", "lora")
WEIGHT_ENCODINGS = ("raw", "xor-zstd")
"""How a ``WeightChunk`` carries its bytes (protocol 3.7): as they are, or as a delta."""
LORA_BIASES = ("none", "all", "lora_only")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
_ACK_STATUS_SET = frozenset(ACK_STATUSES)
_STR_TYPE = frozenset((str,))


class Message(Struct):
    """A top-level message; ``TYPE`` is its name in the header."""

    TYPE: ClassVar[str] = ""


@record
class Sample(Struct):
    """One scored completion. Groups (the n completions of one prompt) share ``assignment_id``."""

    sample_id: str = wire(_STR)
    assignment_id: str = wire(_STR)
    group_index: int = wire(_NAT)
    group_size: int = wire(Int(1))
    prompt_token_ids: np.ndarray = wire(_I32)  # int32 [P]
    completion_token_ids: np.ndarray = wire(_I32)  # int32 [T]
    behavior_logprobs: np.ndarray = wire(_F32_FINITE)  # float32 [T], log-prob of each sampled token (finite)
    token_versions: np.ndarray = wire(_I32_NON_NEGATIVE)  # int32 [T], policy version that produced each token
    reward: float = wire(_FLOAT)
    reward_parts: dict[str, float] = wire(_FMAP, default_factory=dict)
    finish_reason: str = wire(_STR, default="stop")
    timing: dict[str, float] = wire(_FMAP, default_factory=dict)  # seconds: generate_s, reward_s, ...
    completion_text: str = wire(_STR, default="")
    failed: str | None = wire(Optional(_STR), default=None)  # reason, when generation or the reward failed
    metadata: dict[str, Any] = wire(_MAP, default_factory=dict)
    # The dtypes of the four arrays, in field order, as they travel (numpy dtype strings). Each
    # array is 1-D, so its shape is its byte length / item size. Fixed by this protocol version;
    # a receiver refuses any other value instead of misreading the bytes.
    array_dtypes: str = wire(_STR, default="<i4,<i4,<f4,<i4")
    # The temperature the completion was sampled at (protocol 3.3): the server echoes its
    # assignment's, the learner's intake overwrites it with the one it issued (None: unknown, an
    # older sender; the trainer then uses the run's temperature).
    sampling_temperature: float | None = wire(Optional(_TEMPERATURE), default=None)
    # Multi-turn episodes (protocol 3.6; issue 26): int32 [2K], the (start, end) of each of the
    # model's K turns in ``completion_token_ids``, in order. Tokens outside every span are the
    # environment's (observations, the chat template's glue): fed to the engine, never sampled,
    # so loss mask 0, behavior log-prob 0, and the version of the turn before them. None: one
    # turn, every token sampled (a 3.5 sender).
    turn_spans: np.ndarray | None = wire(Optional(_I32_NON_NEGATIVE), default=None)

    def cross_check(self, where: str) -> None:
        if self.array_dtypes != SAMPLE_ARRAY_DTYPES:
            raise ProtocolError(f"{where}.array_dtypes: {self.array_dtypes!r}; this protocol "
                                f"version sends the arrays as {SAMPLE_ARRAY_DTYPES!r}")
        n = len(self.completion_token_ids)
        if len(self.behavior_logprobs) != n:
            raise ProtocolError(f"{where}.behavior_logprobs: length {len(self.behavior_logprobs)} "
                                f"!= completion_token_ids length {n}")
        if len(self.token_versions) != n:
            raise ProtocolError(f"{where}.token_versions: length {len(self.token_versions)} "
                                f"!= completion_token_ids length {n}")
        if self.group_index >= self.group_size:
            raise ProtocolError(f"{where}.group_index: {self.group_index} >= group_size "
                                f"{self.group_size}")
        if self.finish_reason not in FINISH_REASONS:
            raise ProtocolError(f"{where}.finish_reason: {self.finish_reason!r} not in "
                                f"{FINISH_REASONS}")
        if self.turn_spans is not None:
            check_turn_spans(self.turn_spans, n, f"{where}.turn_spans")

    def to_wire(self) -> list:
        """Hand-written ``to_wire_checked`` for the hot path (same wire form, no per-field loop).

        Maps go out as they are; if one holds a value msgpack cannot pack (a numpy scalar), the
        codec falls back to ``to_wire_checked``, which converts through each field's kind.
        """
        p, c = self.prompt_token_ids, self.completion_token_ids
        lp, v = self.behavior_logprobs, self.token_versions
        try:
            # The dtype singletons (np.dtype("<i4") is np.dtype(np.int32)) identify numpy arrays
            # of the wire dtype; anything else (lists, int64, 2-D) is converted or refused field
            # by field. tobytes() is the C-order copy msgpack needs.
            if (p.dtype is _INT32 and c.dtype is _INT32 and lp.dtype is _FLOAT32
                    and v.dtype is _INT32 and p.ndim == 1 and c.ndim == 1 and lp.ndim == 1
                    and v.ndim == 1 and self.turn_spans is None and FAST_PATHS_CURRENT):
                reward, tau = self.reward, self.sampling_temperature
                return [self.sample_id, self.assignment_id, self.group_index, self.group_size,
                        p.tobytes(), c.tobytes(), lp.tobytes(), v.tobytes(),
                        reward if type(reward) is float else float(reward), self.reward_parts,
                        self.finish_reason, self.timing, self.completion_text, self.failed,
                        self.metadata, SAMPLE_ARRAY_DTYPES,
                        tau if tau is None or type(tau) is float else float(tau), None]
        except AttributeError:
            pass
        return self.to_wire_checked()

    @classmethod
    def from_wire(cls, body: Any, where: str | None = None) -> Sample:
        """Fast path first; anything it does not accept goes through the checked path, which
        either accepts it too (an int reward, a field an older sender omitted) or raises the
        error that names the field."""
        if FAST_PATHS_CURRENT:
            samples = _samples_fast([body])
            if samples is not None:
                return samples[0]
        return cls.from_wire_checked(body, where)

    @property
    def turns(self) -> int:
        """The model's turns in this sample (1 for a single completion)."""
        return 1 if self.turn_spans is None else len(self.turn_spans) // 2

    def loss_mask(self) -> np.ndarray | None:
        """float32 [T]: 1 on the tokens the model sampled, 0 on the environment's; None when
        every token was sampled (no ``turn_spans``)."""
        if self.turn_spans is None:
            return None
        mask = np.zeros(len(self.completion_token_ids), dtype=np.float32)
        for start, end in self.turn_spans.reshape(-1, 2).tolist():
            mask[start:end] = 1.0
        return mask

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced a token of this sample (-1 for no tokens)."""
        return int(self.token_versions.min()) if len(self.token_versions) else -1


@record
class TensorSpec(Struct):
    """One tensor of a weights manifest; its bytes start at ``offset`` of the version's stream."""

    name: str = wire(_STR)
    dtype: str = wire(_STR)  # torch dtype name without prefix: "float32", "bfloat16", ...
    shape: list[int] = wire(IntList())
    offset: int = wire(_NAT)
    nbytes: int = wire(_NAT)


    def cross_check(self, where: str) -> None:
        itemsize = DTYPE_BYTES.get(self.dtype)
        if itemsize is None:
            raise ProtocolError(f"{where}.dtype: {self.dtype!r} not in {tuple(DTYPE_BYTES)}")
        expect = itemsize * math.prod(self.shape)
        if self.nbytes != expect:
            raise ProtocolError(f"{where}.nbytes: {self.nbytes} != {self.dtype} x {self.shape} = "
                                f"{expect} bytes")


MAX_NEW_TOKENS_LIMIT = 1 << 20     # sampling.max_new_tokens above this is refused on the wire


@record
class SamplingParams(Struct):
    """How to sample an assignment's completions: the one set of defaults, on both sides.

    The learner fills it from its config; the server hands it to its engine unchanged. The
    learner recomputes log-probs with the same ``temperature``.
    """

    temperature: float = wire(_TEMPERATURE, default=1.0)
    top_p: float = wire(Float(min_value=1e-9, max_value=1.0), default=1.0)
    top_k: int = wire(_NAT, default=0)  # 0 = no top-k truncation
    max_new_tokens: int = wire(Int(1, MAX_NEW_TOKENS_LIMIT), default=16)
    # The seed of the assignment's completions (protocol 3.4; None: the engine's own randomness).
    # Completion i is drawn from a generator of its own seeded by (seed, i), so the same
    # assignment on the same weights gives the same completions whatever else the server runs.
    seed: int | None = wire(Optional(Int(0, SEED_MAX)), default=None)
    # Stop conditions (protocol 3.5; issue 26.3): a completion ends with the token that completes
    # one of the ``stop`` strings in its text, or that is one of ``stop_token_ids`` (besides the
    # model's EOS); the stopping tokens are kept (they were sampled), finish_reason "stop".
    stop: list[str] = wire(StrList(max_items=MAX_STOP_STRINGS, max_chars=MAX_STOP_CHARS, non_empty=True),
                           default_factory=list)
    stop_token_ids: list[int] = wire(IntList(max_items=MAX_STOP_TOKEN_IDS, max_value=2**31 - 1),
                                     default_factory=list)
    # Episodes (protocol 3.6; issue 26): a server running an environment gives the model at most
    # ``max_turns`` turns (each at most ``max_new_tokens``) and the episode at most
    # ``max_episode_tokens`` tokens after the prompt, observations included (None: max_new_tokens,
    # one turn's worth). A 3.5 learner's assignment: one turn.
    max_turns: int = wire(Int(1, MAX_TURNS), default=1)
    max_episode_tokens: int | None = wire(Optional(Int(1, MAX_NEW_TOKENS_LIMIT)), default=None)

    @property
    def episode_tokens(self) -> int:
        """The most tokens a sample of this assignment may hold after its prompt."""
        return self.max_new_tokens if self.max_episode_tokens is None else self.max_episode_tokens


@record
class WeightsSource(Struct):
    """A rollout server that serves the chunks of the versions it holds to its peers (protocol
    3.8): its relay endpoint and, with CURVE, its relay socket's public key (Z85; "" without)."""

    endpoint: str = wire(_STR)
    public_key: str = wire(_STR, default="")

    def cross_check(self, where: str) -> None:
        if len(self.public_key) not in (0, 40):
            raise ProtocolError(f"{where}.public_key: a 40-character Z85 key or \"\", not "
                                f"{len(self.public_key)} characters")


MAX_WEIGHTS_SOURCES = 8
"""Peers one manifest may name (a relay plan gives each server one parent; the rest is room)."""


@record
class Hello(Message):
    TYPE: ClassVar[str] = "hello"
    server_id: str = wire(_STR)
    engine: str = wire(_STR)
    model: str = wire(_STR)
    version: int = wire(_NAT)  # weights version the server currently serves
    max_concurrency: int = wire(Int(1), default=1)
    metadata: dict[str, Any] = wire(_MAP, default_factory=dict)
    # Where this server relays weight chunks to its peers (protocol 3.8; None: it does not).
    relay: WeightsSource | None = wire(Optional(Nested(WeightsSource)), default=None)


@record
class Welcome(Message):
    TYPE: ClassVar[str] = "welcome"
    learner_id: str = wire(_STR)
    run_id: str = wire(_STR)
    version: int = wire(_NAT)
    weights_endpoint: str = wire(_STR)  # where WeightChunkRequests go ("tcp://host:port")
    weights_kind: str = wire(_STR, default="full")
    metadata: dict[str, Any] = wire(_MAP, default_factory=dict)

    def cross_check(self, where: str) -> None:
        if not self.weights_endpoint.startswith(ENDPOINT_SCHEMES):
            raise ProtocolError(f"{where}.weights_endpoint: {self.weights_endpoint!r} is not a "
                                f"ZeroMQ endpoint ({'|'.join(ENDPOINT_SCHEMES)}...)")
        if self.weights_kind not in WEIGHT_KINDS:
            raise ProtocolError(f"{where}.weights_kind: {self.weights_kind!r} not in {WEIGHT_KINDS}")


@record
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    sender_id: str = wire(_STR)
    version: int = wire(_NAT)
    inflight: int = wire(_NAT, default=0)
    idle_ratio: float = wire(Float(min_value=0.0, max_value=1.0), default=0.0)  # server's engine idle since its last beat


@record
class WorkRequest(Message):
    TYPE: ClassVar[str] = "work_request"
    server_id: str = wire(_STR)
    credits: int = wire(Int(1))  # samples the server can take on now


@record
class Assignment(Message):
    """A lease on one prompt: generate ``group_size`` completions before ``deadline_s`` passes."""

    TYPE: ClassVar[str] = "assignment"
    assignment_id: str = wire(_STR)
    prompt_id: str = wire(_STR)
    prompt_token_ids: np.ndarray = wire(_I32)  # int32 [P]
    group_size: int = wire(Int(1))
    version: int = wire(_NAT)  # learner version when issued
    prompt_text: str = wire(_STR, default="")
    sampling: SamplingParams = wire(Nested(SamplingParams), default_factory=SamplingParams)
    metadata: dict[str, Any] = wire(_MAP, default_factory=dict)  # task data for the reward (answer)
    deadline_s: float = wire(Float(min_value=0.0), default=600.0)  # lease length in seconds from receipt
    attempt: int = wire(Int(1), default=1)
    # Assignments that follow this one to the same server in the same dispatch (protocol 3.2):
    # 0 = the last one, the server may start generating; -1 = unknown (an older learner, or
    # work sent on its own): the server waits its batch window for more to join.
    burst_left: int = wire(Int(-1), default=-1)


@record
class RolloutResult(Message):
    TYPE: ClassVar[str] = "rollout_result"
    server_id: str = wire(_STR)
    samples: list[Sample] = wire(StructList(Sample))

    def to_wire(self) -> list:
        samples = []
        for s in self.samples:
            samples.append(s.to_wire())
        return [self.server_id, samples]

    @classmethod
    def from_wire(cls, body: Any, where: str | None = None) -> RolloutResult:
        if type(body) is list and len(body) >= 2 and FAST_PATHS_CURRENT:
            server_id, samples = body[0], body[1]
            if (type(server_id) is str and type(samples) is list
                    and len(server_id) <= MAX_STR_CHARS and len(samples) <= MAX_LIST_ITEMS):
                # Anything unusual in any sample and the checked path decodes them all, naming
                # the sample and field.
                out = _samples_fast(samples)
                if out is not None:
                    return cls(server_id, out)
        return cls.from_wire_checked(body, where)


@record
class Ack(Message):
    TYPE: ClassVar[str] = "ack"
    sample_ids: list[str] = wire(StrList())
    statuses: list[str] = wire(StrList())

    def cross_check(self, where: str) -> None:
        if len(self.sample_ids) != len(self.statuses):
            raise ProtocolError(f"{where}.statuses: length {len(self.statuses)} != sample_ids "
                                f"length {len(self.sample_ids)}")
        for i, st in enumerate(self.statuses):
            if st not in ACK_STATUSES:
                raise ProtocolError(f"{where}.statuses[{i}]: {st!r} not in {ACK_STATUSES}")

    def to_wire(self) -> list:
        """Two lists of strings go out as they are (one Ack per result: the learner's hot path)."""
        ids, statuses = self.sample_ids, self.statuses
        if type(ids) is list and type(statuses) is list:
            return [ids, statuses]
        return self.to_wire_checked()

    @classmethod
    def from_wire(cls, body: Any, where: str | None = None) -> Ack:
        """The checks of ``from_wire_checked`` in C-level passes (``set``, ``map``, ``max``) for
        a well-formed Ack; anything else goes the checked way, which names what is wrong."""
        if type(body) is list and len(body) >= 2:
            ids, statuses = body[0], body[1]
            if (type(ids) is list and type(statuses) is list
                    and len(ids) == len(statuses) <= MAX_LIST_ITEMS):
                try:
                    if (set(statuses) <= _ACK_STATUS_SET and set(map(type, ids)) <= _STR_TYPE
                            and max(map(len, ids), default=0) <= MAX_STR_CHARS):
                        return cls(ids, statuses)
                except TypeError:           # an unhashable status: the checked path names it
                    pass
        return cls.from_wire_checked(body, where)


@record
class LoraSpec(Struct):
    """The adapter of a LoRA publish (protocol 3.3): the PEFT ``LoraConfig`` fields a rollout
    engine needs to build the learner's adapter (the HF engine passes them to ``LoraConfig``,
    vLLM's writes them into ``adapter_config.json``)."""

    r: int = wire(Int(1, 1 << 16))
    lora_alpha: float = wire(Float(min_value=0.0))
    lora_dropout: float = wire(Float(min_value=0.0, max_value=1.0))
    target_modules: list[str] = wire(StrList())  # module names as PEFT resolved them, sorted
    bias: str = wire(_STR, default="none")          # these three: PEFT's defaults
    use_rslora: bool = wire(_BOOL, default=False)
    fan_in_fan_out: bool = wire(_BOOL, default=False)

    def cross_check(self, where: str) -> None:
        if self.bias not in LORA_BIASES:
            raise ProtocolError(f"{where}.bias: {self.bias!r} not in {LORA_BIASES}")

    def peft_kwargs(self) -> dict[str, Any]:
        """The fields as ``LoraConfig`` keyword arguments."""
        return {**{name: getattr(self, name) for name, _ in self.FIELDS},
                "target_modules": list(self.target_modules)}


@record
class WeightsAvailable(Message):
    """Manifest of a published version: tensors laid end to end, cut into ``num_chunks`` chunks."""

    TYPE: ClassVar[str] = "weights_available"
    version: int = wire(_NAT)
    kind: str = wire(_STR)  # "full" or "lora"
    tensors: list[TensorSpec] = wire(StructList(TensorSpec))
    total_bytes: int = wire(_NAT)
    chunk_bytes: int = wire(Int(1))
    num_chunks: int = wire(_NAT)
    checksum: str = wire(_STR)  # over the chunk checksums, see protocol.chunks
    chunk_checksums: list[str] = wire(StrList(), default_factory=list)
    metadata: dict[str, Any] = wire(_MAP, default_factory=dict)
    # The adapter of a "lora" publish (protocol 3.3; None from an older learner, or for "full").
    lora: LoraSpec | None = wire(Optional(Nested(LoraSpec)), default=None)
    # Peers to fetch this version's chunks from first, in order (protocol 3.8; the relay plan):
    # a chunk one of them cannot give, or gives wrong, comes from the next, the learner last.
    sources: list[WeightsSource] = wire(StructList(WeightsSource), default_factory=list)

    def cross_check(self, where: str) -> None:
        if self.kind not in WEIGHT_KINDS:
            raise ProtocolError(f"{where}.kind: {self.kind!r} not in {WEIGHT_KINDS}")
        if self.lora is not None and self.kind != "lora":
            raise ProtocolError(f"{where}.lora: a LoRA adapter in a {self.kind!r} publish")
        if len(self.sources) > MAX_WEIGHTS_SOURCES:
            raise ProtocolError(f"{where}.sources: {len(self.sources)} peers, at most {MAX_WEIGHTS_SOURCES}")
        for i, src in enumerate(self.sources):
            src.cross_check(f"{where}.sources[{i}]")
        expect = -(-self.total_bytes // self.chunk_bytes)
        if self.num_chunks != expect:
            raise ProtocolError(f"{where}.num_chunks: {self.num_chunks} != ceil(total_bytes / "
                                f"chunk_bytes) = {expect}")
        if self.chunk_checksums and len(self.chunk_checksums) != self.num_chunks:
            raise ProtocolError(f"{where}.chunk_checksums: length {len(self.chunk_checksums)} "
                                f"!= num_chunks {self.num_chunks}")
        end = 0
        for i, t in enumerate(self.tensors):
            t.cross_check(f"{where}.tensors[{i}]")
            if t.offset != end:
                raise ProtocolError(f"{where}.tensors[{i}].offset: {t.offset}, expected {end}")
            end += t.nbytes
        if end != self.total_bytes:
            raise ProtocolError(f"{where}.total_bytes: {self.total_bytes} != sum of tensor "
                                f"sizes {end}")


@record
class WeightChunkRequest(Message):
    """Chunk ``index`` of ``version``. ``base`` (protocol 3.7): the version whose chunk
    ``index`` the requester holds, verified (-1: none): the reply may then be a delta against it."""

    TYPE: ClassVar[str] = "weight_chunk_request"
    version: int = wire(_NAT)
    index: int = wire(_NAT)
    base: int = wire(Int(-1), default=-1)


@record
class WeightChunk(Message):
    """Chunk ``index`` of ``version``; ``data`` travels as its own frame (zero-copy).

    ``encoding`` (protocol 3.7): ``raw``, the chunk's bytes; ``xor-zstd``, a delta against chunk
    ``index`` of version ``base`` (:func:`protocol.chunks.apply_xor_delta`). ``checksum`` is
    always the chunk's own (the manifest's), so a delta is verified once applied."""

    TYPE: ClassVar[str] = "weight_chunk"
    version: int = wire(_NAT)
    index: int = wire(_NAT)
    checksum: str = wire(_STR)
    data: bytes | memoryview = wire(Frame(), default=b"")
    base: int = wire(Int(-1), default=-1)
    encoding: str = wire(_STR, default="raw")

    def cross_check(self, where: str) -> None:
        if self.encoding not in WEIGHT_ENCODINGS:
            raise ProtocolError(f"{where}.encoding: {self.encoding!r} not in {WEIGHT_ENCODINGS}")
        if self.encoding != "raw" and not 0 <= self.base < self.version:
            raise ProtocolError(f"{where}.base: a delta of version {self.version} against "
                                f"{self.base} (an older version is required)")


@record
class WeightsApplied(Message):
    TYPE: ClassVar[str] = "weights_applied"
    server_id: str = wire(_STR)
    version: int = wire(_NAT)
    checksum: str = wire(_STR)
    seconds: float = wire(Float())


@record
class ControlRequest(Message):
    TYPE: ClassVar[str] = "control_request"
    command: str = wire(_STR)  # "get", "set", "status", "stop"
    args: dict[str, Any] = wire(_MAP, default_factory=dict)


@record
class ControlReply(Message):
    TYPE: ClassVar[str] = "control_reply"
    ok: bool = wire(_BOOL)
    result: dict[str, Any] = wire(_MAP, default_factory=dict)
    error: str = wire(_STR, default="")


@record
class Error(Message):
    TYPE: ClassVar[str] = "error"
    code: str = wire(_STR)
    message: str = wire(_STR)
    ref_id: str = wire(_STR, default="")  # id of the message this refers to


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Welcome, Heartbeat, WorkRequest, Assignment, RolloutResult, Ack,
                WeightsAvailable, WeightChunkRequest, WeightChunk, WeightsApplied, ControlRequest,
                ControlReply, Error)
}


def check_turn_spans(spans: np.ndarray, n: int, where: str) -> None:
    """``spans`` (a Sample's ``turn_spans``) are K >= 1 (start, end) pairs, each a non-empty span
    of the ``n`` completion tokens, in order, none overlapping the next."""
    k = len(spans)
    if k == 0 or k % 2 or k // 2 > MAX_TURNS:
        raise ProtocolError(f"{where}: {k} values; (start, end) pairs of 1 to {MAX_TURNS} turns expected")
    flat = spans.astype(np.int64)
    starts, ends = flat[0::2], flat[1::2]
    if not (np.all(starts < ends) and np.all(ends[:-1] <= starts[1:]) and int(ends[-1]) <= n):
        raise ProtocolError(f"{where}: spans {flat.tolist()[:8]} are not non-empty, ordered, "
                            f"non-overlapping spans of the {n} completion tokens")


# ---------------------------------------------------------------------------------------------
# The hot path: the samples of a message decoded in one pass, without the per-field loop.
#
# The fast path below knows these fields by position. If Sample.FIELDS changes (a field added), the
# fast paths switch themselves off until they are taught the new field, and a test fails to say so.
_SAMPLE_FAST_FIELDS = (
    "sample_id", "assignment_id", "group_index", "group_size", "prompt_token_ids",
    "completion_token_ids", "behavior_logprobs", "token_versions", "reward", "reward_parts",
    "finish_reason", "timing", "completion_text", "failed", "metadata", "array_dtypes",
    "sampling_temperature", "turn_spans")
FAST_PATHS_CURRENT = (tuple(name for name, _ in Sample.FIELDS) == _SAMPLE_FAST_FIELDS
                      and tuple(name for name, _ in RolloutResult.FIELDS) == ("server_id", "samples"))
_frombuffer = np.frombuffer
_isfinite = math.isfinite
_join = b"".join
_PLAIN_TYPES = PLAIN_TYPES
_N_SAMPLE_FIELDS = len(_SAMPLE_FAST_FIELDS)
_MAX_ARRAY_BYTES = 4 * MAX_ARRAY_ITEMS


def _samples_fast(ws: list) -> list[Sample] | None:
    """The Samples of the wire arrays ``ws`` (one for ``Sample.from_wire``, all of a result's for
    ``RolloutResult.from_wire``) if every one passes every check of ``Sample.from_wire_checked``;
    else None, and the checked path decides (and names the sample and field).

    The one fast check of a Sample; it never accepts more than the checked path (tests/protocol
    checks both). Written for the interpreter: per sample only checks that 3.11 specialises
    (``type(x) is T``, int and float compares), no call per field, array lengths checked on the
    byte strings with Python ints before any array exists. Then, once for all the samples: each
    kind of per-token array joined into one buffer (one copy; none for one sample), one
    ``frombuffer`` each, one finiteness check over all log-probs and one minimum over all
    versions; the samples' arrays are slices of those. Samples that repeat the previous sample's
    prompt bytes (a group's) share one prompt array.
    """
    fields = []
    for w in ws:
        if type(w) is not list:
            return None
        if len(w) != _N_SAMPLE_FIELDS:
            if len(w) > _N_SAMPLE_FIELDS:
                w = w[:_N_SAMPLE_FIELDS]        # a newer minor version appended fields: ignored
            elif len(w) == _N_SAMPLE_FIELDS - 1:
                w = [*w, None]                  # a 3.3-3.5 sender: no turn_spans
            elif len(w) == _N_SAMPLE_FIELDS - 2:
                w = [*w, None, None]            # a 3.2 sender: no sampling_temperature either
            else:                               # older still: the checked path fills defaults
                return None
        (sample_id, assignment_id, group_index, group_size, prompt, completion, logprob, version,
         reward, reward_parts, finish_reason, timing, text, failed, metadata, dtypes, tau,
         spans) = w
        if spans is not None:                   # a multi-turn sample: the checked path
            return None
        if not (type(sample_id) is str and type(assignment_id) is str and type(text) is str
                and type(finish_reason) is str and type(group_index) is int
                and type(group_size) is int and type(reward) is float
                and type(reward_parts) is dict and type(timing) is dict and type(metadata) is dict
                and type(prompt) is bytes and type(completion) is bytes and type(logprob) is bytes
                and type(version) is bytes
                and 0 <= group_index < group_size
                and reward - reward == 0.0              # finite: inf - inf and NaN - NaN are NaN
                and finish_reason in FINISH_REASONS
                and dtypes == SAMPLE_ARRAY_DTYPES
                and (failed is None or (type(failed) is str and len(failed) <= MAX_STR_CHARS))
                # NaN fails both compares
                and (tau is None or (type(tau) is float
                                     and _TEMPERATURE_MIN <= tau <= _TEMPERATURE_MAX))
                # Size limits as sums: a sum within the limit puts every part within it (a sample
                # over the sum but within each limit takes the checked path, which accepts it).
                and len(sample_id) + len(assignment_id) + len(text) <= MAX_STR_CHARS
                and len(reward_parts) + len(timing) + len(metadata) <= MAX_MAP_ITEMS
                # arrays: all four dtypes are 4 bytes wide; one length for the three per-token ones
                and (n := len(completion)) == len(logprob) == len(version)
                and not (len(prompt) | n) & 3 and len(prompt) + n <= _MAX_ARRAY_BYTES):
            return None
        for k, x in reward_parts.items():
            if type(k) is not str or type(x) is not float or x - x:    # x - x: 0.0, or NaN if not finite
                return None
        for k, x in timing.items():
            if type(k) is not str or type(x) is not float or x - x:
                return None
        # schema.is_plain(metadata), inlined: one call per sample instead of one per value.
        for k, x in metadata.items():
            if type(k) is not str:
                return None
            t = type(x)
            if t is str:
                if len(x) > MAX_STR_CHARS:
                    return None
            elif t not in _PLAIN_TYPES and not is_plain(x, 1):
                return None
        fields.append(w)
    one = len(fields) == 1      # then the loop's names still hold that sample's values
    if one:
        all_logprobs, all_versions = _frombuffer(logprob, _FLOAT32), _frombuffer(version, _INT32)
    else:
        all_logprobs = _frombuffer(_join([w[6] for w in fields]), _FLOAT32)
        all_versions = _frombuffer(_join([w[7] for w in fields]), _INT32)
    # x·x is NaN/inf iff some x is (or it overflows; then the checked path decides exactly).
    # argmin + item is about 3x cheaper than min() for a 1k-element array.
    if len(all_versions) and not (_isfinite(all_logprobs.dot(all_logprobs))
                                  and all_versions.item(all_versions.argmin()) >= 0):
        return None
    if one:
        return [Sample(sample_id, assignment_id, group_index, group_size,
                       _frombuffer(prompt, _INT32), _frombuffer(completion, _INT32), all_logprobs,
                       all_versions, reward, reward_parts, finish_reason, timing, text, failed,
                       metadata, SAMPLE_ARRAY_DTYPES, tau, None)]
    all_completions = _frombuffer(_join([w[5] for w in fields]), _INT32)
    out = []
    start = 0
    last_prompt, prompt_ids = None, None
    for (sample_id, assignment_id, group_index, group_size, prompt, completion, _, _, reward,
         reward_parts, finish_reason, timing, text, failed, metadata, _, tau, _) in fields:
        if prompt != last_prompt:
            last_prompt, prompt_ids = prompt, _frombuffer(prompt, _INT32)
        end = start + (len(completion) >> 2)
        out.append(Sample(sample_id, assignment_id, group_index, group_size, prompt_ids,
                          all_completions[start:end], all_logprobs[start:end],
                          all_versions[start:end], reward, reward_parts, finish_reason, timing,
                          text, failed, metadata, SAMPLE_ARRAY_DTYPES, tau, None))
        start = end
    return out


# The fast finiteness check may overflow (|x| > 1.8e19) or meet a signalling NaN; numpy would
# print a RuntimeWarning for what is only a hint to take the exact path. Scoped to this module.
warnings.filterwarnings("ignore", r"(overflow|invalid value) encountered in dot", RuntimeWarning,
                        __name__)
