"""Async vs synchronous (issue 12): the demo at η ∈ {0, 1, 2, 4} against TRL's GRPOTrainer.

    python tests/bench/bench_async.py [--samples 3840] [--etas 0,1,2,4] [--workloads demo,longtail]
        [--repeats 1] [--trl-python /tmp/trl-venv/bin/python] [--device auto] [--body smollm2-135m]
        [--out bench_results/bench_async.json]

Every slipstream run is ``slipstream run`` (deploy/launcher.py) in a subprocess with ``--set``
overrides: the same seeds, the threads of each process as ``slipstream run`` splits the cores
(deploy/cores.py: on 2 cores learner 1 + server 1, and at η = 0 the learner 2, since the two take
turns; ``--learner-threads`` / ``--rollout-threads`` pin them; each row records its split), the
same number of trained samples. From its metrics.jsonl step rows (after ``--skip`` warm-up
steps):

- trained samples/s (samples of the steps after the first counted one over the time between
  their ends), the mean step cycle and train step time, the publish wait of the train loop;
- learner idle fraction (time waiting for samples / cycle) and rollout idle fraction (the
  servers' engine idle time, from their heartbeats);
- the ideal overlap from the same run's phase timings: per batch, generation takes
  ``gen = cycle · (1 − rollout_idle)`` (engine busy time) and training ``train = step + publish
  wait``; a synchronous loop needs their sum, a perfect overlap their max. ``of_ideal`` is the
  measured samples/s over ``batch / max(gen, train)``;
- reward at equal trained samples: the mean reward of the first and of the last quarter of the
  steps' batches, for ``is_mode`` tis (the default) and, at the largest η, none. At η > 0 this
  curve lags the policy by about η versions and 60 steps are few: the retention target is
  measured on the policy itself, over 200 steps and several seeds, by
  tests/bench/bench_staleness_reward.py.
- the loop gap: the cycle less the step, the snapshot and the wait for samples (handing the step
  to its thread and back, the step row, the dispatch of new work), per step;
- η = 0 runs first and again last in every round (``--no-bracket``: first only): × η=0 is over the
  mean of the two, which cancels a drift of the machine's speed over the round that is linear in
  time, and the end/start ratio is printed as the round's drift;
- the core bound: per round, batch × cores / (gen s + train s) of the η = 2 run, the rate a
  perfect sharing of the cores between the two phases (one thread each) would reach.

The baseline in the same run: tests/bench/trl_baseline.py run by ``--trl-python`` (an
interpreter of a separate environment with ``trl==1.16.0``; never a slipstream dependency) on the
same model directory, prompts (same task, same seed), reward, batch, max_completion_length,
temperature, learning rate, beta = 0, once per ``--trl-threads`` entry (default 1 and 2 torch
threads) and once per ``--trl-bf16-threads`` entry with TRL's own mixed precision (``bf16=True``,
default one run at 1 thread: where the CPU computes bfloat16 natively the demo trains under
bfloat16 autocast, ``learner.runtime.autocast: auto``, so TRL gets its bf16 too); the fastest TRL row is the baseline of the ``x TRL`` column. Without that interpreter the TRL rows
are skipped with a note. ``--collect DIR`` re-reads the runs a killed invocation left in DIR.

Workloads: ``demo`` (deploy/configs/default.yaml: builtin:tiny-arith on builtin:arith,
max_new_tokens 4) and ``longtail`` (builtin:tiny-longtail on builtin:longtail: answers of 1..64
tokens, max_new_tokens 64), where a synchronous step waits for the longest completion.

Writes the JSON (every row and its per-step series) and a PNG next to it (samples/s per η
with TRL as a line, and reward against trained samples), and prints the table. The machine's load
average is recorded with the numbers: ratios within one run are what counts.

Measured on the 2-core machine with nothing else running, every process pinned (README
"Benchmark: async vs synchronous"): demo ``--repeats 3`` in two sittings, eta 2 1.43/1.40/1.47x
eta 0 and 0.950-0.952 of ideal per round with the machine fast, 1.14x (median) and 0.963-0.966
with it slow, where eta 0's two-thread step gained more on the one-thread step beside a busy core
(core bound 1.66x eta 0, against 2.2x); eta 0 0.95-1.52x and eta 2 1.19-1.52x the fastest of
TRL's six runs a round. The long tail (``--repeats 3``): compare it in completion tokens/s (the
``tok/s`` column, ``x_trl_tokens``), eta 2 1.30x TRL (median): the completion lengths follow each
run's seed (slipstream's 4.7/7.3/8.8 tokens at seeds 1/2/3, TRL's 10.0/6.5/6.2), not the trainer
(check_trl_gradient.py: the same gradient on the same batch). Two busy processes get ~1.34 cores'
worth of compute from these two cores (two single-thread matmul loops: 141 + 141/s against 211/s
alone), which bounds what overlapping the phases can gain here. Under load (other jobs on the
cores) the overlapped runs lose the second core and the demo's ratios fall below 1.

On a GPU: ``--device cuda`` (or auto) puts the learner, the HF engine and TRL there, and
``--body smollm2-135m`` swaps the tiny model for a random one of SmolLM2-135M's size with the
same tokenizer; tests/gpu/bench_async.sh runs both on a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench_machine import machine, machine_line  # noqa: E402

BATCH_PROMPTS, GROUP = 8, 8
END = "@end"
"""The is_mode suffix of the round's closing η = 0 run (see ratios)."""
WORKLOADS = {
    "demo": {"model": "builtin:tiny-arith", "dataset": "builtin:arith", "max_new_tokens": 4,
             "reward": "exact_numeric"},
    "longtail": {"model": "builtin:tiny-longtail", "dataset": "builtin:longtail",
                 "max_new_tokens": 64, "reward": "exact_match",
                 # Rows of like lengths per forward/backward (the same gradient): the step
                 # 0.17-0.20 -> 0.11-0.12 s at eta 0 (bench_learner.py --longtail: 0.70x).
                 "sets": {"learner.batch.micro_batch_tokens": 1024}},
}
LR, TEMPERATURE = 3.0e-4, 1.0
BODIES = {
    # SmolLM2-135M's decoder (30 layers, width 576, 9 heads over 3 KV heads, MLP 1536) with random
    # weights under the workload's own tokenizer: the cost of a real small model's step and
    # generation, not its answers (the reward stays near 0; a step costs the same).
    "smollm2-135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "intermediate_size": 1536, "max_position_embeddings": 2048},
}


def model_for(work: str, body: str | None) -> str:
    """The model of ``work``'s runs (slipstream's and TRL's): the workload's built-in model, or
    with ``body`` (``--body``) a random-weights model of that size with the same tokenizer, built
    once into the cache (written aside, renamed into place)."""
    if body is None:
        return WORKLOADS[work]["model"]
    from learner.models.builtin import cache_dir, ensure_builtin_model

    base = ensure_builtin_model(WORKLOADS[work]["model"], log=lambda m: print(f"[setup] {m}"))
    target = cache_dir() / "bench" / f"{Path(base).name}-{body}"
    if not (target / "done").exists():
        import shutil

        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        print(f"[setup] {target}: random {body} body", flush=True)
        config = LlamaConfig.from_pretrained(base)
        for k, v in BODIES[body].items():
            setattr(config, k, v)
        torch.manual_seed(1234)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        LlamaForCausalLM(config).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
        (tmp / "done").write_text("ok")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return str(target)


def slipstream_run(work: str, eta: int, is_mode: str, steps: int, run_dir: Path, args) -> dict:
    """One ``slipstream run``; its step rows and wall time."""
    w = WORKLOADS[work]
    devices = {} if args.device == "auto" else {"learner.runtime.device": args.device, "rollout.runtime.device": args.device}
    sets = {"model": model_for(work, args.body), "learner.data.dataset": w["dataset"],
            "learner.sampling.max_new_tokens": w["max_new_tokens"], "learner.total_steps": steps,
            "learner.staleness.max_staleness": eta, "learner.algorithm.is_mode": is_mode,
            "learner.batch.batch_prompts": BATCH_PROMPTS, "learner.batch.group_size": GROUP,
            "learner.optimizer.lr": LR, "learner.sampling.temperature": TEMPERATURE,
            "learner.threads": args.learner_threads, "rollout.threads": args.rollout_threads,
            "learner.seed": args.seed, "rollout.seed": args.seed, "learner.checkpoint.save_every": 0,
            "learner.run_dir": str(run_dir), "learner.network.metrics_port": 0, "rollout.network.metrics_port": 0,
            "learner.network.rollout_port": 0, "learner.network.weights_port": 0, "learner.network.control_port": 0,
            # A heartbeat (the servers' idle ratio) every 0.5 s, not 2: a 60-step run lasts ~3 s.
            "rollout.network.heartbeat_interval_s": 0.5, **w.get("sets", {}), **devices,
            **dict(kv.split("=", 1) for kv in args.set)}
    cmd = [sys.executable, "-m", "deploy.cli", "run"]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = dict(os.environ, SLIPSTREAM_CACHE=os.environ.get("SLIPSTREAM_CACHE", "/tmp/slipstream-cache"))
    t0 = time.monotonic()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.run_timeout_s)
    wall = time.monotonic() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()] if (run_dir / "metrics.jsonl").exists() else []
    rows = [r for r in rows if "step_s" in r and r.get("kind", "step") == "step"]
    if proc.returncode != 0 or len(rows) < steps:
        raise RuntimeError(f"slipstream run {work} eta={eta} {is_mode}: exit {proc.returncode}, "
                           f"{len(rows)}/{steps} steps; see {run_dir}.log")
    split = re.search(r"\[run\] threads: learner (\d+), rollout-0 (\d+)",
                      (run_dir.parent / f"{run_dir.name}.log").read_text())
    return {"rows": rows, "wall_s": wall,
            "threads": {"learner": int(split[1]), "rollout": int(split[2])} if split else None}


def summarize(rows: list[dict], skip: int) -> dict:
    """Throughput, phase and reward figures of one run's step rows (see the module docstring)."""
    steady = rows[skip:]
    span = steady[-1]["time"] - steady[0]["time"]
    samples = sum(r["samples"] for r in steady[1:])
    n = len(steady) - 1
    mean = lambda key: sum(r.get(key, 0.0) for r in steady[1:]) / n  # noqa: E731
    cycle = span / n
    train = mean("step_s") + mean("publish_wait_s")
    # The servers' idle ratio is NaN in the rows before their first Heartbeat (unknown): the mean
    # of the rows that have one.
    reported = [r["rollout_idle_ratio"] for r in steady[1:]
                if r.get("rollout_idle_ratio") is not None and not math.isnan(r["rollout_idle_ratio"])]
    rollout_idle = sum(reported) / len(reported) if reported else float("nan")
    gen = cycle * (1.0 - rollout_idle)
    sps = samples / span
    q = max(1, len(rows) // 4)
    rewards = [r["reward_mean"] for r in rows]
    return {
        "samples_per_s": sps, "cycle_s": cycle, "step_s": mean("step_s"),
        "publish_wait_s": mean("publish_wait_s"),
        "learner_idle": sum(r.get("learner_idle_s", 0.0) for r in steady[1:]) / span,
        "rollout_idle": rollout_idle, "gen_s": gen, "train_s": train,
        # What the train loop spent per step on neither the step, the snapshot nor waiting for
        # samples: handing the step to its thread and back, the step row, dispatching work.
        "loop_gap_s": cycle - train - mean("learner_idle_s"),
        "ideal_sync_sps": samples / n / (gen + train), "ideal_overlap_sps": samples / n / max(gen, train),
        "of_ideal": sps / (samples / n / max(gen, train)),
        "time_update_s": mean("time_update_s"), "time_collate_s": mean("time_collate_s"),
        "time_proximal_s": mean("time_proximal_s"),
        "staleness_mean": mean("staleness_mean"),
        "completion_tokens_mean": mean("completion_tokens_mean"),
        "tokens_per_s": sps * mean("completion_tokens_mean"),
        "reward_first_q": sum(rewards[:q]) / q, "reward_last_q": sum(rewards[-q:]) / q,
        "reward_gain": sum(rewards[-q:]) / q - sum(rewards[:q]) / q,
    }


def trl_run(work: str, steps: int, threads: int, out_dir: Path, args, bf16: bool = False,
            attn: str = "auto") -> dict:
    """TRL's GRPOTrainer in its own interpreter; its per-step records."""
    from learner.data.tasks import get_task
    from learner.models.builtin import ensure_builtin_model

    w = WORKLOADS[work]
    task = get_task(w["dataset"])
    rng = random.Random(args.seed)
    prompts = [task.example(rng) for _ in range(steps * BATCH_PROMPTS)]
    model = model_for(work, args.body)
    spec = {"model": str(ensure_builtin_model(model, log=lambda m: print(f"[setup] {m}")))
            if model.startswith("builtin:") else model, "device": args.device,
            "prompts": [{"prompt": e.prompt, "answer": e.answer} for e in prompts],
            "reward": w["reward"], "batch_prompts": BATCH_PROMPTS, "group_size": GROUP,
            "max_new_tokens": w["max_new_tokens"], "temperature": TEMPERATURE, "lr": LR,
            "steps": steps, "seed": args.seed, "threads": threads, "bf16": bf16,
            "attn_implementation": attn, "output_dir": str(out_dir / f"trl-{work}-out")}
    tag = trl_tag(work, threads, bf16, attn)
    spec_file, result = out_dir / f"{tag}.spec.json", out_dir / f"{tag}.json"
    spec_file.write_text(json.dumps(spec))
    t0 = time.monotonic()
    with open(out_dir / f"{tag}.log", "w") as log:
        proc = subprocess.run([args.trl_python, str(REPO / "tests/bench/trl_baseline.py"),
                               str(spec_file), str(result)], cwd=REPO, stdout=log,
                              stderr=subprocess.STDOUT, timeout=args.run_timeout_s,
                              env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if proc.returncode != 0:
        raise RuntimeError(f"TRL {work}: exit {proc.returncode}; see {out_dir}/{tag}.log")
    data = json.loads(result.read_text())
    data["wall_s"] = time.monotonic() - t0
    return data


def trl_tag(work: str, threads: int, bf16: bool, attn: str) -> str:
    return f"trl-{work}-t{threads}" + ("-bf16" if bf16 else "") + ("" if attn == "auto" else f"-{attn}")


def trl_name(threads: int, bf16: bool, attn: str) -> str:
    return f"TRL {threads} thr" + (" bf16" if bf16 else "") + ("" if attn == "auto" else f" {attn}")


def summarize_trl(data: dict, skip: int) -> dict:
    steady = data["steps"][skip:]
    span = steady[-1]["time"] - steady[0]["time"]
    n = len(steady) - 1
    gen = sum(s["gen_s"] for s in steady[1:]) / n
    step = sum(s["step_s"] for s in steady[1:]) / n
    rewards = [s.get("reward_mean", 0.0) for s in data["steps"]]
    q = max(1, len(rewards) // 4)
    tokens = sum(s.get("completion_tokens_mean", 0.0) for s in steady) / len(steady)
    return {"samples_per_s": data["batch"] * n / span, "cycle_s": span / n, "step_s": step,
            "gen_s": gen, "train_s": step - gen, "completion_tokens_mean": tokens,
            "tokens_per_s": data["batch"] * n / span * tokens,
            "reward_first_q": sum(rewards[:q]) / q, "reward_last_q": sum(rewards[-q:]) / q,
            "reward_gain": sum(rewards[-q:]) / q - sum(rewards[:q]) / q}


def fmt_table(results: list[dict]) -> str:
    head = (f"{'workload':<9} {'run':<20} {'thr':>4} {'samples/s':>9} {'x eta0':>6} {'x TRL':>6} {'cycle s':>8} "
            f"{'step s':>7} {'pub s':>6} {'L idle':>6} {'R idle':>6} {'gen s':>7} {'train s':>7} "
            f"{'gap ms':>6} {'ideal/s':>8} {'of ideal':>8} {'tokens':>6} {'tok/s':>6} {'reward q1→q4':>14}")
    lines = [head, "-" * len(head)]
    for r in results:
        s = r["summary"]
        def opt(k: str, f: str, s: dict = s) -> str:
            return format(s[k], f) if k in s else "-"
        t = r.get("threads")
        thr = f"{t['learner']}+{t['rollout']}" if t else "-"
        gap = format(s["loop_gap_s"] * 1e3, "6.2f") if "loop_gap_s" in s else "-"
        lines.append(
            f"{r['workload']:<9} {r['name']:<20} {thr:>4} {s['samples_per_s']:>9.0f} "
            f"{r.get('x_eta0', float('nan')):>6.2f} {r.get('x_trl', float('nan')):>6.2f} "
            f"{s['cycle_s']:>8.4f} {s['step_s']:>7.4f} {opt('publish_wait_s', '6.4f'):>6} "
            f"{opt('learner_idle', '6.2f'):>6} {opt('rollout_idle', '6.2f'):>6} {s['gen_s']:>7.4f} "
            f"{s['train_s']:>7.4f} {gap:>6} {opt('ideal_overlap_sps', '8.0f'):>8} {opt('of_ideal', '8.2f'):>8} "
            f"{s['completion_tokens_mean']:>6.1f} {opt('tokens_per_s', '6.0f'):>6} "
            f"{s['reward_first_q']:>6.3f}→{s['reward_last_q']:.3f}")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = sorted({r["workload"] for r in results})
    fig, axes = plt.subplots(2, len(works), figsize=(6 * len(works), 8), squeeze=False)
    for j, work in enumerate(works):
        rs = [r for r in results if r["workload"] == work]
        tis = [r for r in rs if r["kind"] == "slipstream" and r["is_mode"] == "tis" and not r.get("end")]
        ax = axes[0][j]
        ax.bar([str(r["eta"]) for r in tis], [r["summary"]["samples_per_s"] for r in tis], label="slipstream (tis)")
        ax.scatter([str(r["eta"]) for r in tis], [r["summary"]["ideal_overlap_sps"] for r in tis],
                   color="k", marker="_", s=400, label="ideal overlap")
        for r in rs:
            if r["kind"] == "trl":
                ax.axhline(r["summary"]["samples_per_s"], color="r", ls="--", label=r["name"])
        ax.set_xlabel("max_staleness η")
        ax.set_ylabel("trained samples/s")
        ax.set_title(f"{work}: throughput")
        ax.legend()
        ax = axes[1][j]
        for r in rs:
            y = r["rewards"]
            ax.plot([(i + 1) * BATCH_PROMPTS * GROUP for i in range(len(y))], y, label=r["name"], alpha=0.8)
        ax.set_xlabel("trained samples")
        ax.set_ylabel("mean reward")
        ax.set_title(f"{work}: reward at equal trained samples")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=3840, help="trained samples per run (÷ 64 = steps)")
    p.add_argument("--etas", default="0,1,2,4")
    p.add_argument("--workloads", default="demo,longtail")
    p.add_argument("--longtail-samples", type=int, default=None,
                   help="trained samples per long-tail run (default: --samples / 2)")
    p.add_argument("--no-is-ablation", action="store_true", help="skip is_mode=none at the largest η")
    p.add_argument("--no-bracket", action="store_true",
                   help="run η=0 once a round, not also at its end (the base of x eta0 is then one run)")
    p.add_argument("--learner-threads", type=int, default=0,
                   help="torch threads of the learner (0: slipstream run's own split, deploy/cores.py)")
    p.add_argument("--rollout-threads", type=int, default=0,
                   help="torch threads of the server (0: slipstream run's own split)")
    p.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON", "/tmp/trl-venv/bin/python"))
    p.add_argument("--trl-threads", default="1,2",
                   help="torch threads of the TRL process, one TRL run each (the best is the baseline)")
    p.add_argument("--trl-bf16-threads", default="1",
                   help="the same with TRL's own mixed precision (GRPOConfig bf16=True); '' for none")
    p.add_argument("--trl-attn", default="auto,eager",
                   help="attention implementations of the TRL model, one TRL run each per thread "
                        "setting above (auto: the model's default, sdpa)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the learner, the HF engine and TRL run (auto: cuda when there is one)")
    p.add_argument("--body", default=None, choices=sorted(BODIES),
                   help="a random-weights model of this size with the workload's tokenizer, instead "
                        "of the workload's built-in model")
    p.add_argument("--seed", type=int, default=1, help="round k runs with seed + k")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of the whole plan, interleaved; the table shows medians over rounds")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the timings")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra slipstream --set for every slipstream run")
    p.add_argument("--run-timeout-s", type=float, default=1800)
    p.add_argument("--out", default=str(REPO / "bench_results" / "bench_async.json"))
    p.add_argument("--collect", default=None, metavar="DIR",
                   help="run nothing: summarize the runs a previous invocation left in DIR")
    args = p.parse_args()
    etas = [int(e) for e in args.etas.split(",")]
    have_trl = Path(args.trl_python).exists()
    if not have_trl:
        print(f"[bench] no TRL interpreter at {args.trl_python}: TRL rows skipped (python3 -m venv "
              f"/tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0 trl==1.16.0, or "
              f"--trl-python PATH)", flush=True)
    tmp = Path(args.collect) if args.collect else Path(tempfile.mkdtemp(prefix="bench_async-"))
    print(f"[bench] run directories and logs in {tmp}", flush=True)
    load0 = os.getloadavg()
    m = machine()                          # this process's threads; the runs' own are in their rows
    results: list[dict] = []
    seed0 = args.seed
    for rnd in range(args.repeats):
        args.seed = seed0 + rnd            # every round its own seed: reward figures average seeds
        for work in args.workloads.split(","):
            samples = args.samples if work == "demo" else (args.longtail_samples or args.samples // 2)
            steps = max(args.skip + 4, samples // (BATCH_PROMPTS * GROUP))
            plan = [("slipstream", eta, "tis") for eta in etas]
            if not args.no_is_ablation:
                plan.append(("slipstream", max(etas), "none"))
            if 0 in etas and len(etas) > 1 and not args.no_bracket:
                plan.append(("slipstream", 0, "tis" + END))   # brackets the round (see ratios)
            if have_trl:                             # after η=0: the same load, roughly
                attns = [a for a in args.trl_attn.split(",") if a] or ["auto"]
                trl = [("trl", int(t), (False, a)) for a in attns
                       for t in args.trl_threads.split(",") if t]
                trl += [("trl", int(t), (True, a)) for a in attns
                        for t in args.trl_bf16_threads.split(",") if t]
                plan[1:1] = trl
            for kind, eta, is_mode in plan:
                name = (trl_name(eta, *is_mode) if kind == "trl" else run_name(eta, is_mode))
                tag = f"round {rnd + 1}/{args.repeats}, " if args.repeats > 1 else ""
                try:
                    row = one_run(work, kind, eta, is_mode, steps, tmp / f"r{rnd}" if rnd else tmp,
                                  args, collect=bool(args.collect), tag=tag)
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                    print(f"[bench] {work}: {name} failed: {e}", flush=True)
                    continue
                if row is None:
                    continue
                results.append({"workload": work, "name": name, "steps": steps, "round": rnd,
                                "seed": args.seed, **row, "load_after": os.getloadavg()[0]})
                print(f"[bench]   {row['summary']['samples_per_s']:.0f} samples/s", flush=True)
            drift = ratios(results, work, rnd)
            if drift is not None:
                print(f"[bench] {work}: eta=0 at the end of the round / at its start: {drift:.2f} (the "
                      f"machine's drift over the round; x eta0 is over their mean)", flush=True)
            write(results, args, load0, have_trl, seed0, m)
    print()
    print(machine_line(m))
    print(fmt_table(medians(results)))
    print()
    print(targets(results))
    print(f"[bench] load average {load0[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
          f"({os.cpu_count()} cores)")


def one_run(work: str, kind: str, eta: int, is_mode: str | None, steps: int, tmp: Path, args,
            collect: bool, tag: str = "") -> dict | None:
    """Run (or, with ``collect``, read back) one configuration; None if collecting and absent."""
    tmp.mkdir(parents=True, exist_ok=True)
    if kind == "trl":
        bf16, attn = is_mode                        # the TRL rows' is_mode slot: (bf16, attention)
        result = tmp / (trl_tag(work, eta, bf16, attn) + ".json")
        if collect:
            if not result.exists():
                return None
            data = json.loads(result.read_text())
        else:
            print(f"[bench] {work}: {tag}{trl_name(eta, bf16, attn)}, {steps} steps "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
            data = trl_run(work, steps, eta, tmp, args, bf16=bf16, attn=attn)
        return {"kind": kind, "eta": eta, "is_mode": None, "bf16": bf16, "attn_implementation": attn,
                "summary": summarize_trl(data, args.skip),
                "rewards": [s.get("reward_mean", 0.0) for s in data["steps"]], "series": data["steps"]}
    run_dir = tmp / f"{work}-eta{eta}-{is_mode.replace(END, '-end')}"
    is_mode = is_mode.removesuffix(END)
    if collect:
        if not (run_dir / "metrics.jsonl").exists():
            return None
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        rows = [r for r in rows if "step_s" in r and r.get("kind", "step") == "step"]
        threads = None
    else:
        print(f"[bench] {work}: {tag}eta={eta} {is_mode}, {steps} steps (load {os.getloadavg()[0]:.1f})", flush=True)
        run = slipstream_run(work, eta, is_mode, steps, run_dir, args)
        rows, threads = run["rows"], run["threads"]
    keys = ("time", "step_s", "publish_wait_s", "learner_idle_s", "rollout_idle_ratio", "reward_mean",
            "staleness_mean", "completion_tokens_mean")
    return {"kind": kind, "eta": eta, "is_mode": is_mode, "threads": threads, "end": run_dir.name.endswith("-end"),
            "summary": summarize(rows, args.skip),
            "rewards": [r["reward_mean"] for r in rows], "series": [{k: r.get(k) for k in keys} for r in rows]}


def run_name(eta: int, is_mode: str) -> str:
    return f"eta={eta} {is_mode.removesuffix(END)}" + (" (end)" if is_mode.endswith(END) else "")


def ratios(results: list[dict], work: str, rnd: int = 0) -> float | None:
    """× η=0 (tis) and × the fastest TRL run of the same workload and round. η = 0 runs first and
    again last in a round (``--no-bracket``: first only); the base of × η=0 is the mean of the two
    rates, which cancels a drift of the machine's speed over the round that is linear in time
    (runs minutes apart on a shared machine differ by up to 30 %). Returns the end run's rate over
    the first's (None without both)."""
    mine = [r for r in results if r["workload"] == work and r.get("round", 0) == rnd]
    zeros = [r for r in mine if r["kind"] == "slipstream" and r["eta"] == 0 and r["is_mode"] == "tis"]
    trls = [r for r in mine if r["kind"] == "trl"]
    trl = max(trls, key=lambda r: r["summary"]["samples_per_s"]) if trls else None
    base = statistics.mean(r["summary"]["samples_per_s"] for r in zeros) if zeros else None
    for r in mine:
        if base:
            r["x_eta0"] = r["summary"]["samples_per_s"] / base
        if trl:
            r["x_trl"] = r["summary"]["samples_per_s"] / trl["summary"]["samples_per_s"]
            if r["summary"].get("tokens_per_s") and trl["summary"].get("tokens_per_s"):
                # The same baseline run, counted in completion tokens: where the two trainers'
                # policies drift to different answer lengths, samples/s alone flatters the shorter.
                r["x_trl_tokens"] = r["summary"]["tokens_per_s"] / trl["summary"]["tokens_per_s"]
    first = [r for r in zeros if not r.get("end")]
    end = [r for r in zeros if r.get("end")]
    if first and end:
        return end[0]["summary"]["samples_per_s"] / first[0]["summary"]["samples_per_s"]
    return None


def medians(results: list[dict]) -> list[dict]:
    """One row per (workload, configuration): the median over rounds of every summary figure and
    of the per-round ratios (a ratio pairs two runs of the same round, minutes apart)."""
    out: dict[tuple, list[dict]] = {}
    for r in results:
        out.setdefault((r["workload"], r["name"]), []).append(r)
    rows = []
    for (work, name), rs in out.items():
        row = {"workload": work, "name": name, "rounds": len(rs), "threads": rs[0].get("threads"),
               "summary": {k: statistics.median(r["summary"][k] for r in rs)
                           for k in rs[0]["summary"] if all(k in r["summary"] for r in rs)}}
        for k in ("x_eta0", "x_trl", "x_trl_tokens"):
            if all(k in r for r in rs):
                row[k] = statistics.median(r[k] for r in rs)
        rows.append(row)
    return rows


def targets(results: list[dict]) -> str:
    """Issue 12's targets on the demo workload (and the long tail's ratios), per round and as
    medians; the reward retention at η = 4 from the mean gains over all rounds (seeds)."""
    lines = ["targets (per round, then the median; the goals are the demo's):"]

    def per_round(work: str, name: str, key: str) -> list[float]:
        return [r[key] if key in r else r["summary"][key] for r in results
                if r["workload"] == work and r["name"] == name and (key in r or key in r["summary"])]

    checks = [("demo", "eta=2 tis", "x_eta0", 1.4), ("demo", "eta=2 tis", "of_ideal", 0.95),
              ("demo", "eta=0 tis", "x_trl", 0.9), ("demo", "eta=2 tis", "x_trl", 1.3),
              ("longtail", "eta=0 tis", "x_trl", None), ("longtail", "eta=2 tis", "x_trl", None),
              ("longtail", "eta=0 tis", "x_trl_tokens", None), ("longtail", "eta=2 tis", "x_trl_tokens", None),
              ("longtail", "eta=2 tis", "x_eta0", None)]
    for work, name, key, goal in checks:
        xs = per_round(work, name, key)
        if not xs:
            continue
        med = statistics.median(xs)
        verdict = "" if goal is None else (f"  >= {goal}: " + ("met" if med >= goal else "NOT met")
                                           + f" ({sum(x >= goal for x in xs)}/{len(xs)} rounds)")
        lines.append(f"  {work:<8} {name:<10} {key:<12} " + " ".join(f"{x:.3f}" for x in xs)
                     + f"  median {med:.3f}{verdict}")
    for work in sorted({r["workload"] for r in results}):
        bounds = core_bounds(results, work)
        if bounds:
            lines.append(f"  {work:<8} eta=2 tis  core bound " + " ".join(f"{b:.0f}/s" for b, _, _ in bounds)
                         + f" = {statistics.median(x for _, x, _ in bounds):.2f}x eta 0, "
                         + (f"{statistics.median(t for _, _, t in bounds if t):.2f}x TRL"
                            if any(t for _, _, t in bounds) else "no TRL")
                         + " (medians): batch / ((gen s + train s) / cores), the most any overlap of "
                           "the two phases on these cores reaches")
    for work in sorted({r["workload"] for r in results}):
        gains = {name: per_round(work, name, "reward_gain") for name in ("eta=0 tis", "eta=4 tis",
                                                                         "eta=4 none")}
        if gains["eta=0 tis"] and gains["eta=4 tis"]:
            base = statistics.mean(gains["eta=0 tis"])
            for name in ("eta=4 tis", "eta=4 none"):
                if gains[name]:
                    g = statistics.mean(gains[name])
                    lines.append(f"  {work:<8} reward gain {name} / eta=0 tis: {g:+.3f} / {base:+.3f}"
                                 f" = {g / base if base else float('nan'):.2f} (mean of "
                                 f"{len(gains[name])} seeds, trained samples' reward; the target is judged on "
                                 f"the policy's, bench_staleness_reward.py)")
    return "\n".join(lines)


def core_bounds(results: list[dict], work: str) -> list[tuple[float, float, float | None]]:
    """Per round: the η = 2 run's core-time bound (samples/s if generation and training, one
    thread each, shared the machine's cores perfectly) and that bound over η = 0 and over TRL."""
    out = []
    for rnd in sorted({r.get("round", 0) for r in results if r["workload"] == work}):
        mine = {r["name"]: r for r in results if r["workload"] == work and r.get("round", 0) == rnd}
        eta2 = mine.get("eta=2 tis")
        zeros = [mine[n]["summary"]["samples_per_s"] for n in ("eta=0 tis", "eta=0 tis (end)") if n in mine]
        if not eta2 or not zeros:
            continue
        s = eta2["summary"]
        bound = BATCH_PROMPTS * GROUP * (os.cpu_count() or 1) / (s["gen_s"] + s["train_s"])
        trls = [r["summary"]["samples_per_s"] for r in mine.values() if r["kind"] == "trl"]
        out.append((bound, bound / statistics.mean(zeros), bound / max(trls) if trls else None))
    return out


def write(results: list[dict], args, load0, have_trl: bool, seed0: int, m: dict) -> None:
    """The JSON and the PNG so far (after every workload: a long run leaves its first half)."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "cores": os.cpu_count(), "loadavg_start": load0,
            "loadavg_end": os.getloadavg(), "learner_threads": args.learner_threads,
            "rollout_threads": args.rollout_threads, "trl_threads": args.trl_threads,
            "trl_attn": args.trl_attn,
            "trl": have_trl, "seed": seed0, "repeats": args.repeats, "skip": args.skip,
            "time": time.time(), "machine": m}
    out.write_text(json.dumps({"meta": meta, "table": fmt_table(medians(results)),
                               "targets": targets(results), "results": results}, indent=1))
    if not results:
        print(f"[bench] wrote {out} (no run finished: no PNG)", flush=True)
        return
    try:
        plot([r for r in results if r.get("round", 0) == 0], out.with_suffix(".png"))
        print(f"[bench] wrote {out} and {out.with_suffix('.png')}", flush=True)
    except ImportError:
        print(f"[bench] wrote {out} (no matplotlib: no PNG)", flush=True)


if __name__ == "__main__":
    main()
