"""Benchmark of the DeepSpeed learner (CPU, gloo; a script, not a test).

    .venv/bin/python tests/bench/bench_deepspeed.py [--repeats 8] [--out bench_results/bench_deepspeed.json]

The same total batch (the default demo's: 8 prompts × 8 completions on the demo model's
architecture, random weights; micro-batches of 16, so 4 per step: 2 per rank with two ranks)
through ``Trainer.step`` plain and with a ``DeepSpeedStrategy`` on 1 and 2 ranks under
ZeRO-2, and with 2 ranks under ZeRO-3 with the gather a publish does (bytes, seconds, buckets of
``publish_bucket_bytes``). Each configuration runs in its own ``torchrun``; its rank 0 also holds
a plain trainer and alternates plain and DeepSpeed steps, so every ratio is against a baseline
measured in the same process at the same time (the host is shared). Medians after two warm-up
steps of each.

On 2 cores the ranks share the cores the single process had: two ranks show the overhead of the
group (a gloo all-reduce of every gradient bucket, the dummy passes, the gathered statistics),
not a speed-up.

Measured (2 cores shared with other jobs, load ~10; medians of 6; plain step 420-470 ms):
ZeRO-2 on 1 rank 1.35x the plain step (the engine's bookkeeping and its gradient buckets with
nobody to reduce with); ZeRO-2 on 2 ranks 1.06x (each rank runs half the micro-batches, the
all-reduce and the dummy-free plan of 4 micro-batches cost about what the halving saves on 2
cores); ZeRO-3 on 2 ranks 1.84x (every pass gathers every layer's parameters over gloo). ZeRO-3
publish gather: 3.44 MB (the 859k float32 parameters) in 47 ms, buckets of 1 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: config_kit
from config_kit import nested  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench_machine import machine, machine_line  # noqa: E402

RUNS = [("zero2", 1, 2), ("zero2", 2, 2), ("zero3", 2, 3)]
"""(name, ranks, ZeRO stage)."""
FIELDS = dict(group_size=8, batch_prompts=8, micro_batch_samples=16, lr=1e-4, seed=0, threads=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(model_dir: str, stage: int, repeats: int, out: str) -> int:
    """One rank of one configuration (under torchrun)."""
    import torch  # noqa: F401 - before deepspeed
    from bench_learner import demo_batch

    from learner.config import LearnerConfig, TrainerConfig
    from learner.train.distributed import join_group, make_trainer, worker_main
    from learner.train.trainer import Trainer

    cfg = LearnerConfig(**nested(**FIELDS, deepspeed={"zero_stage": stage, "timeout_s": 600, "heartbeat_s": 30,
                                             "publish_bucket_bytes": 1 << 20}))
    group = join_group(cfg.deepspeed)
    if group.rank != 0:
        return worker_main(cfg, model_dir, group)
    ds = make_trainer(TrainerConfig.of(cfg), model_dir, group)
    plain = Trainer(TrainerConfig.of(LearnerConfig(**nested(FIELDS))), model_dir)
    batch = demo_batch(plain.tokenizer)
    times: dict[str, list[float]] = {"plain": [], "ds": []}
    gathers = []
    for i in range(repeats + 2):
        for name, tr in (("plain", plain), ("ds", ds)):
            t0 = time.perf_counter()
            tr.step(batch)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
        if stage == 3:
            ds.named_tensors()
            gathers.append(dict(ds.strategy.last_gather))
    result = {k: statistics.median(v) for k, v in times.items()}
    if gathers:
        result["gather_bytes"] = gathers[-1]["bytes"]
        result["gather_s"] = statistics.median(g["seconds"] for g in gathers[2:] or gathers)
    Path(out).write_text(json.dumps(result))
    ds.close()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--out", default="bench_results/bench_deepspeed.json")
    ap.add_argument("--rank", nargs=4, metavar=("MODEL", "STAGE", "REPEATS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        model, stage, repeats, out = args.rank
        return rank_main(model, int(stage), int(repeats), out)

    from learner.models.builtin import build_model, build_tokenizer

    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'bench'}",
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(os.environ.get("SLIPSTREAM_CACHE", tempfile.gettempdir()))
                                              / "torch_extensions"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer()
        build_model(tok).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for name, nproc, stage in RUNS:
            out = Path(tmp) / f"{name}-{nproc}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
                   str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                   "--max-restarts", "0", __file__, "--rank", tmp, str(stage), str(args.repeats), str(out)]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if r.returncode != 0:
                print(r.stderr[-3000:], file=sys.stderr)
                return 1
            res = json.loads(out.read_text())
            rows.append({"config": f"{name} x{nproc}", "ranks": nproc, "stage": stage, **res,
                         "ratio": res["ds"] / res["plain"]})
    m = machine(threads=FIELDS["threads"])          # per rank
    print(machine_line(m))
    print(f"{'config':<10} {'plain ms':>9} {'deepspeed ms':>13} {'ratio':>6} {'gather MB':>10} {'gather ms':>10}")
    for row in rows:
        g = (f"{row['gather_bytes'] / 1e6:10.2f} {row['gather_s'] * 1e3:10.1f}" if "gather_s" in row else "")
        print(f"{row['config']:<10} {row['plain'] * 1e3:9.1f} {row['ds'] * 1e3:13.1f} {row['ratio']:6.2f} {g}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"batch_samples": FIELDS["group_size"] * FIELDS["batch_prompts"],
                                          "micro_batch_samples": FIELDS["micro_batch_samples"],
                                          "repeats": args.repeats, "rows": rows, "machine": m}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
