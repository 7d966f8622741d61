"""Bad input of every kind: the codec raises ProtocolError and nothing else, naming the field.

Random bytes, random frame lists, mutated valid frames (bit flips, truncation, garbage), valid
msgpack of the wrong shape, and targeted mutations of a valid body (type swaps, wrong lengths,
ragged array bytes, NaN/inf log-probs, protocol-1 layouts, oversize, wrong version, unknown
type). Bodies are positional (``protocol.codec``): ``F`` maps a sample field to its position.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_strategies import MESSAGE_STRATEGIES, plain_values

import protocol
from protocol import MESSAGE_TYPES, PROTOCOL_VERSION, ProtocolError, RolloutResult, Sample, decode, encode
from protocol import codec as codec_module
from protocol.schema import wire_field_names

# Generated float32 log-probs above 1.8e19 make the fast x·x finiteness hint overflow. The
# protocol silences that warning with a module-scoped filter (checked in a real interpreter by
# test_protocol_interop); pytest's per-test warning capture replaces filters, so say it here too.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in dot:RuntimeWarning")

FUZZ = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
any_message = st.sampled_from(list(MESSAGE_STRATEGIES.values())).flatmap(lambda s: s)


def decode_or_protocol_error(frames) -> protocol.Message | None:
    """decode(); ProtocolError is the one accepted failure (anything else fails the test)."""
    try:
        return decode(frames)
    except ProtocolError as e:
        assert str(e), "a ProtocolError must say what is wrong"
        return None


def good_sample(n: int = 4) -> Sample:
    return Sample(
        sample_id="s-1", assignment_id="a-1", group_index=1, group_size=4,
        prompt_token_ids=np.arange(3, dtype=np.int32), completion_token_ids=np.arange(n, dtype=np.int32),
        behavior_logprobs=-np.linspace(0.1, 2.0, n, dtype=np.float32),
        token_versions=np.full(n, 2, dtype=np.int32), reward=0.5,
        reward_parts={"correct": 1.0}, finish_reason="length", timing={"generate_s": 0.1},
        completion_text="1234", metadata={"task": "add", "nested": {"x": [1, 2]}},
        sampling_temperature=0.7)


def good_frames() -> list[bytes]:
    return encode(RolloutResult(server_id="srv-0", samples=[good_sample()]))


def header_bytes(mtype: str) -> bytes:
    return msgpack.packb([*PROTOCOL_VERSION, mtype, "x", 1.0])


F = {name: i for i, name in enumerate(wire_field_names(Sample))}    # sample field -> position


# --- random input --------------------------------------------------------------------------------

@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=20))
def test_random_frame_lists(frames):
    decode_or_protocol_error(frames)
    assert isinstance(protocol.message_id(frames), str)


@FUZZ
@given(st.one_of(st.none(), st.integers(), st.text(), st.binary(), st.lists(st.integers()),
                 st.dictionaries(st.text(), st.integers()), st.tuples(st.binary(), st.integers())))
def test_frames_that_are_not_a_list_of_bytes(frames):
    decode_or_protocol_error(frames)


@FUZZ
@given(body=st.binary(max_size=300), mtype=st.sampled_from(sorted(MESSAGE_TYPES)))
def test_valid_header_random_body_bytes(body, mtype):
    header = header_bytes(mtype)
    decode_or_protocol_error([header, body])
    decode_or_protocol_error([header, body, b"raw"])


@FUZZ
@given(body=plain_values, mtype=st.sampled_from(sorted(MESSAGE_TYPES)))
def test_valid_header_random_msgpack_body(body, mtype):
    header = header_bytes(mtype)
    decode_or_protocol_error([header, msgpack.packb(body), b"raw"][:3 if mtype == "weight_chunk" else 2])


@FUZZ
@given(header=plain_values, body=st.binary(max_size=32))
def test_random_header(header, body):
    decode_or_protocol_error([msgpack.packb(header), body])


@FUZZ
@given(field=st.integers(0, 5), value=plain_values)
def test_header_field_replaced_by_any_value(field, value):
    frames = encode(protocol.Heartbeat("srv", 1))
    header = msgpack.unpackb(frames[0])      # [major, minor, type, id, ts]
    if field < len(header):
        header[field] = value
    else:
        header.append(value)                 # a newer minor version's extra header value
    decode_or_protocol_error([msgpack.packb(header), frames[1]])


# --- mutated valid frames ------------------------------------------------------------------------

@FUZZ
@given(msg=any_message, data=st.data())
def test_bit_flips(msg, data):
    frames = encode(msg, msg_id="fuzz-0")   # fixed length, so that draws replay
    i = data.draw(st.integers(0, 1), label="frame")
    buf = bytearray(frames[i])
    for _ in range(data.draw(st.integers(1, 8), label="flips")):
        bit = data.draw(st.integers(0, len(buf) * 8 - 1))
        buf[bit // 8] ^= 1 << (bit % 8)
    frames[i] = bytes(buf)
    decode_or_protocol_error(frames)


@FUZZ
@given(msg=any_message, data=st.data())
def test_truncation_and_garbage(msg, data):
    frames = encode(msg, msg_id="fuzz-0")   # fixed length, so that draws replay
    i = data.draw(st.integers(0, 1), label="frame")
    cut = data.draw(st.integers(0, len(frames[i])), label="cut")
    tail = data.draw(st.binary(max_size=16), label="tail")
    frames[i] = frames[i][:cut] + tail
    decode_or_protocol_error(frames)


@FUZZ
@given(msg=any_message, data=st.data())
def test_frame_list_surgery(msg, data):
    frames = encode(msg, msg_id="fuzz-0")   # fixed length, so that draws replay
    op = data.draw(st.sampled_from(["drop", "extra", "swap", "dup_header", "empty"]))
    if op == "drop":
        del frames[data.draw(st.integers(0, len(frames) - 1))]
    elif op == "extra":
        frames.append(data.draw(st.binary(max_size=8)))
    elif op == "swap":
        frames[0], frames[1] = frames[1], frames[0]
    elif op == "dup_header":
        frames.insert(1, frames[0])
    else:
        frames = [b"" for _ in frames]
    out = decode_or_protocol_error(frames)
    if op in ("drop", "extra", "dup_header", "empty"):
        assert out is None, f"{op}: a wrong number of frames must be refused"


def _mutations_of(value):
    """Values of another type than ``value`` (the field-type swap)."""
    pool = [None, True, -1, 2**40, 1.5, float("nan"), "text", b"bytes", [], [1, "a"], {}, {"k": 1},
            ["<i4", [1], b"\0\0\0\0"], [1, 2, 3, 4]]
    return [v for v in pool if type(v) is not type(value)]


@pytest.mark.parametrize("field", [name for name, _ in Sample.FIELDS])
def test_every_sample_field_type_swap_is_refused_or_harmless(field):
    frames = good_frames()
    body = msgpack.unpackb(frames[1])
    for bad in _mutations_of(body[1][0][F[field]]):
        mutated = copy.deepcopy(body)
        mutated[1][0][F[field]] = bad
        out = decode_or_protocol_error([frames[0], msgpack.packb(mutated)])
        if out is not None:    # the legal swaps: a reason in `failed`, an int reward
            assert (field, type(bad)) in {("failed", str), ("reward", int),
                                          ("sampling_temperature", type(None))}, (field, bad)


@pytest.mark.parametrize("cls", list(MESSAGE_TYPES.values()), ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_field_type_swap_of_every_message(cls, data):
    msg = data.draw(MESSAGE_STRATEGIES[cls])
    frames = encode(msg, msg_id="fuzz-0")   # fixed length, so that draws replay
    body = msgpack.unpackb(frames[1])
    field = data.draw(st.integers(0, len(body) - 1), label="field position")
    bad = data.draw(st.sampled_from(_mutations_of(body[field])) | plain_values)
    body[field] = bad
    frames[1] = msgpack.packb(body)
    try:
        decode(frames)
    except ProtocolError as e:
        assert f"{cls.__name__}." in str(e), f"error does not name a field: {e}"


# --- fast path never accepts more than the checked path -----------------------------------------

def _set_item(s: list, field: str, index: int, value, dtype: str) -> None:
    """Overwrite one element of the raw-bytes array ``field`` of wire sample ``s``."""
    arr = np.frombuffer(s[F[field]], dtype=dtype).copy()
    arr[index] = value
    s[F[field]] = arr.tobytes()


def _set(field: str, value) -> Callable[[list], None]:
    return lambda s: s.__setitem__(F[field], value)


BODY_MUTATIONS: dict[str, Callable[[list], None]] = dict([
    ("logprob NaN", lambda s: _set_item(s, "behavior_logprobs", 0, np.nan, "<f4")),
    ("logprob inf", lambda s: _set_item(s, "behavior_logprobs", 1, -np.inf, "<f4")),
    ("logprobs longer", _set("behavior_logprobs", b"\0" * 16)),
    ("versions shorter", _set("token_versions", b"\0" * 8)),
    ("negative version", lambda s: _set_item(s, "token_versions", 1, -3, "<i4")),
    ("ragged prompt bytes", _set("prompt_token_ids", b"\0" * 13)),
    ("ragged completion bytes", lambda s: [s.__setitem__(F[f], b"\0" * 10) for f in (
        "completion_token_ids", "behavior_logprobs", "token_versions")]),
    ("array as list of ints", _set("prompt_token_ids", [1, 2, 3])),
    ("array as protocol-1 triple", _set("completion_token_ids", ["<i4", [3], b"\0" * 12])),
    ("array as str", _set("prompt_token_ids", "abc")),
    ("array as map", _set("prompt_token_ids", {"dtype": "<i4", "data": b""})),
    ("group_index == size", lambda s: s.__setitem__(F["group_index"], s[F["group_size"]])),
    ("group_index negative", _set("group_index", -1)),
    ("reward inf", _set("reward", float("inf"))),
    ("reward_parts NaN", lambda s: s[F["reward_parts"]].__setitem__("x", float("nan"))),
    ("timing str", lambda s: s[F["timing"]].__setitem__("x", "1")),
    ("timing bytes key", lambda s: s[F["timing"]].__setitem__(b"k", 1.0)),
    ("metadata deep", lambda s: s[F["metadata"]].__setitem__("x", {"deep": [[[[[[[[[1]]]]]]]]]})),
    ("metadata bytes key", lambda s: s[F["metadata"]].__setitem__(b"k", 1)),
    ("finish_reason", _set("finish_reason", "done")),
    ("failed int", _set("failed", 3)),
    ("required fields cut", lambda s: s.__delitem__(slice(F["reward"], None))),
    ("text oversize", _set("completion_text", "x" * ((1 << 20) + 1))),
    ("id oversize", _set("sample_id", "x" * ((1 << 20) + 1))),
    ("temperature NaN", _set("sampling_temperature", float("nan"))),
    ("temperature inf", _set("sampling_temperature", float("inf"))),
    ("temperature negative", _set("sampling_temperature", -0.5)),
    ("temperature zero", _set("sampling_temperature", 0.0)),
    ("temperature bool", _set("sampling_temperature", True)),
    ("temperature str", _set("sampling_temperature", "0.7")),
])


# --- specific bad inputs name the offending field ------------------------------------------------

S0 = r"RolloutResult\.samples\[0\]"


def _body_case(mutate: Callable[[list], None]) -> list[bytes]:
    frames = good_frames()
    body = msgpack.unpackb(frames[1])        # [server_id, samples]
    mutate(body)
    return [frames[0], msgpack.packb(body)]


def _sample_case(mutate: Callable[[list], None]) -> list[bytes]:
    return _body_case(lambda b: mutate(b[1][0]))


def _header_case(index: int, value) -> list[bytes]:
    frames = good_frames()
    header = msgpack.unpackb(frames[0])      # [major, minor, type, id, ts]
    header[index] = value
    return [msgpack.packb(header), frames[1]]


NAMED_ERRORS = [
    ("NaN logprob", lambda: _sample_case(BODY_MUTATIONS["logprob NaN"]), S0 + r"\.behavior_logprobs: .*NaN"),
    ("inf logprob", lambda: _sample_case(BODY_MUTATIONS["logprob inf"]),
     S0 + r"\.behavior_logprobs: .*infinite"),
    ("logprobs length", lambda: _sample_case(_set("behavior_logprobs", b"\0" * 12)),
     S0 + r"\.behavior_logprobs: length 3 != completion_token_ids length 4"),
    ("versions length", lambda: _sample_case(BODY_MUTATIONS["versions shorter"]),
     S0 + r"\.token_versions: length 2 != completion_token_ids length 4"),
    ("ragged bytes", lambda: _sample_case(_set("completion_token_ids", b"\0" * 10)),
     S0 + r"\.completion_token_ids: 10 bytes are not a whole number of 4-byte int32 values"),
    ("ragged float bytes", lambda: _sample_case(_set("behavior_logprobs", b"\0" * 17)),
     S0 + r"\.behavior_logprobs: 17 bytes are not a whole number of 4-byte float32 values"),
    ("ints as msgpack list", lambda: _sample_case(_set("prompt_token_ids", [1, 2, 3, 4])),
     S0 + r"\.prompt_token_ids: expected binary data \(raw little-endian int32 values\), got list"),
    ("protocol-1 array", lambda: _sample_case(BODY_MUTATIONS["array as protocol-1 triple"]),
     S0 + r"\.completion_token_ids: expected binary data"),
    ("negative version", lambda: _sample_case(BODY_MUTATIONS["negative version"]),
     S0 + r"\.token_versions: contains negative values \(min -3\)"),
    ("type swap", lambda: _sample_case(_set("sample_id", 17)),
     S0 + r"\.sample_id: expected a string, got int"),
    ("bool as int", lambda: _sample_case(_set("group_size", True)),
     S0 + r"\.group_size: expected an integer, got bool"),
    ("group index", lambda: _sample_case(_set("group_index", 4)),
     S0 + r"\.group_index: 4 >= group_size 4"),
    ("finish reason", lambda: _sample_case(BODY_MUTATIONS["finish_reason"]),
     S0 + r"\.finish_reason: 'done' not in"),
    ("reward NaN", lambda: _sample_case(_set("reward", float("nan"))),
     S0 + r"\.reward: must be finite"),
    ("reward part", lambda: _sample_case(BODY_MUTATIONS["reward_parts NaN"]),
     S0 + r"\.reward_parts\['x'\]: must be finite"),
    ("metadata depth", lambda: _sample_case(BODY_MUTATIONS["metadata deep"]),
     S0 + r"\.metadata\['x'\].*deeper than"),
    ("missing field", lambda: _sample_case(BODY_MUTATIONS["required fields cut"]),
     S0 + r"\.reward: missing"),
    ("oversize text", lambda: _sample_case(BODY_MUTATIONS["text oversize"]),
     S0 + r"\.completion_text: string of 1048577 characters exceeds"),
    ("oversize array", lambda: _sample_case(_set("prompt_token_ids", b"\0" * (4 * ((1 << 22) + 1)))),
     S0 + r"\.prompt_token_ids: 4194305 elements exceed"),
    ("too many samples", lambda: _body_case(lambda b: b.__setitem__(1, [0] * ((1 << 16) + 1))),
     r"RolloutResult\.samples: 65537 items exceed"),
    ("sample not an array", lambda: _body_case(lambda b: b.__setitem__(1, [b"x"])),
     S0 + r": expected an array of fields, got bytes"),
    ("sample as a protocol-1 map", lambda: _body_case(lambda b: b.__setitem__(1, [{"sample_id": "x"}])),
     S0 + r": expected an array of fields, got dict"),
    ("body not an array", lambda: [good_frames()[0], msgpack.packb({"server_id": "x", "samples": []})],
     r"RolloutResult: expected an array of fields, got dict"),
    ("body garbage", lambda: [good_frames()[0], b"\xc1"], r"RolloutResult body: not valid msgpack"),
    ("body trailing bytes", lambda: [good_frames()[0], good_frames()[1] + b"\x00"],
     r"RolloutResult body: not valid msgpack"),
    ("major version", lambda: _header_case(0, PROTOCOL_VERSION[0] + 1),
     r"header\.v: peer speaks protocol \d+\.\d+, this process speaks \d+\.\d+; major versions must match"),
    ("protocol-1 header", lambda: [msgpack.packb({"v": [1, 0], "type": "rollout_result", "id": "x",
                                                  "ts": 1.0}), good_frames()[1]],
     r"header\.v: peer speaks protocol 1\.0, this process speaks \d+\.\d+; major versions must match"),
    ("version type", lambda: _header_case(0, "2"), r"header\.v: expected integers major, minor"),
    ("unknown type", lambda: _header_case(2, "launch_missiles"),
     r"header\.type: unknown message type 'launch_missiles'"),
    ("unhashable type", lambda: _header_case(2, ["hello"]),
     r"header\.type: unknown message type \['hello'\]"),
    ("minor version type", lambda: _header_case(1, "0"), r"header\.v: expected integers major, minor"),
    ("bool major", lambda: _header_case(0, True), r"header\.v: expected integers major, minor"),
    ("id type", lambda: _header_case(3, 5), r"header\.id: expected a string"),
    ("ts type", lambda: _header_case(4, "now"), r"header\.ts: expected a number"),
    ("header not an array", lambda: [msgpack.packb({"type": "ack"}), good_frames()[1]],
     r"header: expected an array \[major, minor, type, id, ts\], got dict"),
    ("header too short", lambda: [msgpack.packb([*PROTOCOL_VERSION, "ack"]), good_frames()[1]],
     r"header: 3 values, expected an array \[major, minor, type, id, ts\]"),
    ("header garbage", lambda: [b"\x92\x01", good_frames()[1]], r"header: not valid msgpack"),
    ("header oversize", lambda: [msgpack.packb(msgpack.unpackb(good_frames()[0]) + ["x" * 5000]),
                                 good_frames()[1]], r"header: \d+ bytes exceed the limit of 4096"),
    ("too many frames", lambda: good_frames() + [b""] * 15, r"frames: 17 frames exceed the limit of 16"),
    ("frame count", lambda: good_frames() + [b""], r"RolloutResult: expected 2 frames, got 3"),
    ("one frame", lambda: good_frames()[:1], r"frames: expected at least \[header, body\]"),
    ("frame type", lambda: [good_frames()[0], 12345], r"RolloutResult body: frame is int, not bytes"),
    ("ack statuses", lambda: encode(protocol.Ack(["a", "b"], ["accepted", "lost"])),
     r"Ack\.statuses\[1\]: 'lost' not in"),
    ("ack lengths", lambda: encode(protocol.Ack(["a", "b"], ["accepted"])),
     r"Ack\.statuses: length 1 != sample_ids length 2"),
    ("negative version field", lambda: encode(protocol.Heartbeat("srv", -1)),
     r"Heartbeat\.version: -1 is below the minimum 0"),
    ("credits", lambda: encode(protocol.WorkRequest("srv", 0)), r"WorkRequest\.credits: 0 is below"),
    ("manifest offsets", lambda: encode(protocol.WeightsAvailable(
        3, "full", [protocol.TensorSpec("a", "float32", [2], 0, 8), protocol.TensorSpec("b", "float32", [2], 4, 8)],
        16, 8, 2, "c")), r"WeightsAvailable\.tensors\[1\]\.offset: 4, expected 8"),
    ("manifest chunks", lambda: encode(protocol.WeightsAvailable(
        3, "full", [protocol.TensorSpec("a", "float32", [4], 0, 16)], 16, 8, 3, "c")),
     r"WeightsAvailable\.num_chunks: 3 != ceil"),
    ("manifest total", lambda: encode(protocol.WeightsAvailable(
        3, "full", [protocol.TensorSpec("a", "float32", [4], 0, 16)], 24, 8, 3, "c")),
     r"WeightsAvailable\.total_bytes: 24 != sum of tensor sizes 16"),
    ("manifest kind", lambda: encode(protocol.WeightsAvailable(3, "half", [], 0, 8, 0, "c")),
     r"WeightsAvailable\.kind: 'half' not in"),
    ("tensor shape", lambda: encode(protocol.WeightsAvailable(
        3, "full", [protocol.TensorSpec("a", "float32", [-1], 0, 16)], 16, 8, 2, "c")),
     r"WeightsAvailable\.tensors\[0\]\.shape\[0\]: expected a non-negative integer"),
    ("tensor not an array", lambda: _weights_case(lambda b: b[2].__setitem__(0, {"name": "a"})),
     r"WeightsAvailable\.tensors\[0\]: expected an array of fields, got dict"),
    ("chunk frame missing", lambda: encode(protocol.WeightChunk(1, 0, "c", b"data"))[:2],
     r"WeightChunk: expected 3 frames, got 2"),
    ("chunk frame type", lambda: encode(protocol.WeightChunk(1, 0, "c", b"data"))[:2] + [3.5],
     r"WeightChunk\.data: frame is float, not bytes"),
    ("control args", lambda: _control_case({"x": {b"k": 2}}),
     r"ControlRequest\.args\['x'\] key: expected a string, got bytes"),
    # protocol 3.0: typed sampling, the weights endpoint, tensor sizes
    ("sampling not a record", lambda: _assignment_case(lambda s: {"temperature": "hot"}),
     r"Assignment\.sampling: expected an array of fields, got dict"),
    ("sampling temperature text", lambda: _assignment_case(lambda s: s.__setitem__(0, "hot")),
     r"Assignment\.sampling\.temperature: expected a float, got str"),
    ("sampling temperature zero", lambda: _assignment_case(lambda s: s.__setitem__(0, 0.0)),
     r"Assignment\.sampling\.temperature: 0\.0 is below the minimum"),
    ("sampling top_p above 1", lambda: _assignment_case(lambda s: s.__setitem__(1, 1.5)),
     r"Assignment\.sampling\.top_p: 1\.5 is above the maximum 1\.0"),
    ("sampling top_k negative", lambda: _assignment_case(lambda s: s.__setitem__(2, -1)),
     r"Assignment\.sampling\.top_k: -1 is below the minimum 0"),
    ("sampling huge max_new_tokens", lambda: _assignment_case(lambda s: s.__setitem__(3, 10**12)),
     r"Assignment\.sampling\.max_new_tokens: 1000000000000 is above the maximum 1048576"),
    ("welcome without scheme", lambda: _welcome_case("localhost:5556"),
     r"Welcome\.weights_endpoint: 'localhost:5556' is not a ZeroMQ endpoint"),
    ("tensor nbytes", lambda: _weights_case(lambda b: b[2][0].__setitem__(4, 12)),
     r"WeightsAvailable\.tensors\[0\]\.nbytes: 12 != float32 x \[4\] = 16 bytes"),
    ("tensor dtype", lambda: _weights_case(lambda b: b[2][0].__setitem__(1, "complex512")),
     r"WeightsAvailable\.tensors\[0\]\.dtype: 'complex512' not in"),
    # protocol 3.3: typed sampling temperature and LoRA adapter
    ("temperature NaN", lambda: _sample_case(BODY_MUTATIONS["temperature NaN"]),
     S0 + r"\.sampling_temperature: must be finite, got nan"),
    ("temperature inf", lambda: _sample_case(BODY_MUTATIONS["temperature inf"]),
     S0 + r"\.sampling_temperature: must be finite, got inf"),
    ("temperature negative", lambda: _sample_case(BODY_MUTATIONS["temperature negative"]),
     S0 + r"\.sampling_temperature: -0\.5 is below the minimum 1e-06"),
    ("temperature str", lambda: _sample_case(BODY_MUTATIONS["temperature str"]),
     S0 + r"\.sampling_temperature: expected a float, got str"),
    ("lora r", lambda: _lora_case(lambda lo: lo.__setitem__(0, "8")),
     r"WeightsAvailable\.lora\.r: expected an integer, got str"),
    ("lora r zero", lambda: _lora_case(lambda lo: lo.__setitem__(0, 0)),
     r"WeightsAvailable\.lora\.r: 0 is below the minimum 1"),
    ("lora alpha NaN", lambda: _lora_case(lambda lo: lo.__setitem__(1, float("nan"))),
     r"WeightsAvailable\.lora\.lora_alpha: must be finite"),
    ("lora dropout", lambda: _lora_case(lambda lo: lo.__setitem__(2, 1.5)),
     r"WeightsAvailable\.lora\.lora_dropout: 1\.5 is above the maximum 1\.0"),
    ("lora modules", lambda: _lora_case(lambda lo: lo.__setitem__(3, ["q_proj", 7])),
     r"WeightsAvailable\.lora\.target_modules\[1\]: expected a string, got int"),
    ("lora modules str", lambda: _lora_case(lambda lo: lo.__setitem__(3, "all-linear")),
     r"WeightsAvailable\.lora\.target_modules: expected a list of strings, got str"),
    ("lora bias", lambda: _lora_case(lambda lo: lo.__setitem__(4, "some")),
     r"WeightsAvailable\.lora\.bias: 'some' not in"),
    ("lora rslora", lambda: _lora_case(lambda lo: lo.__setitem__(5, 1)),
     r"WeightsAvailable\.lora\.use_rslora: expected a boolean, got int"),
    ("lora field missing", lambda: _lora_case(lambda lo: lo.__delitem__(slice(3, None))),
     r"WeightsAvailable\.lora\.target_modules: missing"),
    ("lora as a 3.2 map", lambda: _weights_case(lambda b: b.__setitem__(_LORA_AT, {"r": 8})),
     r"WeightsAvailable\.lora: expected an array of fields, got dict"),
    ("lora on a full publish", lambda: _weights_case(lambda b: b.__setitem__(_LORA_AT, _LORA_WIRE)),
     r"WeightsAvailable\.lora: a LoRA adapter in a 'full' publish"),
]


def _assignment_case(mutate_sampling) -> list[bytes]:
    frames = encode(protocol.Assignment("a1", "p1", np.arange(3, dtype=np.int32), 4, 0))
    body = msgpack.unpackb(frames[1])
    i = wire_field_names(protocol.Assignment).index("sampling")
    out = mutate_sampling(body[i])
    if out is not None:
        body[i] = out
    return [frames[0], msgpack.packb(body)]


def _welcome_case(endpoint: str) -> list[bytes]:
    frames = encode(protocol.Welcome("l", "r", 0, "tcp://127.0.0.1:1"))
    body = msgpack.unpackb(frames[1])
    body[wire_field_names(protocol.Welcome).index("weights_endpoint")] = endpoint
    return [frames[0], msgpack.packb(body)]


def _weights_case(mutate: Callable[[list], None]) -> list[bytes]:
    frames = encode(protocol.WeightsAvailable(
        3, "full", [protocol.TensorSpec("a", "float32", [4], 0, 16)], 16, 8, 2, "c"))
    body = msgpack.unpackb(frames[1])
    mutate(body)
    return [frames[0], msgpack.packb(body)]


_LORA_AT = [name for name, _ in protocol.WeightsAvailable.FIELDS].index("lora")   # in a manifest body
_LORA_WIRE = [8, 16.0, 0.0, ["q_proj", "v_proj"], "none", False, False]


def _lora_case(mutate: Callable[[list], None]) -> list[bytes]:
    """A LoRA manifest whose ``lora`` field is changed by ``mutate``."""
    frames = encode(protocol.WeightsAvailable(
        3, "lora", [protocol.TensorSpec("a", "float32", [4], 0, 16)], 16, 8, 2, "c",
        lora=protocol.LoraSpec(*_LORA_WIRE)))
    body = msgpack.unpackb(frames[1])
    mutate(body[_LORA_AT])
    return [frames[0], msgpack.packb(body)]


def _control_case(args) -> list[bytes]:
    frames = encode(protocol.ControlRequest("set", {}))
    body = msgpack.unpackb(frames[1])        # [command, args]
    body[1] = args
    return [frames[0], msgpack.packb(body)]


@pytest.mark.parametrize(("make", "pattern"), [(m, p) for _, m, p in NAMED_ERRORS],
                         ids=[n for n, _, _ in NAMED_ERRORS])
def test_bad_input_names_the_field(make, pattern):
    frames = make()
    with pytest.raises(ProtocolError, match=pattern):
        decode(frames)


def test_body_over_the_limit_is_refused_before_unpacking(monkeypatch):
    frames = good_frames()
    monkeypatch.setattr(codec_module, "MAX_BODY_BYTES", 100)
    with pytest.raises(ProtocolError, match=r"RolloutResult body: \d+ bytes exceed the limit of 100"):
        decode(frames)


def test_encode_refuses_a_body_over_the_limit(monkeypatch):
    monkeypatch.setattr(codec_module, "MAX_BODY_BYTES", 100)
    with pytest.raises(ProtocolError, match=r"encode RolloutResult: body of \d+ bytes exceeds"):
        good_frames()


def test_weight_frame_over_the_limit(monkeypatch):
    frames = encode(protocol.WeightChunk(1, 0, "c", b"data"))
    monkeypatch.setattr(codec_module, "MAX_FRAME_BYTES", 3)
    with pytest.raises(ProtocolError, match=r"WeightChunk\.data: 4 bytes exceed 3"):
        decode(frames)


def test_encode_refuses_a_frame_over_the_limit(monkeypatch):
    monkeypatch.setattr(codec_module, "MAX_FRAME_BYTES", 3)
    with pytest.raises(ProtocolError, match=r"encode WeightChunk\.data: 4 bytes exceed 3"):
        encode(protocol.WeightChunk(1, 0, "c", b"data"))
    with pytest.raises(ProtocolError, match=r"encode WeightChunk\.data: expected bytes, got str"):
        encode(protocol.WeightChunk(1, 0, "c", "data"))


def test_protocol_error_is_a_value_error():
    assert issubclass(ProtocolError, ValueError)
