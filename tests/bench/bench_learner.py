"""Benchmark of the learner's policy step against a bare training step (CPU; a script, not a test).

    .venv/bin/python tests/bench/bench_learner.py [--quick] [--threads 1] [--out bench_results/bench_learner.json]

The batch is the default demo's: 8 prompts × 8 completions of ``a+b=`` (BOS + 4 characters) with
1–4 completion tokens, on the demo model's architecture (tiny Llama, 4 layers, width 128, 49-token
vocabulary; random weights: the cost of a step does not depend on them).

- **bare**: one forward of the whole batch, ``log_softmax(logits).gather``, the policy-gradient
  loss −Σ A·log π / n, backward, ``clip_grad_norm_``, ``AdamW.step`` — the least a step can do.
- **learner**: ``Trainer.step`` on the same batch and model, with its phase breakdown
  (``time_<phase>_s``: collate, reference, values, proximal, advantages, update) and the publish
  (``WeightsServer.snapshot``: the copy the train loop waits for; checksums and serving run beside
  the next step, see bench_weights.py).

Configurations: ``grpo_1step`` (the demo's algorithm with one micro-batch, like for like with bare:
the target ≤ 1.25×), ``grpo_demo`` (the demo's config as shipped, micro_batch_samples 32: two
micro-batches), ``ppo`` (critic + KL to the reference + 2 epochs × 2 mini-batches: every extra
pass accounted for). Timing: median of ``--repeats`` interleaved rounds (each configuration once
per round) after warm-up; one torch thread by default (see ``bench_ops.py`` for why).
Where the update's time goes is measured with cProfile over the same steps (``--profile``).
``--sanity``: ``grpo_demo`` with ``algorithm.sanity_every`` 1 and 0: what one sanity check costs
(it runs every 16th step by default). ``--longtail``: a batch of completions of 2–65 tokens (builtin:longtail's lengths) under the demo's
learner settings, in one pass against ``learner.batch.micro_batch_tokens`` budgets (rows of like lengths
per pass, less padding), interleaved, × the one pass.

Measured (2 shared cores, one thread, medians of 20): bare 76–82 ms; ``grpo_1step`` 1.11–1.12×
(step 1.03×, publish 6–7 ms); ``grpo_demo`` 1.30× (the second micro-batch: 32 rows twice cost
~18 ms more than 64 once at this size); ``ppo`` 6.2–6.4× = reference, values and proximal passes
(~28 ms each, a no-grad forward) + 4 updates of policy and critic (~400 ms). In ``grpo_1step``,
backward ~45 ms and forward ~25 ms are the bare step's own; the learner's additions (importance
weights, the PPO loss and its statistics, entropy, token log-probs, collate, advantages) add up to
~3 ms, and the publish snapshot to ~6.5 ms.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: config_kit
from bench_machine import machine, machine_line  # noqa: E402
from config_kit import nested  # noqa: E402

import protocol  # noqa: E402
from buffer import Batch  # noqa: E402
from learner.config import LearnerConfig, TrainerConfig  # noqa: E402
from learner.models.builtin import build_model, build_tokenizer  # noqa: E402
from learner.serve.weights_server import WeightsServer  # noqa: E402
from learner.train.trainer import Trainer, collate  # noqa: E402

PROMPTS, GROUP = 8, 8
CONFIGS = {
    "grpo_1step": dict(micro_batch_samples=PROMPTS * GROUP),
    "grpo_demo": dict(),
    "ppo": dict(advantage="gae", whiten_advantages=True, kl_coef=0.05, ppo_epochs=2,
                mini_batch_samples=PROMPTS * GROUP // 2),
}
PHASES = ("collate", "reference", "values", "proximal", "advantages", "update")
DEMO_SETTINGS = dict(micro_batch_samples=PROMPTS * GROUP, autocast="auto", attn_implementation="eager")
LONGTAIL_CONFIGS = {"lt_one_pass": DEMO_SETTINGS,
                    **{f"lt_tokens_{n}": dict(DEMO_SETTINGS, micro_batch_tokens=n) for n in (512, 1024, 2048)}}
"""``--longtail``: the demo's learner settings on a long-tail batch, in one pass and by a token budget."""


def make_batch(tokenizer, prompt_of, length_of, seed: int = 0) -> Batch:
    """PROMPTS prompts (``prompt_of(rng)``) × GROUP random completions of ``length_of(rng)``
    tokens, behavior log-probs near a uniform policy's, rewards 1 with probability 0.3."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(PROMPTS):
        prompt = np.asarray([tokenizer.bos_token_id] + tokenizer.encode(prompt_of(rng), add_special_tokens=False),
                            dtype=np.int32)
        for i in range(GROUP):
            t = length_of(rng)
            samples.append(protocol.Sample(
                sample_id=protocol.sample_id(f"a{g}", i), assignment_id=f"a{g}", group_index=i,
                group_size=GROUP, prompt_token_ids=prompt,
                completion_token_ids=rng.integers(4, len(tokenizer), t).astype(np.int32),
                behavior_logprobs=(-np.log(len(tokenizer)) + 0.05 * rng.standard_normal(t)).astype(np.float32),
                token_versions=np.zeros(t, dtype=np.int32), reward=float(rng.random() < 0.3)))
    return Batch(samples, version=1, staleness=[0] * len(samples), needs_correction=[False] * len(samples),
                 group_sizes=[GROUP] * PROMPTS)


def demo_batch(tokenizer, seed: int = 0) -> Batch:
    """The demo's: ``a+b=`` with 1–4 completion tokens."""
    def prompt(rng) -> str:
        a, b = rng.integers(0, 10, 2)
        return f"{a}+{b}="

    return make_batch(tokenizer, prompt, lambda rng: int(rng.integers(1, 5)), seed)


def longtail_batch(tokenizer, seed: int = 0) -> Batch:
    """``dx12=`` × completions of n digits + EOS, n log-uniform in 1..64 per completion
    (builtin:longtail's answer lengths, where the policy is still learning them)."""
    return make_batch(tokenizer, lambda rng: f"{int(rng.integers(0, 10))}x12=",
                      lambda rng: min(65, int(np.exp(rng.uniform(0.0, np.log(65)))) + 1), seed)


def longtail(model_dir: str, tokenizer, threads: int, repeats: int) -> dict:
    """``LONGTAIL_CONFIGS`` interleaved on one long-tail batch: step medians, × the one pass."""
    batch = longtail_batch(tokenizer)
    bt = collate(batch.samples, tokenizer.pad_token_id)
    trainers = {n: Trainer(TrainerConfig.of(LearnerConfig(**nested(threads=threads, **kw))), model_dir) for n, kw in LONGTAIL_CONFIGS.items()}
    steps: dict[str, list[float]] = {n: [] for n in trainers}
    for r in range(3 + repeats):                              # 3 warm-up rounds
        for n, tr in trainers.items():
            t = tr.step(batch)["step_s"]
            if r >= 3:
                steps[n].append(t)
    med = {n: statistics.median(v) for n, v in steps.items()}
    base = med["lt_one_pass"]
    print(f"\nlong tail: {len(bt)} samples, {int(bt.attention_mask.sum())} tokens, padded to "
          f"{bt.input_ids.numel()} in one pass; median of {repeats}")
    print(f"{'config':<16}{'step ms':>9}{'x one pass':>11}")
    for n, v in med.items():
        print(f"{n:<16}{v * 1e3:>9.2f}{v / base:>11.2f}")
    return {"tokens": int(bt.attention_mask.sum()), "padded": int(bt.input_ids.numel()),
            "step_s": med, "configs": LONGTAIL_CONFIGS}


class Bare:
    """forward + log-probs + PG loss + backward + clip + AdamW, nothing else."""

    def __init__(self, model_dir: str, batch: Batch, pad_id: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.bt = collate(batch.samples, pad_id)
        self.adv = torch.randn(len(batch.samples))[:, None] * self.bt.mask

    def step(self) -> float:
        t0 = time.perf_counter()
        bt = self.bt
        logits = self.model(input_ids=bt.input_ids, attention_mask=bt.attention_mask, use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, bt.targets[..., None])[..., 0]
        loss = -(self.adv * logp * bt.mask).sum() / bt.mask.sum()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return time.perf_counter() - t0


def learner_step(trainer: Trainer, weights: WeightsServer, batch: Batch, version: int) -> dict[str, float]:
    t0 = time.perf_counter()
    stats = trainer.step(batch)
    t1 = time.perf_counter()
    weights.snapshot(version, trainer.named_tensors())   # what the train loop waits for (the rest runs beside)
    t2 = time.perf_counter()
    out = {p: stats[f"time_{p}_s"] for p in PHASES}
    out["publish"] = t2 - t1
    out["step"] = t1 - t0
    out["total"] = t2 - t0
    return out


PROFILED = {
    "model forward": "modeling_llama.py:{}(forward)",
    "token_logprobs": "logprobs.py:{}(token_logprobs)",
    "entropy_from_logits": "logprobs.py:{}(entropy_from_logits)",
    "importance_weights": "importance.py:{}(importance_weights)",
    "ppo_policy_loss": "losses.py:{}(ppo_policy_loss)",
    "backward": "_tensor.py:{}(backward)",
    "clip_grad_norm_": "clip_grad.py:{}(clip_grad_norm_)",
    "optimizer step": "adam.py:{}(step)",
    "merge_stats": "stats.py:{}(merge_stats)",
    "collate": "batching.py:{}(collate)",
    "advantages": "returns.py:{}(advantages_and_targets)",
}


def profile(trainer: Trainer, batch: Batch, n: int) -> dict[str, float]:
    """Cumulative seconds per step of the functions in PROFILED (cProfile)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        trainer.step(batch)
    prof.disable()
    st = pstats.Stats(prof)
    out = {}
    for label, pattern in PROFILED.items():
        prefix, _, name = pattern.partition("{}")
        total = 0.0
        for (file, _line, func), (_, _, _, ct, _) in st.stats.items():
            if file.endswith(prefix.split(":")[0]) and f"({func})" == name:
                total = max(total, ct)     # outermost frame (recursion counts once)
        out[label] = total / n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="also show where grpo_1step's time goes")
    ap.add_argument("--attn", action="store_true",
                    help="also the demo's learner settings (one micro-batch, autocast auto) "
                         "with sdpa and with eager attention (learner.runtime.attn_implementation)")
    ap.add_argument("--precision", action="store_true",
                    help="also the demo's learner settings under autocast bfloat16, none and auto "
                         "(learner.runtime.autocast; auto: bfloat16 only where the CPU computes it natively)")
    ap.add_argument("--sanity", action="store_true",
                    help="also grpo_demo with the sanity check at every step and never (its cost per check)")
    ap.add_argument("--longtail", action="store_true",
                    help="also a long-tail batch (completions of 2-65 tokens) in one pass against "
                         "learner.batch.micro_batch_tokens budgets")
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "bench_learner.json"))
    args = ap.parse_args()
    repeats = 8 if args.quick else args.repeats
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp())
    tok = build_tokenizer()
    build_model(tok).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    batch = demo_batch(tok)
    bare = Bare(str(tmp), batch, tok.pad_token_id)
    configs = dict(CONFIGS)
    if args.attn:
        configs.update({f"demo_{attn}": dict(DEMO_SETTINGS, attn_implementation=attn) for attn in ("sdpa", "eager")})
    if args.precision:
        configs.update({f"demo_ac_{ac}": dict(DEMO_SETTINGS, autocast=ac) for ac in ("bfloat16", "none", "auto")})
    if args.sanity:        # the default shortcut's sanity check on every step, and never
        configs.update({f"demo_sanity_{n}": dict(algorithm={"sanity_every": n}) for n in (1, 0)})
    trainers = {name: Trainer(TrainerConfig.of(LearnerConfig(**nested(threads=args.threads, **kw))), str(tmp)) for name, kw in configs.items()}
    servers = {name: WeightsServer(64 << 20) for name in configs}
    versions = dict.fromkeys(configs, 0)
    for _ in range(3):                                       # warm-up
        bare.step()
        for name, tr in trainers.items():
            versions[name] += 1
            learner_step(tr, servers[name], batch, versions[name])
    bare_s: list[float] = []
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for _ in range(repeats):
        bare_s.append(bare.step())
        for name, tr in trainers.items():
            versions[name] += 1
            runs[name].append(learner_step(tr, servers[name], batch, versions[name]))
    bare_med = statistics.median(bare_s)
    m = machine(threads=args.threads)
    result = {"machine": m, "threads": args.threads, "repeats": repeats, "samples": PROMPTS * GROUP,
              "tokens": int(collate(batch.samples, tok.pad_token_id).attention_mask.sum()),
              "bare_s": bare_med, "configs": {}}
    cols = ("total", "step", *PHASES, "publish")
    print(machine_line(m))
    print(f"batch {PROMPTS}x{GROUP} = {PROMPTS * GROUP} samples, {result['tokens']} tokens; "
          f"{args.threads} thread(s); median of {repeats}")
    print(f"{'config':<18}{'x bare':>8}" + "".join(f"{c:>11}" for c in cols) + "   (ms)")
    print(f"{'bare':<18}{1.0:>8.2f}{bare_med * 1e3:>11.2f}")
    for name, rs in runs.items():
        med = {c: statistics.median(r[c] for r in rs) for c in cols}
        result["configs"][name] = {"ratio_total": med["total"] / bare_med, "ratio_step": med["step"] / bare_med,
                                   **{f"{c}_s": v for c, v in med.items()}, "config": configs[name]}
        print(f"{name:<18}{med['total'] / bare_med:>8.2f}" + "".join(f"{med[c] * 1e3:>11.2f}" for c in cols))
    if args.profile:
        prof = profile(trainers["grpo_1step"], batch, max(5, repeats // 2))
        result["profile_grpo_1step_s"] = prof
        print("\nwhere grpo_1step's step goes (cProfile, cumulative, per step; nested entries overlap):")
        for label, sec in sorted(prof.items(), key=lambda kv: -kv[1]):
            print(f"  {label:<22}{sec * 1e3:>9.2f} ms")
    if args.longtail:
        result["longtail"] = longtail(str(tmp), tok, args.threads, repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
