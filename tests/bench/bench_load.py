"""R4 soak: 8 protocol-level clients (no model) push results at a real learner for 60 s.

    python tests/bench/bench_load.py [--clients 8] [--duration 60] [--out bench_results/bench_load.json]

Prints the figures (results/s, samples/s, steps, drops, duplicates, RSS after warm-up and its
growth) and the RSS curve, writes them as JSON, and applies the same checks as the CI test
(tests/integration/load_kit.py). The baseline: a raw PUSH/PULL of the same RolloutResult bytes
in this process, to say how far the learner's ingress is from the wire's limit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_machine import machine, machine_line  # noqa: E402
from load_client import group  # noqa: E402
from load_kit import check, run_load  # noqa: E402


def raw_push_pull(messages: int = 20_000) -> float:
    """Messages/s of a raw PUSH/PULL of one client's RolloutResult bytes over tcp loopback."""
    import numpy as np
    import zmq

    import protocol

    a = protocol.Assignment(assignment_id="a1", prompt_id="p", prompt_token_ids=np.arange(1, 9, dtype=np.int32),
                            group_size=4, version=0)
    frames = protocol.encode(protocol.RolloutResult(server_id="s", samples=group(a, 0)))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")

    def send():
        for _ in range(messages):
            push.send_multipart(frames)
    t = threading.Thread(target=send)
    start = time.perf_counter()
    t.start()
    for _ in range(messages):
        protocol.decode(pull.recv_multipart())
    elapsed = time.perf_counter() - start
    t.join()
    push.close(0)
    pull.close(0)
    ctx.term()
    return messages / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--out", default="bench_results/bench_load.json")
    args = p.parse_args()
    from learner.models.builtin import ensure_builtin_model

    model = str(ensure_builtin_model("builtin:tiny-arith", log=lambda m: None))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        procs: list[subprocess.Popen] = []

        def popen(cmd, **kw):
            procs.append(subprocess.Popen(cmd, **kw))
            return procs[-1]
        try:
            f = run_load(Path(tmp), model, env, popen, clients=args.clients, duration_s=args.duration)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
    f["raw_push_pull_msgs_per_s"] = round(raw_push_pull(), 1)
    f["machine"] = machine()
    print(machine_line(f["machine"]))
    width = max(len(k) for k in f)
    for k, v in f.items():
        if k not in ("rss_curve_mb", "counters", "machine"):
            print(f"{k:<{width}}  {v}")
    print("rss curve (s, MiB):", " ".join(f"{t:g}:{r}" for t, r in f["rss_curve_mb"][::4]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(f, indent=1))
    check(f)
    print(f"checks passed; wrote {out}")


if __name__ == "__main__":
    main()
