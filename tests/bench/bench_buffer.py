"""Benchmark of buffer.RolloutBuffer: throughput of put + next_batch, and memory per buffered sample.

    python tests/bench/bench_buffer.py [--samples 200000] [--out bench_results/bench_buffer.json]

Samples have a 1,024-token completion (plus a 128-token prompt) in groups of 8, as decoded from
the wire (numpy arrays). The loop is the learner's: issue assignments while the gate allows,
put every sample of them, take a batch, advance the version. Sample construction is outside the
timed region; issue, put and next_batch are inside. Time is CPU time of the process (the loop is
single-threaded: samples per CPU-second = samples/s on one core, even on a busy machine); wall
time is reported next to it. Target: >= 100k samples/s on one core.

Memory: tracemalloc of N distinct samples (each with its own arrays) held in the buffer, split
into the samples themselves and the buffer's own bookkeeping per sample; then what stays per
trained sample (ids remembered for de-duplication, bounded by ``dedupe_window``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_machine import machine, machine_line  # noqa: E402

from buffer import RolloutBuffer  # noqa: E402
from protocol import Sample  # noqa: E402

GROUP = 8
COMPLETION_TOKENS = 1024
PROMPT_TOKENS = 128
TARGET_SAMPLES_PER_S = 100_000


def _arrays(version: int, fresh: bool) -> tuple[np.ndarray, ...]:
    """prompt, completion, logprobs, versions. Shared between samples unless ``fresh``."""
    key = version
    if not fresh and key in _ARRAY_CACHE:
        return _ARRAY_CACHE[key]
    out = (np.arange(PROMPT_TOKENS, dtype=np.int32),
           np.arange(COMPLETION_TOKENS, dtype=np.int32),
           np.full(COMPLETION_TOKENS, -0.5, dtype=np.float32),
           np.full(COMPLETION_TOKENS, version, dtype=np.int32))
    if not fresh:
        _ARRAY_CACHE[key] = out
    return out


_ARRAY_CACHE: dict[int, tuple[np.ndarray, ...]] = {}


def make_group(assignment_id: str, version: int, fresh: bool = False) -> list[Sample]:
    out = []
    for i in range(GROUP):
        p, c, lp, tv = _arrays(version, fresh)
        out.append(Sample(sample_id=f"{assignment_id}/{i}", assignment_id=assignment_id,
                          group_index=i, group_size=GROUP, prompt_token_ids=p,
                          completion_token_ids=c, behavior_logprobs=lp, token_versions=tv,
                          reward=float(i % 2)))
    return out


async def throughput(total_samples: int, batch_samples: int, max_staleness: int,
                     length_bucketing: bool = False) -> dict:
    buf = RolloutBuffer(batch_samples=batch_samples, group_size=GROUP, max_staleness=max_staleness,
                        length_bucketing=length_bucketing)
    version = 0
    done = 0
    next_id = 0
    t_issue = t_put = t_batch = 0.0
    wall = 0.0
    perf = time.process_time        # CPU seconds of this process: one core, whoever else runs
    while done < total_samples:
        w0 = time.perf_counter()
        t0 = perf()
        ids = []
        while buf.capacity(version) >= GROUP:
            aid = f"a{next_id}"
            next_id += 1
            buf.issue(aid, "server-0", GROUP)
            ids.append(aid)
        t_issue += perf() - t0
        wall += time.perf_counter() - w0
        groups = [make_group(aid, version) for aid in ids]          # not timed: the "network"
        w0 = time.perf_counter()
        t0 = perf()
        for g in groups:
            for s in g:
                await buf.put(s, version)
        t1 = perf()
        batch = await buf.next_batch(version)
        while buf.ready_samples >= batch_samples:                   # drain what is ready
            done += len(batch)
            version += 1
            batch = await buf.next_batch(version)
        t2 = perf()
        wall += time.perf_counter() - w0
        t_put += t1 - t0
        t_batch += t2 - t1
        done += len(batch)
        version += 1
    total = t_issue + t_put + t_batch
    c = buf.counters
    assert c["consumed"] == done and c["stale_dropped"] == 0, c
    return {"samples": done, "batch_samples": batch_samples, "max_staleness": max_staleness,
            "length_bucketing": length_bucketing, "cpu_seconds": total, "wall_seconds": wall,
            "samples_per_s": done / total, "samples_per_wall_s": done / wall,
            "put_us_per_sample": 1e6 * t_put / done,
            "next_batch_us_per_sample": 1e6 * t_batch / done,
            "issue_us_per_sample": 1e6 * t_issue / done}


async def memory(n_samples: int) -> dict:
    buf = RolloutBuffer(batch_samples=n_samples, group_size=GROUP, max_staleness=0,
                        dedupe_window=100_000)
    n_groups = n_samples // GROUP
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    groups = [make_group(f"m{i}", 0, fresh=True) for i in range(n_groups)]
    after_samples = tracemalloc.get_traced_memory()[0]
    for i in range(n_groups):
        buf.issue(f"m{i}", "server-0", GROUP)
    for g in groups:
        for s in g:
            await buf.put(s, 0)
    after_buffer = tracemalloc.get_traced_memory()[0]
    assert buf.pending_samples == n_samples
    batch = buf.poll_batch(0)                       # train them all: only the dedupe memory stays
    assert batch is not None and len(batch) == n_samples
    del batch, groups
    gc.collect()
    after_trained = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    sample_bytes = (after_samples - base) / n_samples
    overhead = (after_buffer - after_samples) / n_samples
    array_bytes = PROMPT_TOKENS * 4 + COMPLETION_TOKENS * (4 + 4 + 4)
    return {"samples": n_samples, "sample_bytes_per_sample": sample_bytes,
            "array_bytes_per_sample": array_bytes,
            "buffer_overhead_bytes_per_sample": overhead,
            "total_bytes_per_buffered_sample": sample_bytes + overhead,
            "dedupe_bytes_per_trained_sample": (after_trained - base) / n_samples}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200_000, help="samples through the buffer per case")
    ap.add_argument("--memory-samples", type=int, default=8192, help="samples held for the memory case")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per case; the best is reported (others on the machine only slow it)")
    ap.add_argument("--out", default="bench_results/bench_buffer.json", help="JSON results file")
    args = ap.parse_args(argv)

    cases = [(256, 1, False), (256, 4, False), (1024, 1, False), (256, 4, True)]
    rows = []
    for b, eta, lb in cases:
        runs = [asyncio.run(throughput(args.samples, b, eta, lb)) for _ in range(args.repeats)]
        best = max(runs, key=lambda r: r["samples_per_s"])
        best["median_samples_per_s"] = sorted(r["samples_per_s"] for r in runs)[len(runs) // 2]
        best["repeats"] = len(runs)
        rows.append(best)
    mem = asyncio.run(memory(args.memory_samples))

    m = machine()
    print(machine_line(m))
    print(f"RolloutBuffer put + next_batch, {COMPLETION_TOKENS}-token completions "
          f"(+{PROMPT_TOKENS} prompt), groups of {GROUP}, one core")
    print(f"{'batch':>6} {'eta':>4} {'bucket':>6} {'samples/s':>11} {'median':>11} {'wall/s':>9} "
          f"{'put us':>7} {'batch us':>8} {'issue us':>8}  target (per CPU-second)")
    for r in rows:
        ok = "ok" if r["samples_per_s"] >= TARGET_SAMPLES_PER_S else "MISS"
        print(f"{r['batch_samples']:>6} {r['max_staleness']:>4} {str(r['length_bucketing']):>6} "
              f"{r['samples_per_s']:>11,.0f} {r['median_samples_per_s']:>11,.0f} "
              f"{r['samples_per_wall_s']:>9,.0f} "
              f"{r['put_us_per_sample']:>7.2f} "
              f"{r['next_batch_us_per_sample']:>8.2f} {r['issue_us_per_sample']:>8.2f}  "
              f">= {TARGET_SAMPLES_PER_S:,} {ok}")
    print(f"memory per buffered sample ({mem['samples']} samples): "
          f"{mem['total_bytes_per_buffered_sample']:,.0f} B total = "
          f"{mem['sample_bytes_per_sample']:,.0f} B sample ({mem['array_bytes_per_sample']:,} B of "
          f"arrays) + {mem['buffer_overhead_bytes_per_sample']:,.0f} B buffer bookkeeping")
    print(f"after training: {mem['dedupe_bytes_per_trained_sample']:,.0f} B per sample remembered "
          f"for de-duplication (bounded by dedupe_window)")

    result = {"benchmark": "bench_buffer", "python": sys.version.split()[0],
              "machine": m, "cpu_count": os.cpu_count(),
              "target_samples_per_s": TARGET_SAMPLES_PER_S, "throughput": rows, "memory": mem}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
