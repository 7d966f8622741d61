"""Bad input of every kind: the codec raises ProtocolError and nothing else, naming the field.

Random bytes, random frame lists, mutated valid frames (bit flips, truncation, garbage), valid
msgpack of the wrong shape, and targeted mutations of a valid body (type swaps, wrong lengths,
NaN/inf log-probs, wrong dtype, oversize, wrong version, unknown type).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_strategies import MESSAGE_STRATEGIES, plain_values, samples

import protocol
from protocol import MESSAGE_TYPES, ProtocolError, RolloutResult, Sample, decode, encode
from protocol import codec as codec_module
from protocol.messages import _sample_fast

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
        completion_text="1234", metadata={"task": "add", "nested": {"x": [1, 2]}})


def good_frames() -> list[bytes]:
    return encode(RolloutResult(server_id="srv-0", samples=[good_sample()]))


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
    header = msgpack.packb({"v": list(protocol.PROTOCOL_VERSION), "type": mtype, "id": "x", "ts": 1.0})
    decode_or_protocol_error([header, body])
    decode_or_protocol_error([header, body, b"raw"])


@FUZZ
@given(body=plain_values, mtype=st.sampled_from(sorted(MESSAGE_TYPES)))
def test_valid_header_random_msgpack_body(body, mtype):
    header = msgpack.packb({"v": list(protocol.PROTOCOL_VERSION), "type": mtype, "id": "x", "ts": 1.0})
    decode_or_protocol_error([header, msgpack.packb(body), b"raw"][:3 if mtype == "weight_chunk" else 2])


@FUZZ
@given(header=plain_values, body=st.binary(max_size=32))
def test_random_header(header, body):
    decode_or_protocol_error([msgpack.packb(header), body])


@FUZZ
@given(field=st.sampled_from(["v", "type", "id", "ts"]), value=plain_values)
def test_header_field_replaced_by_any_value(field, value):
    frames = encode(protocol.Heartbeat("srv", 1))
    header = msgpack.unpackb(frames[0])
    header[field] = value
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
            ["<i4", [1], b"\0\0\0\0"]]
    return [v for v in pool if type(v) is not type(value)]


@pytest.mark.parametrize("field", [name for name, _ in Sample.FIELDS])
def test_every_sample_field_type_swap_is_refused_or_harmless(field):
    frames = good_frames()
    body = msgpack.unpackb(frames[1])
    for bad in _mutations_of(body["samples"][0][field]):
        mutated = copy.deepcopy(body)
        mutated["samples"][0][field] = bad
        out = decode_or_protocol_error([frames[0], msgpack.packb(mutated)])
        if out is not None:    # the legal swaps: a reason in `failed`, an int reward
            assert (field, type(bad)) in {("failed", str), ("reward", int)}, (field, bad)


@pytest.mark.parametrize("cls", list(MESSAGE_TYPES.values()), ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_field_type_swap_of_every_message(cls, data):
    msg = data.draw(MESSAGE_STRATEGIES[cls])
    frames = encode(msg, msg_id="fuzz-0")   # fixed length, so that draws replay
    body = msgpack.unpackb(frames[1])
    field = data.draw(st.sampled_from(sorted(body)))
    bad = data.draw(st.sampled_from(_mutations_of(body[field])) | plain_values)
    body[field] = bad
    frames[1] = msgpack.packb(body)
    try:
        decode(frames)
    except ProtocolError as e:
        assert f"{cls.__name__}." in str(e), f"error does not name a field: {e}"


# --- fast path never accepts more than the checked path -----------------------------------------

def _set_item(array_triple: list, index: int, value) -> None:
    """Overwrite one element of a wire array ``[dtype, [n], data]`` in place."""
    arr = np.frombuffer(array_triple[2], dtype=array_triple[0]).copy()
    arr[index] = value
    array_triple[2] = arr.tobytes()


BODY_MUTATIONS: dict[str, Callable[[dict], None]] = dict([
    ("logprob NaN", lambda s: _set_item(s["behavior_logprobs"], 0, np.nan)),
    ("logprob inf", lambda s: _set_item(s["behavior_logprobs"], 1, -np.inf)),
    ("data longer than shape", lambda s: s["behavior_logprobs"].__setitem__(2, b"\0" * 16)),
    ("versions shorter", lambda s: s.__setitem__("token_versions", ["<i4", [2], b"\0" * 8])),
    ("negative version", lambda s: _set_item(s["token_versions"], 1, -3)),
    ("shape bool", lambda s: s["completion_token_ids"].__setitem__(1, [True])),
    ("shape float", lambda s: s["prompt_token_ids"].__setitem__(1, [1.0])),
    ("shape 2-d", lambda s: s["prompt_token_ids"].__setitem__(1, [1, 1])),
    ("dtype i8", lambda s: s["completion_token_ids"].__setitem__(0, "<i8")),
    ("dtype big-endian", lambda s: s["behavior_logprobs"].__setitem__(0, ">f4")),
    ("data as str", lambda s: s["prompt_token_ids"].__setitem__(2, "abc")),
    ("array as map", lambda s: s.__setitem__("prompt_token_ids", {"dtype": "<i4", "shape": [0],
                                                                  "data": b""})),
    ("array of 4", lambda s: s["prompt_token_ids"].append(1)),
    ("group_index == size", lambda s: s.__setitem__("group_index", s["group_size"])),
    ("reward inf", lambda s: s.__setitem__("reward", float("inf"))),
    ("reward_parts NaN", lambda s: s["reward_parts"].__setitem__("x", float("nan"))),
    ("timing str", lambda s: s["timing"].__setitem__("x", "1")),
    ("timing bytes key", lambda s: s["timing"].__setitem__(b"k", 1.0)),
    ("metadata deep", lambda s: s["metadata"].__setitem__("x", {"deep": [[[[[[[[[1]]]]]]]]]})),
    ("finish_reason", lambda s: s.__setitem__("finish_reason", "done")),
    ("failed int", lambda s: s.__setitem__("failed", 3)),
    ("sample_id missing", lambda s: s.pop("sample_id")),
    ("text oversize", lambda s: s.__setitem__("completion_text", "x" * ((1 << 20) + 1))),
])


@pytest.mark.parametrize("mutate", list(BODY_MUTATIONS.values()), ids=list(BODY_MUTATIONS))
def test_fast_path_refuses_what_checked_path_refuses(mutate):
    body = msgpack.unpackb(msgpack.packb(good_sample(3).to_wire()))
    mutate(body)
    body = msgpack.unpackb(msgpack.packb(body))   # as it would arrive
    assert _sample_fast(body) is None
    with pytest.raises(ProtocolError):
        Sample.from_wire_checked(body)
    with pytest.raises(ProtocolError):
        Sample.from_wire(body)


@FUZZ
@given(sample=samples(max_tokens=8), data=st.data())
def test_fast_and_checked_paths_agree_on_random_field_values(sample, data):
    body = msgpack.unpackb(msgpack.packb(sample.to_wire()))
    field = data.draw(st.sampled_from(sorted(body)))
    body[field] = data.draw(plain_values | st.sampled_from(_mutations_of(body[field])))
    body = msgpack.unpackb(msgpack.packb(body))
    fast = _sample_fast(body)
    try:
        checked = Sample.from_wire_checked(body)
    except ProtocolError:
        assert fast is None, f"fast path accepted {field}={body[field]!r} that the checked path refuses"
        return
    if fast is not None:
        assert fast.to_wire() == checked.to_wire()


# --- specific bad inputs name the offending field ------------------------------------------------

S0 = r"RolloutResult\.samples\[0\]"


def _body_case(mutate: Callable[[dict], None]) -> list[bytes]:
    frames = good_frames()
    body = msgpack.unpackb(frames[1])
    mutate(body)
    return [frames[0], msgpack.packb(body)]


def _sample_case(mutate: Callable[[dict], None]) -> list[bytes]:
    return _body_case(lambda b: mutate(b["samples"][0]))


def _header_case(**changes) -> list[bytes]:
    frames = good_frames()
    header = msgpack.unpackb(frames[0])
    header.update(changes)
    return [msgpack.packb(header), frames[1]]


NAMED_ERRORS = [
    ("NaN logprob", lambda: _sample_case(BODY_MUTATIONS["logprob NaN"]), S0 + r"\.behavior_logprobs: .*NaN"),
    ("inf logprob", lambda: _sample_case(BODY_MUTATIONS["logprob inf"]),
     S0 + r"\.behavior_logprobs: .*infinite"),
    ("logprobs length", lambda: _sample_case(
        lambda s: s.__setitem__("behavior_logprobs", ["<f4", [3], b"\0" * 12])),
     S0 + r"\.behavior_logprobs: length 3 != completion_token_ids length 4"),
    ("versions length", lambda: _sample_case(BODY_MUTATIONS["versions shorter"]),
     S0 + r"\.token_versions: length 2 != completion_token_ids length 4"),
    ("bytes vs shape", lambda: _sample_case(lambda s: s["completion_token_ids"].__setitem__(2, b"\0" * 12)),
     S0 + r"\.completion_token_ids: 12 bytes do not match shape \[4\]"),
    ("wrong dtype", lambda: _sample_case(BODY_MUTATIONS["dtype i8"]),
     S0 + r"\.completion_token_ids: dtype '<i8', expected '<i4'"),
    ("big-endian", lambda: _sample_case(BODY_MUTATIONS["dtype big-endian"]),
     S0 + r"\.behavior_logprobs: dtype '>f4'"),
    ("ints as msgpack list", lambda: _sample_case(lambda s: s.__setitem__("prompt_token_ids", [1, 2, 3, 4])),
     S0 + r"\.prompt_token_ids: expected an array"),
    ("negative version", lambda: _sample_case(BODY_MUTATIONS["negative version"]),
     S0 + r"\.token_versions: contains negative values \(min -3\)"),
    ("type swap", lambda: _sample_case(lambda s: s.__setitem__("sample_id", 17)),
     S0 + r"\.sample_id: expected a string, got int"),
    ("bool as int", lambda: _sample_case(lambda s: s.__setitem__("group_size", True)),
     S0 + r"\.group_size: expected an integer, got bool"),
    ("group index", lambda: _sample_case(lambda s: s.__setitem__("group_index", 4)),
     S0 + r"\.group_index: 4 >= group_size 4"),
    ("finish reason", lambda: _sample_case(BODY_MUTATIONS["finish_reason"]),
     S0 + r"\.finish_reason: 'done' not in"),
    ("reward NaN", lambda: _sample_case(lambda s: s.__setitem__("reward", float("nan"))),
     S0 + r"\.reward: must be finite"),
    ("reward part", lambda: _sample_case(BODY_MUTATIONS["reward_parts NaN"]),
     S0 + r"\.reward_parts\['x'\]: must be finite"),
    ("metadata depth", lambda: _sample_case(BODY_MUTATIONS["metadata deep"]),
     S0 + r"\.metadata\['x'\].*deeper than"),
    ("missing field", lambda: _sample_case(lambda s: s.pop("reward")), S0 + r"\.reward: missing"),
    ("oversize text", lambda: _sample_case(BODY_MUTATIONS["text oversize"]),
     S0 + r"\.completion_text: string of 1048577 characters exceeds"),
    ("oversize array", lambda: _sample_case(lambda s: s.__setitem__(
        "prompt_token_ids", ["<i4", [(1 << 22) + 1], b"\0" * (4 * ((1 << 22) + 1))])),
     S0 + r"\.prompt_token_ids: 4194305 elements exceed"),
    ("too many samples", lambda: _body_case(lambda b: b.__setitem__("samples", [0] * ((1 << 16) + 1))),
     r"RolloutResult\.samples: 65537 items exceed"),
    ("sample not a map", lambda: _body_case(lambda b: b.__setitem__("samples", [b"x"])),
     S0 + r": expected a map, got bytes"),
    ("body not a map", lambda: [good_frames()[0], msgpack.packb([1, 2])], r"RolloutResult: expected a map"),
    ("body garbage", lambda: [good_frames()[0], b"\xc1"], r"RolloutResult body: not valid msgpack"),
    ("body trailing bytes", lambda: [good_frames()[0], good_frames()[1] + b"\x00"],
     r"RolloutResult body: not valid msgpack"),
    ("major version", lambda: _header_case(v=[2, 0]),
     r"header\.v: peer speaks protocol 2\.0, this process speaks 1\.\d+; major versions must match"),
    ("version shape", lambda: _header_case(v="1.0"), r"header\.v: expected \[major, minor\]"),
    ("unknown type", lambda: _header_case(type="launch_missiles"),
     r"header\.type: unknown message type 'launch_missiles'"),
    ("unhashable type", lambda: _header_case(type=["hello"]),
     r"header\.type: unknown message type \['hello'\]"),
    ("minor version type", lambda: _header_case(v=[1, "0"]), r"header\.v: expected \[major, minor\]"),
    ("bool major", lambda: _header_case(v=[True, 0]), r"header\.v: expected \[major, minor\]"),
    ("id type", lambda: _header_case(id=5), r"header\.id: expected a string"),
    ("ts type", lambda: _header_case(ts="now"), r"header\.ts: expected a number"),
    ("header not a map", lambda: [b"\x92\x01\x02", good_frames()[1]], r"header: expected a map, got list"),
    ("header garbage", lambda: [b"\x92\x01", good_frames()[1]], r"header: not valid msgpack"),
    ("header oversize", lambda: _header_case(pad="x" * 5000), r"header: \d+ bytes exceed the limit of 4096"),
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
    ("chunk frame missing", lambda: encode(protocol.WeightChunk(1, 0, "c", b"data"))[:2],
     r"WeightChunk: expected 3 frames, got 2"),
    ("chunk frame type", lambda: encode(protocol.WeightChunk(1, 0, "c", b"data"))[:2] + [3.5],
     r"WeightChunk\.data: frame is float, not bytes"),
    ("control args", lambda: _control_case({"x": {b"k": 2}}),
     r"ControlRequest\.args\['x'\] key: expected a string, got bytes"),
]


def _control_case(args) -> list[bytes]:
    frames = encode(protocol.ControlRequest("set", {}))
    body = msgpack.unpackb(frames[1])
    body["args"] = args
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
