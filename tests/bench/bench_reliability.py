"""Issue 31, items 1-4, after the fixes: the figures the issue quotes from before, measured again on
real processes (a script, not a test; the CI tests of each item only assert their bounds).

    python tests/bench/bench_reliability.py [--items 1,2,3,4] [--window-s 20] [--fleet 20]
        [--no-valid-timeout-s 10] [--reward raise] [--out bench_results/bench_reliability.json]

Every process is a real ``python -m deploy.cli ...`` with the tiny model (random weights, built in
a temporary directory), started in its own process group and stopped with it; every port is 0.
The scenarios are the integration tests' (their kits imported, not copied):

1. **NaN model** (tests/integration/test_broken_model.py): a ``slipstream learner`` fed by two
   protocol-level clients (tests/integration/load_client.py); after 3 steps the real ``slipstream
   ctl set optimizer.lr`` with ``Infinity`` and ``NaN`` (must be refused, exit 2), then ``1e30``
   (accepted). Measured: seconds from ``ctl set`` returning to the learner's exit, its exit code
   (6: diverged), the steps skipped (rolled back) meanwhile, its one stop line, whether the
   checkpoint written at the stop is finite; and a config with ``learner.optimizer.lr: .inf``
   (exit code of ``slipstream learner``: must be 2). ``max_consecutive_skips`` is the default.
2. **Unfinished messages** (tests/learner/serve/test_learner_service.py::
   test_unfinished_messages_are_cut_on_every_socket, here against a learner process): a raw ZMTP
   DEALER (tests/zmtp_kit.py) sends 25 frames of 60 MiB, each with MORE set, to the rollout socket
   (stopping at the cut), then 10,000 frames of 60 KiB to the control socket. Measured: the
   learner's RSS (``/proc/PID/status`` VmRSS) before, at its peak (sampled every 20 ms) and once
   the client has left (within 64 MiB of the start, or 5 s), the complete frames written before
   the learner hung up, and its ``slipstream_connections_cut_total`` for the socket. The default
   limits: ``network.max_message_bytes`` 64 MiB (rollout), ``control_max_message_bytes`` 64 KiB.
3. **Fake servers starving the run** (tests/integration/test_fleet_guards.py, with the default
   ``learner.servers`` guards): versions trained in ``--window-s`` seconds by one honest client
   (load_client.py) alone, and by the same client joining a learner whose staleness gate the
   ``--fleet`` identities (tests/integration/load_kit.py ``hoarder``: Hello, ask for 64, heartbeat,
   apply every version, never return an assignment) already hold; the leases pre-empted and the
   most one identity held at the end of the window.
4. **A reward that always fails** (test_fleet_guards.py and tests/integration/test_stalls.py
   ``run_with_reward``): ``slipstream run`` with one real rollout server whose reward plug-in
   raises ValueError (``--reward exit``: calls ``sys.exit(3)``), ``learner.servers.
   no_valid_sample_timeout_s`` set to ``--no-valid-timeout-s`` (default of the setting: 120 s).
   Measured: seconds from the learner's first ``samples_refused`` line (the first failed samples)
   and from the launch to the run's exit, its exit code (5) and the learner's one stop line.

Prints the table (item, what was measured, the figure before from the issue, the figure now; item 2
has a line per socket) and writes every figure as JSON. Exit code 0 when every measurement was
taken (whatever its figure), 1 when one could not be (its row says why and the traceback is on
stderr). Sized for about 3 minutes on 2 cores: item 3's two windows and item 4's ``slipstream run``
take most of it. As in the test suite, precision ``auto`` is float32 in every process (tests/conftest.py sets
SLIPSTREAM_NATIVE_BF16=0).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
sys.path.insert(0, str(TESTS / "integration"))
sys.path.insert(0, str(TESTS))                       # conftest (ProcessGroups), zmtp_kit, config_kit
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402
from bench_machine import machine, machine_line  # noqa: E402
from conftest import ProcessGroups  # noqa: E402
from load_kit import control_status, event_line, hoarder, rss_bytes, scrape, total  # noqa: E402
from test_fleet_guards import EXITING_REWARD  # noqa: E402
from test_stalls import PORTS, RAISING_REWARD, learner_alone, run_with_reward  # noqa: E402
from zmtp_kit import raw_dealer, send_unfinished  # noqa: E402

from learner.serve.sample_watch import EXIT_NO_VALID_SAMPLES  # noqa: E402
from learner.serve.service import EXIT_DIVERGED  # noqa: E402

CLI = [sys.executable, "-m", "deploy.cli"]
LOAD_CLIENT = TESTS / "integration" / "load_client.py"
MB = 1 << 20
TRAINING = {"total_steps": 10_000_000, "max_staleness": 1, "exit_on_finish": False}
"""learner_alone's config (batch 2 prompts x 4, lease and server timeouts 600 s) made to train on:
load_kit.start_learner's staleness and no end."""
GATE = (1 + 1) * 2 * 4
"""Samples the staleness gate lets out at version 0 with η 1 and a batch of 2 x 4 (buffer/gate.py)."""

BEFORE = {
    "1": "lr 1e30 and Infinity accepted (also .inf in the config); every parameter NaN, every later "
         "step skipped as non-finite loss, no stop; ctl stop checkpoints the NaN model",
    "2a": "483 -> 1,983 MB, growing linearly (nothing cut)",
    "2b": "+587 MB held after the client left",
    "3": "3 versions in 60 s with 20 fake identities (baseline ~190 per 20 s); recovered 31 s "
         "after they left",
    "4": "never trains, never exits: 57,536 assignments issued and 50,288 abandoned in 40 s; logs "
         "nothing",
}
WHAT = {
    "1": "ctl set optimizer.lr 1e30 on a training learner: time to its stop, exit code; "
         "Infinity/NaN via ctl and .inf in the config refused?",
    "2a": "learner RSS: 25 x 60 MiB frames with MORE to the rollout socket (start -> peak -> after)",
    "2b": "learner RSS: 10,000 x 60 KiB frames with MORE to the control socket (growth held)",
    "3": "versions trained in the window: 1 honest server joining the fake fleet (vs. alone)",
    "4": "reward that always fails (slipstream run, 1 real server): time to the stop, exit code",
}


def ctl(run_dir: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "ctl", "--run-dir", str(run_dir), *args], capture_output=True,
                          text=True, env=env, timeout=60)


def one_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def stop(groups: ProcessGroups, proc: subprocess.Popen | None, grace_s: float = 10) -> int | None:
    return None if proc is None else groups.stop(proc, grace_s=grace_s)


# --- item 1 -------------------------------------------------------------------------------------

def nan_model(work: Path, model: str, env: dict, groups: ProcessGroups, args) -> dict:
    out: dict = {}
    # The config's .inf: refused at start (it must not start; 60 s bounds it if it did).
    cfg = work / "inf.yaml"
    cfg.write_text(yaml.safe_dump({"model": model, "learner": {
        "network": PORTS, "run_dir": str(work / "inf-run"), "optimizer": {"lr": float("inf")}}}))
    try:
        r = subprocess.run([*CLI, "learner", "--config", str(cfg)], capture_output=True, text=True,
                           env=env, cwd=work, timeout=60)
        out["config_inf"] = {"exit_code": r.returncode, "line": one_line(r.stderr)}
    except subprocess.TimeoutExpired:
        out["config_inf"] = {"exit_code": None, "line": "started (still running after 60 s)"}

    learner, ready = learner_alone(work, model, env, groups, **TRAINING)
    run_dir = work / "run"
    clients = groups.popen([sys.executable, str(LOAD_CLIENT), ready["rollout"], "2", "300",
                            str(work / "clients.json"), "8"], env=env, cwd=work)
    try:
        learner.wait_for(lambda line: (ev := event_line("step")(line)) and ev["version"] >= 3, 120,
                         "3 steps")
        for bad in ("Infinity", "NaN"):
            r = ctl(run_dir, env, "set", "optimizer.lr", bad)
            out[f"ctl_{bad}"] = {"exit_code": r.returncode, "line": one_line(r.stderr)}
        r = ctl(run_dir, env, "set", "optimizer.lr", "1e30")
        accepted = time.monotonic()
        out["ctl_1e30"] = {"exit_code": r.returncode, "line": one_line(r.stderr or r.stdout)}
        try:
            if r.returncode != 0:                    # not accepted: nothing to wait for
                raise subprocess.TimeoutExpired(r.args, 0)
            out["exit_code"] = learner.proc.wait(timeout=args.stop_timeout_s)
            out["seconds_to_stop"] = round(time.monotonic() - accepted, 2)
        except subprocess.TimeoutExpired:
            out["exit_code"], out["seconds_to_stop"] = None, None
    finally:
        stop(groups, clients, grace_s=2)
        stop(groups, learner.proc)
    lines = learner.read_to_end(30)
    mark = next((i for i, line in enumerate(lines)
                 if (ev := event_line("control_set", key="optimizer.lr")(line)) and ev["value"] == 1e30),
                len(lines))
    after = [ev for line in lines[mark:] if (ev := json_event(line))]
    steps = [ev for ev in after if ev["event"] == "step"]
    skipped = [ev for ev in after if ev["event"] == "step_skipped"]
    out["steps_after_setting"] = len(steps)
    out["steps_skipped"] = len(skipped)
    out["skip_reasons"] = sorted({s.get("reason", "")[:80] for s in skipped})
    out["stop_line"] = next((line.strip() for line in lines
                             if line.startswith("slipstream learner: stopping:")), None)
    out["tracebacks"] = sum("Traceback" in line for line in lines)
    out["checkpoint"] = checkpoint_state(run_dir)
    return out


def json_event(line: str) -> dict | None:
    try:
        ev = json.loads(line)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) and "event" in ev else None


def checkpoint_state(run_dir: Path) -> dict:
    """The newest checkpoint's name and whether every tensor of its policy is finite (and its norm
    below 1e6, as the CI test checks)."""
    try:
        import torch
        from safetensors.torch import load_file

        from learner.state.checkpoint import Checkpointer

        ckpt, _ = Checkpointer(run_dir / "checkpoints", keep_last=5).read_latest()
        tensors = [t for f in sorted((ckpt.path / "policy").glob("*.safetensors"))
                   for t in load_file(str(f)).values()]
        finite = bool(tensors) and all(torch.isfinite(t).all() and t.float().norm() < 1e6 for t in tensors)
        return {"name": ckpt.path.name, "tensors": len(tensors), "finite": finite}
    except Exception as e:          # none written, or unreadable: say which
        return {"name": None, "error": f"{type(e).__name__}: {e}"[:200]}


def row_1(f: dict) -> str:
    refused = ", ".join(f"{k.removeprefix('ctl_')} exit {f[k]['exit_code']}"
                        for k in ("ctl_Infinity", "ctl_NaN") if k in f)
    ck = f.get("checkpoint", {})
    ck_text = (f"checkpoint {ck['name']} {'finite' if ck.get('finite') else 'NOT finite'}"
               if ck.get("name") else "no checkpoint")
    stopped = (f"stopped {f['seconds_to_stop']} s after ctl set 1e30 returned, exit {f['exit_code']} "
               f"(diverged = {EXIT_DIVERGED})" if f.get("exit_code") is not None
               else f"did not stop within {f.get('stop_timeout_s')} s")
    return (f"{stopped}; {f['steps_skipped']} steps rolled back and skipped, {f['steps_after_setting']} "
            f"trained after it; {ck_text}; ctl {refused}; config .inf exit {f['config_inf']['exit_code']}; "
            f"line: {(f.get('stop_line') or '(none)')[:160]}")


# --- item 2 -------------------------------------------------------------------------------------

class PeakRss:
    """The largest VmRSS of ``pid`` seen every ``every_s`` while the block runs."""

    def __init__(self, pid: int, every_s: float = 0.02):
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except (OSError, RuntimeError):
                return
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def cut_count(metrics: dict[str, float], socket: str) -> float:
    return sum(v for k, v in metrics.items()
               if k.startswith("slipstream_connections_cut_total{") and f'socket="{socket}"' in k)


def unfinished(work: Path, model: str, env: dict, groups: ProcessGroups, args) -> dict:
    learner, ready = learner_alone(work, model, env, groups)
    pid = learner.proc.pid
    out: dict = {}
    try:
        time.sleep(2.0)                                  # past the start's last allocations
        for name, frames, size in (("rollout", 25, 60 << 20), ("control", 10_000, 60 << 10)):
            start = rss_bytes(pid)
            with PeakRss(pid) as peak:
                sock = raw_dealer(ready[name], 30)
                try:
                    written = send_unfinished(sock, frames, size)
                except OSError as e:                     # a socket timeout: not a cut
                    written = None
                    out[f"{name}_error"] = f"{type(e).__name__}: {e}"
                finally:
                    sock.close()
                deadline = time.monotonic() + 5
                while rss_bytes(pid) - start >= 64 * MB and time.monotonic() < deadline:
                    time.sleep(0.1)
                after = rss_bytes(pid)
            out[name] = {"frames": frames, "frame_bytes": size, "offered_mb": round(frames * size / MB, 1),
                         "written_mb": None if written is None else round(written / MB, 2),
                         "cut": written is not None and written < frames * (size + 9),
                         "rss_start_mb": round(start / MB, 1), "rss_peak_mb": round(max(peak.peak, after) / MB, 1),
                         "rss_after_mb": round(after / MB, 1),
                         "rss_held_mb": round((after - start) / MB, 1),
                         "cuts_counted": cut_count(scrape(ready["metrics"]), name)}
    finally:
        stop(groups, learner.proc)
    return out


def row_2(f: dict, name: str) -> str:
    s = f[name]
    written = "?" if s["written_mb"] is None else f"{s['written_mb']:g}"
    cut = f"cut after {written} of {s['offered_mb']:g} MiB written" if s["cut"] else \
        f"NOT cut ({written} of {s['offered_mb']:g} MiB written)"
    return (f"{s['rss_start_mb']:g} -> {s['rss_peak_mb']:g} (peak) -> {s['rss_after_mb']:g} MB "
            f"(held {s['rss_held_mb']:+g} MB); {cut}; slipstream_connections_cut_total"
            f"{{socket={name}}} {s['cuts_counted']:g}")


# --- item 3 -------------------------------------------------------------------------------------

def versions_in_window(work: Path, model: str, env: dict, groups: ProcessGroups, fleet: int,
                       window_s: float) -> dict:
    """Versions trained in ``window_s`` from the start of one honest client, which joins a learner
    whose gate ``fleet`` hoarders already hold (none: the baseline)."""
    learner, ready = learner_alone(work, model, env, groups, **TRAINING)
    got: dict[str, dict] = {f"hoard-{i}": {} for i in range(fleet)}
    honest: list[subprocess.Popen] = []

    def held() -> int:
        return sum(g.get("samples", 0) for g in got.values())

    async def scenario() -> dict:
        ctx = zmq.asyncio.Context()
        halt = asyncio.Event()
        tasks = [asyncio.create_task(hoarder(ctx, ready["rollout"], name, halt, g)) for name, g in got.items()]
        try:
            deadline = time.monotonic() + 30
            while fleet and held() < GATE and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            taken = held()
            honest.append(groups.popen([sys.executable, str(LOAD_CLIENT), ready["rollout"], "1",
                                        str(window_s + 30), str(work / "honest.json")], env=env, cwd=work))
            v0 = (await asyncio.to_thread(control_status, ready["control"]))["version"]
            t0 = time.monotonic()
            await asyncio.sleep(window_s)
            status = await asyncio.to_thread(control_status, ready["control"])
            seconds = time.monotonic() - t0
        finally:
            halt.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            ctx.term()
        hoarders = {k: v for k, v in status["servers"].items() if k.startswith("hoard-")}
        return {"fleet": fleet, "fleet_took_samples": taken, "version_at_join": v0,
                "versions": status["version"] - v0, "seconds": round(seconds, 2),
                "versions_per_min": round((status["version"] - v0) * 60 / seconds, 1),
                "most_held_by_one": max((v.get("outstanding", 0) for v in hoarders.values()), default=0),
                "samples_taken_by_fleet": held()}

    try:
        out = asyncio.run(scenario())
        m = scrape(ready["metrics"])
        out["leases_preempted"] = total(m, "slipstream_leases_preempted_total")
        out["servers_refused"] = total(m, "slipstream_rollout_servers_refused_total")
    finally:
        for proc in honest:
            stop(groups, proc, grace_s=5)
        stop(groups, learner.proc)
    return out


def starving_fleet(work: Path, model: str, env: dict, groups: ProcessGroups, args) -> dict:
    (work / "alone").mkdir()
    (work / "fleet").mkdir()
    return {"alone": versions_in_window(work / "alone", model, env, groups, 0, args.window_s),
            "with_fleet": versions_in_window(work / "fleet", model, env, groups, args.fleet, args.window_s)}


def row_3(f: dict) -> str:
    a, b = f["alone"], f["with_fleet"]
    return (f"{b['versions']} versions in {b['seconds']:.0f} s with {b['fleet']} fake identities "
            f"({b['versions_per_min']:g}/min) vs {a['versions']} alone ({a['versions_per_min']:g}/min); "
            f"{b['leases_preempted']:g} leases pre-empted, at most {b['most_held_by_one']} samples held "
            f"by one identity")


# --- item 4 -------------------------------------------------------------------------------------

def failing_reward(work: Path, model: str, env: dict, groups: ProcessGroups, args) -> dict:
    name, source = ("broken", RAISING_REWARD) if args.reward == "raise" else ("leave", EXITING_REWARD)
    launched = time.monotonic()
    run = run_with_reward(work, model, env, groups, name, source,
                          servers={"no_valid_sample_timeout_s": args.no_valid_timeout_s})
    out: dict = {"reward": args.reward, "no_valid_sample_timeout_s": args.no_valid_timeout_s}
    first = None
    try:
        try:
            run.wait_for_line(r"\[learner\] samples_refused|stopping:", 240)
            first = time.monotonic()
        except AssertionError:              # exited (or 240 s) first: the exit code says which
            pass
        try:
            out["exit_code"] = run.proc.wait(timeout=args.no_valid_timeout_s + 120)
        except subprocess.TimeoutExpired:
            out["exit_code"] = None
        end = time.monotonic()
    finally:
        stop(groups, run.proc, grace_s=20)
    lines = run.read_to_end(30)
    out["seconds_from_launch"] = round(end - launched, 1)
    out["seconds_from_first_failure"] = None if first is None else round(end - first, 1)
    out["stop_line"] = next((line.strip() for line in lines if "stopping: no valid sample" in line), None)
    out["samples_refused_lines"] = sum("samples_refused" in line for line in lines)
    out["server_restarted"] = any("server_restarted" in line for line in lines)
    out["tracebacks"] = sum("Traceback" in line for line in lines)
    return out


def row_4(f: dict) -> str:
    if f.get("exit_code") is None:
        return f"did not stop within {f['no_valid_sample_timeout_s'] + 120:g} s of the first failure"
    took = f["seconds_from_first_failure"]
    return (f"exit {f['exit_code']} (no valid samples = {EXIT_NO_VALID_SAMPLES}) {took} s after the first "
            f"failed samples ({f['seconds_from_launch']} s from launch; no_valid_sample_timeout_s "
            f"{f['no_valid_sample_timeout_s']:g}); {f['samples_refused_lines']} samples_refused lines; "
            f"server restarted: {'yes' if f['server_restarted'] else 'no'}; "
            f"stop line: {f['stop_line'] or '(none)'}")


# --- the table ----------------------------------------------------------------------------------

def table(rows: list[tuple[str, str, str, str]], widths=(4, 34, 38, 60)) -> str:
    head = ("item", "measured", "before (issue 31)", "after (now)")
    out = []
    for k, cells in enumerate([head, *rows]):
        wrapped = [textwrap.wrap(c, w) or [""] for c, w in zip(cells, widths)]
        for parts in itertools.zip_longest(*wrapped, fillvalue=""):
            out.append("  ".join(p.ljust(w) for p, w in zip(parts, widths)).rstrip())
        out.append("-" * (sum(widths) + 2 * (len(widths) - 1)) if k == 0 else "")
    return "\n".join(out)


ITEMS = {"1": nan_model, "2": unfinished, "3": starving_fleet, "4": failing_reward}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", default="1,2,3,4", help="which of items 1-4 to measure")
    ap.add_argument("--window-s", type=float, default=20.0, help="item 3: the window counted")
    ap.add_argument("--fleet", type=int, default=20, help="item 3: fake identities")
    ap.add_argument("--no-valid-timeout-s", type=float, default=10.0,
                    help="item 4: learner.servers.no_valid_sample_timeout_s (default of the setting: 120)")
    ap.add_argument("--reward", choices=("raise", "exit"), default="raise",
                    help="item 4: the plug-in raises ValueError, or calls sys.exit(3)")
    ap.add_argument("--stop-timeout-s", type=float, default=120.0, help="item 1: how long to wait for the stop")
    ap.add_argument("--out", default="bench_results/bench_reliability.json")
    args = ap.parse_args()
    items = [i.strip() for i in args.items.split(",") if i.strip()]
    if not items or any(i not in ITEMS for i in items):
        ap.error(f"--items: a comma-separated subset of {','.join(ITEMS)}")

    from learner.models.builtin import build_model, build_tokenizer

    figures: dict = {}
    failed = False
    groups = ProcessGroups()
    with tempfile.TemporaryDirectory(prefix="bench-reliability-") as tmp:
        work = Path(tmp)
        model = work / "model"
        tok = build_tokenizer()
        build_model(tok).save_pretrained(model)
        tok.save_pretrained(model)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        try:
            for item in items:
                (work / f"item{item}").mkdir()
                start = time.monotonic()
                print(f"[bench] item {item} ...", flush=True)
                try:
                    figures[item] = ITEMS[item](work / f"item{item}", str(model), env, groups, args)
                except Exception as e:
                    failed = True
                    traceback.print_exc()
                    figures[item] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                finally:
                    groups.stop_all()            # whatever the item left (each stops its own)
                    groups.procs.clear()
                figures[item]["bench_seconds"] = round(time.monotonic() - start, 1)
                print(f"[bench] item {item}: {figures[item]['bench_seconds']} s", flush=True)
        finally:
            groups.stop_all()
    if "1" in figures:
        figures["1"].setdefault("stop_timeout_s", args.stop_timeout_s)

    def after(item: str, render, *a) -> str:
        f = figures[item]
        if "error" in f:
            return f"not measured: {one_line(f['error'])[:300]}"
        try:
            return render(f, *a)
        except (KeyError, TypeError, ValueError) as e:
            return f"(incomplete: {type(e).__name__} {e}) {json.dumps(f)[:300]}"

    rows = []
    for item in items:
        if item == "2":
            for key, name in (("2a", "rollout"), ("2b", "control")):
                rows.append((key, WHAT[key], BEFORE[key], after("2", row_2, name)))
        else:
            render = {"1": row_1, "3": row_3, "4": row_4}[item]
            rows.append((item, WHAT[item], BEFORE[item], after(item, render)))

    m = machine()
    print()
    print(machine_line(m))
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": {"command": " ".join(sys.argv), "cores": os.cpu_count(),
                                        "platform": platform.platform(),
                                        "python": platform.python_version(), "machine": m,
                                        "args": vars(args)},
                               "items": figures, "table": rows}, indent=1, default=str))
    print(f"[bench] wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
