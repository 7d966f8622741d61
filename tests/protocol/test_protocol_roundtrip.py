"""Round trip of every message type, and the hot path checked against the reference path."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_strategies import MESSAGE_STRATEGIES, assert_same, samples

import protocol
from protocol import MESSAGE_TYPES, ProtocolError, RolloutResult, Sample, decode, encode
from protocol.messages import _samples_fast
from protocol.schema import wire_field_names

# Generated float32 log-probs above 1.8e19 make the fast x·x finiteness hint overflow. The
# protocol silences that warning with a module-scoped filter (checked in a real interpreter by
# test_protocol_interop); pytest's per-test warning capture replaces filters, so say it here too.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in dot:RuntimeWarning")

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_fast_paths_know_every_field():
    """Sample/RolloutResult fast paths list their fields by hand: teach them a new field (and
    extend ``_SAMPLE_FAST_FIELDS``) when you add one; until then they switch themselves off."""
    from protocol import messages
    assert messages.FAST_PATHS_CURRENT, "update Sample.to_wire and _samples_fast for the new field"


@settings(max_examples=20, deadline=None)
@given(msg=MESSAGE_STRATEGIES[RolloutResult])
def test_round_trip_with_fast_paths_off(msg):
    from protocol import messages
    frames_fast = encode(msg, msg_id="m")
    saved = messages.FAST_PATHS_CURRENT
    messages.FAST_PATHS_CURRENT = False
    try:
        frames_slow = encode(msg, msg_id="m")
        assert frames_slow[1] == frames_fast[1]
        assert_same(msg, decode(frames_slow))
    finally:
        messages.FAST_PATHS_CURRENT = saved


def test_every_message_type_has_a_strategy():
    assert set(MESSAGE_STRATEGIES) == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("cls", list(MESSAGE_TYPES.values()), ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_round_trip(cls, data):
    msg = data.draw(MESSAGE_STRATEGIES[cls])
    frames = encode(msg)
    assert all(isinstance(f, bytes) for f in frames[:2])
    header = protocol.decode_header(frames)
    assert header["type"] == cls.TYPE and header["v"] == list(protocol.PROTOCOL_VERSION)
    out = decode(frames)
    assert_same(msg, out, cls.__name__)
    # And again from the decoded message (read-only arrays, memoryviews) to the same bytes.
    again = encode(out, msg_id=header["id"])
    assert again[1] == frames[1]


@FAST
@given(data=st.data())
def test_round_trip_through_generic_path_matches_fast_path(data):
    """Sample/RolloutResult have hand-written to_wire/from_wire; the generic Struct versions are
    the reference. Same bytes out, same message back."""
    msg = RolloutResult(server_id="srv", samples=data.draw(st.lists(samples(), max_size=3)))
    fast_body = msgpack.packb(msg.to_wire())
    generic_body = msgpack.packb(msg.to_wire_checked())
    assert fast_body == generic_body
    body = msgpack.unpackb(fast_body)
    assert_same(RolloutResult.from_wire(body), RolloutResult.from_wire_checked(body))
    for item in body[1]:                     # [server_id, samples]
        fast, checked = _samples_fast([item]), Sample.from_wire_checked(item)
        if fast is None:   # only where x·x overflows float32: then the exact check decides
            assert np.abs(checked.behavior_logprobs.astype(np.float64)).max() > 1e18
        else:
            assert_same(fast, [checked])


def test_hot_paths_are_taken(monkeypatch):
    """A plain result goes through the hand-written paths and the codec's fast decode, never the
    reference ones (which are correct but several times slower)."""
    from protocol import codec

    def refuse(*args, **kwargs):
        raise AssertionError("slow path taken")

    msg = RolloutResult("srv", [Sample(
        "s", "a", 0, 2, np.arange(3, dtype=np.int32), np.arange(4, dtype=np.int32),
        -np.ones(4, np.float32), np.full(4, 3, np.int32), 0.5, {"x": 1.0}, "length",
        {"generate_s": 0.1}, "text", None, {"task": "add", "nested": [1, {"k": None}]})])
    for cls, name in ((Sample, "to_wire_checked"), (RolloutResult, "to_wire_checked")):
        monkeypatch.setattr(cls, name, refuse)
    for cls in (Sample, RolloutResult):
        monkeypatch.setattr(cls, "from_wire_checked", classmethod(refuse))
    monkeypatch.setattr(codec, "_decode", refuse)
    assert_same(decode(encode(msg)), msg)


@FAST
@given(data=st.data())
def test_codec_fast_and_general_paths_agree(data):
    """``decode`` has a fast path for [header, body] as bytes; the general one (any sequence of
    bytes-like frames) must give the same message or the same error."""
    from protocol import codec
    msg = data.draw(st.sampled_from(list(MESSAGE_STRATEGIES.values())).flatmap(lambda s: s))
    frames = encode(msg)
    out = decode(frames)
    assert_same(out, codec._decode(frames))
    assert_same(out, decode(tuple(frames)))
    assert_same(out, decode([bytearray(f) for f in frames]))


def test_size_limits_summed_by_the_fast_path_are_decided_exactly():
    """The fast path bounds the sum of the string lengths; a sample over the sum but within every
    limit is still accepted (by the checked path), one over a limit still refused."""
    half = "x" * (protocol.schema.MAX_STR_CHARS // 2 + 1)
    s = Sample(half, "a", 0, 1, np.zeros(0, np.int32), np.zeros(1, np.int32),
               np.zeros(1, np.float32), np.zeros(1, np.int32), 0.0, completion_text=half)
    body = msgpack.unpackb(msgpack.packb(s.to_wire()))
    assert _samples_fast([body]) is None
    assert_same(decode(encode(RolloutResult("srv", [s]))).samples[0], s)
    s.completion_text = half * 2
    with pytest.raises(ProtocolError, match=r"completion_text: string of \d+ characters exceeds"):
        decode(encode(RolloutResult("srv", [s])))


def test_decoded_arrays_are_read_only_views():
    s = Sample("s", "a", 0, 1, np.arange(3, dtype=np.int32), np.arange(4, dtype=np.int32),
               np.zeros(4, np.float32), np.zeros(4, np.int32), 1.0)
    out = decode(encode(RolloutResult("srv", [s]))).samples[0]
    for arr in (out.prompt_token_ids, out.completion_token_ids, out.behavior_logprobs,
                out.token_versions):
        assert not arr.flags.writeable
    assert out.completion_token_ids.dtype == np.dtype("<i4")
    assert out.behavior_logprobs.dtype == np.dtype("<f4")
    assert out.min_version == 0


def test_encode_converts_lists_and_other_dtypes():
    s = Sample("s", "a", 0, 1, [1, 2], np.array([5, 6], dtype=np.int64),
               np.array([-0.5, -1.5], dtype=np.float64), [3, 4], 1, reward_parts={"x": 1},
               timing={"generate_s": np.float32(0.25)})
    out = decode(encode(RolloutResult("srv", [s]))).samples[0]
    assert out.prompt_token_ids.tolist() == [1, 2] and out.prompt_token_ids.dtype == np.int32
    assert out.completion_token_ids.tolist() == [5, 6]
    assert out.behavior_logprobs.tolist() == [-0.5, -1.5]
    assert out.token_versions.tolist() == [3, 4]
    assert out.reward == 1.0 and type(out.reward) is float
    assert out.reward_parts == {"x": 1.0} and out.timing == {"generate_s": 0.25}


def test_encode_of_non_contiguous_array():
    a = np.arange(8, dtype=np.int32)[::2]
    s = Sample("s", "a", 0, 1, a, a, np.zeros(4, np.float32), a, 0.0)
    out = decode(encode(RolloutResult("srv", [s]))).samples[0]
    assert out.prompt_token_ids.tolist() == [0, 2, 4, 6]


def test_int_reward_and_missing_defaulted_fields_take_the_checked_path():
    """What the fast path does not accept but the protocol does: still decoded, same result."""
    body = msgpack.unpackb(msgpack.packb(Sample(
        "s", "a", 0, 1, np.zeros(1, np.int32), np.zeros(2, np.int32), np.zeros(2, np.float32),
        np.zeros(2, np.int32), 1.0).to_wire()))
    assert wire_field_names(Sample)[8] == "reward"
    body[8] = 3                                  # an int from a lenient sender
    del body[9:]                                 # reward_parts ... metadata: an older minor version
    assert _samples_fast([body]) is None
    s = Sample.from_wire(body)
    assert s.reward == 3.0 and type(s.reward) is float
    assert s.finish_reason == "stop" and s.metadata == {} and s.failed is None


def test_float32_logprobs_whose_square_overflows_are_finite():
    """x·x overflows float32 for |x| > 1.8e19: the fast check defers to the exact one."""
    big = np.array([-3e38, -1.0], dtype=np.float32)
    s = Sample("s", "a", 0, 1, np.zeros(0, np.int32), np.zeros(2, np.int32), big,
               np.zeros(2, np.int32), 0.0)
    out = decode(encode(RolloutResult("srv", [s]))).samples[0]
    assert out.behavior_logprobs.tolist() == big.tolist()


def test_weight_chunk_data_is_zero_copy():
    data = bytes(range(256)) * 1024
    frames = encode(protocol.WeightChunk(version=1, index=0, checksum="c", data=data))
    assert frames[2] is data
    assert decode(frames).data is data
    buf = bytearray(data)
    out = decode([frames[0], frames[1], buf])
    assert isinstance(out.data, memoryview) and out.data.obj is buf


def test_encode_refuses_what_is_not_a_message():
    with pytest.raises(ProtocolError, match="not a protocol message type"):
        encode(protocol.TensorSpec("w", "float32", [1], 0, 4))
    with pytest.raises(ProtocolError, match="not a protocol message type"):
        encode({"type": "hello"})


@pytest.mark.parametrize(
    ("sample_kwargs", "field"),
    [
        ({"metadata": {"x": object()}}, "metadata"),
        ({"prompt_token_ids": np.zeros((2, 2), np.int32)}, "prompt_token_ids"),
        ({"token_versions": np.array([2**40, 0], np.int64)}, "token_versions"),
        ({"completion_token_ids": ["a", "b"]}, "completion_token_ids"),
        ({"reward": "high"}, "reward"),
    ],
)
def test_encode_errors_name_the_field(sample_kwargs, field):
    kwargs = dict(sample_id="s", assignment_id="a", group_index=0, group_size=1,
                  prompt_token_ids=np.zeros(2, np.int32), completion_token_ids=np.zeros(2, np.int32),
                  behavior_logprobs=np.zeros(2, np.float32), token_versions=np.zeros(2, np.int32),
                  reward=0.0)
    kwargs.update(sample_kwargs)
    with pytest.raises(ProtocolError, match=rf"RolloutResult\.samples\[0\]\.{field}: "):
        encode(RolloutResult("srv", [Sample(**kwargs)]))


def test_message_ids():
    a, b = protocol.new_message_id(), protocol.new_message_id()
    assert a != b
    frames = encode(protocol.Heartbeat("srv", 1), msg_id="m-1")
    assert protocol.message_id(frames) == "m-1"
    assert protocol.message_id([b"junk", b""]) == ""
    with pytest.raises(ProtocolError, match="msg_id"):
        encode(protocol.Heartbeat("srv", 1), msg_id=7)
