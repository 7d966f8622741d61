"""Benchmark of learner.rollout_log: what logging an accepted result costs, with and without fsync.

    python tests/bench/bench_rollout_log.py [--messages 400] [--group 8] [--prompt 128]
                                            [--completion 256] [--steps-of 4]
                                            [--out bench_results/bench_rollout_log.json]

One RolloutResult per message (``--group`` samples of ``--prompt`` + ``--completion`` tokens),
as the learner logs it before the Ack. Rows, all per message and per accepted sample:

    encode only        protocol.encode of the accepted samples (the baseline, same process)
    write, no fsync    encode + os.write of the record (what a learner process crash needs)
    fsync: step        encode + os.write of the record; one fsync per policy step of
                       ``--steps-of`` messages (the default policy), the fsync counted in
    fsync: record      encode + os.write + fsync of every record before its Ack
    read back          LogReader: CRC check + protocol.decode (the resume and replay path)

Ratios are against the baseline. The log lives in a temporary directory on the disk of
``--dir`` (default: the working directory, not a tmpfs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_machine import machine, machine_line  # noqa: E402

import protocol  # noqa: E402
from learner.state.rollout_log import LIFE, RESULT, LogReader, RolloutLogWriter  # noqa: E402


def make_result(k: int, group: int, prompt: int, completion: int) -> protocol.RolloutResult:
    rng = np.random.default_rng(k)
    samples = []
    for i in range(group):
        aid = f"bench-a{k}"
        samples.append(protocol.Sample(
            sample_id=protocol.sample_id(aid, i), assignment_id=aid, group_index=i, group_size=group,
            prompt_token_ids=rng.integers(0, 32000, prompt).astype(np.int32),
            completion_token_ids=rng.integers(0, 32000, completion).astype(np.int32),
            behavior_logprobs=-rng.random(completion).astype(np.float32),
            token_versions=np.zeros(completion, np.int32), reward=float(rng.random()),
            completion_text="x" * completion))
    return protocol.RolloutResult(server_id="bench", samples=samples)


def run(mode: str, results, root: Path, steps_of: int) -> float:
    """Seconds for all messages."""
    w = RolloutLogWriter(root, 64 << 20, "record" if mode == "record" else "step")
    w.append(LIFE, {"life": w.life})
    start = time.perf_counter()
    for k, r in enumerate(results):
        frames = protocol.encode(r)
        if mode == "encode":
            continue
        w.append(RESULT, {"life": w.life, "version": 0, "time": 0.0}, frames)
        if mode == "record" or (mode == "step" and (k + 1) % steps_of == 0):
            w.sync()
    if mode != "write":
        w.sync()
    seconds = time.perf_counter() - start
    w.close()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=400)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--steps-of", type=int, default=4, help="messages per policy step (fsync: step)")
    ap.add_argument("--dir", default=".")
    ap.add_argument("--out", default="bench_results/bench_rollout_log.json")
    a = ap.parse_args()
    results = [make_result(k, a.group, a.prompt, a.completion) for k in range(a.messages)]
    record_bytes = sum(len(f) for f in protocol.encode(results[0]))
    rows = {}
    with tempfile.TemporaryDirectory(dir=a.dir, prefix=".bench-rollout-log-") as tmp:
        for mode in ("encode", "write", "step", "record"):
            root = Path(tmp) / mode
            rows[mode] = run(mode, results, root, a.steps_of)
        reader = LogReader(Path(tmp) / "step")
        start = time.perf_counter()
        n = sum(len(r.result.samples) for r in reader if r.kind == RESULT)
        rows["read"] = time.perf_counter() - start
        assert n == a.messages * a.group and reader.torn == reader.corrupt == 0
        fs = os.statvfs(tmp)
    base = rows["encode"]
    names = {"encode": "encode only (baseline)", "write": "write, no fsync", "step": f"fsync: step (1 per {a.steps_of} messages)",
             "record": "fsync: record", "read": "read back (CRC + decode)"}
    m = machine()
    print(machine_line(m))
    print(f"{a.messages} messages x {a.group} samples, {record_bytes} bytes a message "
          f"({a.prompt} + {a.completion} tokens a sample)")
    print(f"{'mode':<34} {'us/message':>11} {'us/sample':>10} {'us/step':>9} {'x baseline':>11}")
    table = []
    for mode, sec in rows.items():
        per_msg = sec / a.messages * 1e6
        row = {"mode": mode, "us_per_message": per_msg, "us_per_sample": per_msg / a.group,
               "us_per_step": per_msg * a.steps_of, "ratio_vs_encode": sec / base}
        table.append(row)
        print(f"{names[mode]:<34} {per_msg:>11.1f} {per_msg / a.group:>10.2f} {per_msg * a.steps_of:>9.0f} "
              f"{sec / base:>11.2f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "rollout_log", "messages": a.messages, "group": a.group,
                               "prompt_tokens": a.prompt, "completion_tokens": a.completion,
                               "bytes_per_message": record_bytes, "messages_per_step": a.steps_of,
                               "block_size": fs.f_bsize, "platform": platform.platform(),
                               "machine": m, "rows": table}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
