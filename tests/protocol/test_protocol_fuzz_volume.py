"""R3 in CI: 100,000 hostile inputs from a fixed seed through ``decode()`` (no sockets): every one
a ProtocolError or a message, nothing else; every must-fail category refused; memory bounded.
The million-input variant is tests/bench/bench_fuzz.py; the categories are in fuzz_inputs.py."""

from __future__ import annotations

import resource
import struct
import tracemalloc

import msgpack
import pytest
from fuzz_inputs import Fuzzer, run, valid_messages

import protocol
from protocol import MESSAGE_TYPES

# Float32 log-probs near the float32 limit make the fast x·x finiteness hint overflow; the protocol
# silences that warning with a module filter, which pytest's per-test capture replaces.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in dot:RuntimeWarning")

CI_INPUTS = 100_000
SEED = 14


def test_every_message_type_is_fuzzed():
    assert {type(m) for m in valid_messages()} == set(MESSAGE_TYPES.values())
    for m in valid_messages():                        # the seeds are valid: decoding them works
        assert type(protocol.decode(protocol.encode(m))) is type(m)


def test_a_hundred_thousand_hostile_inputs_are_protocol_errors():
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = run(Fuzzer(SEED), CI_INPUTS)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert report["crashes"] == 0 and report["holes"] == 0, report["examples"]
    assert sum(report["counts"].values()) == CI_INPUTS
    assert min(report["counts"].values()) > CI_INPUTS // (2 * len(Fuzzer.CATEGORIES)), report["counts"]
    assert report["decoded"] < CI_INPUTS // 20       # mutations that stay valid are rare
    assert grown_kib < 64 << 10, f"peak RSS grew by {grown_kib} KiB over {CI_INPUTS} inputs"


def test_the_fuzzer_catches_a_crash_and_a_hole():
    """The harness can fail: a decoder that raises something else, or accepts everything."""
    def brittle(frames):
        return frames[0][0] + 1                      # TypeError / IndexError / KeyError ...
    assert run(Fuzzer(1), 2_000, decode=brittle)["crashes"] > 0
    assert run(Fuzzer(1), 2_000, decode=lambda frames: None)["holes"] > 0


def test_a_case_is_reproducible_from_its_index():
    a, b = Fuzzer(3), Fuzzer(3)
    first = [repr(a.case(i)) for i in (0, 17, 99_999)]
    a.case()
    assert [repr(a.case(i)) for i in (0, 17, 99_999)] == first
    for i in (0, 17, 99_999):       # another instance: the same case (its seed headers' ts differ)
        (ca, fa, ma), (cb, fb, mb) = a.case(i), b.case(i)
        assert (ca, ma, type(fa)) == (cb, mb, type(fb))


def _peak_bytes(frames) -> tuple[int, str]:
    tracemalloc.start()
    try:
        protocol.decode(frames)
        outcome = "decoded"
    except protocol.ProtocolError as e:
        outcome = str(e)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, outcome


HEADER = msgpack.packb([*protocol.PROTOCOL_VERSION, "rollout_result", "x", 1.0])


@pytest.mark.parametrize("declared", [
    b"\xdd" + struct.pack(">I", 60_000_000),                       # array32
    b"\xdf" + struct.pack(">I", 60_000_000),                       # map32
    b"\x92\xa1x\xdd" + struct.pack(">I", 60_000_000),              # nested, as the samples list
])
def test_a_declared_huge_length_allocates_nothing(declared):
    # 70 MiB of nil after the header: without msgpack's limits (which default to the input's size)
    # the 60 M-element list would be allocated (480 MB of pointers) before anything fails.
    body = declared + b"\xc0" * (70 << 20)
    peak, outcome = _peak_bytes([HEADER, body])
    assert "exceeds max_" in outcome
    assert peak < 1 << 20, f"{peak} bytes allocated for a refused length"


def test_decoded_memory_is_bounded_by_the_input():
    """The worst case known: nested empty arrays (1 byte each on the wire, a Python list each).
    Decoding costs at most ~64x the body's size, transiently (refused, then freed); a frame is
    at most ZMQ_MAXMSGSIZE (learner.network.max_message_bytes), so this bounds a message's memory."""
    inner = b"\xdc" + struct.pack(">H", 65535) + b"\x90" * 65535
    body = b"\xdc\x00\x10" + inner * 16                                   # 1 MiB
    peak, outcome = _peak_bytes([HEADER, body])
    assert outcome != "decoded"
    assert peak < 80 * len(body), f"{peak / len(body):.0f}x the input"
