"""The wire is plain msgpack: any msgpack library reads and writes it; versions are checked."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import numpy as np
import pytest

import protocol
from protocol import PROTOCOL_VERSION, ProtocolError, RolloutResult, Sample, decode, encode
from protocol.chunks import chunk_checksum, combine_checksums, split_chunks
from protocol.messages import _samples_fast
from protocol.schema import wire_field_names


def make_sample() -> Sample:
    return Sample(
        sample_id="s-7", assignment_id="a-2", group_index=0, group_size=2,
        prompt_token_ids=np.array([1, 2, 3], dtype=np.int64),          # converted on the way out
        completion_token_ids=np.array([10, -20, 30_000_000], dtype=np.int32),
        behavior_logprobs=np.array([-0.25, -1.5, -7.0], dtype=np.float32),
        token_versions=np.array([4, 4, 5], dtype=np.int32), reward=1.0,
        reward_parts={"correct": 1.0}, finish_reason="stop", timing={"generate_s": 0.5},
        completion_text="42", metadata={"answer": "42"})


SAMPLE_FIELDS = wire_field_names(Sample)


def test_wire_field_order_is_pinned():
    """Bodies are positional: reordering or removing a field breaks every peer. Within a major
    version fields may only be appended (with a default). Extend this table when you append one."""
    expected = {
        "hello": ("server_id", "engine", "model", "version", "max_concurrency", "metadata",
                  "relay"),                                                          # 3.8: relay
        "welcome": ("learner_id", "run_id", "version", "weights_endpoint", "weights_kind",
                    "metadata"),
        "heartbeat": ("sender_id", "version", "inflight", "idle_ratio"),            # 3.1: idle_ratio
        "work_request": ("server_id", "credits"),
        "assignment": ("assignment_id", "prompt_id", "prompt_token_ids", "group_size", "version",
                       "prompt_text", "sampling", "metadata", "deadline_s", "attempt",
                       "burst_left"),                                               # 3.2: burst_left
        "rollout_result": ("server_id", "samples"),
        "ack": ("sample_ids", "statuses"),
        "weights_available": ("version", "kind", "tensors", "total_bytes", "chunk_bytes",
                              "num_chunks", "checksum", "chunk_checksums", "metadata",
                              "lora", "sources"),                                   # 3.3: lora, 3.8: sources
        "weight_chunk_request": ("version", "index", "base"),                      # 3.7: base
        "weight_chunk": ("version", "index", "checksum", "base", "encoding"),      # 3.7; data: its own frame
        "weights_applied": ("server_id", "version", "checksum", "seconds"),
        "control_request": ("command", "args"),
        "control_reply": ("ok", "result", "error"),
        "error": ("code", "message", "ref_id"),
    }
    assert {name: wire_field_names(cls) for name, cls in protocol.MESSAGE_TYPES.items()} == expected
    # nested records are positional too
    assert wire_field_names(protocol.SamplingParams) == ("temperature", "top_p", "top_k",
                                                         "max_new_tokens", "seed",   # seed: 3.4
                                                         "stop", "stop_token_ids",   # 3.5
                                                         "max_turns", "max_episode_tokens")  # 3.6
    assert wire_field_names(protocol.TensorSpec) == ("name", "dtype", "shape", "offset", "nbytes")
    assert wire_field_names(protocol.WeightsSource) == ("endpoint", "public_key")          # 3.8
    assert wire_field_names(protocol.LoraSpec) == ("r", "lora_alpha", "lora_dropout",
                                                   "target_modules", "bias", "use_rslora",
                                                   "fan_in_fan_out")                # 3.3
    assert SAMPLE_FIELDS == (
        "sample_id", "assignment_id", "group_index", "group_size", "prompt_token_ids",
        "completion_token_ids", "behavior_logprobs", "token_versions", "reward", "reward_parts",
        "finish_reason", "timing", "completion_text", "failed", "metadata", "array_dtypes",
        "sampling_temperature",                                                     # 3.3
        "turn_spans")                                                               # 3.6
    assert wire_field_names(protocol.TensorSpec) == ("name", "dtype", "shape", "offset", "nbytes")


def test_body_decodes_with_plain_msgpack():
    s = make_sample()
    header, body = encode(RolloutResult(server_id="srv-0", samples=[s]))
    h = msgpack.unpackb(header)
    major, minor, mtype, mid, ts = h
    assert [major, minor] == list(PROTOCOL_VERSION) and mtype == "rollout_result"
    assert isinstance(mid, str) and isinstance(ts, float)
    # The header is exactly what msgpack writes for that array (the codec assembles it by hand).
    assert header == msgpack.packb(h)
    assert protocol.decode_header([header, body]) == {"v": [major, minor], "type": mtype,
                                                       "id": mid, "ts": ts}

    server_id, samples = msgpack.unpackb(body)
    assert server_id == "srv-0" and len(samples) == 1
    w = dict(zip(SAMPLE_FIELDS, samples[0], strict=True))      # names from the schema order
    assert w["sample_id"] == "s-7" and w["reward"] == 1.0 and w["completion_text"] == "42"
    assert w["finish_reason"] == "stop" and w["reward_parts"] == {"correct": 1.0}
    assert w["failed"] is None and w["metadata"] == {"answer": "42"} and w["group_size"] == 2
    expected = {
        "prompt_token_ids": s.prompt_token_ids.astype("<i4").tobytes(),
        "completion_token_ids": s.completion_token_ids.astype("<i4").tobytes(),
        "behavior_logprobs": s.behavior_logprobs.astype("<f4").tobytes(),
        "token_versions": s.token_versions.astype("<i4").tobytes(),
    }
    for name, raw in expected.items():
        assert type(w[name]) is bytes and w[name] == raw, name   # raw little-endian bytes
    assert np.array_equal(np.frombuffer(w["behavior_logprobs"], "<f4"), s.behavior_logprobs)


def test_body_written_by_plain_msgpack_decodes():
    """A sender in another language only needs msgpack and the field order; it may leave out
    trailing fields that have defaults."""
    ids = np.array([5, 6], dtype="<i4").tobytes()
    sample = ["x", "a", 0, 1, b"", ids, np.array([-1, -2], "<f4").tobytes(),
              np.zeros(2, "<i4").tobytes(), 0.0]                  # up to reward; the rest defaults
    header = [PROTOCOL_VERSION[0], PROTOCOL_VERSION[1], "rollout_result", "m1", 1]  # int ts is fine
    msg = decode([msgpack.packb(header), msgpack.packb(["foreign", [sample]])])
    s = msg.samples[0]
    assert s.completion_token_ids.tolist() == [5, 6] and s.behavior_logprobs.tolist() == [-1.0, -2.0]
    assert s.prompt_token_ids.dtype == np.int32 and len(s.prompt_token_ids) == 0
    assert s.finish_reason == "stop" and s.timing == {} and s.metadata == {}   # defaults filled in


def test_major_version_mismatch_is_refused_clearly():
    frames = encode(protocol.Heartbeat("srv", 1))
    h = msgpack.unpackb(frames[0])
    major, minor = PROTOCOL_VERSION
    for other in (major + 1, major - 1):
        h[0], h[1] = other, 3
        with pytest.raises(ProtocolError) as e:
            decode([msgpack.packb(h), frames[1]])
        msg = str(e.value)
        assert msg.startswith("header.v: ")
        assert f"peer speaks protocol {other}.3" in msg
        assert f"this process speaks {major}.{minor}" in msg
        assert "major versions must match" in msg
    assert protocol.message_id([msgpack.packb(h), frames[1]]) == ""


def test_protocol_1_header_is_refused_as_a_version_mismatch():
    """Protocol 1 wrote the header as a map; a peer still on it gets the version error, not a
    complaint about the header's shape."""
    old = msgpack.packb({"v": [1, 0], "type": "heartbeat", "id": "m", "ts": 1.0})
    with pytest.raises(ProtocolError, match=r"^header\.v: peer speaks protocol 1\.0, this process "
                                            r"speaks \d+\.\d+; major versions must match"):
        decode([old, msgpack.packb({"sender_id": "srv", "version": 1})])


def test_newer_minor_version_with_unknown_fields_still_decodes():
    s = make_sample()
    frames = encode(RolloutResult(server_id="srv", samples=[s]))
    h = msgpack.unpackb(frames[0])
    h[1] += 7
    h.append({"span": "abc"})                         # a header value from the future
    b = msgpack.unpackb(frames[1])
    b.append("none")                                  # a message field from the future
    b[1][0].append(b"\0" * 12)                        # a sample field from the future
    assert _samples_fast([b[1][0]]) is not None       # still the fast path
    out = decode([msgpack.packb(h), msgpack.packb(b)])
    assert out.samples[0].sample_id == s.sample_id
    assert out.samples[0].token_versions.tolist() == [4, 4, 5]
    header = protocol.decode_header([msgpack.packb(h), b""])
    assert header["v"] == [PROTOCOL_VERSION[0], PROTOCOL_VERSION[1] + 7] and set(header) == {
        "v", "type", "id", "ts"}
    # A newer Hello with an extra field decodes through the generic path too.
    hello = encode(protocol.Hello("srv", "hf", "tiny", 3))
    newer = msgpack.packb(msgpack.unpackb(hello[1]) + ["future"])
    assert decode([hello[0], newer]) == protocol.Hello("srv", "hf", "tiny", 3)


def test_older_minor_version_without_defaulted_fields_decodes():
    frames = encode(protocol.Hello("srv", "hf", "tiny", 3, max_concurrency=4, metadata={"a": 1}))
    b = msgpack.unpackb(frames[1])
    del b[4:]                                         # max_concurrency, metadata: defaults
    out = decode([frames[0], msgpack.packb(b)])
    assert out == protocol.Hello("srv", "hf", "tiny", 3)


def test_a_3_1_assignment_has_no_burst_hint_and_a_3_2_one_round_trips():
    """Assignment.burst_left (3.2): a 3.1 learner's assignment (no such field) decodes as -1,
    "unknown" (the server waits its batch window, as before); the values a learner sends round
    trip; below -1 is refused."""
    a = protocol.Assignment(assignment_id="a-1", prompt_id="p", prompt_token_ids=np.arange(3, dtype=np.int32),
                            group_size=2, version=0, burst_left=3)
    frames = encode(a)
    body = msgpack.unpackb(frames[1])
    assert body[-1] == 3 and decode(frames).burst_left == 3
    older = [msgpack.packb([3, 1, *msgpack.unpackb(frames[0])[2:]]), msgpack.packb(body[:-1])]
    assert decode(older).burst_left == -1
    with pytest.raises(ProtocolError, match=r"Assignment\.burst_left: -2 is below the minimum -1"):
        decode([frames[0], msgpack.packb([*body[:-1], -2])])


LORA = protocol.LoraSpec(r=8, lora_alpha=16.0, lora_dropout=0.05, target_modules=["k_proj", "q_proj"],
                         bias="none", use_rslora=False, fan_in_fan_out=False)


def lora_manifest(lora: protocol.LoraSpec | None = LORA) -> protocol.WeightsAvailable:
    return protocol.WeightsAvailable(
        version=2, kind="lora", tensors=[protocol.TensorSpec("a.lora_A.weight", "float32", [8, 4], 0, 128)],
        total_bytes=128, chunk_bytes=64, num_chunks=2, checksum="c", lora=lora)


def as_minor(frames: list[bytes], minor: int, body: list) -> list[bytes]:
    """``frames`` re-sent as a ``3.minor`` peer would: its header's minor version, ``body``."""
    return [msgpack.packb([3, minor, *msgpack.unpackb(frames[0])[2:]]), msgpack.packb(body)]


def test_a_3_2_peer_has_no_typed_temperature_or_lora_and_3_3_ones_round_trip():
    """Sample.sampling_temperature and WeightsAvailable.lora (3.3) replace the metadata keys
    "sampling_temperature" and "lora" of 3.2. A 3.2 sample (16 values) decodes, on the fast
    path, with no temperature (the learner stamps its own); a 3.2 manifest with no lora field,
    with none (its old metadata key is an opaque map entry: nothing reads it). 3.3 values round
    trip; hostile ones are refused, naming the field."""
    s = make_sample()
    s.sampling_temperature = 0.7
    frames = encode(RolloutResult("srv", [s]))
    body = msgpack.unpackb(frames[1])
    tau_at = SAMPLE_FIELDS.index("sampling_temperature")
    assert body[1][0][tau_at] == 0.7 and decode(frames).samples[0].sampling_temperature == 0.7
    old = [body[0], [body[1][0][:tau_at]]]
    assert _samples_fast(old[1]) is not None                       # 3.2 samples stay fast
    out = decode(as_minor(frames, 2, old)).samples[0]
    assert out.sampling_temperature is None and out.token_versions.tolist() == [4, 4, 5]

    m = decode(encode(lora_manifest()))
    assert m.lora == LORA and type(m.lora.lora_alpha) is float
    assert m.lora.peft_kwargs() == {"r": 8, "lora_alpha": 16.0, "lora_dropout": 0.05,
                                    "target_modules": ["k_proj", "q_proj"], "bias": "none",
                                    "use_rslora": False, "fan_in_fan_out": False}
    frames = encode(lora_manifest(None))
    older = msgpack.unpackb(frames[1])[:-2]                         # no lora, no sources (3.8)
    older[-1] = {"lora": {"r": 8}}                                  # where 3.2 put it
    m = decode(as_minor(frames, 2, older))
    assert m.kind == "lora" and m.lora is None and m.metadata == {"lora": {"r": 8}}

    for bad, error in ((float("nan"), "must be finite"), (float("inf"), "must be finite"),
                       (-1.0, "is below the minimum"), (0.0, "is below the minimum"),
                       (1e7, "is above the maximum"), ("hot", "expected a float")):
        wire = [body[0], [[*body[1][0][:tau_at], bad]]]
        with pytest.raises(ProtocolError, match=rf"samples\[0\]\.sampling_temperature: .*{error}"):
            decode([encode(RolloutResult("srv", []))[0], msgpack.packb(wire)])


def test_required_field_missing_is_refused():
    frames = encode(protocol.Hello("srv", "hf", "tiny", 3))
    b = msgpack.unpackb(frames[1])
    del b[2:]                                         # model and everything after it
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


def test_array_dtypes_travel_with_every_sample_and_are_enforced():
    """Each sample declares its arrays' dtypes (1-D: shape = byte length / item size); a receiver
    refuses another declaration instead of misreading the bytes (e.g. int64 token ids)."""
    s = Sample("s", "a", 0, 1, np.arange(3, dtype=np.int32), np.arange(2, dtype=np.int32),
               np.zeros(2, np.float32), np.zeros(2, np.int32), 0.0)
    header, body = encode(RolloutResult("srv", [s]))
    wire = msgpack.unpackb(body)
    sample = wire[1][0]
    assert sample[SAMPLE_FIELDS.index("array_dtypes")] == "<i4,<i4,<f4,<i4"
    for name, dtype in zip(("prompt_token_ids", "completion_token_ids", "behavior_logprobs",
                            "token_versions"), ("<i4", "<i4", "<f4", "<i4")):
        raw = sample[SAMPLE_FIELDS.index(name)]
        assert np.frombuffer(raw, dtype).tolist() == getattr(s, name).tolist()
    sample[SAMPLE_FIELDS.index("array_dtypes")] = "<i8,<i4,<f4,<i4"
    with pytest.raises(protocol.ProtocolError, match=r"samples\[0\]\.array_dtypes: '<i8"):
        decode([header, msgpack.packb(wire)])


def test_a_3_3_assignment_has_no_seed_and_a_3_4_seed_round_trips():
    """SamplingParams.seed (3.4, issue 27.9): absent from a 3.3 learner's assignment -> None (the
    engine's own randomness); a seed round-trips; negative or past 2^63 - 1 is refused."""
    a = protocol.Assignment(assignment_id="a-1", prompt_id="p", prompt_token_ids=np.arange(3, dtype=np.int32),
                            group_size=2, version=0, sampling=protocol.SamplingParams(seed=protocol.SEED_MAX))
    frames = encode(a)
    assert decode(frames).sampling.seed == protocol.SEED_MAX
    body = msgpack.unpackb(frames[1])
    sampling_at = next(i for i, v in enumerate(body) if isinstance(v, list) and len(v) == 9 and v[4] == protocol.SEED_MAX)
    older = list(body)
    older[sampling_at] = body[sampling_at][:4]
    assert decode(as_minor(frames, 3, older)).sampling.seed is None
    for bad in (-1, protocol.SEED_MAX + 1):
        worse = list(body)
        worse[sampling_at] = [*body[sampling_at][:4], bad]
        with pytest.raises(ProtocolError, match="seed"):
            decode([frames[0], msgpack.packb(worse)])


def test_a_3_4_assignment_has_no_stops_and_3_5_stops_round_trip():
    """SamplingParams.stop / stop_token_ids (3.5, issue 26.3): absent from a 3.4 learner's
    assignment -> none; they round-trip; an empty string, too many or too long strings, and ids
    outside [0, 2^31) are refused."""
    sp = protocol.SamplingParams(seed=3, stop=["</tool>", "\n\n"], stop_token_ids=[7, 2**31 - 1])
    a = protocol.Assignment(assignment_id="a-1", prompt_id="p", prompt_token_ids=np.arange(3, dtype=np.int32),
                            group_size=2, version=0, sampling=sp)
    frames = encode(a)
    got = decode(frames).sampling
    assert got.stop == ["</tool>", "\n\n"] and got.stop_token_ids == [7, 2**31 - 1]
    body = msgpack.unpackb(frames[1])
    at = next(i for i, v in enumerate(body) if isinstance(v, list) and len(v) == 9 and v[4] == 3)
    older = list(body)
    older[at] = body[at][:5]
    old = decode(as_minor(frames, 4, older)).sampling
    assert old.stop == [] and old.stop_token_ids == [] and old.seed == 3
    for stop, ids, match in (([""], [], "empty string"), (["x"] * 17, [], "items exceed 16"),
                             (["x" * 257], [], "exceeds 256"), ([], [-1], "stop_token_ids"),
                             ([], [2**31], "stop_token_ids"), ([], list(range(65)), "items exceed 64")):
        worse = list(body)
        worse[at] = [*body[at][:5], stop, ids]
        with pytest.raises(ProtocolError, match=match):
            decode([frames[0], msgpack.packb(worse)])


def test_a_3_5_sample_is_one_turn_and_3_6_turn_spans_round_trip():
    """Sample.turn_spans and SamplingParams.max_turns / max_episode_tokens (3.6, issue 26.2): a
    3.5 sample (17 values) decodes on the fast path as one turn, every token sampled; a 3.5
    assignment asks for one turn. Spans round-trip (the checked path) with their loss mask;
    spans that are not ordered, non-empty (start, end) pairs within the completion are refused,
    naming the field, and so are turn limits out of range."""
    s = make_sample()
    frames = encode(RolloutResult("srv", [s]))
    body = msgpack.unpackb(frames[1])
    assert body[1][0][-1] is None and len(body[1][0]) == len(SAMPLE_FIELDS)
    old = [body[0], [body[1][0][:-1]]]
    assert _samples_fast(old[1]) is not None                       # 3.5 samples stay fast
    out = decode(as_minor(frames, 5, old)).samples[0]
    assert out.turn_spans is None and out.turns == 1 and out.loss_mask() is None

    s.completion_token_ids = np.array([10, 11, 12, 13, 14], dtype=np.int32)
    s.behavior_logprobs = np.array([-0.5, -1.0, 0.0, 0.0, -2.0], dtype=np.float32)
    s.token_versions = np.array([4, 4, 4, 4, 5], dtype=np.int32)
    s.turn_spans = np.array([0, 2, 4, 5], dtype=np.int32)
    frames = encode(RolloutResult("srv", [s]))
    got = decode(frames).samples[0]
    assert got.turn_spans.tolist() == [0, 2, 4, 5] and got.turns == 2
    assert got.loss_mask().tolist() == [1, 1, 0, 0, 1]
    body = msgpack.unpackb(frames[1])
    for bad, words in (([0, 2, 1, 5], "not non-empty, ordered"), ([0, 6], "not non-empty"),
                       ([3, 3], "not non-empty"), ([0, 2, 4], "3 values"), ([], "0 values"),
                       ([0, -1], "negative")):
        wire = [body[0], [[*body[1][0][:-1], np.array(bad, dtype="<i4").tobytes()]]]
        with pytest.raises(ProtocolError, match=rf"samples\[0\]\.turn_spans: .*{words}"):
            decode([frames[0], msgpack.packb(wire)])

    sp = protocol.SamplingParams(max_turns=6, max_episode_tokens=300)
    a = protocol.Assignment(assignment_id="a-1", prompt_id="p", prompt_token_ids=np.arange(3, dtype=np.int32),
                            group_size=2, version=0, sampling=sp)
    frames = encode(a)
    got = decode(frames).sampling
    assert (got.max_turns, got.max_episode_tokens, got.episode_tokens) == (6, 300, 300)
    body = msgpack.unpackb(frames[1])
    at = next(i for i, v in enumerate(body) if isinstance(v, list) and len(v) == 9)
    older = list(body)
    older[at] = body[at][:7]
    old = decode(as_minor(frames, 5, older)).sampling
    assert (old.max_turns, old.max_episode_tokens, old.episode_tokens) == (1, None, old.max_new_tokens)
    for turns, tokens, field in ((0, None, "max_turns"), (protocol.MAX_TURNS + 1, None, "max_turns"),
                                 (2, 0, "max_episode_tokens"), (2, "many", "max_episode_tokens")):
        worse = list(body)
        worse[at] = [*body[at][:7], turns, tokens]
        with pytest.raises(ProtocolError, match=field):
            decode([frames[0], msgpack.packb(worse)])


def test_3_6_chunk_messages_are_raw_and_3_7_deltas_are_checked():
    """WeightChunkRequest.base and WeightChunk.base / encoding (3.7, issue 28.1): a 3.6 request
    asks for no delta and a 3.6 chunk is raw; an unknown encoding, or a delta whose base is not
    an older version, is refused naming the field."""
    frames = encode(protocol.WeightChunkRequest(version=4, index=2, base=3))
    assert decode(frames).base == 3
    body = msgpack.unpackb(frames[1])
    assert decode(as_minor(frames, 6, body[:2])).base == -1
    chunk = protocol.WeightChunk(version=4, index=2, checksum="c", data=b"xyz", base=3, encoding="xor-zstd")
    frames = encode(chunk)
    got = decode(frames)
    assert (got.base, got.encoding, bytes(got.data)) == (3, "xor-zstd", b"xyz")
    body = msgpack.unpackb(frames[1])
    old = decode([*as_minor(frames, 6, body[:3]), *frames[2:]])
    assert (old.base, old.encoding, bytes(old.data)) == (-1, "raw", b"xyz")
    for base, encoding, words in ((3, "gzip", r"\.encoding: 'gzip' not in"), (4, "xor-zstd", r"\.base: a delta"),
                                  (-1, "xor-zstd", r"\.base: a delta"), (-2, "raw", "minimum")):
        with pytest.raises(ProtocolError, match=words):
            decode([frames[0], msgpack.packb([*body[:3], base, encoding]), *frames[2:]])


def test_3_7_hello_and_manifest_have_no_relay_and_3_8_sources_are_checked():
    """Hello.relay and WeightsAvailable.sources (3.8, issue 28.2): a 3.7 Hello relays nothing and
    a 3.7 manifest names no peer; both round-trip; a key that is not 40 characters and more than
    MAX_WEIGHTS_SOURCES peers are refused, naming the field."""
    src = protocol.WeightsSource(endpoint="tcp://198.18.0.2:6000", public_key="k" * 40)
    hello = protocol.Hello(server_id="s", engine="hf", model="m", version=0, relay=src)
    frames = encode(hello)
    assert decode(frames).relay == src
    body = msgpack.unpackb(frames[1])
    assert decode(as_minor(frames, 7, body[:6])).relay is None
    m = protocol.WeightsAvailable(version=1, kind="full", tensors=[], total_bytes=0, chunk_bytes=1024,
                                  num_chunks=0, checksum="c", sources=[src])
    frames = encode(m)
    assert decode(frames).sources == [src]
    body = msgpack.unpackb(frames[1])
    assert decode(as_minor(frames, 7, body[:10])).sources == []
    with pytest.raises(ProtocolError, match=r"sources\[0\]\.public_key: a 40-character"):
        decode([frames[0], msgpack.packb([*body[:10], [["tcp://h:1", "short"]]])])
    with pytest.raises(ProtocolError, match=r"\.sources: 9 peers, at most 8"):
        decode([frames[0], msgpack.packb([*body[:10], [["tcp://h:1", ""]] * 9])])
