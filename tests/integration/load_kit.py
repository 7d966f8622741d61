"""R4 load: a real `slipstream learner` (tiny model) and N protocol-level clients in another process
(tests/integration/load_client.py) pushing results as fast as the learner grants work. Shared by
the CI test (test_load.py, a few seconds) and tests/bench/bench_load.py (60 s, with the figures).

What is checked (:func:`run_load`), from the learner's metrics, control status and run directory:

- nothing lost: every sample a client sent reached the learner (slipstream_rollouts_received)
  and got a final status; the buffer's identities hold (issued == accepted + stale − stale_late
  + abandoned + failed − failed_reported + cancelled + in flight; accepted == consumed + pending
  + dropped_stale + dropped_incomplete);
- no duplicates: no sample id trained twice (trained_ids.jsonl), none acked ``duplicate``;
- backpressure through credits, not drops: no send dropped for a full queue
  (slipstream_send_dropped_total{reason="full"}; "unreachable" ones are the clients closing at
  the end, whose leases are re-issued), slipstream_credits_refused_total 0, no protocol error;
- memory: the learner's RSS after warm-up (the first quarter) grows by less than 10 %.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: config_kit
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: protocol
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402
from config_kit import nested  # noqa: E402

import protocol  # noqa: E402

HERE = Path(__file__).resolve().parent


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
    return out


def total(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def run_load(workdir: Path, model_dir: str, env: dict, popen, *, clients: int = 8,
             duration_s: float = 60.0, sample_every_s: float = 0.5) -> dict:
    run_dir = workdir / "run"
    cfg = {"model": model_dir,
           "learner": nested({"rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
                       "total_steps": 10_000_000, "batch_prompts": 4, "group_size": 4,
                       "max_new_tokens": 4, "max_staleness": 2, "run_dir": str(run_dir),
                       "save_every": 0, "threads": 1, "lease_timeout_s": 600,
                       "server_timeout_s": 600, "exit_on_finish": False})}
    cfg_file = workdir / "load.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    learner = popen([sys.executable, "-m", "deploy.cli", "learner", "--config", str(cfg_file)],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir)
    ready = None
    for line in learner.stdout:
        if line.startswith("{") and '"event": "ready"' in line:
            ready = json.loads(line)
            break
    assert ready is not None, "the learner did not get ready"
    import threading

    tail: list[str] = []
    threading.Thread(target=lambda: [tail.append(x) for x in learner.stdout], daemon=True).start()
    out = workdir / "clients.json"
    client = popen([sys.executable, str(HERE / "load_client.py"), ready["rollout"], str(clients),
                    str(duration_s), str(out)], env=env, cwd=workdir)
    curve: list[tuple[float, int]] = []
    start = time.monotonic()
    while client.poll() is None:
        curve.append((round(time.monotonic() - start, 2), rss_bytes(learner.pid)))
        time.sleep(sample_every_s)
    assert client.returncode == 0, "the load clients failed"
    sent = json.loads(out.read_text())
    results = sum(c["results"] for c in sent["clients"].values())
    samples = sum(c["samples"] for c in sent["clients"].values())
    deadline = time.monotonic() + 30
    while True:                                  # every sent result has reached the learner
        m = scrape(ready["metrics"])
        if total(m, "slipstream_rollouts_received_total") >= samples or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    status = control_status(ready["control"])
    learner.send_signal(signal.SIGTERM)
    learner.wait(timeout=60)
    c = status["counters"]
    trained = [json.loads(x) for x in (run_dir / "trained_ids.jsonl").read_text().splitlines()]
    ids = [sid for t in trained for sid in t["sample_ids"]]
    warm = [rss for t, rss in curve if t >= duration_s / 4]
    figures = {
        "clients": clients, "duration_s": round(sent["elapsed_s"], 2),
        "results_sent": results, "samples_sent": samples,
        "results_per_s": round(results / sent["elapsed_s"], 1),
        "samples_per_s": round(samples / sent["elapsed_s"], 1),
        "steps": len(trained), "samples_trained": len(ids),
        "received": total(m, "slipstream_rollouts_received_total"),
        # A peer's queue full (backpressure failed) vs. gone (the clients closing at the end).
        "send_dropped_full": sum(v for k, v in m.items()
                                 if k.startswith("slipstream_send_dropped_total{") and 'reason="full"' in k),
        "send_dropped_unreachable": sum(v for k, v in m.items() if k.startswith(
            "slipstream_send_dropped_total{") and 'reason="unreachable"' in k),
        "credits_refused": total(m, "slipstream_credits_refused_total"),
        "protocol_errors": total(m, "slipstream_protocol_errors_total"),
        "duplicates_acked": sum(cl["ack_statuses"].get("duplicate", 0) for cl in sent["clients"].values()),
        "trained_twice": sum(1 for n in Counter(ids).values() if n > 1),
        "rss_warm_mb": round(warm[0] / 2**20, 1) if warm else None,
        "rss_end_mb": round(curve[-1][1] / 2**20, 1) if curve else None,
        "rss_growth": round(max(warm) / warm[0] - 1, 4) if warm else None,
        "rss_curve_mb": [(t, round(r / 2**20, 1)) for t, r in curve],
        "counters": c, "inflight": status["inflight_samples"], "pending": status["buffered_samples"],
    }
    return figures


def control_status(endpoint: str) -> dict:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(protocol.encode(protocol.ControlRequest(command="status")))
        assert sock.poll(10_000), "no control reply"
        reply = protocol.decode(sock.recv_multipart())
        assert reply.ok, reply.error
        return reply.result
    finally:
        sock.close(0)


def check(f: dict) -> None:
    """The assertions of the module docstring on :func:`run_load`'s figures."""
    c = f["counters"]
    assert f["received"] == f["samples_sent"], f                       # nothing lost on the wire
    assert c["issued"] == (c["accepted"] + c["stale"] - c["stale_late"] + c["abandoned"] + c["failed"]
                           - c["failed_reported"] + c["cancelled"] + f["inflight"]), c
    assert c["accepted"] == (c["consumed"] + f["pending"] + c["dropped_stale"]
                             + c["dropped_incomplete"]), c
    assert f["trained_twice"] == 0 and f["duplicates_acked"] == 0 and c["duplicate"] == 0, f
    assert f["send_dropped_full"] == 0 and f["credits_refused"] == 0 and f["protocol_errors"] == 0, f
    assert f["steps"] > 0 and f["samples_trained"] == f["steps"] * 16
    assert f["rss_growth"] is not None and f["rss_growth"] < 0.10, f["rss_curve_mb"]


def event_line(name: str, **want):
    """A matcher for conftest's ``Watched.wait_for``: the event ``name`` (a JSON line) whose fields
    include ``want``, parsed; None for any other line."""
    def match(line: str):
        try:
            ev = json.loads(line)
        except ValueError:
            return None
        ok = isinstance(ev, dict) and ev.get("event") == name
        return ev if ok and all(ev.get(k) == v for k, v in want.items()) else None
    return match


def start_learner(workdir: Path, model_dir: str, env: dict, popen, **learner) -> tuple:
    cfg = {"model": model_dir, "learner": nested({
        "rollout_port": 0, "weights_port": 0, "control_port": 0, "metrics_port": 0,
        "total_steps": 10_000, "batch_prompts": 2, "group_size": 4, "max_new_tokens": 4,
        "max_staleness": 1, "run_dir": str(workdir / "run"), "save_every": 0, "threads": 1,
        "lease_timeout_s": 600, "server_timeout_s": 600, "exit_on_finish": False, **learner})}
    (workdir / "learner.yaml").write_text(yaml.safe_dump(cfg))
    proc = popen([sys.executable, "-m", "deploy.cli", "learner", "--config", str(workdir / "learner.yaml")],
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=workdir)
    for line in proc.stdout:
        if line.startswith("{") and '"event": "ready"' in line:
            ready = json.loads(line)
            break
    else:
        raise AssertionError("the learner did not get ready")
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, ready, lines


async def hoarder(ctx: zmq.asyncio.Context, endpoint: str, name: str, stop: asyncio.Event,
                  got: dict) -> None:
    """Hello, ask for 64 samples, heartbeat, apply every version; never answer an assignment."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.connect(endpoint)
    version = 0
    send = lambda msg: sock.send_multipart(protocol.encode(msg))   # noqa: E731
    await send(protocol.Hello(server_id=name, engine="hoard", model="none", version=0, max_concurrency=64))
    await send(protocol.WorkRequest(server_id=name, credits=64))
    beat = time.monotonic()
    try:
        while not stop.is_set():
            if time.monotonic() - beat > 0.5:
                await send(protocol.Heartbeat(sender_id=name, version=version, inflight=64))
                beat = time.monotonic()
            if not await sock.poll(50):
                continue
            msg = protocol.decode(await sock.recv_multipart())
            if isinstance(msg, protocol.Assignment):
                got["assignments"] = got.get("assignments", 0) + 1
                got["samples"] = got.get("samples", 0) + msg.group_size
            elif isinstance(msg, protocol.WeightsAvailable) and msg.version > version:
                version = msg.version
                await send(protocol.WeightsApplied(server_id=name, version=version,
                                                   checksum=msg.checksum, seconds=0.0))
            elif isinstance(msg, protocol.Error):
                got.setdefault("errors", []).append(msg.code)
    finally:
        sock.close(0)
