"""The wire is plain msgpack: any msgpack library reads and writes it; versions are checked."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import numpy as np
import pytest

import protocol
from protocol import PROTOCOL_VERSION, ProtocolError, RolloutResult, Sample, decode, encode
from protocol.weights import chunk_checksum, combine_checksums, split_chunks


def make_sample() -> Sample:
    return Sample(
        sample_id="s-7", assignment_id="a-2", group_index=0, group_size=2,
        prompt_token_ids=np.array([1, 2, 3], dtype=np.int64),          # converted on the way out
        completion_token_ids=np.array([10, -20, 30_000_000], dtype=np.int32),
        behavior_logprobs=np.array([-0.25, -1.5, -7.0], dtype=np.float32),
        token_versions=np.array([4, 4, 5], dtype=np.int32), reward=1.0,
        reward_parts={"correct": 1.0}, finish_reason="stop", timing={"generate_s": 0.5},
        completion_text="42", metadata={"answer": "42"})


def test_body_decodes_with_plain_msgpack():
    s = make_sample()
    header, body = encode(RolloutResult(server_id="srv-0", samples=[s]))
    h = msgpack.unpackb(header)
    assert h["v"] == list(PROTOCOL_VERSION) and h["type"] == "rollout_result"
    assert isinstance(h["id"], str) and isinstance(h["ts"], float)
    # The header is exactly what msgpack writes for that map (the codec assembles it by hand).
    assert header == msgpack.packb(h)

    b = msgpack.unpackb(body)
    assert b["server_id"] == "srv-0"
    w = b["samples"][0]
    assert w["sample_id"] == "s-7" and w["reward"] == 1.0 and w["completion_text"] == "42"
    assert w["finish_reason"] == "stop" and w["reward_parts"] == {"correct": 1.0}
    expected = {
        "prompt_token_ids": ("<i4", s.prompt_token_ids.astype("<i4").tobytes()),
        "completion_token_ids": ("<i4", s.completion_token_ids.astype("<i4").tobytes()),
        "behavior_logprobs": ("<f4", s.behavior_logprobs.astype("<f4").tobytes()),
        "token_versions": ("<i4", s.token_versions.astype("<i4").tobytes()),
    }
    for name, (dtype, raw) in expected.items():
        wire_dtype, shape, data = w[name]
        assert wire_dtype == dtype and shape == [3], name
        assert type(data) is bytes and data == raw, name     # raw little-endian bytes, not ints
    assert np.array_equal(np.frombuffer(w["behavior_logprobs"][2], "<f4"), s.behavior_logprobs)


def test_body_written_by_plain_msgpack_decodes():
    """A sender in another language only needs msgpack and this layout."""
    ids = np.array([5, 6], dtype="<i4").tobytes()
    body = {"server_id": "foreign", "samples": [{
        "sample_id": "x", "assignment_id": "a", "group_index": 0, "group_size": 1,
        "prompt_token_ids": ["<i4", [0], b""], "completion_token_ids": ["<i4", [2], ids],
        "behavior_logprobs": ["<f4", [2], np.array([-1, -2], "<f4").tobytes()],
        "token_versions": ["<i4", [2], np.zeros(2, "<i4").tobytes()], "reward": 0.0,
    }]}
    header = {"v": list(PROTOCOL_VERSION), "type": "rollout_result", "id": "m1", "ts": 1}
    msg = decode([msgpack.packb(header), msgpack.packb(body)])
    s = msg.samples[0]
    assert s.completion_token_ids.tolist() == [5, 6] and s.behavior_logprobs.tolist() == [-1.0, -2.0]
    assert s.finish_reason == "stop" and s.timing == {} and s.metadata == {}   # defaults filled in


def test_major_version_mismatch_is_refused_clearly():
    frames = encode(protocol.Heartbeat("srv", 1))
    h = msgpack.unpackb(frames[0])
    major, minor = PROTOCOL_VERSION
    for other in (major + 1, major - 1):
        h["v"] = [other, 3]
        with pytest.raises(ProtocolError) as e:
            decode([msgpack.packb(h), frames[1]])
        msg = str(e.value)
        assert msg.startswith("header.v: ")
        assert f"peer speaks protocol {other}.3" in msg
        assert f"this process speaks {major}.{minor}" in msg
        assert "major versions must match" in msg
    assert protocol.message_id([msgpack.packb(h), frames[1]]) == ""


def test_newer_minor_version_with_unknown_fields_still_decodes():
    s = make_sample()
    frames = encode(RolloutResult(server_id="srv", samples=[s]))
    h = msgpack.unpackb(frames[0])
    h["v"] = [PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 7]
    h["trace"] = {"span": "abc"}                      # a header field from the future
    b = msgpack.unpackb(frames[1])
    b["compression"] = "none"                        # a message field from the future
    b["samples"][0]["entropy"] = ["<f4", [3], b"\0" * 12]    # a sample field from the future
    out = decode([msgpack.packb(h), msgpack.packb(b)])
    assert out.samples[0].sample_id == s.sample_id
    assert out.samples[0].token_versions.tolist() == [4, 4, 5]
    assert protocol.decode_header([msgpack.packb(h), b""])["v"][1] == PROTOCOL_VERSION[1] + 7


def test_older_minor_version_without_defaulted_fields_decodes():
    frames = encode(protocol.Hello("srv", "hf", "tiny", 3, max_concurrency=4, metadata={"a": 1}))
    b = msgpack.unpackb(frames[1])
    del b["max_concurrency"], b["metadata"]
    out = decode([frames[0], msgpack.packb(b)])
    assert out == protocol.Hello("srv", "hf", "tiny", 3)


def test_required_field_missing_is_refused():
    frames = encode(protocol.Hello("srv", "hf", "tiny", 3))
    b = msgpack.unpackb(frames[1])
    del b["model"]
    with pytest.raises(ProtocolError, match=r"^Hello\.model: missing$"):
        decode([frames[0], msgpack.packb(b)])


def test_zmq_frames_decode_without_copy():
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://protocol-interop")
        b.connect("inproc://protocol-interop")
        data = bytes(range(256)) * 4096
        a.send_multipart(encode(protocol.WeightChunk(2, 0, chunk_checksum(data), data)), copy=False)
        a.send_multipart(encode(RolloutResult("srv", [make_sample()])))
        chunk = decode(b.recv_multipart(copy=False))
        assert isinstance(chunk.data, memoryview) and chunk.data == data
        assert chunk_checksum(chunk.data) == chunk.checksum
        result = decode(b.recv_multipart(copy=False))
        assert result.samples[0].completion_token_ids.tolist() == [10, -20, 30_000_000]
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_weight_helpers():
    data = bytes(range(256)) * 10          # 2,560 bytes
    chunks = split_chunks(data, 1000)
    assert [c.nbytes for c in chunks] == [1000, 1000, 560]
    assert b"".join(chunks) == data
    assert all(c.obj is data for c in chunks)                       # views, no copies
    sums = [chunk_checksum(c) for c in chunks]
    assert all(len(c) == 32 for c in sums) and len(set(sums)) == 3
    assert combine_checksums(sums) == combine_checksums(list(sums))
    assert combine_checksums(sums) != combine_checksums(sums[::-1])
    assert split_chunks(b"", 8) == []
    with pytest.raises(ValueError):
        split_chunks(data, 0)


def test_fast_check_warnings_stay_quiet_in_a_real_process():
    """The x·x finiteness hint overflows for |x| > 1.8e19; that must not print or raise, even
    under ``-W error`` (pytest's own warning capture hides this, so run a real interpreter)."""
    code = (
        "import numpy as np, protocol as p\n"
        "s = p.Sample('s', 'a', 0, 1, np.zeros(0, np.int32), np.zeros(2, np.int32),\n"
        "             np.array([-3e38, -1], np.float32), np.zeros(2, np.int32), 0.0)\n"
        "out = p.decode(p.encode(p.RolloutResult('srv', [s])))\n"
        "assert out.samples[0].behavior_logprobs[0] == np.float32(-3e38)\n"
    )
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
