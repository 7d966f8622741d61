"""Benchmark of the vLLM engine (issue 5): throughput against bare ``LLM.generate``, update latency.

    VLLM_CPU_KVCACHE_SPACE=1 python tests/bench/bench_vllm.py [--out bench_results/bench_vllm.json]
        [--model DIR] [--prompts 32] [--n 4] [--max-new 48] [--rounds 5]

What is measured (one process; both engines loaded at once, with the same engine arguments —
LoRA enabled, ``logprobs_mode="processed_logprobs"``, enforce_eager — and idle while the other runs):

Our engine keeps vLLM's stats on (``vllm:`` Prometheus metrics); ``LLM`` turns them off by
default — ``--bare-log-stats`` turns them on for the bare side too (same work on both sides).

- ``throughput``: generated tokens/s of ``VLLMEngine.generate`` (all requests concurrent, log-probs
  and version tags collected into numpy arrays) against ``LLM.generate`` on the same token prompts
  with the same ``SamplingParams(n, logprobs=0, max_tokens)``. Rounds alternate ours/bare (order
  flipped every round); the ratio is the median of per-round ratios. Target: >= 0.9.
- ``full_update``: ``update_weights(kind="full")`` seconds (write safetensors to /dev/shm ->
  ``collective_rpc`` -> in-place ``reload_weights`` -> prefix-cache reset), idle engine, median;
  ``worker_reload_median_s`` is the part spent inside the worker (mmap + ``reload_weights``).
- ``lora_update``: ``update_weights(kind="lora")`` seconds (write the PEFT adapter -> ``add_lora``,
  evicting the oldest beyond ``max_loras``), rank ``--lora-rank`` (8) on q/v/o projections, idle
  engine, median.

Default model: the tiny Llama built in code (hidden 128, 4 layers, 64 positions), so ``--max-new``
is capped by its 64-token context; pass ``--model`` for a real checkpoint directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench_machine import machine, machine_line  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: config_kit
from config_kit import rollout_config  # noqa: E402


def build_tiny(path: str) -> str:
    from learner.models.builtin import build_model, build_tokenizer

    tok = build_tokenizer()
    build_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_prompts(tokenizer, count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        a, b = rng.integers(0, 100, size=2)
        ids = tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)
        out.append(np.array([tokenizer.bos_token_id, *ids], dtype=np.int32))
    return out


def lora_updates(model_dir: str, rank: int, versions: list[int]):
    """PEFT adapters (q/v/o projections, random non-zero lora_B) as LoRA WeightUpdates."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from rollout_server.engine import WeightUpdate

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "o_proj"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
    out = []
    for v in versions:
        torch.manual_seed(v)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        tensors = {k: t.clone() for k, t in get_peft_model_state_dict(model).items()}
        out.append(WeightUpdate(v, "lora", tensors, config.to_dict()))
    return out


async def run(args) -> dict:
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rollout_server.engine import GenRequest, WeightUpdate
    from rollout_server.engine_vllm import WORKER_EXTENSION, VLLMEngine

    model_dir = args.model or build_tiny(tempfile.mkdtemp(prefix="bench-vllm-model-"))
    cfg = rollout_config(engine="vllm", seed=0, vllm={
        "enable_lora": True, "max_lora_rank": args.lora_rank, "max_loras": 2,
        "kv_cache_gib": args.kv_gib})
    t0 = time.perf_counter()
    ours = VLLMEngine(model_dir, cfg)
    start_ours = time.perf_counter() - t0
    max_new = min(args.max_new, ours.max_model_len - 8)
    prompts = make_prompts(ours.tokenizer, args.prompts)
    t0 = time.perf_counter()
    bare = LLM(model=model_dir, dtype=cfg.runtime.dtype, seed=0, enforce_eager=True,
               max_model_len=ours.max_model_len, logprobs_mode="processed_logprobs",
               worker_extension_cls=WORKER_EXTENSION, enable_lora=True, max_lora_rank=args.lora_rank,
               max_loras=2, max_cpu_loras=2, kv_cache_memory_bytes=int(args.kv_gib * (1 << 30)),
               disable_log_stats=not args.bare_log_stats)
    start_bare = time.perf_counter() - t0
    reqs = [GenRequest(p, args.n, max_new_tokens=max_new) for p in prompts]
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=max_new, logprobs=0)
    bare_prompts = [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts]

    async def time_ours():
        t = time.perf_counter()
        out = await ours.generate(reqs)
        return sum(len(c.token_ids) for cs in out for c in cs) / (time.perf_counter() - t)

    def time_bare():
        t = time.perf_counter()
        out = bare.generate(bare_prompts, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in out for c in o.outputs) / (time.perf_counter() - t)

    await time_ours()            # warm-up both
    time_bare()
    ours_tps, bare_tps, ratios = [], [], []
    for r in range(args.rounds):
        if r % 2 == 0:
            a = await time_ours()
            b = time_bare()
        else:
            b = time_bare()
            a = await time_ours()
        ours_tps.append(a)
        bare_tps.append(b)
        ratios.append(a / b)

    base = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    full_s, reload_s = [], []
    for v in range(1, args.updates + 1):
        tensors = {n: t + 0.01 * torch.randn(t.shape, dtype=t.dtype) for n, t in base.items()}
        full_s.append(await ours.update_weights(WeightUpdate(v, "full", tensors)))
        reload_s.append(ours.last_reload[0]["seconds"])
    lora_s = []
    for upd in lora_updates(model_dir, args.lora_rank, [100 + i for i in range(args.updates)]):
        lora_s.append(await ours.update_weights(upd))
    await ours.close()
    bare.llm_engine.engine_core.shutdown()

    return {
        "machine": machine(), "vllm": __import__("vllm").__version__,
        "model": args.model or "tiny-llama (built in code)",
        "workload": {"prompts": args.prompts, "n": args.n, "max_new_tokens": max_new,
                     "rounds": args.rounds},
        "engine_start_s": {"ours": round(start_ours, 2), "bare_LLM": round(start_bare, 2)},
        "throughput": {"ours_tok_s": round(statistics.median(ours_tps), 1),
                       "bare_tok_s": round(statistics.median(bare_tps), 1),
                       "ratio": round(statistics.median(ratios), 3), "target": 0.9,
                       "bare_log_stats": args.bare_log_stats,
                       "ratios": [round(x, 3) for x in ratios]},
        "full_update": {"bytes": nbytes, "median_s": round(statistics.median(full_s), 4),
                        "worker_reload_median_s": round(statistics.median(reload_s), 4),
                        "all_s": [round(x, 4) for x in full_s]},
        "lora_update": {"rank": args.lora_rank, "median_s": round(statistics.median(lora_s), 4),
                        "all_s": [round(x, 4) for x in lora_s]},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_results/bench_vllm.json")
    ap.add_argument("--model", default=None, help="HF model dir (default: the tiny built-in model)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--bare-log-stats", action="store_true",
                    help="bare LLM also records vLLM stats (our engine always does: vllm: metrics)")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--kv-gib", type=float, default=1.0)
    args = ap.parse_args()
    report = asyncio.run(run(args))
    t, f, lo = report["throughput"], report["full_update"], report["lora_update"]
    print(machine_line(report["machine"]))
    print(f"{'metric':<28}{'value':>14}")
    print(f"{'engine start ours (s)':<28}{report['engine_start_s']['ours']:>14}")
    print(f"{'engine start bare LLM (s)':<28}{report['engine_start_s']['bare_LLM']:>14}")
    print(f"{'ours tok/s':<28}{t['ours_tok_s']:>14}")
    print(f"{'bare LLM.generate tok/s':<28}{t['bare_tok_s']:>14}")
    print(f"{'ratio (target >= 0.9)':<28}{t['ratio']:>14}")
    print(f"{'full update (s, ' + str(f['bytes'] // 1024) + ' KiB)':<28}{f['median_s']:>14}")
    print(f"{'  of which worker reload (s)':<28}{f['worker_reload_median_s']:>14}")
    print(f"{'LoRA update r=' + str(lo['rank']) + ' (s)':<28}{lo['median_s']:>14}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
