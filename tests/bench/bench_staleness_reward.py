"""Reward at equal trained samples under staleness (issues 12, 27): what η > 0 keeps of η = 0's gain.

    python tests/bench/bench_staleness_reward.py [--seeds 4] [--samples 12800] [--etas 0,4]
        [--modes tis,tis/proximal,none] [--eval-prompts 512] [--eval-every 25]
        [--out bench_results/bench_staleness_reward.json]
    python tests/bench/bench_staleness_reward.py --etas 0,4,8,16 --modes tis,geo_mis,m2po,icepop

A mode is an ``is_mode`` (none, tis, geo_mis, icepop, ...) or a named correction of
:data:`CORRECTIONS` (``m2po``: tis weights with M2PO's second-moment mask at the paper's 0.04),
optionally ``/anchor`` (the ``clip_anchor``).

How stale the data is: on the demo the server generates a batch (64 four-token completions) in a
fraction of a training step, so generation runs ahead to the staleness gate's limit and a batch is
trained about η versions after it was sampled; nothing has to be throttled. Measured, not assumed:
the ``staleness`` column is the mean over the run's steps of the batch's mean per-sample lag
(learner version − the oldest token version of the sample; a sample's tokens share one version
here), the first η steps' ramp included (a run always at the limit: 3.9 at η = 4, 7.7 at 8, 15.3
at 16 over 200 steps; measured 3.5, 6.5–7.2 and 13.3–14.4: at η ≥ 8 the server falls behind the
limit now and then).

Every run is the demo (``slipstream run``, the same overrides as tests/bench/bench_async.py: model,
task, batch 8 × 8, learning rate, temperature, seeds, threads as ``slipstream run`` splits them)
for ``--samples`` trained samples (12,800 = the demo's 200 steps), at ``max_staleness`` η and
``is_mode`` m (``m/anchor`` also sets ``clip_anchor``; the demo's is ``behavior``). Runs are interleaved seed by seed (seed s: every (η, m) once, then seed s + 1), so
a seed's runs share their prompts, their first samples and the machine's state.

What "the reward gain" is, measured two ways per run:

- **policy** (the figure the target is judged on): the learner's own held-out evaluation
  (learner.data.evaluation) every ``--eval-every`` versions from version 0, ``--eval-prompts``
  prompts of the task, the same ones in every run of a seed, one completion each at the
  training temperature (1.0): the mean reward of the policy's samples, i.e. what GRPO
  maximizes, measured on the policy itself. The gain is the mean of the rounds in the last
  quarter of the run (versions >= 3/4 of the steps, the last one included) minus version 0's:
  what the trained samples bought, whatever their staleness. One round alone is not enough: at
  the demo's learning rate the policy's reward swings by ±0.1 from one version to the next (a
  run whose trained samples gained +0.17 had its last version at +0.00), so the gain of a
  single last round is mostly that swing.
- **trained samples** (what bench_async.py prints, for reference): the mean reward of the last
  quarter of the steps' batches minus the first quarter's. At η > 0 a batch's samples come from
  policies up to η versions older than the one trained, so this curve lags the policy by about
  η steps: at equal trained samples it understates an η = 4 run's gain by the reward the last η
  steps bought, however well the staleness is corrected.

Reported per (η, m): the mean gain over seeds with its standard error, and the retention
(mean gain / η = 0 tis's mean gain; the targets, for the best correction at each η, are in
:data:`TARGETS`), with the per-seed
ratios beside it. Writes the JSON (every run's eval rounds and step rewards) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_async  # noqa: E402  (the same run recipe: one definition of the demo's overrides)
from bench_machine import machine, machine_line  # noqa: E402

TARGETS = {4: 0.95, 8: 0.95, 16: 0.90}
"""The retention the best correction should reach at each η (issue 27: ≥ 95 % at η = 8, ≥ 90 % at 16)."""

CORRECTIONS = {
    "m2po": {"learner.algorithm.is_mode": "tis", "learner.algorithm.m2po_threshold": 0.04},
}
"""Named corrections: their overrides. Any other mode name is an ``is_mode``."""


def run_one(eta: int, mode: str, seed: int, steps: int, run_dir: Path, args) -> dict:
    """One demo run with evaluation rounds every ``args.eval_every`` versions from version 0."""
    args.seed = seed
    mode, _, anchor = mode.partition("/")
    named = CORRECTIONS.get(mode, {})
    is_mode = named.get("learner.algorithm.is_mode", mode)
    every = args.eval_every or max(1, steps // 8)
    args.set = [*(f"{k}={v}" for k, v in named.items() if k != "learner.algorithm.is_mode"),
                f"learner.evaluation.data={bench_async.WORKLOADS['demo']['dataset']}",
                f"learner.evaluation.every={every}", f"learner.evaluation.prompts={args.eval_prompts}",
                f"learner.evaluation.temperature={bench_async.TEMPERATURE}",
                *([f"learner.algorithm.clip_anchor={anchor}"] if anchor else []), *args.extra_set]
    bench_async.slipstream_run("demo", eta, is_mode, steps, run_dir, args)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = sorted((r for r in rows if r.get("kind") == "eval"), key=lambda r: r["eval_version"])
    steps_rows = [r for r in rows if r.get("kind", "step") == "step" and "step_s" in r]
    late = [r["eval_reward_mean"] for r in evals if r["eval_version"] >= 0.75 * steps]
    if not evals or evals[0]["eval_version"] != 0 or not late:
        raise RuntimeError(f"eta={eta} {mode} seed {seed}: eval rounds at versions "
                           f"{[r['eval_version'] for r in evals]}: none at 0 or none in the last quarter "
                           f"of {steps} steps; see {run_dir}.log")
    first = evals[0]["eval_reward_mean"]
    rewards = [r["reward_mean"] for r in steps_rows]
    q = max(1, len(rewards) // 4)
    return {
        "eta": eta, "is_mode": f"{mode}/{anchor}" if anchor else mode, "seed": seed, "steps": steps,
        "eval_first": first, "eval_last": statistics.mean(late), "eval_late_rounds": len(late),
        "policy_gain": statistics.mean(late) - first,
        "evals": [{k: r.get(k) for k in ("eval_version", "eval_reward_mean", "eval_accuracy", "eval_samples")}
                  for r in evals],
        "trained_gain": sum(rewards[-q:]) / q - sum(rewards[:q]) / q,
        "staleness_mean": statistics.mean(r.get("staleness_mean", 0.0) for r in steps_rows),
        "is_truncated_fraction": statistics.mean(r.get("is_truncated_fraction", 0.0) for r in steps_rows),
        "rewards": rewards,
    }


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = statistics.mean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def table(runs: list[dict]) -> str:
    """The table: per (η, mode) the mean gains over seeds with their standard errors, the retention
    (mean gain / η = 0 tis's mean gain over the same seeds, with its standard error; n/a when that
    is not positive) and each seed's ratio to its own η = 0 run; then per η > 0 the best correction against its target (:data:`TARGETS`)."""
    configs = sorted({(r["eta"], r["is_mode"]) for r in runs})
    base = [r for r in runs if r["eta"] == 0 and r["is_mode"] == "tis"]
    by_seed = {r["seed"]: r for r in base}
    ratio = lambda x, y: x / y if y > 0 else float("nan")  # noqa: E731
    lines = [f"{'run':<19} {'seeds':>5} {'staleness':>9} {'policy gain':>16} {'retention':>16} "
             f"{'per seed':<28} {'trained-sample gain':>20} {'retention':>9}", "-" * 130]
    best: dict[int, tuple[float, str]] = {}
    for eta, mode in configs:
        rs = [r for r in runs if r["eta"] == eta and r["is_mode"] == mode]
        pg, pse = mean_se([r["policy_gain"] for r in rs])
        tg, tse = mean_se([r["trained_gain"] for r in rs])
        lag = statistics.mean(r["staleness_mean"] for r in rs)
        # Against η = 0 on the same seeds (a seed's runs share their prompts and first samples).
        paired = [by_seed[r["seed"]] for r in rs if r["seed"] in by_seed]
        b, bse = mean_se([r["policy_gain"] for r in paired]) if paired else (float("nan"), float("nan"))
        bt = statistics.mean(r["trained_gain"] for r in paired) if paired else float("nan")
        keep, keep_t = ratio(pg, b), ratio(tg, bt)
        # The retention's standard error from the two means' (first order; 0 for the base itself).
        keep_se = (0.0 if (eta, mode) == (0, "tis") else
                   abs(keep) * math.sqrt((pse / pg) ** 2 + (bse / b) ** 2) if pg and b > 0 else float("nan"))
        per_seed = " ".join(f"{ratio(r['policy_gain'], by_seed[r['seed']]['policy_gain']):.2f}"
                            for r in rs if r["seed"] in by_seed)
        lines.append(f"eta={eta:<3} {mode:<13} {len(rs):>5} {lag:>9.2f} {pg:+8.3f} ± {pse:.3f} {keep:>9.2f} ± {keep_se:.2f} "
                     f"{per_seed:<28} {tg:+12.3f} ± {tse:.3f} {keep_t:>9.2f}")
        if eta > 0 and (eta not in best or keep > best[eta][0]):
            best[eta] = (keep, keep_se, mode)
    verdicts = []
    for eta, (keep, keep_se, mode) in sorted(best.items()):
        target = TARGETS.get(eta)
        verdict = "" if target is None else (f" (target >= {target}): " + ("met" if keep >= target else "NOT met"))
        verdicts.append(f"eta={eta}: the best correction, {mode}, keeps {keep:.2f} ± {keep_se:.2f} of eta=0's "
                        f"policy gain{verdict}")
    return "\n".join(lines + [""] + verdicts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--seed", type=int, default=1, help="the first seed")
    p.add_argument("--samples", type=int, default=12800, help="trained samples per run (÷ 64 = steps)")
    p.add_argument("--etas", default="0,4")
    p.add_argument("--modes", default="tis,tis/proximal,none",
                   help="is_mode of the runs at η > 0, optionally /clip_anchor (else the demo config's); "
                        "η = 0 runs tis")
    p.add_argument("--eval-prompts", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=0, help="versions between eval rounds (0: steps / 8)")
    p.add_argument("--learner-threads", type=int, default=0)
    p.add_argument("--rollout-threads", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the learner and the HF engine run (auto: cuda when there is one)")
    p.add_argument("--body", default=None, choices=sorted(bench_async.BODIES),
                   help="a random-weights model of this size with the demo's tokenizer")
    p.add_argument("--set", dest="extra_set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra slipstream --set for every run")
    p.add_argument("--run-timeout-s", type=float, default=1800)
    p.add_argument("--out", default=str(HERE.parents[1] / "bench_results" / "bench_staleness_reward.json"))
    p.add_argument("--table", nargs="+", metavar="JSON", default=None,
                   help="run nothing: print the table of the runs in these JSON files together")
    args = p.parse_args()
    if args.table:
        runs = [r for f in args.table for r in json.loads(Path(f).read_text())["runs"]]
        print(table(runs))
        return
    steps = args.samples // (bench_async.BATCH_PROMPTS * bench_async.GROUP)
    plan = [(eta, mode) for eta in map(int, args.etas.split(","))
            for mode in (["tis"] if eta == 0 else args.modes.split(","))]
    tmp = Path(tempfile.mkdtemp(prefix="bench_reward-"))
    print(f"[bench] {len(plan)} configurations x {args.seeds} seeds, {steps} steps each; runs in {tmp}",
          flush=True)
    load0 = os.getloadavg()
    m = machine()                          # this process's threads; the runs' split is slipstream run's
    runs: list[dict] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for seed in range(args.seed, args.seed + args.seeds):
        for eta, mode in plan:
            print(f"[bench] seed {seed}: eta={eta} {mode} (load {os.getloadavg()[0]:.1f})", flush=True)
            r = run_one(eta, mode, seed, steps, tmp / f"s{seed}-eta{eta}-{mode.replace('/', '-')}", args)
            rounds = " ".join(f"{e['eval_reward_mean']:.2f}" for e in r["evals"])
            print(f"[bench]   policy reward {r['eval_first']:.3f} -> {r['eval_last']:.3f} "
                  f"(rounds {rounds}) "
                  f"({r['policy_gain']:+.3f}); trained samples {r['trained_gain']:+.3f}", flush=True)
            runs.append(r)
            out.write_text(json.dumps({"command": " ".join(sys.argv), "cores": os.cpu_count(), "machine": m,
                                       "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                                       "steps": steps, "eval_prompts": args.eval_prompts,
                                       "runs": runs}, indent=1))
    print()
    print(machine_line(m))
    print(table(runs))
    print(f"[bench] wrote {out}; load average {load0[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
