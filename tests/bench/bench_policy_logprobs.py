"""The learner's per-token log-probs of a whole model, forward and backward: through the logits
(``model(...).logits`` -> ``ops.token_logprobs``) against through the decoder's hidden state
(:class:`learner.models.forward.LogprobForward` -> ``ops.token_logprobs_from_hidden``, what the
trainer uses). A script, not a test:

    .venv/bin/python tests/bench/bench_policy_logprobs.py [--out bench_results/bench_policy_logprobs.json]

The model has SmolLM2's vocabulary (49,152, tied embeddings) and a small body (hidden 64, 2 layers),
so the logits dominate as they do for a real model's LM head. Each path runs in a fresh child
process (this script with ``--child``) with ``MALLOC_MMAP_THRESHOLD_=65536`` and its peak RSS above
the RSS before the pass is read from the kernel's high-water mark (``PeakRSS`` of bench_ops.py);
time is one pass after a warm-up. The ratio is hidden / logits of the same batch, measured in this
run. Also printed: the size of the float32 logits the hidden path never builds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench_machine import machine, machine_line  # noqa: E402

CASES = [{"B": 8, "T": 512}, {"B": 16, "T": 512}]
VOCAB, HIDDEN = 49152, 64


def child(spec: dict) -> dict:
    import torch
    from bench_ops import PeakRSS
    from transformers import LlamaConfig, LlamaForCausalLM

    import ops
    from learner.models.forward import LogprobForward

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    forward = LogprobForward(model)
    assert forward.uses_hidden

    def run(B: int, T: int) -> float:
        ids = torch.randint(0, VOCAB, (B, T))
        attn = torch.ones_like(ids)
        if spec["path"] == "logits":
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
            lp = ops.token_logprobs(logits, ids[:, 1:])
            with torch.no_grad():
                ops.entropy_from_logits(logits.detach())
        else:
            lp, _ = forward(ids, attn, ids[:, 1:], 1.0, entropy="stat")
        lp.sum().backward()
        model.zero_grad(set_to_none=False)
        return float(lp.detach().sum())

    run(1, 8)                                       # warm-up: kernels' code pages, .grad buffers
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        run(spec["B"], spec["T"])
        seconds = time.perf_counter() - t0
    return {"peak_extra_bytes": mem.extra, "mem_method": mem.method, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_results/bench_policy_logprobs.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    results = []
    m = machine(threads=1)                          # the children's (child sets 1)
    print(machine_line(m))
    print(f"{'B x T':>9} {'logits GiB':>10} {'path':>7} {'peak MiB':>9} {'s':>6}")
    for case in CASES:
        row = {**case, "vocab": VOCAB, "logits_fp32_bytes": case["B"] * (case["T"] - 1) * VOCAB * 4}
        for path in ("logits", "hidden"):
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps({**case, "path": path})],
                                  env=env, capture_output=True, text=True, check=True)
            row[path] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{case['B']:>4} x {case['T']:<4}{row['logits_fp32_bytes'] / 2**30:>10.2f} {path:>7} "
                  f"{row[path]['peak_extra_bytes'] / 2**20:>9.0f} {row[path]['seconds']:>6.2f}")
        row["memory_ratio"] = row["hidden"]["peak_extra_bytes"] / row["logits"]["peak_extra_bytes"]
        row["time_ratio"] = row["hidden"]["seconds"] / row["logits"]["seconds"]
        print(f"{'':>9} hidden / logits: memory {row['memory_ratio']:.3f}, time {row['time_ratio']:.2f}")
        results.append(row)
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": m, "rows": results}, indent=2))


if __name__ == "__main__":
    main()
