"""Hypothesis strategies for every protocol message, plus a field-by-field comparison.

``MESSAGE_STRATEGIES`` must cover ``protocol.MESSAGE_TYPES`` (a test checks it), so a new message
type cannot land without a round-trip test.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol import (
    ACK_STATUSES,
    FINISH_REASONS,
    Ack,
    Assignment,
    ControlReply,
    ControlRequest,
    Error,
    Heartbeat,
    Hello,
    LoraSpec,
    RolloutResult,
    Sample,
    SamplingParams,
    TensorSpec,
    WeightChunk,
    WeightChunkRequest,
    WeightsApplied,
    WeightsAvailable,
    Welcome,
    WorkRequest,
)
from protocol.chunks import DTYPE_BYTES, chunk_checksum, combine_checksums
from protocol.messages import MAX_NEW_TOKENS_LIMIT

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MAX = 2**63 - 1

texts = st.text(max_size=24)
ids = st.text(min_size=1, max_size=24)
nats = st.integers(0, INT64_MAX)
positives = st.integers(1, INT64_MAX)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
float_maps = st.dictionaries(texts, finite_floats, max_size=4)

# Plain msgpack values as the protocol allows them in metadata / args maps (NaN left out only so
# that == works in the comparison; NaN itself is legal there).
plain_leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | finite_floats
                | texts | st.binary(max_size=16))
plain_values = st.recursive(
    plain_leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
plain_maps = st.dictionaries(texts, plain_values, max_size=4)


def int32_arrays(n: int, min_value: int = INT32_MIN) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.int32, n, elements=st.integers(min_value, INT32_MAX))


def finite_float32_arrays(n: int) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.float32, n, elements=st.floats(width=32, allow_nan=False,
                                                        allow_infinity=False))


@st.composite
def samples(draw, max_tokens: int = 40) -> Sample:
    n = draw(st.integers(0, max_tokens))
    group_size = draw(st.integers(1, 64))
    return Sample(
        sample_id=draw(ids), assignment_id=draw(ids),
        group_index=draw(st.integers(0, group_size - 1)), group_size=group_size,
        prompt_token_ids=draw(int32_arrays(draw(st.integers(0, max_tokens)))),
        completion_token_ids=draw(int32_arrays(n)),
        behavior_logprobs=draw(finite_float32_arrays(n)),
        token_versions=draw(int32_arrays(n, min_value=0)),
        reward=draw(finite_floats), reward_parts=draw(float_maps),
        finish_reason=draw(st.sampled_from(FINISH_REASONS)), timing=draw(float_maps),
        completion_text=draw(texts), failed=draw(st.none() | texts), metadata=draw(plain_maps),
        sampling_temperature=draw(st.none() | st.floats(1e-6, 1e6)),
    )


lora_specs = st.builds(
    LoraSpec, r=st.integers(1, 1 << 16), lora_alpha=st.floats(0.0, 1e6),
    lora_dropout=st.floats(0.0, 1.0), target_modules=st.lists(ids, max_size=4),
    bias=st.sampled_from(["none", "all", "lora_only"]), use_rslora=st.booleans(),
    fan_in_fan_out=st.booleans())


@st.composite
def weights_available(draw) -> WeightsAvailable:
    shapes = draw(st.lists(st.lists(st.integers(0, 16), max_size=3), max_size=6))
    tensors, offset = [], 0
    for i, shape in enumerate(shapes):
        dtype = draw(st.sampled_from(["float32", "bfloat16", "float16", "int64"]))
        nbytes = DTYPE_BYTES[dtype] * int(np.prod(shape, dtype=np.int64))
        tensors.append(TensorSpec(name=f"layers.{i}.weight", dtype=dtype, shape=shape,
                                  offset=offset, nbytes=nbytes))
        offset += nbytes
    chunk_bytes = draw(st.integers(max(1, offset // 16), max(1, offset) + 10))
    num_chunks = -(-offset // chunk_bytes)
    chunk_checksums = draw(st.just([f"{i:032x}" for i in range(num_chunks)]) | st.just([]))
    kind = draw(st.sampled_from(["full", "lora"]))
    return WeightsAvailable(
        version=draw(nats), kind=kind, tensors=tensors,
        total_bytes=offset, chunk_bytes=chunk_bytes, num_chunks=num_chunks,
        checksum=combine_checksums(chunk_checksums), chunk_checksums=chunk_checksums,
        metadata=draw(plain_maps), lora=draw(lora_specs | st.none()) if kind == "lora" else None)


@st.composite
def weight_chunks(draw) -> WeightChunk:
    data = draw(st.binary(max_size=2048))
    return WeightChunk(version=draw(nats), index=draw(nats), checksum=chunk_checksum(data),
                       data=data)


@st.composite
def acks(draw) -> Ack:
    n = draw(st.integers(0, 8))
    return Ack(sample_ids=draw(st.lists(ids, min_size=n, max_size=n)),
               statuses=draw(st.lists(st.sampled_from(ACK_STATUSES), min_size=n, max_size=n)))


sampling_params = st.builds(
    SamplingParams, temperature=st.floats(1e-6, 1e6), top_p=st.floats(1e-9, 1.0),
    top_k=nats, max_new_tokens=st.integers(1, MAX_NEW_TOKENS_LIMIT),
    seed=st.none() | st.integers(0, (1 << 63) - 1))

MESSAGE_STRATEGIES: dict[type, st.SearchStrategy] = {
    Hello: st.builds(Hello, server_id=ids, engine=texts, model=texts, version=nats,
                     max_concurrency=positives, metadata=plain_maps),
    Welcome: st.builds(Welcome, learner_id=ids, run_id=ids, version=nats,
                       weights_endpoint=st.sampled_from(["tcp://127.0.0.1:5556", "ipc:///tmp/w",
                                                         "tcp://[::1]:7"]),
                       weights_kind=st.sampled_from(["full", "lora"]), metadata=plain_maps),
    Heartbeat: st.builds(Heartbeat, sender_id=ids, version=nats, inflight=nats),
    WorkRequest: st.builds(WorkRequest, server_id=ids, credits=positives),
    Assignment: st.builds(
        Assignment, assignment_id=ids, prompt_id=ids,
        prompt_token_ids=st.integers(0, 64).flatmap(int32_arrays), group_size=positives,
        version=nats, prompt_text=texts, sampling=sampling_params, metadata=plain_maps,
        deadline_s=st.floats(0, 1e9), attempt=positives),
    RolloutResult: st.builds(RolloutResult, server_id=ids, samples=st.lists(samples(), max_size=4)),
    Ack: acks(),
    WeightsAvailable: weights_available(),
    WeightChunkRequest: st.builds(WeightChunkRequest, version=nats, index=nats),
    WeightChunk: weight_chunks(),
    WeightsApplied: st.builds(WeightsApplied, server_id=ids, version=nats, checksum=texts,
                              seconds=finite_floats),
    ControlRequest: st.builds(ControlRequest, command=st.sampled_from(["get", "set", "status", "stop"]),
                              args=plain_maps),
    ControlReply: st.builds(ControlReply, ok=st.booleans(), result=plain_maps, error=texts),
    Error: st.builds(Error, code=texts, message=texts, ref_id=texts),
}


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Deep equality that understands numpy arrays (dtype included) and bytes-like frames."""
    if dataclasses.is_dataclass(a):
        assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert a.tobytes() == b.tobytes(), f"{where}: values differ"
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, (memoryview, bytearray)) or isinstance(b, (memoryview, bytearray)):
        assert bytes(a) == bytes(b), where
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"
