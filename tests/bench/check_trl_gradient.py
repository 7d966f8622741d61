"""Does slipstream's learner step take the gradient TRL's ``GRPOTrainer`` takes on the same batch?

    python tests/bench/check_trl_gradient.py [--workload longtail] [--seeds 1,2,3] \
        [--trl-python /tmp/trl-venv/bin/python] [--out bench_results]

bench_async.py compares slipstream with TRL on speed, and both learn from the same model, prompts,
reward, batch, learning rate and clip. If the two policies then drift apart (the long tail's
completion lengths did, README "Benchmark"), either the data differs (what was sampled) or the
update does. This check separates the two: TRL generates and scores one batch as in its training
(``trl_baseline.py``'s ``gradient`` mode records that batch, its rewards and advantages, and the
gradient just before its optimizer step, unclipped); slipstream's ``Trainer.step`` then trains on
exactly those tokens and rewards (behavior log-probs: the same weights' own, so the batch is
on-policy as TRL's is) and its gradient is read at the same point. Both in float32, eager
attention, one micro-batch.

``--trl-eps`` gives slipstream's advantages TRL's epsilon (1e-4; the library's is 1e-6) for the
check, which leaves float rounding. Prints, per seed and per learner setting (the library default, and the demo's ``clip_anchor:
behavior``): the largest difference of the advantages, the two gradient norms, the relative
error ‖g − g_TRL‖ / ‖g_TRL‖ and the cosine over all parameters. Writes JSON to ``--out``. Exits 1
when a relative error is above ``--tolerance``.

TRL runs in its own environment (never a slipstream dependency), as for bench_async.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_async import BATCH_PROMPTS, GROUP, LR, REPO, TEMPERATURE, WORKLOADS  # noqa: E402
from bench_machine import machine, machine_line  # noqa: E402

sys.path.insert(0, str(REPO))
import ops  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: config_kit
from config_kit import nested  # noqa: E402

from buffer import Batch  # noqa: E402
from learner.config import LearnerConfig, TrainerConfig  # noqa: E402
from learner.data.tasks import get_task  # noqa: E402
from learner.models.builtin import ensure_builtin_model  # noqa: E402
from learner.train.trainer import Trainer  # noqa: E402
from protocol import Sample  # noqa: E402

SETTINGS = {
    "default": {},
    "clip_anchor=behavior": {"clip_anchor": "behavior"},
}
"""Learner settings compared with TRL (over the check's base: is_mode none, float32, eager)."""
TRL_ADV_EPS = 1e-4
"""TRL's (r - mean) / (std + eps) epsilon (GRPOTrainer, scale_rewards group)."""


def trl_batch(model_dir: Path, work: str, seed: int, args, tmp: Path) -> tuple[dict, dict]:
    """TRL's first batch (rows) and its gradient (by parameter name), from TRL's environment."""
    from safetensors.torch import load_file

    w = WORKLOADS[work]
    rng = random.Random(seed)
    task = get_task(w["dataset"])
    prompts = [task.example(rng) for _ in range(BATCH_PROMPTS)]
    spec = {"mode": "gradient", "model": str(model_dir),
            "prompts": [{"prompt": e.prompt, "answer": e.answer} for e in prompts],
            "reward": w["reward"], "batch_prompts": BATCH_PROMPTS, "group_size": GROUP,
            "max_new_tokens": w["max_new_tokens"], "temperature": TEMPERATURE, "lr": LR,
            "steps": 1, "seed": seed, "threads": args.threads, "bf16": False,
            "attn_implementation": "eager", "output_dir": str(tmp / f"trl-out-{seed}")}
    spec_file, out = tmp / f"spec-{seed}.json", tmp / f"trl-{seed}.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run([args.trl_python, str(REPO / "tests/bench/trl_baseline.py"), str(spec_file),
                           str(out)], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if proc.returncode != 0:
        raise SystemExit(f"TRL failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text()), load_file(str(out) + ".safetensors")


def samples_of(rows: list[dict], model) -> list[Sample]:
    """TRL's rows as slipstream samples; behavior log-probs from the same weights (on-policy)."""
    out = []
    for i, r in enumerate(rows):
        p, c = np.asarray(r["prompt_ids"], np.int32), np.asarray(r["completion_ids"], np.int32)
        ids = torch.from_numpy(np.concatenate([p, c]).astype(np.int64))[None]
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[:, len(p) - 1:-1]
        lp = ops.token_logprobs(logits, ids[:, len(p):], temperature=TEMPERATURE)[0]
        g, gi = divmod(i, GROUP)
        out.append(Sample(sample_id=f"a{g}-{gi}", assignment_id=f"a{g}", group_index=gi, group_size=GROUP,
                          prompt_token_ids=p, completion_token_ids=c, behavior_logprobs=lp.numpy(),
                          token_versions=np.zeros(len(c), np.int32), reward=r["reward"]))
    return out


def our_gradient(model_dir: Path, rows: list[dict], overrides: dict, threads: int) -> dict:
    cfg = LearnerConfig(**nested(group_size=GROUP, batch_prompts=BATCH_PROMPTS, micro_batch_samples=len(rows),
                        lr=LR, max_grad_norm=1e9, is_mode="none", temperature=TEMPERATURE,
                        attn_implementation="eager", autocast="none", seed=1, threads=threads,
                        **overrides))
    tr = Trainer(TrainerConfig.of(cfg), str(model_dir))
    grads: dict[str, torch.Tensor] = {}
    step = tr.optimizer.step

    def grab(*a, **k):
        grads.update({n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None})
        return step(*a, **k)

    tr.optimizer.step = grab
    samples = samples_of(rows, tr.model)
    tr.step(Batch(samples, version=0, staleness=[0] * len(samples), needs_correction=[False] * len(samples),
                  group_sizes=[GROUP] * (len(samples) // GROUP)))
    return grads


def compare(ours: dict, theirs: dict) -> dict:
    names = sorted(theirs)
    missing = sorted(set(theirs) ^ set(ours))
    if missing:
        raise SystemExit(f"parameter names differ: {missing[:5]}")
    a = torch.cat([ours[n].flatten().double() for n in names])
    b = torch.cat([theirs[n].flatten().double() for n in names])
    def rel(x: torch.Tensor, y: torch.Tensor) -> float:     # 0 where both are 0 (no signal)
        d, n = float((x - y).norm()), float(y.norm())
        return d / n if n > 0 else (0.0 if d == 0 else math.inf)

    worst = max(names, key=lambda n: rel(ours[n].double(), theirs[n].double()))
    return {"norm": float(a.norm()), "norm_trl": float(b.norm()), "rel_err": rel(a, b),
            "cosine": float(a @ b / (a.norm() * b.norm())) if a.norm() * b.norm() > 0 else math.nan,
            "worst_param": worst, "worst_rel_err": rel(ours[worst].double(), theirs[worst].double())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="longtail")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--trl-python", default="/tmp/trl-venv/bin/python")
    p.add_argument("--tolerance", type=float, default=1e-3, help="the largest relative error accepted")
    p.add_argument("--out", default=str(REPO / "bench_results"))
    p.add_argument("--trl-eps", action="store_true",
                   help="slipstream's group advantages with TRL's epsilon (1e-4, the library's is 1e-6) "
                        "for this check: what differs then is float rounding")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.trl_eps:
        group_advantages = ops.group_advantages
        ops.group_advantages = lambda scores, g, method="grpo", eps=None: group_advantages(
            scores, g, method, eps=TRL_ADV_EPS)
    model_dir = ensure_builtin_model(WORKLOADS[args.workload]["model"], log=lambda m: print(f"[setup] {m}"))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            data, theirs = trl_batch(model_dir, args.workload, seed, args, Path(tmp))
            rows = data["rows"]
            rewards = torch.tensor([r["reward"] for r in rows])
            adv = ops.group_advantages(rewards, GROUP, "grpo")
            adv_diff = float((adv - torch.tensor([r["advantage"] for r in rows])).abs().max())
            lengths = [len(r["completion_ids"]) for r in rows]
            for name, overrides in SETTINGS.items():
                res = compare(our_gradient(model_dir, rows, overrides, args.threads), theirs)
                res.update(seed=seed, setting=name, adv_max_diff=adv_diff, reward_mean=float(rewards.mean()),
                           tokens_mean=sum(lengths) / len(lengths), trl_loss_type=data["loss_type"])
                results.append(res)
    m = machine(threads=args.threads)
    print(f"\n{machine_line(m)}")
    print(f"{args.workload}: slipstream's gradient against TRL's (loss_type {results[0]['trl_loss_type']}) "
          "on TRL's first batch")
    print(f"{'seed':>4} {'setting':<22} {'reward':>6} {'tokens':>6} {'adv diff':>9} {'|g|':>9} {'|g| TRL':>9} "
          f"{'rel err':>9} {'cosine':>9}  worst parameter")
    for r in results:
        print(f"{r['seed']:>4} {r['setting']:<22} {r['reward_mean']:>6.3f} {r['tokens_mean']:>6.1f} "
              f"{r['adv_max_diff']:>9.2e} {r['norm']:>9.4f} {r['norm_trl']:>9.4f} {r['rel_err']:>9.2e} "
              f"{r['cosine']:>9.6f}  {r['worst_param']} ({r['worst_rel_err']:.2e})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"trl_gradient_{args.workload}.json").write_text(json.dumps({"machine": m, "rows": results},
                                                                       indent=1))
    bad = [r for r in results if not math.isfinite(r["rel_err"]) or r["rel_err"] > args.tolerance]
    if bad:
        print(f"\n{len(bad)} of {len(results)} above the tolerance {args.tolerance:g}")
        sys.exit(1)


if __name__ == "__main__":
    main()
