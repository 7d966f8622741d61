"""R3 at volume: a million (default) hostile inputs through ``protocol.decode``. A script, not a test.

    python tests/bench/bench_fuzz.py [--inputs 1000000] [--seed 0] [--out bench_results/bench_fuzz.json]

Reports inputs/s, crashes (any exception but ProtocolError: must be 0), holes (a must-fail input
that decoded: must be 0), inputs that decoded (mutations that stay valid), per-category counts,
and memory: RSS before, after and at its peak (the process's max RSS), which must not grow with
the number of inputs, plus the peak traced by tracemalloc for the two memory cases of the CI
test (a declared 60 M-element array; the nested-empty-arrays worst case, as bytes per input
byte). The inputs are those of tests/protocol/fuzz_inputs.py (CI runs 100,000 of them).
Exit code 1 when there was a crash or a hole.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import struct
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protocol"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgpack  # noqa: E402
from bench_machine import machine, machine_line  # noqa: E402
from fuzz_inputs import Fuzzer, run  # noqa: E402

import protocol  # noqa: E402


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def traced_peak(frames) -> int:
    tracemalloc.start()
    try:
        protocol.decode(frames)
    except protocol.ProtocolError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_results/bench_fuzz.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", "overflow encountered in dot", RuntimeWarning)

    fuzzer = Fuzzer(args.seed)
    run(fuzzer, 10_000)                                   # warm-up (caches, allocator)
    rss_start = rss_kib()
    batches, per_batch = [], max(1, args.inputs // 10)
    total = {"counts": dict.fromkeys(fuzzer.categories, 0), "decoded": 0, "crashes": 0, "holes": 0,
             "examples": []}
    start = time.perf_counter()
    done = 0
    while done < args.inputs:
        n = min(per_batch, args.inputs - done)
        t = time.perf_counter()
        r = run(fuzzer, n)
        batches.append({"inputs": done + n, "seconds": round(time.perf_counter() - t, 3),
                        "rss_kib": rss_kib()})
        for k, v in r["counts"].items():
            total["counts"][k] += v
        for k in ("decoded", "crashes", "holes"):
            total[k] += r[k]
        total["examples"] += [(done + i, c, w) for i, c, w in r["examples"]][:20 - len(total["examples"])]
        done += n
    seconds = time.perf_counter() - start
    rss_end = rss_kib()
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    header = msgpack.packb([*protocol.PROTOCOL_VERSION, "rollout_result", "x", 1.0])
    huge = b"\xdd" + struct.pack(">I", 60_000_000) + b"\xc0" * (70 << 20)
    inner = b"\xdc" + struct.pack(">H", 65535) + b"\x90" * 65535
    nested = b"\xdc\x00\x10" + inner * 16
    result = {
        "inputs": done, "seed": args.seed, "seconds": round(seconds, 2),
        "inputs_per_s": round(done / seconds), "crashes": total["crashes"], "holes": total["holes"],
        "decoded": total["decoded"], "per_category": total["counts"], "examples": total["examples"],
        "rss_start_kib": rss_start, "rss_end_kib": rss_end,
        "max_rss_kib_before_memory_cases": max_rss, "batches": batches,
        "huge_declared_length_peak_bytes": traced_peak([header, huge]),
        "nested_worst_case_bytes_per_input_byte": round(traced_peak([header, nested]) / len(nested), 1),
        "python": platform.python_version(), "msgpack": ".".join(map(str, msgpack.version)),
        "machine": machine(), "cpus": os.cpu_count(),    # after the memory figures: imports torch
    }
    print(machine_line(result["machine"]))
    print(json.dumps({k: v for k, v in result.items() if k != "batches"}, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if total["crashes"] or total["holes"] else 0


if __name__ == "__main__":
    sys.exit(main())
