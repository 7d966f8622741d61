"""R1 at length: `slipstream run` with 3 rollout servers, a serving one SIGKILLed 10 times (default),
each time restarted by the launcher and waited for until it has joined the learner again. A
script, not a test (CI runs 3 kills: tests/integration/test_chaos.py).

    python tests/bench/bench_chaos.py [--kills 10] [--steps 2500] [--seed 0] [--out bench_results/bench_chaos.json]

Then (R7) rewards of 1e300 until ``--nan-skips`` steps were skipped. Checks everything the CI test checks (tests/integration/chaos_kit.py: the step count reached, no
sample id trained twice, the buffer's identities) and reports: kills, restarts, rejoins, the
longest time from a kill to the killed server's rejoin, the learner's longest stall (overall and
across a kill), the median step gap, and the buffer's counters. The tiny model is built in a
temporary directory (random weights: the figures are about delivery, not learning).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO))

from bench_machine import machine, machine_line  # noqa: E402
from chaos_kit import ChaosRun, chaos, chaos_env, check_run, config, nan_window  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--steps", type=int, default=2500, help="the run's total_steps (must outlast the kills)")
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nan-skips", type=int, default=3, help="R7: skipped steps to provoke after the kills")
    ap.add_argument("--out", default="bench_results/bench_chaos.json")
    args = ap.parse_args()

    from learner.models.builtin import build_model, build_tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    model = work / "model"
    tok = build_tokenizer()
    build_model(tok).save_pretrained(model)
    tok.save_pretrained(model)
    env = chaos_env(dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO)), work)
    cfg = config(work / "run", str(model), total_steps=args.steps, servers=args.servers, seed=args.seed,
                 spiky_reward=True)
    start = time.monotonic()
    run = ChaosRun(cfg, work, env)
    try:
        chaos(run, kills=args.kills, servers=args.servers, seed=args.seed, steps_between=5,
              rejoin=True)
        if args.nan_skips:
            nan_window(run, skips=args.nan_skips)
        code = run.finish(3600)
        assert code == 0, "".join(run.lines[-60:])
        figures = check_run(run, args.steps, batch_samples=4)
    finally:
        run.stop()
    figures.update(exit_code=code, seconds=round(time.monotonic() - start, 1), seed=args.seed,
                   servers=args.servers, python=platform.python_version(), cpus=os.cpu_count(),
                   run_dir=str(work / "run"), machine=machine())
    print(machine_line(figures["machine"]))
    print(json.dumps(figures, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
