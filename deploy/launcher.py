"""``slipstream run``: one learner and N rollout servers as separate OS processes, supervised.

The launcher checks the dataset, builds/resolves the model once, shares the cores among the
processes (:mod:`deploy.cores`), writes the resolved config into the run directory, starts the
learner, waits for its ``ready`` line (endpoints), starts the servers pointed at it, and shows the
learner's steps (:mod:`deploy.live`: a live view on a terminal, table lines otherwise; a summary
at the end). It stops everything — SIGTERM, then SIGKILL after
``launcher.shutdown_timeout_s`` — when the learner exits, when a process fails to start (exit 2,
a config error), when no rollout server is left, or on Ctrl-C. Each child is signalled by its own
pid.

Supervision: a rollout server that dies (a crash, a signal, an OOM kill) is not a reason to stop
the run — the learner re-issues its leases — it is started again, with the same server id, after
``restart_backoff_s`` doubling per restart up to ``restart_backoff_max_s``, at most
``restart_limit`` times within ``restart_window_s`` (:class:`RestartPolicy`); each death, restart
and give-up is an event line (``[run] server_died {...}``, ``server_restarted``,
``server_given_up``). A server that exits 0 (the learner said the run finished) is not restarted.

A child's stderr is not lost: its one-line startup error (``slipstream: ...``, exit code 2) is
printed as it comes, and when a child crashes the last lines of its stderr (the traceback) are.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from deploy.config_file import SlipstreamConfig
from deploy.cores import allowed_cpus, available_cores, pin, plan_affinity, share_cores
from deploy.live import LiveView, cell

SHOWN_EVENTS = ("runtime", "ready", "finished", "crashed", "server_joined", "server_lost", "stopped",
                "control_set", "control_pause", "control_resume", "staleness_changed", "checkpoint", "resumed",
                "checkpoint_failed", "data_exhausted", "protocol_error", "server_dropped", "server_readmitted",
                "server_version_mismatch", "new_run", "step_skipped", "samples_refused",
                "leases_preempted", "server_refused", "welcome_refused", "diverged", "record_failed",
                "record_recovered", "record_torn", "checkpoint_skipped", "stacks_written",
                "stalled", "progress_resumed", "stalled_abort")


def event_text(ev: dict) -> str:
    """An event as one readable line: ``event: line`` for one that carries its own ``line`` (the
    ``runtime`` decisions) or ``diagnosis`` (the watchdog's), else ``event {fields}``."""
    if isinstance(ev.get("line"), str):
        return f"{ev.get('event')}: {ev['line']}"
    if isinstance(ev.get("diagnosis"), str):             # the watchdog's stalled lines
        return f"{ev.get('event')}: {ev['diagnosis']}"
    rest = {k: v for k, v in ev.items() if k not in ("proc", "event", "run_id")}
    return f"{ev.get('event')} {json.dumps(rest, default=str)}"


STDERR_TAIL_LINES = 30
"""Lines of a crashed child's stderr shown (enough for a Python traceback)."""
STDERR_DRAIN_S = 5.0
"""After a child's stdout closes, how long to wait for the rest of its stderr."""
EXIT_STARTUP = 2
"""A child's exit code for a startup/config error (its one line on stderr says it all)."""


class Child:
    """A child process whose stdout and stderr lines are pumped into one queue.

    Queue items are ``(name, "out" | "err", line)``, then ``(name, "exit", None)`` once both
    streams are done (stderr is drained first, so an error line comes before the exit).
    """

    def __init__(self, name: str, cmd: list[str], events: queue.Queue, env: dict,
                 cpus: list[int] | None = None):
        self.name = name
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     bufsize=1, env=env)
        # Pinned from here (not in a preexec_fn, unsafe beside this process's pump threads): the
        # child is still starting its interpreter, so every thread it starts inherits the CPUs.
        if cpus:
            pin(self.proc.pid, cpus)
        self._err = threading.Thread(target=self._pump, args=(self.proc.stderr, "err", events),
                                     daemon=True)
        self._err.start()
        threading.Thread(target=self._pump_out, args=(events,), daemon=True).start()

    def _pump(self, stream, kind: str, events: queue.Queue) -> None:
        for line in stream:
            events.put((self.name, kind, line.rstrip("\n")))

    def _pump_out(self, events: queue.Queue) -> None:
        self._pump(self.proc.stdout, "out", events)
        self._err.join(timeout=STDERR_DRAIN_S)
        events.put((self.name, "exit", None))

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def _print_line(name: str, line: str, verbose: bool, view: LiveView) -> dict | None:
    """Show one stdout line of a child (a step in the view, notable events above it); its JSON
    event or None."""
    try:
        ev = json.loads(line)
    except ValueError:
        ev = None
    if not isinstance(ev, dict):
        if verbose or "Error" in line or "Traceback" in line:
            view.note(f"[{name}] {line}")
        return None
    if name == "learner":
        view.event(ev)
    if ev.get("event") == "step" and name == "learner":
        view.step(ev)
    elif ev.get("event") == "eval" and name == "learner":
        view.eval(ev)
        view.note(f"[{name}] eval accuracy {cell(ev, 'eval_accuracy', '{:.3f}')} reward "
                  f"{cell(ev, 'eval_reward_mean', '{:.3f}')} at version {ev.get('eval_version')}")
    elif ev.get("event") in SHOWN_EVENTS or verbose:
        view.note(f"[{name}] {event_text(ev)}")
    return ev


def _on_stderr(child: Child, line: str, verbose: bool) -> None:
    """A ``slipstream: ...`` line (the CLI's one-line error) is shown now; the rest is kept."""
    if verbose or line.startswith("slipstream"):
        print(f"[{child.name}] {line}", flush=True)
    else:
        child.stderr_tail.append(line)


def _report_exit(child: Child, code: int) -> None:
    print(f"[run] {child.name} exited with code {code}", flush=True)
    if code not in (0, EXIT_STARTUP) and child.stderr_tail:
        print(f"[run] last {len(child.stderr_tail)} lines of {child.name}'s stderr:", flush=True)
        for line in child.stderr_tail:
            print(f"[{child.name}] {line}", flush=True)


class RestartPolicy:
    """When a dead server is started again: its k-th restart within ``window_s`` waits
    ``min(backoff_max_s, backoff_s · 2^(k-1))``; past ``limit`` restarts in the window it is given
    up (:meth:`delay` returns None)."""

    def __init__(self, limit: int, backoff_s: float, backoff_max_s: float, window_s: float,
                 clock=time.monotonic):
        self.limit, self.backoff_s, self.backoff_max_s, self.window_s = limit, backoff_s, backoff_max_s, window_s
        self.clock = clock
        self.restarts: dict[str, list[float]] = {}

    def delay(self, name: str) -> float | None:
        """Seconds to wait before restarting ``name`` (recorded as a restart), or None."""
        now = self.clock()
        recent = [t for t in self.restarts.get(name, []) if now - t < self.window_s]
        if len(recent) >= self.limit:
            self.restarts[name] = recent
            return None
        recent.append(now)
        self.restarts[name] = recent
        return min(self.backoff_max_s, self.backoff_s * 2 ** (len(recent) - 1))


def _event(event: str, **fields) -> None:
    print(f"[run] {event} {json.dumps(fields)}", flush=True)


def _thread_split(cfg: SlipstreamConfig) -> tuple[int, int, dict[str, list[int]]]:
    """Threads for the learner and each server (:func:`deploy.cores.share_cores`) and, with
    ``launcher.pin_cores``, each process's own CPUs where the split fits them
    (:func:`deploy.cores.plan_affinity`; empty otherwise), printed."""
    cores = available_cores()
    n = cfg.launcher.num_rollout_servers
    learner, rollout = share_cores(cores, n, cfg.learner.threads, cfg.rollout.threads,
                                   synchronous=cfg.learner.staleness.max_staleness == 0)
    servers = ", ".join(f"rollout-{i} {rollout}" for i in range(n))
    print(f"[run] threads: learner {learner}, {servers} ({cores} cores)", flush=True)
    plan = (plan_affinity(allowed_cpus(), n, learner, rollout, cores) if cfg.launcher.pin_cores
            else None) or {}
    if plan:
        print("[run] cores: " + ", ".join(f"{name} {','.join(map(str, cpus))}"
                                          for name, cpus in plan.items()), flush=True)
    return learner, rollout, plan


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _server_metrics_port(cfg: SlipstreamConfig, index: int) -> int:
    """``rollout.network.metrics_port + index`` (0 stays 0: any free port). When the user did not choose
    the port and it is taken (another run on this machine), any free port instead, said on stdout
    (a port the user chose and that is taken stays an error of that server)."""
    base = cfg.rollout.network.metrics_port
    if not base:
        return 0
    port = base + index
    chosen = "metrics_port" in cfg.rollout.network.model_fields_set
    if not chosen and not _port_free(cfg.rollout.network.metrics_host, port):
        print(f"[run] rollout-{index}: metrics port {port} is in use; it gets a free one "
              f"(set rollout.network.metrics_port to choose)", flush=True)
        return 0
    return port


def launch(cfg: SlipstreamConfig, config_path: str | None, overrides: list[str],
           resume: str | None = None) -> int:
    from deploy.model_source import resolve_model
    from learner.data.prompts import check_dataset

    verbose = bool(os.environ.get("SLIPSTREAM_VERBOSE"))
    lc = cfg.learner                        # a bad dataset (or eval_data) stops us before any process
    check_dataset(lc.data, lc.evaluation.data, seed=lc.seed, batch_prompts=lc.batch.batch_prompts)
    model_path = resolve_model(cfg.model, log=lambda m: print(f"[setup] {m}", flush=True))
    learner_threads, rollout_threads, cpus = _thread_split(cfg)
    run_dir = Path(cfg.learner.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = cfg.model_dump(mode="json")
    resolved["model"] = model_path
    resolved["learner"]["threads"] = learner_threads
    resolved["rollout"]["threads"] = rollout_threads
    if cfg.launcher.secure and not cfg.learner.security.curve:
        from deploy.curve_keys import run_keys

        resolved["learner"]["security"], resolved["rollout"]["security"] = run_keys(run_dir)
    cfg_file = run_dir / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(resolved, sort_keys=False))
    (run_dir / "learner.json").unlink(missing_ok=True)      # a stale endpoint file misleads ctl

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("SLIPSTREAM_STACKS_DIR", str(run_dir / "stacks"))   # kill -USR1: every process's stacks
    base = [sys.executable, "-m", "deploy.cli"]
    events: queue.Queue = queue.Queue()
    children: dict[str, Child] = {}
    interrupted = threading.Event()

    def on_signal(signum, frame):
        interrupted.set()

    server_cmds: dict[str, list[str]] = {}
    restart_at: dict[str, float] = {}          # server -> monotonic time of its next start
    lc = cfg.launcher
    policy = RestartPolicy(lc.restart_limit, lc.restart_backoff_s, lc.restart_backoff_max_s,
                           lc.restart_window_s)

    def start_servers(endpoint: str) -> None:
        for i in range(cfg.launcher.num_rollout_servers):
            port = _server_metrics_port(cfg, i)
            server_cmds[f"rollout-{i}"] = [
                *base, "rollout", "--config", str(cfg_file), "--learner", endpoint,
                "--set", f"rollout.server_id=rollout-{i}", "--set", f"rollout.network.metrics_port={port}",
                "--set", f"rollout.seed={cfg.rollout.seed + i}"]
            child = children[f"rollout-{i}"] = Child(f"rollout-{i}", server_cmds[f"rollout-{i}"],
                                                     events, env, cpus.get(f"rollout-{i}"))
            print(f"[run] rollout-{i} pid {child.proc.pid}", flush=True)

    def restart_due() -> None:
        now = time.monotonic()
        for name, at in list(restart_at.items()):
            if at <= now:
                del restart_at[name]
                child = children[name] = Child(name, server_cmds[name], events, env, cpus.get(name))
                _event("server_restarted", server=name, pid=child.proc.pid)

    def servers_left() -> bool:
        return bool(restart_at) or any(c.proc.poll() is None for n, c in children.items()
                                       if n != "learner")

    view = LiveView(cfg.learner.total_steps)
    old_int = signal.signal(signal.SIGINT, on_signal)
    old_term = signal.signal(signal.SIGTERM, on_signal)
    exit_code = 0
    run_id = None                             # the learner's, from its events: whose report to write
    finished = False                          # the learner said the run is over: no restarts
    try:
        learner = children["learner"] = Child(
            "learner", [*base, "learner", "--config", str(cfg_file),
                        *(["--resume", resume] if resume else [])], events, env, cpus.get("learner"))
        print(f"[run] learner pid {learner.proc.pid}; run dir {run_dir}", flush=True)
        while True:
            if interrupted.is_set():
                view.status("stopping")
                view.note("[run] interrupted: stopping all processes")
                exit_code = 130
                break
            restart_due()
            try:
                name, kind, line = events.get(timeout=0.2)
            except queue.Empty:
                continue
            child = children[name]
            if kind == "err":
                _on_stderr(child, line, verbose)
            elif kind == "exit":
                code = child.proc.wait()
                if interrupted.is_set():
                    continue                   # stopped by our Ctrl-C: reported at the top
                _report_exit(child, code)
                if name == "learner":
                    exit_code = code
                    break
                if code == EXIT_STARTUP:             # a config error: a restart cannot help
                    exit_code = code
                    print(f"[run] stopping the run: {name} failed to start", flush=True)
                    break
                if code != 0 and not finished:
                    delay = policy.delay(name)
                    if delay is None:
                        _event("server_given_up", server=name, exit_code=code,
                               restarts=lc.restart_limit, window_s=lc.restart_window_s)
                    else:
                        restart_at[name] = time.monotonic() + delay
                        _event("server_died", server=name, exit_code=code, restart_in_s=delay,
                               restart=len(policy.restarts[name]))
                if not finished and not servers_left():
                    exit_code = 1
                    print("[run] stopping the run: no rollout server left", flush=True)
                    break
            else:
                ev = _print_line(name, line, verbose, view)
                if ev and name == "learner":
                    run_id = ev.get("run_id", run_id)
                # A server's "learner_finished" precedes its exit 0 on its own stream: the run
                # is over even if the learner's "finished" line has not been read yet.
                if ev and ev.get("event") in ("finished", "learner_finished"):
                    finished = True
                if (ev and name == "learner" and ev.get("event") == "ready"
                        and "rollout-0" not in children):
                    start_servers(ev["rollout"])
    finally:
        view.close()
        _stop_all(list(children.values()), cfg.launcher.shutdown_timeout_s)
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    report = _write_report(run_dir, run_id)
    final = run_dir / "final"
    if exit_code == 0 and final.exists():
        print(f"[run] done: metrics in {run_dir / 'metrics.jsonl'}, final model in {final}", flush=True)
    view.summary(run_dir=run_dir, final_policy=final if final.exists() else None,
                 checkpoint=_latest_checkpoint(cfg, run_dir), report=report,
                 resume=_resume_command(config_path, overrides)
                 if _latest_checkpoint(cfg, run_dir) is not None else None)
    return exit_code


def _resume_command(config_path: str | None, overrides: list[str]) -> str:
    """The command that continues this run from its latest checkpoint."""
    parts = ["slipstream run", *([f"--config {config_path}"] if config_path else []),
             *(f"--set {shlex.quote(o)}" for o in overrides), "--resume"]
    return " ".join(parts)


def _latest_checkpoint(cfg: SlipstreamConfig, run_dir: Path) -> Path | None:
    from learner.state.checkpoint import Checkpointer

    try:
        return Checkpointer(cfg.learner.checkpoint.dir or run_dir / "checkpoints").latest_complete()
    except OSError:
        return None


def _write_report(run_dir: Path, run_id: str | None) -> Path | None:
    """``slipstream report`` of this run (deploy/report.py), also after Ctrl-C or a crash; its path
    is said on stdout. A run that trained no step has none; a report that fails says so and never
    changes the run's exit code."""
    from deploy.report import write_report
    from protocol.errors import StartupError

    if run_id is None or not (run_dir / "metrics.jsonl").exists():
        return None
    try:
        path = write_report(run_dir, run_id)
    except StartupError:                       # this run has no row in metrics.jsonl
        print("[run] no report: this run trained no step", flush=True)
    except Exception as e:  # noqa: BLE001 -- plots must not turn a finished run into a failed one
        print(f"[run] the report failed: {type(e).__name__}: {e}", flush=True)
    else:
        print(f"[run] report: {path}", flush=True)
        return path
    return None


def _stop_all(children: list[Child], timeout_s: float) -> None:
    for c in children:
        c.terminate()
    deadline = time.monotonic() + timeout_s
    for c in children:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"[run] {c.name} did not stop in {timeout_s}s: killing pid {c.proc.pid}", flush=True)
            c.kill()
            c.proc.wait()
