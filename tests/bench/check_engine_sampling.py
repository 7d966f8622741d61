"""Does the HF engine sample what ``model.generate`` samples?

    python tests/bench/check_engine_sampling.py [--model builtin:tiny-longtail] [--n 512] \
        [--prompts 7x3=,2x12=,5x40=] [--max-new-tokens 64] [--out bench_results]

The engine (rollout_server/engine_hf.py) has its own decode loop: rows of one prompt share its
prefill, prompts are left-padded together, tokens are drawn from softmax(logits / T). Its
behavior log-probs are tested against the learner's recompute (tests/rollout_server); this checks
the draws themselves against transformers' ``generate`` (do_sample, top_k 0, top_p 1) from the
same weights at temperature 1: per prompt, ``--n`` completions from each, their mean length (with
the standard error of the difference) and how often the first token is the model's top choice,
beside that choice's probability. Prints a table, writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench_machine import machine, machine_line  # noqa: E402

from learner.models.builtin import ensure_builtin_model  # noqa: E402
from rollout_server.engine import GenRequest  # noqa: E402
from rollout_server.engine_hf import HFEngine  # noqa: E402


def length_to_eos(row: list[int], eos: int) -> int:
    return next((i + 1 for i, t in enumerate(row) if t == eos), len(row))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny-longtail")
    p.add_argument("--prompts", default="7x3=,2x12=,5x40=")
    p.add_argument("--n", type=int, default=512, help="completions per prompt from each sampler")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "bench_results"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    path = (ensure_builtin_model(args.model, log=lambda m: print(f"[setup] {m}"))
            if args.model.startswith("builtin:") else args.model)
    eng = HFEngine(str(path), seed=args.seed)
    tok, results = eng.tokenizer, []
    group = min(64, args.n)
    for text in args.prompts.split(","):
        prompt = np.array([tok.bos_token_id, *tok.encode(text, add_special_tokens=False)], dtype=np.int32)
        out = eng.generate_sync([GenRequest(prompt, group, temperature=1.0, max_new_tokens=args.max_new_tokens)
                                 for _ in range(-(-args.n // group))])
        comps = [c for cs in out for c in cs][:args.n]
        ids = torch.from_numpy(prompt.astype(np.int64))[None]
        with torch.no_grad():
            probs = torch.softmax(eng.model(input_ids=ids).logits[0, -1].float(), -1)
            gen = eng.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                     top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                                     num_return_sequences=args.n, eos_token_id=eng.eos_id,
                                     pad_token_id=eng.pad_id)[:, ids.shape[1]:]
        top = int(probs.argmax())
        a = np.array([len(c.token_ids) for c in comps], dtype=float)
        b = np.array([length_to_eos(r, eng.eos_id) for r in gen.tolist()], dtype=float)
        results.append({
            "prompt": text, "n": args.n, "engine_len_mean": a.mean(), "generate_len_mean": b.mean(),
            "len_diff_se": math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)),
            "p_top_first": float(probs[top]),
            "engine_top_first": float(np.mean([c.token_ids[0] == top for c in comps])),
            "generate_top_first": float((gen[:, 0] == top).float().mean())})
    m = machine(threads=args.threads)
    print(f"\n{machine_line(m)}")
    print(f"{args.model}: the HF engine's draws against model.generate's, temperature 1, {args.n} each")
    print(f"{'prompt':<10} {'len engine':>10} {'len generate':>12} {'diff / se':>9} {'P(top 1st)':>10} "
          f"{'engine':>7} {'generate':>8}")
    for r in results:
        z = (r["engine_len_mean"] - r["generate_len_mean"]) / r["len_diff_se"]
        print(f"{r['prompt']:<10} {r['engine_len_mean']:>10.2f} {r['generate_len_mean']:>12.2f} {z:>9.2f} "
              f"{r['p_top_first']:>10.3f} {r['engine_top_first']:>7.3f} {r['generate_top_first']:>8.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_sampling.json").write_text(json.dumps({"machine": m, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
