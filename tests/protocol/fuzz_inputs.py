"""Hostile frame lists from a fixed seed, for the R3 volume fuzz (CI) and tests/bench/bench_fuzz.py.

Plain ``random.Random`` rather than hypothesis: a million inputs must cost seconds, and a seed
must reproduce any one of them (``Fuzzer(seed).case(i)``). Every category is a kind of bad input
the issue names; ``must_fail`` marks the ones where decoding must raise ``ProtocolError`` (a
decoded message would be a validation hole). The others (random bytes, bit flips, type swaps)
may happen to decode; what they must never do is raise anything but ``ProtocolError``.

    random_bytes        1-4 frames of random bytes
    not_frames          not a list of byte frames (None, ints, strings, nested lists)
    truncated           the header or body of a valid message cut short           must fail
    trailing            extra bytes after the header's or body's msgpack object   must fail
    bit_flips           1-8 random bytes of a valid message's header or body changed
    frame_count         a frame added or removed                                  must fail
    type_swap           a field of a valid body replaced by a value of another type
    huge_length         a container/string/bin declaring up to 4 Gi elements      must fail
    ragged_arrays       a sample whose arrays disagree in length (or odd bytes)  must fail
    nonfinite_logprobs  NaN / +-Inf behaviour log-probs                           must fail
    unknown_type        a header naming a message type that does not exist        must fail
    wrong_version       another major version (or a protocol-1 map header)        must fail
    wrong_shape         valid msgpack of the wrong shape as header or body        must fail
"""

from __future__ import annotations

import math
import random
import struct

import msgpack
import numpy as np

import protocol
from protocol import PROTOCOL_VERSION, encode
from protocol.chunks import chunk_checksum, combine_checksums, tensor_layout
from protocol.schema import wire_field_names

MAJOR, MINOR = PROTOCOL_VERSION
F = {name: i for i, name in enumerate(wire_field_names(protocol.Sample))}
ARRAY_FIELDS = ("prompt_token_ids", "completion_token_ids", "behavior_logprobs", "token_versions")


def sample(aid: str = "run-a1", i: int = 0, n: int = 6) -> protocol.Sample:
    return protocol.Sample(
        sample_id=protocol.sample_id(aid, i), assignment_id=aid, group_index=i, group_size=4,
        prompt_token_ids=np.arange(1, 5, dtype=np.int32), completion_token_ids=np.arange(n, dtype=np.int32),
        behavior_logprobs=-np.linspace(0.1, 3.0, n, dtype=np.float32),
        token_versions=np.full(n, 3, dtype=np.int32), reward=1.0, reward_parts={"exact": 1.0},
        finish_reason="stop", timing={"generate_s": 0.01}, completion_text="12",
        metadata={"task": "add", "n": [1, 2]}, sampling_temperature=0.7)


def manifest() -> protocol.WeightsAvailable:
    data = bytes(range(48))
    chunks = [data[:32], data[32:]]
    sums = [chunk_checksum(c) for c in chunks]
    return protocol.WeightsAvailable(
        version=4, kind="full", tensors=tensor_layout([("w", "float32", [3, 4])]), total_bytes=48,
        chunk_bytes=32, num_chunks=2, checksum=combine_checksums(sums), chunk_checksums=sums)


def valid_messages() -> list[protocol.Message]:
    """One valid message of every type (a test checks the list covers MESSAGE_TYPES)."""
    return [
        protocol.Hello(server_id="srv-0", engine="hf", model="tiny", version=3, max_concurrency=8),
        protocol.Welcome(learner_id="learner-1", run_id="run", version=3,
                         weights_endpoint="tcp://127.0.0.1:5556"),
        protocol.WorkRequest(server_id="srv-0", credits=8),
        protocol.Assignment(assignment_id="run-a1", prompt_id="p1",
                            prompt_token_ids=np.arange(1, 5, dtype=np.int32), group_size=4, version=3,
                            prompt_text="1+2=", metadata={"answer": "3"}),
        protocol.RolloutResult(server_id="srv-0", samples=[sample(i=0), sample(i=1, n=3)]),
        protocol.Ack(sample_ids=["run-a1/0", "run-a1/1"], statuses=["accepted", "duplicate"]),
        manifest(),
        protocol.WeightsAvailable(                       # a LoRA publish and its adapter (3.3)
            version=5, kind="lora", tensors=tensor_layout([("a.lora_A.weight", "float32", [2, 4])]),
            total_bytes=32, chunk_bytes=32, num_chunks=1, checksum="c", lora=protocol.LoraSpec(
                r=2, lora_alpha=4.0, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])),
        protocol.WeightChunkRequest(version=4, index=1),
        protocol.WeightChunk(version=4, index=1, checksum=chunk_checksum(bytes(range(32, 48))),
                             data=bytes(range(32, 48))),
        protocol.WeightsApplied(server_id="srv-0", version=4, checksum="abc", seconds=0.5),
        protocol.Heartbeat(sender_id="srv-0", version=3, inflight=2),
        protocol.ControlRequest(command="set", args={"key": "max_staleness", "value": 2}),
        protocol.ControlReply(ok=True, result={"version": 3}),
        protocol.Error(code="protocol_error", message="x", ref_id="m-1"),
    ]


def _packed_array(items: list[bytes]) -> bytes:
    """A msgpack array from already-packed elements (to splice raw bytes into a body)."""
    n = len(items)
    head = bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n)
    return head + b"".join(items)


_HUGE_HEADERS = (b"\xdd", b"\xdf", b"\xdb", b"\xc6", b"\xc9", b"\xdc", b"\xde", b"\xda", b"\xc5")
_OTHER_VALUES = (None, True, -1, 2**63, 1.5, float("nan"), "", "x" * 40, b"\x00\x01", [], [1, "a"],
                 {}, {"k": 1}, {1: 2}, [[[]]])


class Fuzzer:
    """Hostile inputs: :meth:`case` returns ``(category, frames, must_fail)``."""

    CATEGORIES = ("random_bytes", "not_frames", "truncated", "trailing", "bit_flips", "frame_count",
                  "type_swap", "huge_length", "ragged_arrays", "nonfinite_logprobs", "unknown_type",
                  "wrong_version", "wrong_shape")

    def __init__(self, seed: int = 0, socket_safe: bool = False):
        """``socket_safe``: only inputs ZeroMQ can carry (non-empty lists of bytes)."""
        self.seed = seed
        self.rng = random.Random(seed)
        self.messages = valid_messages()
        self.frames = [encode(m, msg_id=f"fuzz-{i}") for i, m in enumerate(self.messages)]
        self.bodies = [msgpack.unpackb(f[1]) for f in self.frames]
        self.result_index = next(i for i, m in enumerate(self.messages) if isinstance(m, protocol.RolloutResult))
        self.categories = [c for c in self.CATEGORIES if not (socket_safe and c == "not_frames")]
        self._makers = {c: getattr(self, f"_{c}") for c in self.categories}

    def case(self, index: int | None = None) -> tuple[str, list, bool]:
        if index is not None:
            self.rng.seed(self.seed * 1_000_003 + index)
        category = self.rng.choice(self.categories)
        frames, must_fail = self._makers[category]()
        return category, frames, must_fail

    # ---- helpers ----------------------------------------------------------------------------
    def _valid(self) -> tuple[int, list]:
        i = self.rng.randrange(len(self.frames))
        return i, list(self.frames[i])

    def _bytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def _header(self, mtype: str, major: int = MAJOR, minor: int = MINOR) -> bytes:
        return msgpack.packb([major, minor, mtype, "fuzz", 1.0])

    def _result_with(self, mutate) -> list:
        """A RolloutResult whose first sample's wire values were changed by ``mutate(sample_body)``."""
        body = msgpack.unpackb(self.frames[self.result_index][1])
        mutate(body[1][0])
        return [self.frames[self.result_index][0], msgpack.packb(body)]

    # ---- categories -------------------------------------------------------------------------
    def _random_bytes(self):
        r = self.rng
        return [self._bytes(r.randrange(0, 80)) for _ in range(r.randrange(1, 5))], False

    def _not_frames(self):
        r = self.rng
        choices = (None, 0, "frames", b"bytes", [], [None, b"x"], [b"\x95", 3], ["str", "str"],
                   {"a": b"b"}, (b"x",), [[b"a"], [b"b"]], [b"a"] * 40)
        value = r.choice(choices)
        must_fail = not (isinstance(value, tuple) and len(value) >= 2)
        return value, must_fail

    def _truncated(self):
        i, frames = self._valid()
        k = self.rng.randrange(2)
        if len(frames[k]) < 2:
            k = 0
        frames[k] = frames[k][:self.rng.randrange(0, len(frames[k]))]
        return frames, True

    def _trailing(self):
        i, frames = self._valid()
        k = self.rng.randrange(2)
        frames[k] = frames[k] + self._bytes(self.rng.randrange(1, 9))
        return frames, True

    def _bit_flips(self):
        r = self.rng
        i, frames = self._valid()
        k = r.randrange(2)
        data = bytearray(frames[k])
        for _ in range(r.randrange(1, 9)):
            data[r.randrange(len(data))] = r.randrange(256)
        frames[k] = bytes(data)
        return frames, False

    def _frame_count(self):
        r = self.rng
        i, frames = self._valid()
        if r.random() < 0.5 and len(frames) > 0:
            del frames[r.randrange(len(frames))]
        else:
            frames.insert(r.randrange(2, len(frames) + 1), self._bytes(r.randrange(0, 16)))
        return frames, True

    def _type_swap(self):
        r = self.rng
        i, frames = self._valid()
        body = msgpack.unpackb(frames[1])
        target = body
        if i == self.result_index and r.random() < 0.7:
            target = body[1][0]                      # a field of a sample
        j = r.randrange(len(target))
        target[j] = r.choice(_OTHER_VALUES)
        frames[1] = msgpack.packb(body)
        return frames, False

    def _huge_length(self):
        r = self.rng
        i, frames = self._valid()
        body = msgpack.unpackb(frames[1])
        marker = r.choice(_HUGE_HEADERS)
        width = {b"\xdc": 2, b"\xde": 2, b"\xda": 2, b"\xc5": 2}.get(marker, 4)
        n = r.randrange(1 << (8 * width - 1), 1 << (8 * width))
        huge = marker + n.to_bytes(width, "big") + self._bytes(r.randrange(0, 32))
        items = [msgpack.packb(v) for v in body]
        if r.random() < 0.3:
            raw = huge                                      # the whole body
        else:
            items[r.randrange(len(items))] = huge           # one field (the rest is cut off)
            raw = _packed_array(items)
        frames[1] = raw
        return frames, True

    def _ragged_arrays(self):
        r = self.rng
        name = r.choice(ARRAY_FIELDS[1:])       # prompt ids have their own length

        def mutate(s):
            data = s[F[name]]
            if r.random() < 0.3:
                s[F[name]] = data + self._bytes(r.randrange(1, 4))          # not whole elements
            else:
                s[F[name]] = data[:4 * r.randrange(0, len(data) // 4)] if r.random() < 0.5 \
                    else data + self._bytes(4 * r.randrange(1, 5))
        return self._result_with(mutate), True

    def _nonfinite_logprobs(self):
        r = self.rng

        def mutate(s):
            lp = np.frombuffer(s[F["behavior_logprobs"]], "<f4").copy()
            for _ in range(r.randrange(1, len(lp) + 1)):
                lp[r.randrange(len(lp))] = r.choice((math.nan, math.inf, -math.inf))
            s[F["behavior_logprobs"]] = lp.tobytes()
        return self._result_with(mutate), True

    def _unknown_type(self):
        r = self.rng
        i, frames = self._valid()
        name = r.choice(("", "hello ", "Hello", "rollout_results", "x" * 200, "__class__",
                         "weight_chunk\x00", self._bytes(6).hex()))
        frames[0] = self._header(name)
        return frames, True

    def _wrong_version(self):
        r = self.rng
        i, frames = self._valid()
        mtype = type(self.messages[i]).TYPE
        if r.random() < 0.2:
            frames[0] = msgpack.packb({"v": [r.choice((1, 2)), 0], "type": mtype, "id": "x", "ts": 1.0})
        else:
            major = r.choice((0, 1, 2, 4, 5, 255, 2**31, -1))
            frames[0] = self._header(mtype, major=major, minor=r.randrange(0, 9))
        return frames, True

    def _wrong_shape(self):
        r = self.rng
        i, frames = self._valid()
        junk = r.choice(([], [MAJOR], {}, "text", 7, None, [MAJOR, MINOR, "hello"], [[MAJOR, MINOR]]))
        k = r.randrange(2)
        if k == 1:
            junk = r.choice(([], {}, "text", 7, None, {"server_id": "x"}, [[]], [None] * 3))
        frames[k] = msgpack.packb(junk)
        return frames, True


def run(fuzzer: Fuzzer, n: int, decode=protocol.decode) -> dict:
    """Decode ``n`` inputs. Returns ``{"counts": per category, "decoded": inputs that decoded,
    "crashes": n, "holes": n, "examples": [...]}``: a crash is any exception but ProtocolError (or
    a ProtocolError without a message), a hole a must-fail input that decoded; ``examples`` holds
    ``(index, category, what)`` of the first few of either."""
    counts = dict.fromkeys(fuzzer.categories, 0)
    crashes = holes = decoded = 0
    examples = []
    ProtocolError = protocol.ProtocolError
    for i in range(n):
        category, frames, must_fail = fuzzer.case()
        counts[category] += 1
        try:
            decode(frames)
        except ProtocolError as e:
            if not str(e):
                crashes += 1
                examples.append((i, category, "ProtocolError without a message"))
            continue
        except BaseException as e:  # noqa: BLE001 - the thing under test: report, do not stop
            crashes += 1
            if len(examples) < 20:
                examples.append((i, category, f"{type(e).__name__}: {e}"[:300]))
            continue
        decoded += 1
        if must_fail:
            holes += 1
            if len(examples) < 20:
                examples.append((i, category, f"decoded: {frames!r}"[:300]))
    return {"counts": counts, "decoded": decoded, "crashes": crashes, "holes": holes,
            "examples": examples}
