"""Multi-turn episodes learn (issue 26 item 8): the built-in multi-turn presets on the demo model.

    python tests/bench/bench_episodes.py [--preset guess|calc] [--seeds 3] [--steps 600]
        [--etas 0,2] [--out bench_results/bench_episodes.json]

Every run is ``slipstream run --config deploy/configs/<preset>.yaml`` with ``--set`` for the
seed, the steps and ``learner.staleness.max_staleness`` η, its run directory in a temporary
folder. ``guess`` (builtin:guess): a digit in three turns, told "up" / "down". ``calc``
(builtin:calc, model builtin:tiny-calc): two-digit products with a calculator tool; the tool-use
rate (calls per episode) is reported too. Runs are
interleaved seed by seed (seed s: every η once, then s + 1), so a seed's runs share their prompts
and the machine's state.

Reported per η (the mean over seeds, each seed's value beside it):

- **reward**: the mean reward of the steps' batches in the first and the last quarter of the run
  (the episode's reward: 1 when found, -0.1 per missed guess), and its rise;
- **turns**: the mean turns per episode in the first and last quarter (fewer: found sooner);
- **solved**: the fraction of episodes that found the digit, first and last quarter (a step's
  episodes solve iff reward > -0.25: an unsolved episode of three turns has -0.3);
- **samples/s**: trained samples over the run's wall time from its first step to its last
  (start-up excluded), and η = 2's rate over η = 0's on the same seed.

TRL 1.16's GRPOTrainer has ``environment_factory`` (multi-turn tool calling through the model's
chat template and its tool-call format, transformers >= 5.2); the demo model has neither a chat
template nor a tool format, so there is no TRL baseline on this task.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_machine import machine, machine_line  # noqa: E402


def one_run(preset: str, seed: int, eta: int, steps: int, run_dir: Path, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "deploy.cli", "run", "--config", str(REPO / f"deploy/configs/{preset}.yaml"),
           "--set", f"learner.run_dir={run_dir}", "--set", f"learner.seed={seed}",
           "--set", f"rollout.seed={seed}", "--set", f"learner.total_steps={steps}",
           "--set", f"learner.staleness.max_staleness={eta}", "--set", "learner.checkpoint.save_every=0",
           "--set", "learner.network.rollout_port=0", "--set", "learner.network.weights_port=0",
           "--set", "learner.network.control_port=0", "--set", "learner.network.metrics_port=0",
           "--set", "rollout.network.metrics_port=0"]
    start = time.monotonic()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed} eta {eta}: exit {proc.returncode}, see {run_dir.parent / run_dir.name}.log")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"seed": seed, "eta": eta, "wall_s": time.monotonic() - start, "rows": [
        {k: r.get(k) for k in ("step", "time", "reward_mean", "episode_turns_mean", "samples",
                               "staleness_mean", "tool_calls_mean")} for r in rows]}


def quarter(rows: list[dict], key: str, last: bool) -> float:
    q = max(1, len(rows) // 4)
    part = rows[-q:] if last else rows[:q]
    return statistics.fmean(r[key] for r in part)


def summarize(run: dict) -> dict:
    rows = run["rows"]
    span = rows[-1]["time"] - rows[0]["time"]
    samples = sum(r["samples"] for r in rows[1:])
    return {"reward_first": quarter(rows, "reward_mean", False), "reward_last": quarter(rows, "reward_mean", True),
            "turns_first": quarter(rows, "episode_turns_mean", False),
            "turns_last": quarter(rows, "episode_turns_mean", True),
            "tools_first": quarter(rows, "tool_calls_mean", False),
            "tools_last": quarter(rows, "tool_calls_mean", True),
            "samples_per_s": samples / span if span > 0 else float("nan"),
            "staleness": statistics.fmean(r["staleness_mean"] for r in rows)}


def table(runs: list[dict]) -> str:
    lines = ["| η | seeds | mean lag | reward first ¼ | reward last ¼ | rise | turns first ¼ | turns last ¼ "
             "| tool calls first ¼ | last ¼ | samples/s | × first η |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_eta: dict[int, list[dict]] = {}
    for r in runs:
        by_eta.setdefault(r["eta"], []).append(r)
    base = {r["seed"]: summarize(r)["samples_per_s"] for r in by_eta.get(min(by_eta), [])}
    for eta, rs in sorted(by_eta.items()):
        s = [summarize(r) for r in rs]
        ratio = [x["samples_per_s"] / base[r["seed"]] for x, r in zip(s, rs) if r["seed"] in base]

        def m(key: str, s: list[dict] = s) -> str:
            vals = [x[key] for x in s]
            return f"{statistics.fmean(vals):+.3f} ({', '.join(f'{v:+.2f}' for v in vals)})"
        rise = [x["reward_last"] - x["reward_first"] for x in s]
        lines.append(f"| {eta} | {len(rs)} | {statistics.fmean(x['staleness'] for x in s):.2f} | {m('reward_first')} | "
                     f"{m('reward_last')} | {statistics.fmean(rise):+.3f} ({', '.join(f'{v:+.2f}' for v in rise)}) | "
                     f"{statistics.fmean(x['turns_first'] for x in s):.2f} | "
                     f"{statistics.fmean(x['turns_last'] for x in s):.2f} | "
                     f"{statistics.fmean(x['tools_first'] for x in s):.2f} | "
                     f"{statistics.fmean(x['tools_last'] for x in s):.2f} | "
                     f"{statistics.fmean(x['samples_per_s'] for x in s):.0f} | "
                     f"{(statistics.median(ratio) if ratio else float('nan')):.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=["guess", "calc"], default="guess")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed0", type=int, default=1)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--etas", default="0,2")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--out", default="bench_results/bench_episodes.json")
    args = ap.parse_args()
    etas = [int(x) for x in args.etas.split(",")]
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-episodes-") as tmp:
        for seed in range(args.seed0, args.seed0 + args.seeds):
            for eta in etas:
                run = one_run(args.preset, seed, eta, args.steps, Path(tmp) / f"s{seed}-eta{eta}", args.timeout_s)
                runs.append(run)
                print(f"seed {seed} eta {eta}: {json.dumps(summarize(run))}", flush=True)
    m = machine()                          # this process's threads; the runs' split is slipstream run's
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "machine": m, "runs": runs}))
    print(machine_line(m))
    print(table(runs))


if __name__ == "__main__":
    main()
