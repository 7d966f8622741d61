"""The fast sample checks never accept what the checked path refuses: every body mutation the
fuzz suite knows, in one sample or in one sample of eight, is refused with the error naming it, and
on random valid results the fast and the checked paths agree. (The mutations and helpers are
test_protocol_fuzz.py's.)"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from protocol_strategies import assert_same, plain_values, samples
from test_protocol_fuzz import BODY_MUTATIONS, FUZZ, F, _mutations_of, _set_item, good_sample

from protocol import ProtocolError, RolloutResult, Sample, decode, encode
from protocol.messages import _samples_fast
from protocol.schema import wire_field_names

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in dot:RuntimeWarning")


@pytest.mark.parametrize("mutate", list(BODY_MUTATIONS.values()), ids=list(BODY_MUTATIONS))
def test_fast_path_refuses_what_checked_path_refuses(mutate):
    body = msgpack.unpackb(msgpack.packb(good_sample(3).to_wire()))
    assert _samples_fast([body]) is not None
    mutate(body)
    body = msgpack.unpackb(msgpack.packb(body))   # as it would arrive
    assert _samples_fast([body]) is None
    with pytest.raises(ProtocolError):
        Sample.from_wire_checked(body)
    with pytest.raises(ProtocolError):
        Sample.from_wire(body)


@FUZZ
@given(sample=samples(max_tokens=8), data=st.data())
def test_fast_and_checked_paths_agree_on_random_field_values(sample, data):
    body = msgpack.unpackb(msgpack.packb(sample.to_wire()))
    field = data.draw(st.integers(0, len(body) - 1), label="field position")
    body[field] = data.draw(plain_values | st.sampled_from(_mutations_of(body[field])))
    body = msgpack.unpackb(msgpack.packb(body))
    fast = _samples_fast([body])
    try:
        checked = Sample.from_wire_checked(body)
    except ProtocolError:
        assert fast is None, (f"fast path accepted {wire_field_names(Sample)[field]}="
                              f"{body[field]!r} that the checked path refuses")
        return
    if fast is not None:
        assert fast[0].to_wire() == checked.to_wire()


def group_body(n: int = 8) -> list:
    """The wire body of a RolloutResult of ``n`` good samples (a group's: one prompt), as it
    arrives."""
    samples = []
    for i in range(n):
        s = good_sample(3 + i)                # lengths differ: the slices must not be off by one
        s.group_index, s.group_size, s.sample_id = i, n, f"a-1/{i}"
        s.behavior_logprobs = s.behavior_logprobs - i
        s.token_versions = s.token_versions + i
        samples.append(s)
    return msgpack.unpackb(msgpack.packb(RolloutResult("srv", samples).to_wire()))


@pytest.mark.parametrize("position", [0, 3, 7])
@pytest.mark.parametrize("mutate", list(BODY_MUTATIONS.values()), ids=list(BODY_MUTATIONS))
def test_batch_path_refuses_one_bad_sample_of_eight_and_the_error_names_it(mutate, position):
    """A result's samples are decoded with the array checks made once for all
    (``_samples_fast``): any mutation of any one sample refuses the whole batch path, and the
    checked path's error names that sample."""
    body = group_body()
    assert _samples_fast(body[1]) is not None
    mutate(body[1][position])
    body = msgpack.unpackb(msgpack.packb(body))
    assert _samples_fast(body[1]) is None
    with pytest.raises(ProtocolError, match=rf"samples\[{position}\]\."):
        RolloutResult.from_wire(body)
    with pytest.raises(ProtocolError, match=rf"samples\[{position}\]\."):
        decode([encode(RolloutResult("srv", []))[0], msgpack.packb(body)])


def test_batch_path_matches_the_checked_path_and_shares_one_buffer():
    body = group_body()
    fast = RolloutResult.from_wire(body)
    checked = RolloutResult.from_wire_checked(body)
    assert_same(fast, checked)
    assert _samples_fast(body[1]) is not None
    s0, s7 = fast.samples[0], fast.samples[7]
    assert s0.prompt_token_ids is s7.prompt_token_ids              # one group, one prompt array
    assert s7.token_versions.tolist() == [2 + 7] * 10 and len(s0.completion_token_ids) == 3
    for s in fast.samples:
        for arr in (s.prompt_token_ids, s.completion_token_ids, s.behavior_logprobs,
                    s.token_versions):
            assert not arr.flags.writeable
    # the next sample's prompt differs: its own array
    body[1][4][F["prompt_token_ids"]] = np.array([5, 6], "<i4").tobytes()
    out = RolloutResult.from_wire(body).samples
    assert out[4].prompt_token_ids.tolist() == [5, 6] and out[5].prompt_token_ids.tolist() == [0, 1, 2]
    assert out[3].prompt_token_ids is not out[4].prompt_token_ids


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("what", ["nan", "negative version", "overflow"])
def test_batch_path_one_pass_finds_what_the_per_sample_pass_finds(what, where):
    """The joined checks: one NaN among 8 x n log-probs, one negative version in the last
    sample's last token. A square that overflows float32 (finite, |x| > 1.8e19) sends the
    result to the checked path, which accepts it."""
    body = group_body()
    i = 0 if where == "first" else 7
    if what == "nan":
        _set_item(body[1][i], "behavior_logprobs", -1, np.nan, "<f4")
    elif what == "negative version":
        _set_item(body[1][i], "token_versions", -1, -1, "<i4")
    else:
        _set_item(body[1][i], "behavior_logprobs", 0, -3e38, "<f4")
    body = msgpack.unpackb(msgpack.packb(body))
    assert _samples_fast(body[1]) is None
    if what == "overflow":
        out = RolloutResult.from_wire(body)
        assert out.samples[i].behavior_logprobs[0] == np.float32(-3e38)
    else:
        with pytest.raises(ProtocolError, match=rf"samples\[{i}\]\.(behavior_logprobs|token_versions)"):
            RolloutResult.from_wire(body)


@FUZZ
@given(items=st.lists(samples(max_tokens=8), min_size=2, max_size=5), data=st.data())
def test_batch_and_checked_paths_agree_on_random_results(items, data):
    """Random samples, one field of one of them replaced by a random value: the batch path
    gives the checked path's samples, or hands the result to it (never accepts what it
    refuses)."""
    body = msgpack.unpackb(msgpack.packb(RolloutResult("srv", items).to_wire()))
    if data.draw(st.booleans(), label="mutate"):
        k = data.draw(st.integers(0, len(items) - 1), label="sample")
        field = data.draw(st.integers(0, len(body[1][k]) - 1), label="field position")
        body[1][k][field] = data.draw(plain_values | st.sampled_from(_mutations_of(body[1][k][field])))
        body = msgpack.unpackb(msgpack.packb(body))
    fast = _samples_fast(body[1])
    try:
        checked = RolloutResult.from_wire_checked(body)
    except ProtocolError:
        assert fast is None, "the batch path accepted a result the checked path refuses"
        return
    if fast is not None:
        assert_same(RolloutResult("srv", fast), checked)
        assert_same(RolloutResult.from_wire(body), checked)
