"""Learner ingress against the wire: results pushed over tcp loopback into the learner's real
rollout socket, against a raw pyzmq DEALER -> ROUTER of the same bytes in the same run (issue 12).

    python tests/bench/bench_ingress.py [--reps 5] [--groups 1000] [--tokens 1024]
                                        [--profile] [--out bench_results/bench_ingress.json]

The socket pattern is the learner's: its rollout socket is a ROUTER (``ROUTER_MANDATORY``,
``ROUTER_HANDOVER``, the configured HWMs and ``MAXMSGSIZE``, learner.serve.service) and rollout servers
connect as DEALERs, so the baseline is DEALER -> ROUTER (a ROUTER adds the identity frame; PUSH ->
PULL would not). Two message shapes, built by the load client's ``group()`` (the one the R4 load
test uses) with ``--tokens`` completion tokens and a 128-token prompt: one sample per
RolloutResult (a server streaming single samples) and one whole group of 8 per RolloutResult (what
rollout_server's pipeline sends).

Rows, each in every repetition, interleaved (raw 1, ingress 1, raw 8, ingress 8), so that a ratio
pairs two measurements taken seconds apart on the same (shared, noisy) machine:

- ``raw``: a sender process pushes one encoded RolloutResult's frames (``protocol.encode``) N
  times; this process receives them with a plain ``recv_multipart`` and does nothing else. The
  window runs from the first message received to the last, so process start-up does not count.
- ``raw_decode``: the same, the receiver calling ``protocol.decode`` on every message: the floor
  of any learner that speaks the protocol (reported beside the target ratio, not instead of it).
- ``ingress``: the same shape through slipstream's learner, in this process: a
  :class:`learner.serve.service.LearnerService` with its sockets opened by ``_open()`` (the real
  ROUTER, the real :class:`learner.serve.router.RouterSocket` loop) and its real ``on_rollout``:
  admission (``touch``), ``protocol.decode``, :class:`learner.serve.intake.Intake` (every check, the
  temperature stamp), ``RolloutBuffer.put`` (dedupe, gate, group assembly), the metrics, the Ack
  encoded and sent, ``dispatch`` and the gauges after every result. The client is a protocol-level
  rollout server in another process (``--client``): Hello, WorkRequests for all its credits,
  every Assignment received and answered with a valid result (``group()``), and the results'
  frames encoded *before* the timed phase; then it pushes them as fast as the socket takes them
  (at most ``WINDOW`` results' samples unacknowledged, below the learner's send HWM, so an Ack
  is never dropped) and reads and decodes every Ack. The learner merges the Acks of a burst per
  server (``learner.serve.router.PendingAcks``; a real server matches acks by sample id), so the
  client counts acknowledged samples, as ``rollout_server.outbox`` does. Every Ack status must
  be ``accepted`` (the bench fails otherwise). The window runs, on the learner side, from the
  first RolloutResult received to the last one's Ack sent (the service's ``flush_acks``, the
  rollout loop's ``idle``).

How training is taken out without faking the ingress: the model is never loaded (``_load`` is not
called; the Intake is built as ``_load`` builds it, with a 32k vocabulary) and the train loop is
replaced by a drain task that takes every batch from the buffer with the same ``next_batch`` the
train loop awaits, and drops it. ``max_staleness`` is set beyond the run's length, so the gate never
closes for want of steps (the capacity is still computed for every issue) and no weights need to
be published (the client never lags). What is measured is therefore the ingress path end to end,
with nothing stubbed between the socket and the buffer, and nothing of training in the loop.
Assignments are issued before the timed phase (the client asks for all its credits up front):
sending new work is the egress path and is not in the window; the dispatch call after each Ack
is (it finds no credits, as a learner with no idle server does).

Reported per shape: messages/s and MB/s (median over reps), the median of the per-rep ratios
ingress/raw (the target is >= 0.6) and ingress/raw_decode, and the CPU time per message of the
receiving thread (``time.thread_time``; the learner's event-loop thread for ingress; the JSON also
has the whole process's). On a shared machine the CPU cost is the steadier figure: under load
the rates follow the CPU share the scheduler gives each process (the learner's queue never runs
empty during a phase, yet its thread is busy only a fraction of the wall time), so the rate
ratio swings from rep to rep while the CPU ratio does not. A second table says who limits the
rate: the learner loop thread's busy fraction (CPU / wall), the client's CPU per message and
busy fraction, the cores both processes used together (their libzmq threads included; when it
is near the cores the scheduler gives them, the rate is the CPU cost of the whole path, the
client's included), and the Acks per message. ``--profile`` adds a cProfile run (this
thread's CPU time) of one ingress phase per shape.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_machine import machine, machine_line  # noqa: E402
from load_client import group  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: config_kit
from config_kit import nested  # noqa: E402

import protocol  # noqa: E402

GROUP = 8
PROMPT_TOKENS = 128
PROMPT = np.arange(1, 1 + PROMPT_TOKENS, dtype=np.int32)
WINDOW = 512             # results in flight from the client (the learner's send_hwm is 1000)
CREDIT_CHUNK = 256       # groups asked for per WorkRequest while collecting assignments


def messages_of(a: protocol.Assignment, per_message: int, tokens: int) -> list[list[bytes]]:
    """The encoded RolloutResult(s) answering ``a``: ``per_message`` samples each."""
    samples = group(a, 0, tokens)
    return [protocol.encode(protocol.RolloutResult(server_id="ingress-client",
                                                   samples=samples[i:i + per_message]))
            for i in range(0, len(samples), per_message)]


def template_frames(per_message: int, tokens: int) -> list[bytes]:
    """One message's frames, with an assignment id as long as the learner's (for the raw row)."""
    a = protocol.Assignment(assignment_id="ingress-000000-a100000", prompt_id="p",
                            prompt_token_ids=PROMPT, group_size=GROUP, version=0)
    return messages_of(a, per_message, tokens)[0]


# ---- processes on the other side of the socket ---------------------------------------------------

def raw_sender(endpoint: str, n: int, frames_file: str) -> None:
    frames = msgpack.unpackb(Path(frames_file).read_bytes())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    for _ in range(n):
        sock.send_multipart(frames)
    sock.close(linger=10_000)
    ctx.term()


def client(endpoint: str, name: str, groups: int, per_message: int, tokens: int, out: str) -> None:
    """A protocol-level rollout server: collect ``groups`` assignments, encode every answer, then
    push them all (the timed phase) and read the Acks."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.connect(endpoint)

    def recv(timeout_ms: int = 30_000) -> protocol.Message:
        if not sock.poll(timeout_ms):
            raise SystemExit(f"{name}: nothing from the learner in {timeout_ms} ms")
        return protocol.decode(sock.recv_multipart())

    sock.send_multipart(protocol.encode(protocol.Hello(
        server_id=name, engine="load", model="none", version=0, max_concurrency=groups * GROUP)))
    assignments: list[protocol.Assignment] = []
    while len(assignments) < groups:
        want = min(CREDIT_CHUNK, groups - len(assignments))
        sock.send_multipart(protocol.encode(protocol.WorkRequest(server_id=name, credits=want * GROUP)))
        got = 0
        while got < want:
            msg = recv()
            if isinstance(msg, protocol.Assignment):
                assignments.append(msg)
                got += 1
            elif not isinstance(msg, protocol.Welcome):
                raise SystemExit(f"{name}: unexpected {type(msg).__name__} while collecting work")
    messages = [m for a in assignments for m in messages_of(a, per_message, tokens)]
    statuses: dict[str, int] = {}
    sent = acked = acks = 0          # messages sent, samples acknowledged, Ack messages read
    total = len(messages)
    samples = total * per_message
    t_first, c_first, h_first = time.monotonic(), time.process_time(), time.thread_time()
    while acked < samples:
        # An Ack may name the samples of several results (the learner merges a burst's Acks per
        # server, learner.serve.router.PendingAcks): the window counts samples.
        while sent < total and sent * per_message - acked < WINDOW * per_message:
            sock.send_multipart(messages[sent], copy=False)
            sent += 1
        if sock.poll(30_000):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                ack = protocol.decode(frames)
                if not isinstance(ack, protocol.Ack):
                    raise SystemExit(f"{name}: {type(ack).__name__} instead of an Ack: {ack}")
                acks += 1
                acked += len(ack.statuses)
                for s in ack.statuses:
                    statuses[s] = statuses.get(s, 0) + 1
        else:
            raise SystemExit(f"{name}: no Ack in 30 s ({acked}/{samples} samples)")
    elapsed = time.monotonic() - t_first
    cpu, thread = time.process_time() - c_first, time.thread_time() - h_first
    sock.close(0)
    ctx.term()
    Path(out).write_text(json.dumps({"messages": total, "elapsed_s": elapsed, "statuses": statuses,
                                     "acks": acks, "cpu_s": cpu, "thread_s": thread,
                                     "bytes": sum(len(f) for f in messages[0])}))


# ---- this process's side ----------------------------------------------------------------------------

def raw_rate(n: int, frames: list[bytes], tmp: Path, decode: bool = False) -> dict:
    """Messages/s of a plain DEALER -> ROUTER of ``frames`` (the receiver does nothing else, or,
    with ``decode``, only ``protocol.decode``)."""
    path = tmp / "frames.msgpack"
    path.write_bytes(msgpack.packb(frames))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = subprocess.Popen([sys.executable, __file__, "--raw-sender", f"tcp://127.0.0.1:{port}",
                             str(n), str(path)])
    try:
        assert sock.poll(60_000), "the raw sender sent nothing"
        sock.recv_multipart()
        t0, c0, h0 = time.monotonic(), time.process_time(), time.thread_time()
        if decode:
            for _ in range(n - 1):
                protocol.decode(sock.recv_multipart()[1:])
        else:
            for _ in range(n - 1):
                sock.recv_multipart()
        elapsed, cpu = time.monotonic() - t0, time.process_time() - c0
        thread = time.thread_time() - h0
    finally:
        proc.wait(timeout=60)
        sock.close(0)
        ctx.term()
    size = sum(len(f) for f in frames)
    return {"messages": n, "elapsed_s": elapsed, "msgs_per_s": (n - 1) / elapsed,
            "mb_per_s": (n - 1) * size / elapsed / 1e6, "cpu_us_per_msg": cpu / (n - 1) * 1e6,
            "thread_us_per_msg": thread / (n - 1) * 1e6, "bytes": size}


class Prompts:
    """An endless prompt stream (the model and tokenizer are never loaded): the same 128-token
    prompt under a new id each time."""

    finite = False
    exhausted = False

    def __init__(self):
        self.n = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        self.n += 1
        return {"prompt_id": f"p{self.n}", "prompt_token_ids": PROMPT, "prompt": "", "answer": ""}

    def status(self) -> dict:
        return {"drawn": self.n}


class Ingress:
    """A learner service without a model: real sockets, real on_rollout, a drain for a trainer
    (see the module docstring). ``phase(n)`` arms the window for the next ``n`` results."""

    def __init__(self, run_dir: Path, tokens: int):
        from learner.app import assemble_results
        from learner.config import LearnerConfig
        from learner.serve.intake import Intake
        from learner.serve.service import LearnerService

        cfg = LearnerConfig(**nested(rollout_port=0, weights_port=0, control_port=0, metrics_port=0,
                            run_dir=str(run_dir), batch_prompts=8, group_size=GROUP,
                            max_staleness=1_000_000_000, lease_timeout_s=3600, server_timeout_s=3600,
                            max_new_tokens=tokens))
        svc = self.svc = LearnerService(cfg, "unused: the model is not loaded")
        svc._open()
        # What the model's load would build (learner.app.assemble_model), without a model: the
        # intake at a 32k vocabulary, prompts of fixed tokens, the ingress between them.
        svc.intake = Intake(svc.buffer, vocab_size=32_000, sampling=cfg.sampling,
                            servers=cfg.servers, version=lambda: svc.version,
                            metrics=svc.metrics, log=svc.log)
        svc.prompts = svc.offers.prompts = Prompts()
        svc.batches, svc.ingress = assemble_results(svc.parts, cfg, intake=svc.intake, prompts=svc.prompts,
                                                    evaluation=None)
        self.endpoint = svc.endpoints["rollout"]
        self.expected = 0
        self.seen = 0
        self.window: dict[str, float] = {}
        self.done = asyncio.Event()
        self.profiler: cProfile.Profile | None = None
        self.drained = 0

    async def on_rollout(self, identity: bytes, msg: protocol.Message):
        """The service's own handler; the window's clock is read at the first and last result."""
        if type(msg) is not protocol.RolloutResult or not self.expected:
            return await self.svc.on_rollout(identity, msg)
        if self.seen == 0:
            self.window = {"t0": time.monotonic(), "c0": time.process_time(),
                           "h0": time.thread_time()}
            if self.profiler is not None:
                self.profiler.enable()
        reply = await self.svc.on_rollout(identity, msg)
        self.seen += 1
        return reply

    async def flush_acks(self) -> None:
        """The service's own ``idle`` (the held Acks sent, then dispatch); the window ends when
        the last result's Ack has been sent."""
        await self.svc.ingress.flush()
        if self.expected and self.seen == self.expected:
            if self.profiler is not None:
                self.profiler.disable()
            self.window.update(t1=time.monotonic(), c1=time.process_time(), h1=time.thread_time())
            self.expected = 0
            self.done.set()

    async def drain(self) -> None:
        """Take every batch off the buffer (the train loop's next_batch, no step)."""
        while True:
            batch = await self.svc.buffer.next_batch(self.svc.version)
            self.drained += len(batch.samples)

    async def phase(self, groups: int, per_message: int, tokens: int, tmp: Path, name: str,
                    profile: bool = False) -> dict:
        n = groups * GROUP // per_message
        self.expected, self.seen, self.done = n, 0, asyncio.Event()
        # CPU time of this thread, not wall time: on a loaded machine a wall-clock profile
        # charges the time the OS gave to other processes to whatever was running then.
        self.profiler = cProfile.Profile(time.thread_time) if profile else None
        out = tmp / f"{name}.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", self.endpoint, name, str(groups), str(per_message),
            str(tokens), str(out))
        rc = await proc.wait()
        assert rc == 0, f"the ingress client failed ({rc})"
        await asyncio.wait_for(self.done.wait(), 30)
        # The client has exited: forget it now, as server_timeout_s would. Left known, it would
        # make the next phase's client the second server, held to an initial allowance
        # (learner.serve.admission: Allowance) while it asks for all its work up front.
        for srv in list(self.svc.admission.servers.values()):
            self.svc.admission.lose(srv, "left")
        client_side = json.loads(out.read_text())
        assert client_side["statuses"] == {"accepted": groups * GROUP}, client_side["statuses"]
        w = self.window
        elapsed, cpu, thread = w["t1"] - w["t0"], w["c1"] - w["c0"], w["h1"] - w["h0"]
        size = client_side["bytes"]
        row = {"messages": n, "elapsed_s": elapsed, "msgs_per_s": (n - 1) / elapsed,
               "mb_per_s": (n - 1) * size / elapsed / 1e6, "cpu_us_per_msg": cpu / (n - 1) * 1e6,
               "thread_us_per_msg": thread / (n - 1) * 1e6,
               "bytes": size, "client_msgs_per_s": n / client_side["elapsed_s"],
               "acks": client_side["acks"],
               # Who limits the rate: the learner's loop thread busy (of the wall time), the
               # client's thread, and the CPU both processes used (threads of libzmq included)
               # against the machine's cores.
               "learner_thread_busy": thread / elapsed,
               "client_thread_us_per_msg": client_side["thread_s"] / n * 1e6,
               "client_cpu_us_per_msg": client_side["cpu_s"] / n * 1e6,
               "client_thread_busy": client_side["thread_s"] / client_side["elapsed_s"],
               "cores_used": (cpu + client_side["cpu_s"]) / max(elapsed, client_side["elapsed_s"])}
        if self.profiler is not None:
            s = io.StringIO()
            pstats.Stats(self.profiler, stream=s).sort_stats("tottime").print_stats(30)
            row["profile"] = s.getvalue()
        return row


async def run(args, tmp: Path) -> dict:
    ingress = Ingress(tmp / "run", args.tokens)
    svc = ingress.svc
    tasks = [asyncio.create_task(svc.sockets["rollout"].serve(ingress.on_rollout,
                                                              idle=ingress.flush_acks)),
             asyncio.create_task(ingress.drain())]
    shapes = {1: template_frames(1, args.tokens), GROUP: template_frames(GROUP, args.tokens)}
    rows: dict[str, list[dict]] = {f"{k}_{p}": [] for p in shapes
                                   for k in ("raw", "raw_decode", "ingress")}
    profiles: dict[str, str] = {}
    try:
        for rep in range(args.reps):
            for per in shapes:
                n = args.groups * GROUP // per
                raw = await asyncio.to_thread(raw_rate, n, shapes[per], tmp)
                rows[f"raw_{per}"].append(raw)
                rows[f"raw_decode_{per}"].append(await asyncio.to_thread(
                    raw_rate, n, shapes[per], tmp, decode=True))
                ing = await ingress.phase(args.groups, per, args.tokens, tmp, f"client-{rep}-{per}")
                rows[f"ingress_{per}"].append(ing)
                print(f"rep {rep} {per} sample(s)/msg: raw {raw['msgs_per_s']:,.0f}/s, ingress "
                      f"{ing['msgs_per_s']:,.0f}/s, ratio {ing['msgs_per_s'] / raw['msgs_per_s']:.3f}",
                      flush=True)
        if args.profile:
            for per in shapes:
                r = await ingress.phase(args.groups, per, args.tokens, tmp, f"profile-{per}", profile=True)
                profiles[str(per)] = r.pop("profile")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        svc._close()
    counters = svc.buffer.counters
    assert counters["duplicate"] == 0 and counters["invalid"] == 0, counters
    return {"rows": rows, "profiles": profiles, "counters": counters, "drained": ingress.drained}


def summarize(rows: dict[str, list[dict]]) -> dict:
    out = {}
    for per in (1, GROUP):
        raw, dec, ing = rows[f"raw_{per}"], rows[f"raw_decode_{per}"], rows[f"ingress_{per}"]
        ratios = [i["msgs_per_s"] / r["msgs_per_s"] for r, i in zip(raw, ing)]
        med = statistics.median
        out[str(per)] = {
            "bytes_per_msg": ing[0]["bytes"],
            "raw_msgs_per_s": med(r["msgs_per_s"] for r in raw),
            "raw_mb_per_s": med(r["mb_per_s"] for r in raw),
            "raw_cpu_us_per_msg": med(r["cpu_us_per_msg"] for r in raw),
            "ingress_msgs_per_s": med(i["msgs_per_s"] for i in ing),
            "ingress_mb_per_s": med(i["mb_per_s"] for i in ing),
            "ingress_samples_per_s": med(i["msgs_per_s"] for i in ing) * per,
            "ingress_cpu_us_per_msg": med(i["cpu_us_per_msg"] for i in ing),
            "raw_thread_us_per_msg": med(r["thread_us_per_msg"] for r in raw),
            "ingress_thread_us_per_msg": med(i["thread_us_per_msg"] for i in ing),
            "ratio": med(ratios), "ratios": ratios,
            "cpu_ratio": med(r["thread_us_per_msg"] / i["thread_us_per_msg"] for r, i in zip(raw, ing)),
            "raw_decode_msgs_per_s": med(d["msgs_per_s"] for d in dec),
            "raw_decode_thread_us_per_msg": med(d["thread_us_per_msg"] for d in dec),
            "ratio_vs_raw_decode": med(i["msgs_per_s"] / d["msgs_per_s"] for d, i in zip(dec, ing)),
            "cpu_ratio_vs_raw_decode": med(d["thread_us_per_msg"] / i["thread_us_per_msg"]
                                           for d, i in zip(dec, ing)),
            "acks_per_msg": med(i["acks"] / i["messages"] for i in ing),
            "learner_thread_busy": med(i["learner_thread_busy"] for i in ing),
            "client_thread_us_per_msg": med(i["client_thread_us_per_msg"] for i in ing),
            "client_cpu_us_per_msg": med(i["client_cpu_us_per_msg"] for i in ing),
            "client_thread_busy": med(i["client_thread_busy"] for i in ing),
            "cores_used": med(i["cores_used"] for i in ing),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--groups", type=int, default=1000, help="groups of 8 per phase")
    p.add_argument("--tokens", type=int, default=1024, help="completion tokens per sample")
    p.add_argument("--profile", action="store_true", help="cProfile one ingress phase per shape")
    p.add_argument("--out", default="bench_results/bench_ingress.json")
    p.add_argument("--raw-sender", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--client", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.raw_sender:
        endpoint, n, path = args.raw_sender
        return raw_sender(endpoint, int(n), path)
    if args.client:
        endpoint, name, groups, per, tokens, out = args.client
        return client(endpoint, name, int(groups), int(per), int(tokens), out)
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    summary = summarize(result["rows"])
    m = machine()
    print(machine_line(m))
    print(f"\n{'samples/msg':<12}{'bytes':>8}{'raw msg/s':>11}{'raw MB/s':>10}{'ingress msg/s':>15}"
          f"{'ingress MB/s':>14}{'ratio':>7}   {'ratio per rep':<30}{'raw+decode msg/s':>18}"
          f"{'ratio':>7}")
    for per, s in summary.items():
        reps = " ".join(f"{r:.2f}" for r in s["ratios"])
        print(f"{per:<12}{s['bytes_per_msg']:>8}{s['raw_msgs_per_s']:>11,.0f}{s['raw_mb_per_s']:>10,.0f}"
              f"{s['ingress_msgs_per_s']:>15,.0f}{s['ingress_mb_per_s']:>14,.0f}{s['ratio']:>7.3f}   "
              f"{reps:<30}{s['raw_decode_msgs_per_s']:>18,.0f}{s['ratio_vs_raw_decode']:>7.3f}")
    print(f"\nCPU time of the receiving thread per message, us (the learner's loop thread for ingress)"
          f"\n{'samples/msg':<12}{'raw':>8}{'raw+decode':>12}{'ingress':>10}{'raw/ingress':>13}"
          f"{'raw+decode/ingress':>20}")
    for per, s in summary.items():
        print(f"{per:<12}{s['raw_thread_us_per_msg']:>8.1f}{s['raw_decode_thread_us_per_msg']:>12.1f}"
              f"{s['ingress_thread_us_per_msg']:>10.1f}{s['cpu_ratio']:>13.3f}"
              f"{s['cpu_ratio_vs_raw_decode']:>20.3f}")
    print(f"\nWho limits ingress (medians): busy = thread CPU / wall; cores = CPU of learner and "
          f"client processes (libzmq threads included) / wall\n{'samples/msg':<12}"
          f"{'learner busy':>13}{'client us/msg':>14}{'client busy':>12}{'cores used':>11}"
          f"{'Acks/msg':>10}")
    for per, s in summary.items():
        print(f"{per:<12}{s['learner_thread_busy']:>13.2f}{s['client_thread_us_per_msg']:>14.1f}"
              f"{s['client_thread_busy']:>12.2f}{s['cores_used']:>11.2f}{s['acks_per_msg']:>10.2f}")
    for per, text in result["profiles"].items():
        print(f"\ncProfile, one ingress phase, {per} sample(s) per message:\n{text}")
    met = all(s["ratio"] >= 0.6 for s in summary.values())
    ratios = ", ".join(f"{k}/msg: {s['ratio']:.3f}" for k, s in summary.items())
    print(f"target ingress >= 0.6x raw: {'met' if met else 'NOT met'} ({ratios})")
    report = {"benchmark": "bench_ingress", "machine": m, "socket_pattern": "DEALER -> ROUTER",
              "tokens": args.tokens, "prompt_tokens": PROMPT_TOKENS, "group_size": GROUP,
              "groups_per_phase": args.groups, "reps": args.reps, "target_ratio": 0.6,
              "target_met": met, "summary": summary, "rows": result["rows"],
              "profiles": result["profiles"], "buffer_counters": result["counters"],
              "samples_drained": result["drained"],
              "env": {"python": sys.version.split()[0], "pyzmq": zmq.__version__,
                      "libzmq": zmq.zmq_version(), "platform": platform.platform(),
                      "cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
