"""Benchmark of the wire codec against bare msgpack (issue 2 §3). A script, not a test.

    python tests/bench/bench_protocol.py [--out bench_results/bench_protocol.json] [--rounds 31]

What is measured, all in one process so that the ratios share the machine's state:

- ``result_1x1024``: ``decode(encode(msg))`` of a RolloutResult holding one Sample with 1,024
  completion tokens and a 128-token prompt, against ``unpackb(packb(d))`` of a plain dict with the
  same fields, the four arrays already as raw bytes (``arr.tobytes()``) and the dicts prebuilt.
  ``ratio`` = bare time / our time = our throughput / bare throughput. Target: >= 0.5.
  Ours includes everything bare msgpack does not do: the header frame (version, type, id, time),
  ``to_wire`` (arrays to bytes), every validation of ``Sample.from_wire_checked`` and building
  the numpy arrays and message objects.
- ``result_16x1024``: the same with 16 samples in one result.
- ``*_vs_reused_packer``: the same, the bare side reusing one ``msgpack.Packer`` (as the codec
  does) instead of ``packb``, which builds a Packer per call; on bodies of several hundred KiB
  its buffer allocation is at times (malloc state) several times slower, which swings the
  16-sample ratio against plain ``packb`` between runs. This row is the steady comparison.
- ``floor_*``: not the codec, but parts of it against the same bare reference, to show where
  the time goes: encode + decode_header + unpackb of the body with no ``from_wire`` at all, and
  ``to_wire`` + pack + unpackb alone.
- ``layout_*_msgpack_only``: our positional body packed and unpacked by msgpack alone, with the
  arrays as raw bytes (what protocol 2 sends) or self-describing as ``[dtype, data]`` or as
  protocol 1's ``[dtype, [n], data]`` triple: the msgpack part of what a per-array dtype/shape
  would cost.
- ``weight_chunk_64MiB`` (and ``_1MiB``): ``decode(encode(WeightChunk))``; the data rides as its
  own frame, so the time must not grow with the size (zero-copy). The bare reference packs the
  bytes inside the msgpack map, which copies them twice.

Method: rounds alternate ours/bare (order flipped every round), each timing ``number`` calls
sized to ~20 ms; per-round ratios are paired, the reported ratio is their median, and times are
medians over rounds. The clock is this thread's CPU time by default (``--clock wall`` for
perf_counter), so time the OS gives to other processes on a shared machine does not count. The
garbage collector stays on, as in a real process. Absolute times still move from run to run
(caches, frequency); the paired ratio is the stable figure.

``--breakdown`` (on by default) also times the pieces of our path, to show where the time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench_machine import machine, machine_line  # noqa: E402

import protocol  # noqa: E402
from protocol import RolloutResult, Sample, WeightChunk, decode, encode  # noqa: E402
from protocol.chunks import chunk_checksum  # noqa: E402
from protocol.codec import _pack, _unpackb, decode_header  # noqa: E402
from protocol.messages import _samples_fast  # noqa: E402

PROMPT_TOKENS = 128
COMPLETION_TOKENS = 1024


def make_sample(rng: np.random.Generator, i: int) -> Sample:
    t = COMPLETION_TOKENS
    return Sample(
        sample_id=f"srv-0:a-{i // 8:06d}:{i % 8}", assignment_id=f"a-{i // 8:06d}",
        group_index=i % 8, group_size=8,
        prompt_token_ids=rng.integers(0, 32_000, PROMPT_TOKENS, dtype=np.int32),
        completion_token_ids=rng.integers(0, 32_000, t, dtype=np.int32),
        behavior_logprobs=-rng.exponential(1.0, t).astype(np.float32),
        token_versions=np.full(t, 7, dtype=np.int32),
        reward=1.0, reward_parts={"correct": 1.0, "format": 0.0},
        finish_reason="length", timing={"generate_s": 0.83, "reward_s": 0.002},
        completion_text="x" * (4 * t), metadata={"task": "add", "answer": "1234"},
    )


def bare_sample(s: Sample) -> dict:
    """The same fields as a plain dict, arrays as raw little-endian bytes."""
    return {
        "sample_id": s.sample_id, "assignment_id": s.assignment_id,
        "group_index": s.group_index, "group_size": s.group_size,
        "prompt_token_ids": s.prompt_token_ids.astype("<i4").tobytes(),
        "completion_token_ids": s.completion_token_ids.astype("<i4").tobytes(),
        "behavior_logprobs": s.behavior_logprobs.astype("<f4").tobytes(),
        "token_versions": s.token_versions.astype("<i4").tobytes(),
        "reward": s.reward, "reward_parts": s.reward_parts, "finish_reason": s.finish_reason,
        "timing": s.timing, "completion_text": s.completion_text, "failed": s.failed,
        "metadata": s.metadata,
    }


CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}
clock = time.thread_time


def time_per_call(fn: Callable[[], object], number: int) -> float:
    t0 = clock()
    for _ in range(number):
        fn()
    return (clock() - t0) / number


def calibrate(fn: Callable[[], object], target_s: float) -> int:
    fn()
    number = 1
    while True:
        t = time_per_call(fn, number) * number
        if t >= target_s / 4 or number >= 1 << 20:
            return max(1, int(number * target_s / max(t, 1e-9)))
        number *= 4


def compare(ours: Callable[[], object], bare: Callable[[], object], rounds: int,
            target_s: float) -> dict:
    n_ours, n_bare = calibrate(ours, target_s), calibrate(bare, target_s)
    t_ours, t_bare, ratios = [], [], []
    for r in range(rounds):
        if r % 2:
            b = time_per_call(bare, n_bare)
            o = time_per_call(ours, n_ours)
        else:
            o = time_per_call(ours, n_ours)
            b = time_per_call(bare, n_bare)
        t_ours.append(o)
        t_bare.append(b)
        ratios.append(b / o)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {
        "ours_us": statistics.median(t_ours) * 1e6, "bare_us": statistics.median(t_bare) * 1e6,
        "ours_per_s": 1 / statistics.median(t_ours), "bare_per_s": 1 / statistics.median(t_bare),
        "ratio": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
        "rounds": rounds, "calls_per_round": {"ours": n_ours, "bare": n_bare},
    }


def median_us(fn: Callable[[], object], rounds: int, target_s: float) -> float:
    number = calibrate(fn, target_s)
    return statistics.median(time_per_call(fn, number) for _ in range(rounds)) * 1e6


def bench_results(rounds: int, target_s: float) -> dict[str, dict]:
    rng = np.random.default_rng(0)
    packer = msgpack.Packer()
    out, one = {}, None
    for n in (1, 16):
        msg = RolloutResult(server_id="srv-0", samples=[make_sample(rng, i) for i in range(n)])
        bare_dict = {"server_id": msg.server_id, "samples": [bare_sample(s) for s in msg.samples]}
        assert decode(encode(msg)).samples[0].completion_text == msg.samples[0].completion_text
        one = one or (msg, bare_dict)
        out[f"result_{n}x{COMPLETION_TOKENS}"] = compare(
            lambda msg=msg: decode(encode(msg)),
            lambda d=bare_dict: msgpack.unpackb(msgpack.packb(d)), rounds, target_s)
        out[f"result_{n}x{COMPLETION_TOKENS}_vs_reused_packer"] = compare(
            lambda msg=msg: decode(encode(msg)),
            lambda d=bare_dict: msgpack.unpackb(packer.pack(d)), max(5, rounds // 2), target_s)

    # Floors, to locate the time: our encode + decode_header + unpackb of the body with no
    # from_wire at all (no validation, no arrays, no objects); and to_wire + pack + unpackb alone.
    msg, bare_dict = one

    def no_from_wire():
        frames = encode(msg)
        decode_header(frames)
        return _unpackb(frames[1])

    out["floor_no_from_wire"] = compare(
        no_from_wire, lambda: msgpack.unpackb(msgpack.packb(bare_dict)), max(5, rounds // 2), target_s)
    out["floor_to_wire_pack_unpack_only"] = compare(
        lambda: _unpackb(_pack(msg.to_wire())), lambda: msgpack.unpackb(msgpack.packb(bare_dict)),
        max(5, rounds // 2), target_s)

    # The array layout: the same positional body, msgpack only (reused Packer + unpackb), with
    # the arrays as the raw bytes protocol 2 sends, or self-describing as [dtype, data] or as
    # protocol 1's [dtype, [n], data]. The gap between these rows is what carrying dtype/shape
    # per array costs in msgpack alone (building and checking the extra lists costs more).
    wire = msg.to_wire()
    for layout, wrap in (("raw_bytes", lambda d, b: b), ("dtype_data", lambda d, b: [d, b]),
                         ("dtype_shape_data", lambda d, b: [d, [len(b) // 4], b])):
        sample = list(wire[1][0])
        for i, dtype in ((4, "<i4"), (5, "<i4"), (6, "<f4"), (7, "<i4")):
            sample[i] = wrap(dtype, sample[i])
        out[f"layout_{layout}_msgpack_only"] = compare(
            lambda d=[wire[0], [sample]]: _unpackb(_pack(d)),
            lambda: msgpack.unpackb(msgpack.packb(bare_dict)), max(5, rounds // 3), target_s)
    return out


def bench_chunks(rounds: int, target_s: float) -> dict[str, dict]:
    out = {}
    for mib in (1, 64):
        data = np.random.default_rng(1).integers(0, 255, mib << 20, dtype=np.uint8).tobytes()
        msg = WeightChunk(version=3, index=0, checksum=chunk_checksum(data[:1024]), data=data)
        bare_dict = {"version": 3, "index": 0, "checksum": msg.checksum, "data": data}
        assert decode(encode(msg)).data is data
        out[f"weight_chunk_{mib}MiB"] = compare(
            lambda msg=msg: decode(encode(msg)),
            lambda d=bare_dict: msgpack.unpackb(msgpack.packb(d)), max(5, rounds // 3), target_s)
    return out


def breakdown(rounds: int, target_s: float) -> dict[str, float]:
    """Median microseconds of each piece of ``decode(encode(one-sample result))``."""
    rng = np.random.default_rng(0)
    msg = RolloutResult(server_id="srv-0", samples=[make_sample(rng, 0)])
    s = msg.samples[0]
    frames = encode(msg)
    wire = msg.to_wire()
    body = _unpackb(frames[1])
    sw = body[1][0]                           # [server_id, [sample, ...]]
    bare = {"server_id": "srv-0", "samples": [bare_sample(s)]}
    bare_packed = msgpack.packb(bare)
    lp, tv = s.behavior_logprobs, s.token_versions
    c_data = sw[5]
    pieces = {
        "bare packb": lambda: msgpack.packb(bare),
        "bare unpackb": lambda: msgpack.unpackb(bare_packed),
        "encode (total)": lambda: encode(msg),
        "  RolloutResult.to_wire": msg.to_wire,
        "  Packer.pack(body)": lambda: _pack(wire),
        "decode (total)": lambda: decode(frames),
        "  decode_header (dict, not used by decode)": lambda: decode_header(frames),
        "  unpackb(header)": lambda: _unpackb(frames[0]),
        "  unpackb(body)": lambda: _unpackb(frames[1]),
        "  RolloutResult.from_wire": lambda: RolloutResult.from_wire(body),
        "    _samples_fast([sample])": lambda: _samples_fast([sw]),
        "    Sample(...) constructor": lambda: Sample(
            s.sample_id, s.assignment_id, 0, 8, s.prompt_token_ids, s.completion_token_ids, lp, tv,
            1.0, s.reward_parts, "stop", s.timing, s.completion_text, None, s.metadata),
        "    np.frombuffer x1": lambda: np.frombuffer(c_data, np.int32),
        "    logprobs.dot(logprobs) (finite)": lambda: lp.dot(lp),
        "    versions.argmin() (>= 0)": lambda: tv.item(tv.argmin()),
        "reference: versions.min()": tv.min,
        "reference: np.isfinite(lp).all()": lambda: np.isfinite(lp).all(),
    }
    return {name: median_us(fn, rounds, target_s) for name, fn in pieces.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_results/bench_protocol.json")
    ap.add_argument("--rounds", type=int, default=31, help="interleaved rounds per comparison")
    ap.add_argument("--round-ms", type=float, default=20.0, help="target duration of one round")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="thread",
                    help="thread: CPU time of this thread (ignores time the OS gave to other "
                         "processes, the right default on a shared machine); wall: perf_counter")
    ap.add_argument("--no-breakdown", action="store_true")
    args = ap.parse_args(argv)
    global clock
    clock = CLOCKS[args.clock]
    target_s = args.round_ms / 1000

    results = bench_results(args.rounds, target_s)
    results.update(bench_chunks(args.rounds, target_s))
    m = machine()
    print(machine_line(m))
    print(f"{'case':<38}{'ours us':>10}{'bare us':>10}{'ours/s':>12}{'bare/s':>12}"
          f"{'ratio':>8}{'  (q1-q3)':>14}")
    for name, r in results.items():
        print(f"{name:<38}{r['ours_us']:>10.2f}{r['bare_us']:>10.2f}{r['ours_per_s']:>12.0f}"
              f"{r['bare_per_s']:>12.0f}{r['ratio']:>8.3f}  ({r['ratio_q1']:.3f}-{r['ratio_q3']:.3f})")
    target = results[f"result_1x{COMPLETION_TOKENS}"]["ratio"]
    print(f"\ntarget: ratio >= 0.5 for result_1x{COMPLETION_TOKENS}: "
          f"{'met' if target >= 0.5 else 'NOT met'} ({target:.3f})")

    parts = {}
    if not args.no_breakdown:
        parts = breakdown(max(7, args.rounds // 3), target_s / 2)
        print("\nwhere the time goes (median us per call, one-sample result):")
        for name, us in parts.items():
            print(f"  {name:<62}{us:>8.2f}")

    report = {
        "benchmark": "bench_protocol",
        "machine": m,
        "protocol_version": list(protocol.PROTOCOL_VERSION),
        "sample": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS},
        "target_ratio": 0.5, "target_met": target >= 0.5,
        "results": results, "breakdown_us": parts,
        "clock": args.clock,
        "env": {"python": sys.version.split()[0], "msgpack": ".".join(map(str, msgpack.version)),
                "numpy": np.__version__, "platform": platform.platform(),
                "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
