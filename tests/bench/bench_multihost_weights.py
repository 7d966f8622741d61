"""Benchmark of weights across simulated hosts (issue 28 item 6): publish -> every server holding
the version, and the learner's egress, for 1, 3 and 6 servers, full vs delta, direct vs relay
(a script, not a test; needs root for network namespaces).

    .venv/bin/python tests/bench/bench_multihost_weights.py [--servers 1,3,6] [--model smollm2]
        [--rate 1gbit] [--versions 3] [--out bench_results/bench_multihost_weights.json]

Hosts are network namespaces on 1 Gbit/s links (tests/integration/netns_kit.py, tbf; no netem
delay in this kernel). The learner host runs the real ``WeightsServer`` behind the learner's
``RouterSocket`` loop with the model's bf16 weights (SmolLM2-135M: 269 MB, 64 MiB chunks); each
server host runs the real ``WeightsReceiver`` (and with relay, a ``RelayServer``) with an engine
that applies nothing: what is timed is the transport, from the manifest's announcement to each
server's verified fetch. Per mode, version 1 is the full model to every server (every server
starts empty: "full"), then ``--versions`` more versions, each an optimizer step at the
full-weight preset's learning rate (0.37 % of the bf16 elements move one ulp, as
bench_weights_delta.py measured at 1e-6): those go as deltas ("delta") to servers holding the
version before. Relay: the learner's plan (``Admission.sources``, fanout 2). The driver in the
root namespace passes manifests between processes over their pipes (the learner's announcement
is one small message in a run). Times are CLOCK_MONOTONIC, one clock across namespaces.

Measured 2026-12-07 (AMD EPYC, 2 shared cores for all 7 processes, 1 Gbit/s tbf links; "delta":
the median of 3 versions; 269 MB is 2.15 s at line rate):

    chunks  plan       servers  full s  learner egress  delta s  delta egress
    64 MiB  direct     1 / 3 / 6   2.49 / 6.77 / 13.53   1 / 3 / 6 models   0.43 / 0.75 / 1.37   1.6 / 4.9 / 9.8 MB
    64 MiB  tree (2)   1 / 3 / 6   2.26 / 5.08 / 6.27    1 / 1 / 1          0.45 / 0.79 / 1.60   1.6 MB
    8 MiB   direct     1 / 3 / 6   2.60 / 6.82 / 13.59   1 / 3 / 6          0.42 / 0.73 / 1.17   1.4 / 4.2 / 8.5 MB
    8 MiB   chain (1)  1 / 3 / 6   2.33 / 2.52 / 2.73    1 / 1 / 1          0.34 / 1.09 / 2.20   1.4 MB

Against the issue's goals: with the relay chain (8 MiB chunks) publish -> all serving grows
1.17x from 1 to 6 servers (goal <= 1.5x; direct grows 5.2x), the learner's egress is one model
per version whatever the number of servers (goal <= 1.2x), a delta is 1.4 MB of 269 MB (190x
fewer bytes; goal >= 10x). A tree of fan-out 2 on equal links grows 2.8x: a node feeding two
children needs twice its link. Deltas through the chain are slower than deltas straight from the
learner here (2.20 s against 1.17 s for 6: each hop makes its own deltas on 2 shared cores) while
their learner egress is 8.5 MB against 1.4 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (str(ROOT), str(ROOT / "tests" / "bench"), str(ROOT / "tests" / "integration")):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_machine import machine, machine_line  # noqa: E402

LEARNER_PORT, RELAY_PORT = 5556, 5560


def _frames_out(msg) -> str:
    import protocol
    return json.dumps([base64.b64encode(f).decode() for f in protocol.encode(msg)])


def _frames_in(line: str):
    import protocol
    return protocol.decode([base64.b64decode(x) for x in json.loads(line)])


# ---- the learner host ---------------------------------------------------------------------------
async def learner_main(model: str, versions: int, fraction: float, chunk_mb: int) -> None:
    import torch
    import zmq
    import zmq.asyncio
    from bench_rollout import resolve
    from transformers import AutoModelForCausalLM

    from learner.metrics import LearnerMetrics
    from learner.serve.router import RouterSocket
    from learner.serve.weights_server import WeightsServer
    from protocol.plumbing.sockets import bind, make_socket

    m = AutoModelForCausalLM.from_pretrained(resolve(model), dtype=torch.bfloat16)
    named = [(n, p.detach().clone()) for n, p in m.named_parameters()]
    del m
    metrics = LearnerMetrics()
    ws = WeightsServer(chunk_mb << 20, metrics=metrics, keep=2)
    sock = make_socket(zmq.asyncio.Context.instance(), zmq.ROUTER, max_message_bytes=64 << 10, hwm=16)
    bind(sock, "0.0.0.0", LEARNER_PORT, "weights")
    router = RouterSocket(sock, "weights", metrics, log=lambda *a, **k: None)
    serving = asyncio.create_task(router.serve(ws.handle))
    g = torch.Generator().manual_seed(0)
    loop = asyncio.get_running_loop()
    for version in range(1, versions + 2):
        if version > 1:
            for _, t in named:
                flat = t.view(-1)
                moved = torch.rand(flat.numel(), generator=g) < fraction
                flat[moved] = torch.nextafter(flat[moved], torch.full_like(flat[moved], 1e9))
        manifest = await asyncio.to_thread(ws.publish, version, named)
        egress = metrics.value("slipstream_weights_egress_bytes_total")
        print(json.dumps({"manifest": _frames_out(manifest), "t": time.monotonic(), "egress": egress}), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)        # the driver: all fetched
    print(json.dumps({"egress": metrics.value("slipstream_weights_egress_bytes_total")}), flush=True)
    serving.cancel()


# ---- a server host --------------------------------------------------------------------------------
async def server_main(learner_host: str, relay_endpoint: str | None) -> None:
    import zmq
    import zmq.asyncio

    from protocol.plumbing.sockets import bind, make_socket
    from rollout_server.metrics import RolloutMetrics
    from rollout_server.receiver import WeightsReceiver, ZmqChunkChannel
    from rollout_server.relay import RelayServer, RelayStore

    ctx = zmq.asyncio.Context.instance()
    metrics = RolloutMetrics()
    store = sock = None
    tasks = []
    if relay_endpoint:
        store = RelayStore()
        sock = make_socket(ctx, zmq.ROUTER, max_message_bytes=64 << 10, hwm=64)
        bind(sock, "0.0.0.0", RELAY_PORT, "relay")
        tasks.append(asyncio.create_task(RelayServer(store, sock, wait_s=30, metrics=metrics,
                                                     log=lambda *a, **k: None).serve()))

    async def nothing(*_):
        return 0.0

    r = WeightsReceiver(connect=lambda ep, n, key=None: ZmqChunkChannel(ctx, ep, n), apply=nothing, report=nothing,
                        version=lambda: 0, server_id="s", metrics=metrics, log=lambda *a, **k: None,
                        max_weights_bytes=1 << 34, chunk_timeout_s=120, relay=store,
                        relay_endpoint=relay_endpoint, relay_timeout_s=60)
    r.welcome(f"tcp://{learner_host}:{LEARNER_PORT}")
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        m = _frames_in(line)
        ok = await r.receive(m)
        value = metrics.registry.get_sample_value
        print(json.dumps({"version": m.version, "ok": ok, "t": time.monotonic(),
                          "learner": value("slipstream_weights_received_bytes_total", {"source": "learner"}),
                          "peer": value("slipstream_weights_received_bytes_total", {"source": "peer"})}), flush=True)
    for t in tasks:
        t.cancel()


# ---- the driver ---------------------------------------------------------------------------------
def plan(n: int, relay: bool, manifest, endpoints: list[str], holders: set[int], fanout: int = 2):
    """The learner's relay plan for ``n`` servers (Admission.sources), as manifests."""
    import protocol
    from buffer import RolloutBuffer
    from learner.config import ServersSettings
    from learner.metrics import LearnerMetrics
    from learner.serve.admission import Admission, ServerState

    adm = Admission(RolloutBuffer(batch_samples=2, group_size=1, max_staleness=0), None, None,
                    version=lambda: manifest.version, servers=ServersSettings(), metrics=LearnerMetrics(),
                    relay_fanout=fanout if relay else 0)
    for i in range(n):
        srv = adm.servers[f"s{i}".encode()] = ServerState(f"s{i}", f"s{i}".encode(), 8)
        srv.relay = protocol.WeightsSource(endpoint=endpoints[i]) if relay else None
        srv.version = manifest.version if i in holders else manifest.version - 1
    return [dataclasses.replace(manifest, sources=adm.sources(s, manifest)) for s in adm.servers.values()]


def _read(proc) -> dict:
    """The next JSON line of ``proc`` (libraries may print other lines to stdout)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"process {proc.args[:6]} ended (exit {proc.wait()})")
        if line.startswith("{"):
            return json.loads(line)


def run_mode(hosts, n: int, relay: bool, args, env) -> dict:
    learner_host, *server_hosts = hosts.hosts[:n + 1]
    here = str(Path(__file__).resolve())
    lp = subprocess.Popen(learner_host.cmd(sys.executable, here, "--role", "learner", "--model", args.model,
                                           "--versions", str(args.versions), "--fraction", str(args.fraction),
                                           "--chunk-mb", str(args.chunk_mb)),
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    endpoints = [f"tcp://{h.address}:{RELAY_PORT}" for h in server_hosts]
    sps = [subprocess.Popen(h.cmd(sys.executable, here, "--role", "server", "--learner-host", learner_host.address,
                                  *(["--relay", endpoints[i]] if relay else [])),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
           for i, h in enumerate(server_hosts)]
    rows = []
    try:
        for _ in range(args.versions + 1):
            ev = _read(lp)
            manifest = _frames_in(ev["manifest"])
            for sp, m in zip(sps, plan(n, relay, manifest, endpoints, set(), args.fanout)):
                sp.stdin.write(_frames_out(m) + "\n")
                sp.stdin.flush()
            done = [_read(sp) for sp in sps]
            assert all(d["ok"] for d in done), done
            lp.stdin.write("\n")
            lp.stdin.flush()
            rows.append({"version": manifest.version, "bytes": manifest.total_bytes,
                         "seconds": max(d["t"] for d in done) - ev["t"], "egress_before": ev["egress"],
                         "peer": sum(d["peer"] for d in done), "learner": sum(d["learner"] for d in done)})
        final = _read(lp)["egress"]
    finally:
        for p in (lp, *sps):
            p.kill()
            p.wait()
    for i, row in enumerate(rows):
        after = rows[i + 1]["egress_before"] if i + 1 < len(rows) else final
        row["egress"] = after - row["egress_before"]
    return {"servers": n, "relay": relay, "full": rows[0],
            "delta": {"seconds": statistics.median(r["seconds"] for r in rows[1:]),
                      "egress": statistics.median(r["egress"] for r in rows[1:]),
                      "seconds_all": [r["seconds"] for r in rows[1:]]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="driver", choices=["driver", "learner", "server"])
    ap.add_argument("--servers", default="1,3,6")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.0037)
    ap.add_argument("--fanout", type=int, default=2, help="learner.weights.relay_fanout")
    ap.add_argument("--chunk-mb", type=int, default=64, help="learner.weights.chunk_bytes in MiB")
    ap.add_argument("--modes", default="direct,relay")
    ap.add_argument("--learner-host")
    ap.add_argument("--relay")
    ap.add_argument("--out", default="bench_results/bench_multihost_weights.json")
    args = ap.parse_args()
    if args.role == "learner":
        asyncio.run(learner_main(args.model, args.versions, args.fraction, args.chunk_mb))
        return 0
    if args.role == "server":
        asyncio.run(server_main(args.learner_host, args.relay))
        return 0
    import os

    from netns_kit import Hosts, unavailable

    why = unavailable()
    if why is not None:
        raise SystemExit(f"bench_multihost_weights: {why}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "bench")]))
    counts = [int(x) for x in args.servers.split(",")]
    res = {"machine": machine(), "rate": args.rate, "fanout": args.fanout, "chunk_mb": args.chunk_mb,
           "results": []}
    print(machine_line(res["machine"]))
    print(f"{'servers':>7} {'mode':>6} {'full s':>7} {'full egress/model':>18} {'delta s':>8} "
          f"{'delta egress MB':>16}")
    with Hosts(max(counts) + 1, rate=args.rate) as hosts:
        for n in counts:
            for relay in [m == "relay" for m in args.modes.split(",")]:
                r = run_mode(hosts, n, relay, args, env)
                res["results"].append(r)
                f, d = r["full"], r["delta"]
                print(f"{n:7d} {'relay' if relay else 'direct':>6} {f['seconds']:7.2f} "
                      f"{f['egress'] / f['bytes']:18.2f} {d['seconds']:8.2f} {d['egress'] / 1e6:16.2f}",
                      flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
