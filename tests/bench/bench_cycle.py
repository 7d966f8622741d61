"""Where an η = 0 cycle goes, part by part, across both processes (CPU; a script, not a test).

    python tests/bench/bench_cycle.py [--workload demo] [--steps 150] [--skip 20] [--repeats 2]
        [--out bench_results/bench_cycle.json]

At η = 0 a cycle is serial: the learner steps, publishes, the server fetches and applies the new
weights, gets its work, generates, scores and sends, and the learner takes the batch. Each run is
bench_async.py's ``slipstream run`` of the workload at η = 0 with ``SLIPSTREAM_TRACE`` set, so the
learner and the server append their trace points (``protocol.plumbing.process.trace``) to one file. For
every cycle from one ``learner.step_end`` to the next (after ``--skip`` warm-up steps) each
point's time is its last occurrence in the cycle, taken from the cycle's start; the table shows
the medians per run of that time ("at") and of the part before it ("+"). Parts that run side by
side (the checksums in a thread beside the step's row) can show a negative "+". "Neither
computes" is the cycle less the step and the generation.

Measured (2-core machine, 2026-12-03, the demo, two runs of 150 steps): see the README's
"Where η = 0's cycle goes".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_async import REPO, WORKLOADS, slipstream_run  # noqa: E402
from bench_machine import machine, machine_line  # noqa: E402

from protocol.plumbing.process import TRACE_ENV  # noqa: E402

POINTS = [
    # (point, the part that ends there)
    ("learner.step_end", "(cycle start: the step returned)"),
    ("learner.published", "snapshot of the weights (the loop's publish wait)"),
    ("learner.dispatched", "step row, metrics, dispatch (none: the lag rule)"),
    ("learner.prepared", "checksums (a thread, beside the row)"),
    ("learner.announced", "install, WeightsAvailable sent"),
    ("rollout.manifest", "the manifest reaches the server"),
    ("rollout.fetch", "the fetch starts"),
    ("learner.chunk", "fetch socket opened, chunk asked for"),
    ("rollout.fetched", "chunks sent, received, checked"),
    ("rollout.applied", "copied into the engine"),
    ("rollout.assignment", "WeightsApplied -> assignments (last one)"),
    ("rollout.generate", "batch window, weights checked"),
    ("rollout.generated", "generation"),
    ("rollout.scored", "decode and score"),
    ("rollout.sent", "results sent"),
    ("learner.result", "results received (the last one's intake starts)"),
    ("learner.batch", "intake done, the batch taken"),
    ("learner.step_end", "the step (with its hand-off to the train thread)"),
]
STEP, GENERATION = len(POINTS) - 1, [p for p, _ in POINTS].index("rollout.generated")
"""Indices in POINTS of the ends of the parts that compute: the step and the generation."""


def read_trace(path: Path) -> list[tuple[float, str]]:
    """``(unix time, point)`` per line of a trace file, in time order (a torn line is skipped)."""
    events = []
    for line in path.read_text(encoding="ascii", errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 3:
            try:
                events.append((float(parts[0]), parts[2]))
            except ValueError:
                continue
    events.sort()
    return events


def cycles(events: list[tuple[float, str]], skip: int) -> list[list[float | None]]:
    """Per cycle (after ``skip`` of them) the time from its start to each point of POINTS (the
    point's last occurrence in the cycle; None if absent), the last entry being the cycle."""
    ends = [i for i, (_, p) in enumerate(events) if p == POINTS[0][0]]
    out = []
    for a, b in zip(ends[skip:], ends[skip + 1:]):
        start, last = events[a][0], {}
        for t, p in events[a + 1:b]:
            last[p] = t - start
        last_end = events[b][0] - start
        out.append([0.0] + [last.get(p) for p, _ in POINTS[1:-1]] + [last_end])
    return out


def summarize(cyc: list[list[float | None]]) -> dict:
    """Medians (ms) of each point's time ("at") and of the part before it ("plus"), the cycle,
    and the time in which neither process computes (cycle - step - generation)."""
    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) * 1e3 if xs else None

    at = [med([c[i] for c in cyc]) for i in range(len(POINTS))]
    plus = [None] + [med([c[i] - c[i - 1] if c[i] is not None and c[i - 1] is not None else None
                          for c in cyc]) for i in range(1, len(POINTS))]
    idle = med([c[-1] - (c[STEP] - c[STEP - 1]) - (c[GENERATION] - c[GENERATION - 1])
                for c in cyc if None not in (c[STEP - 1], c[GENERATION], c[GENERATION - 1])])
    return {"cycles": len(cyc), "cycle_ms": at[-1], "idle_ms": idle, "at_ms": at, "plus_ms": plus}


def fmt(runs: list[dict]) -> str:
    def num(x):
        return "      -" if x is None else f"{x:7.2f}"

    head = "".join(f"  run {k + 1} at      +" for k in range(len(runs)))
    lines = [f"{'point':<20} {'the part before it':<52}{head}", "-" * (73 + 17 * len(runs))]
    for i, (point, what) in enumerate(POINTS):
        cells = "".join(f"  {num(r['at_ms'][i])} {num(r['plus_ms'][i])}" for r in runs)
        lines.append(f"{point:<20} {what:<52}{cells}")
    lines.append(f"{'cycle (ms)':<73}" + "".join(f"  {num(r['cycle_ms'])}        " for r in runs))
    lines.append(f"{'neither computes (ms)':<73}" + "".join(f"  {num(r['idle_ms'])}        "
                                                              for r in runs))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="demo", choices=sorted(WORKLOADS))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--skip", type=int, default=20, help="warm-up cycles left out")
    p.add_argument("--repeats", type=int, default=2, help="runs (seeds 1, 2, ...)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--run-timeout-s", type=float, default=600)
    p.add_argument("--out", default=str(REPO / "bench_results" / "bench_cycle.json"))
    args = p.parse_args()
    if args.steps < args.skip + 2:
        p.error("--steps must exceed --skip by at least 2")
    # The fields slipstream_run reads besides those: the launcher's own thread split and device.
    run_args = argparse.Namespace(device="auto", body=None, learner_threads=0, rollout_threads=0,
                                  set=[], run_timeout_s=args.run_timeout_s)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_cycle-") as tmp:
        for k in range(args.repeats):
            trace = Path(tmp) / f"trace-{k}.txt"
            os.environ[TRACE_ENV] = str(trace)
            run_args.seed = args.seed + k
            try:
                slipstream_run(args.workload, 0, "tis", args.steps, Path(tmp) / f"run-{k}", run_args)
            finally:
                os.environ.pop(TRACE_ENV, None)
            runs.append({"seed": run_args.seed, **summarize(cycles(read_trace(trace), args.skip))})
            print(f"[bench] run {k + 1}/{args.repeats}: cycle {runs[-1]['cycle_ms']:.1f} ms "
                  f"({runs[-1]['cycles']} cycles)", flush=True)
    m = machine()
    print()
    print(machine_line(m))
    print(fmt(runs))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": {"command": " ".join(sys.argv), "cores": os.cpu_count(),
                                        "platform": platform.platform(), "workload": args.workload,
                                        "points": [p for p, _ in POINTS], "machine": m},
                               "runs": runs}, indent=1))
    print(f"[bench] wrote {out}")


if __name__ == "__main__":
    main()
