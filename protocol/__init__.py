"""slipstream wire protocol: message types, msgpack codec, validation, errors.

The process plumbing the services share but that is not the wire format (event log, sockets,
CURVE, the HTTP endpoint) is ``protocol.plumbing``. Imports the stdlib, msgpack, numpy, pyzmq and
xxhash only — never torch (docs/design.md §2).
"""

from protocol.codec import (
    PROTOCOL_VERSION,
    decode,
    decode_header,
    encode,
    message_id,
    new_message_id,
)
from protocol.errors import ProtocolError, StartupError
from protocol.ids import parse_sample_id, sample_id
from protocol.messages import (
    ACK_STATUSES,
    BUCKET_KEY,
    DATASET_KEY,
    FINISH_REASONS,
    MAX_TURNS,
    MESSAGE_TYPES,
    PROMPT_MESSAGES_KEY,
    SEED_MAX,
    Ack,
    Assignment,
    ControlReply,
    ControlRequest,
    Error,
    Heartbeat,
    Hello,
    LoraSpec,
    Message,
    RolloutResult,
    Sample,
    SamplingParams,
    TensorSpec,
    WeightChunk,
    WeightChunkRequest,
    WeightsApplied,
    WeightsAvailable,
    WeightsSource,
    Welcome,
    WorkRequest,
)

__all__ = [
    "ACK_STATUSES", "BUCKET_KEY", "DATASET_KEY", "PROMPT_MESSAGES_KEY", "FINISH_REASONS", "MAX_TURNS", "MESSAGE_TYPES", "PROTOCOL_VERSION", "SEED_MAX", "Ack", "Assignment",
    "ControlReply", "ControlRequest", "Error", "Heartbeat", "Hello", "LoraSpec", "Message", "ProtocolError",
    "RolloutResult", "Sample", "SamplingParams", "StartupError", "TensorSpec", "WeightChunk", "WeightChunkRequest", "WeightsApplied",
    "WeightsAvailable", "WeightsSource", "Welcome", "WorkRequest", "decode", "decode_header", "encode", "message_id",
    "new_message_id", "parse_sample_id", "sample_id",
]
