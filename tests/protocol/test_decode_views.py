"""``protocol.decode`` reads a body handed over as a memoryview (the learner's rollout loop keeps
a large received frame as a view of libzmq's buffer instead of copying it to bytes) exactly as it
reads bytes: the same message, the same errors, nothing of the view kept."""

from __future__ import annotations

import gc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_strategies import MESSAGE_STRATEGIES, assert_same

from protocol import ProtocolError, RolloutResult, Sample, decode, encode
from protocol import codec as codec_module

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in dot:RuntimeWarning")
FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def result(samples: int, tokens: int) -> RolloutResult:
    return RolloutResult("srv", [Sample(
        f"a/{i}", "a", i, samples, np.arange(1, 129, dtype=np.int32),
        np.arange(tokens, dtype=np.int32), np.full(tokens, -1.5, np.float32),
        np.zeros(tokens, np.int32), 1.0) for i in range(samples)])


@pytest.mark.parametrize("samples,tokens", [(1, 4), (8, 1024)])   # below and above _SMALL_BYTES
def test_a_memoryview_body_takes_the_fast_path_and_keeps_nothing_of_the_view(samples, tokens, monkeypatch):
    frames = encode(result(samples, tokens))
    expect = decode(frames)
    buf = bytearray(frames[1])
    view = memoryview(buf)

    def refuse(*args, **kwargs):
        raise AssertionError("general path taken")

    monkeypatch.setattr(codec_module, "_decode", refuse)
    got = decode([frames[0], view])
    assert_same(got, expect)
    view.release()                  # raises BufferError if a decoded value still exported it
    buf[:] = b"\0" * len(buf)       # the decoded arrays are their own bytes
    assert_same(got, expect)
    gc.collect()


def test_odd_views_decode_as_their_bytes_or_are_protocol_errors(monkeypatch):
    frames = encode(result(1, 4))
    body = np.frombuffer(frames[1], np.uint8)
    strided = memoryview(np.repeat(body, 2)[::2])            # not contiguous: the same bytes
    assert_same(decode([frames[0], strided]), decode(frames))
    wide = memoryview(np.zeros((3, 5), np.int64))             # 2-D, 8-byte items: not msgpack
    with pytest.raises(ProtocolError):
        decode([frames[0], wide])
    monkeypatch.setattr(codec_module, "MAX_BODY_BYTES", len(frames[1]) - 1)
    with pytest.raises(ProtocolError, match="exceed"):
        decode([frames[0], memoryview(frames[1])])


@FUZZ
@given(msg=st.sampled_from(list(MESSAGE_STRATEGIES.values())).flatmap(lambda s: s),
       data=st.data())
def test_views_and_bytes_decode_alike_even_when_mangled(msg, data):
    frames = encode(msg)
    body = bytes(frames[1])
    if data.draw(st.booleans(), label="mangle"):
        i = data.draw(st.integers(0, max(len(body) - 1, 0)), label="at")
        body = body[:i] + data.draw(st.binary(max_size=8), label="garbage") + body[i + 1:]
    as_bytes = [frames[0], body, *frames[2:]]
    as_view = [frames[0], memoryview(body), *frames[2:]]
    try:
        expect = decode(as_bytes)
    except ProtocolError as e:
        with pytest.raises(ProtocolError) as got:
            decode(as_view)
        assert str(got.value) == str(e)
        return
    assert_same(decode(as_view), expect)


def test_the_body_is_msgpack_however_it_arrives():
    frames = encode(result(1, 4))
    assert msgpack.unpackb(memoryview(frames[1]))[0] == "srv"
