"""Message types for the whole flow of DESIGN.md §1/§6.

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

All fields are required unless they have a default. Field kinds (see ``schema``) define the wire
form and the validation applied on decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from protocol.errors import ProtocolError
from protocol.schema import (
    Array,
    Bool,
    Float,
    FloatMap,
    Frame,
    Int,
    IntList,
    Optional,
    PlainMap,
    Str,
    StrList,
    Struct,
    StructList,
)

_STR, _INT, _NAT, _FLOAT, _BOOL = Str(), Int(), Int(min_value=0), Float(), Bool()
_MAP, _FMAP = PlainMap(), FloatMap()
_I32, _F32_FINITE = Array("int32"), Array("float32", finite=True)

FINISH_REASONS = ("stop", "length", "abort", "error")
ACK_STATUSES = ("accepted", "duplicate", "stale", "invalid")
WEIGHT_KINDS = ("full", "lora")


class Message(Struct):
    """A top-level message; ``TYPE`` is its name in the header."""

    TYPE: ClassVar[str] = ""


@dataclass(slots=True)
class Sample(Struct):
    """One scored completion. Groups (the n completions of one prompt) share ``assignment_id``."""

    sample_id: str
    assignment_id: str
    group_index: int
    group_size: int
    prompt_token_ids: np.ndarray           # int32 [P]
    completion_token_ids: np.ndarray       # int32 [T]
    behavior_logprobs: np.ndarray          # float32 [T], log-prob of each sampled token (finite)
    token_versions: np.ndarray             # int32 [T], policy version that produced each token
    reward: float
    reward_parts: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "stop"
    timing: dict[str, float] = field(default_factory=dict)   # seconds: generate_s, reward_s, ...
    completion_text: str = ""
    failed: str | None = None              # reason, when generation or the reward failed
    metadata: dict[str, Any] = field(default_factory=dict)

    FIELDS: ClassVar = (
        ("sample_id", _STR), ("assignment_id", _STR), ("group_index", _NAT), ("group_size", Int(1)),
        ("prompt_token_ids", _I32), ("completion_token_ids", _I32),
        ("behavior_logprobs", _F32_FINITE), ("token_versions", _I32),
        ("reward", _FLOAT), ("reward_parts", _FMAP), ("finish_reason", _STR), ("timing", _FMAP),
        ("completion_text", _STR), ("failed", Optional(_STR)), ("metadata", _MAP),
    )

    @classmethod
    def from_wire(cls, body: Any, where: str | None = None) -> Sample:
        s = super(Sample, cls).from_wire(body, where)
        where = where or "Sample"
        n = len(s.completion_token_ids)
        if len(s.behavior_logprobs) != n:
            raise ProtocolError(f"{where}.behavior_logprobs: length {len(s.behavior_logprobs)} "
                                 f"!= completion_token_ids length {n}")
        if len(s.token_versions) != n:
            raise ProtocolError(f"{where}.token_versions: length {len(s.token_versions)} "
                                 f"!= completion_token_ids length {n}")
        if s.group_index >= s.group_size:
            raise ProtocolError(f"{where}.group_index: {s.group_index} >= group_size {s.group_size}")
        if s.finish_reason not in FINISH_REASONS:
            raise ProtocolError(f"{where}.finish_reason: {s.finish_reason!r} not in {FINISH_REASONS}")
        if n and int(s.token_versions.min()) < 0:
            raise ProtocolError(f"{where}.token_versions: negative version")
        return s

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced a token of this sample (-1 for no tokens)."""
        return int(self.token_versions.min()) if len(self.token_versions) else -1


@dataclass(slots=True)
class TensorSpec(Struct):
    """One tensor of a weights manifest; its bytes start at ``offset`` of the version's stream."""

    name: str
    dtype: str            # torch dtype name without prefix: "float32", "bfloat16", ...
    shape: list[int]
    offset: int
    nbytes: int

    FIELDS: ClassVar = (("name", _STR), ("dtype", _STR), ("shape", IntList()),
                        ("offset", _NAT), ("nbytes", _NAT))


@dataclass(slots=True)
class Hello(Message):
    TYPE: ClassVar[str] = "hello"
    server_id: str
    engine: str
    model: str
    version: int                  # weights version the server currently serves
    max_concurrency: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    FIELDS: ClassVar = (("server_id", _STR), ("engine", _STR), ("model", _STR), ("version", _NAT),
                        ("max_concurrency", Int(1)), ("metadata", _MAP))


@dataclass(slots=True)
class Welcome(Message):
    TYPE: ClassVar[str] = "welcome"
    learner_id: str
    run_id: str
    version: int
    weights_kind: str = "full"
    metadata: dict[str, Any] = field(default_factory=dict)
    FIELDS: ClassVar = (("learner_id", _STR), ("run_id", _STR), ("version", _NAT),
                        ("weights_kind", _STR), ("metadata", _MAP))


@dataclass(slots=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    sender_id: str
    version: int
    inflight: int = 0
    FIELDS: ClassVar = (("sender_id", _STR), ("version", _NAT), ("inflight", _NAT))


@dataclass(slots=True)
class WorkRequest(Message):
    TYPE: ClassVar[str] = "work_request"
    server_id: str
    credits: int                  # samples the server can take on now
    FIELDS: ClassVar = (("server_id", _STR), ("credits", Int(1)))


@dataclass(slots=True)
class Assignment(Message):
    """A lease on one prompt: generate ``group_size`` completions before ``deadline_s`` passes."""

    TYPE: ClassVar[str] = "assignment"
    assignment_id: str
    prompt_id: str
    prompt_token_ids: np.ndarray   # int32 [P]
    group_size: int
    version: int                   # learner version when issued
    prompt_text: str = ""
    sampling: dict[str, Any] = field(default_factory=dict)   # temperature, top_p, max_new_tokens
    metadata: dict[str, Any] = field(default_factory=dict)   # task data for the reward (answer)
    deadline_s: float = 600.0      # lease length in seconds from receipt
    attempt: int = 1
    FIELDS: ClassVar = (("assignment_id", _STR), ("prompt_id", _STR), ("prompt_token_ids", _I32),
                        ("group_size", Int(1)), ("version", _NAT), ("prompt_text", _STR),
                        ("sampling", _MAP), ("metadata", _MAP), ("deadline_s", Float()),
                        ("attempt", Int(1)))


@dataclass(slots=True)
class RolloutResult(Message):
    TYPE: ClassVar[str] = "rollout_result"
    server_id: str
    samples: list[Sample]
    FIELDS: ClassVar = (("server_id", _STR), ("samples", StructList(Sample)))


@dataclass(slots=True)
class Ack(Message):
    TYPE: ClassVar[str] = "ack"
    sample_ids: list[str]
    statuses: list[str]
    FIELDS: ClassVar = (("sample_ids", StrList()), ("statuses", StrList()))

    @classmethod
    def from_wire(cls, body: Any, where: str | None = None) -> Ack:
        a = super(Ack, cls).from_wire(body, where)
        if len(a.sample_ids) != len(a.statuses):
            raise ProtocolError(f"Ack.statuses: length {len(a.statuses)} != sample_ids length "
                                 f"{len(a.sample_ids)}")
        for i, st in enumerate(a.statuses):
            if st not in ACK_STATUSES:
                raise ProtocolError(f"Ack.statuses[{i}]: {st!r} not in {ACK_STATUSES}")
        return a


@dataclass(slots=True)
class WeightsAvailable(Message):
    """Manifest of a published version: tensors laid end to end, cut into ``num_chunks`` chunks."""

    TYPE: ClassVar[str] = "weights_available"
    version: int
    kind: str                      # "full" or "lora"
    tensors: list[TensorSpec]
    total_bytes: int
    chunk_bytes: int
    num_chunks: int
    checksum: str                  # over the chunk checksums, see protocol.weights
    chunk_checksums: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)   # e.g. the LoRA config
    FIELDS: ClassVar = (("version", _NAT), ("kind", _STR), ("tensors", StructList(TensorSpec)),
                        ("total_bytes", _NAT), ("chunk_bytes", Int(1)), ("num_chunks", _NAT),
                        ("checksum", _STR), ("chunk_checksums", StrList()), ("metadata", _MAP))

    @classmethod
    def from_wire(cls, body: Any, where: str | None = None) -> WeightsAvailable:
        w = super(WeightsAvailable, cls).from_wire(body, where)
        if w.kind not in WEIGHT_KINDS:
            raise ProtocolError(f"WeightsAvailable.kind: {w.kind!r} not in {WEIGHT_KINDS}")
        expect = -(-w.total_bytes // w.chunk_bytes)
        if w.num_chunks != expect:
            raise ProtocolError(f"WeightsAvailable.num_chunks: {w.num_chunks} != ceil(total_bytes / "
                                 f"chunk_bytes) = {expect}")
        if w.chunk_checksums and len(w.chunk_checksums) != w.num_chunks:
            raise ProtocolError("WeightsAvailable.chunk_checksums: length != num_chunks")
        end = 0
        for i, t in enumerate(w.tensors):
            if t.offset != end:
                raise ProtocolError(f"WeightsAvailable.tensors[{i}].offset: {t.offset}, expected {end}")
            end += t.nbytes
        if end != w.total_bytes:
            raise ProtocolError(f"WeightsAvailable.total_bytes: {w.total_bytes} != sum of tensor "
                                 f"sizes {end}")
        return w


@dataclass(slots=True)
class WeightChunkRequest(Message):
    TYPE: ClassVar[str] = "weight_chunk_request"
    version: int
    index: int
    FIELDS: ClassVar = (("version", _NAT), ("index", _NAT))


@dataclass(slots=True)
class WeightChunk(Message):
    """Chunk ``index`` of ``version``; ``data`` travels as its own frame (zero-copy)."""

    TYPE: ClassVar[str] = "weight_chunk"
    version: int
    index: int
    checksum: str
    data: bytes | memoryview = b""
    FIELDS: ClassVar = (("version", _NAT), ("index", _NAT), ("checksum", _STR), ("data", Frame()))


@dataclass(slots=True)
class WeightsApplied(Message):
    TYPE: ClassVar[str] = "weights_applied"
    server_id: str
    version: int
    checksum: str
    seconds: float
    FIELDS: ClassVar = (("server_id", _STR), ("version", _NAT), ("checksum", _STR),
                        ("seconds", Float()))


@dataclass(slots=True)
class ControlRequest(Message):
    TYPE: ClassVar[str] = "control_request"
    command: str                   # "get", "set", "status", "stop"
    args: dict[str, Any] = field(default_factory=dict)
    FIELDS: ClassVar = (("command", _STR), ("args", _MAP))


@dataclass(slots=True)
class ControlReply(Message):
    TYPE: ClassVar[str] = "control_reply"
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    FIELDS: ClassVar = (("ok", _BOOL), ("result", _MAP), ("error", _STR))


@dataclass(slots=True)
class Error(Message):
    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    ref_id: str = ""               # id of the message this refers to
    FIELDS: ClassVar = (("code", _STR), ("message", _STR), ("ref_id", _STR))


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Welcome, Heartbeat, WorkRequest, Assignment, RolloutResult, Ack,
                WeightsAvailable, WeightChunkRequest, WeightChunk, WeightsApplied, ControlRequest,
                ControlReply, Error)
}
