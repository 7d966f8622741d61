"""The rollout server process: sockets and loops around three components.

* :class:`rollout_server.pipeline.Pipeline`: assignment -> engine -> samples -> rewards;
* :class:`rollout_server.outbox.Outbox`: results until acknowledged, re-sent after reconnects;
* :class:`rollout_server.receiver.WeightsReceiver`: fetch, verify, apply, report new weights.

This module owns the learner link, the credits, health and shutdown; each component is handed the
few functions it needs (a send, a clock, the engine's generate) and is tested without sockets.

Delivery (docs/design.md §6): the server is a DEALER connected to the learner's ROUTER. It grants
*credits* (free generation slots, counted in samples) with ``WorkRequest``; the learner answers
with ``Assignment`` leases. On each ``Welcome`` the server grants every free slot
(``max_concurrency`` minus the samples it holds) and re-sends every unacknowledged result; after
that, the credits of each finished batch. Credits are held back while the outbox holds more than
``UNACKED_CREDIT_FACTOR x max_concurrency`` samples (a learner that never acks cannot make this
server buffer without bound); the next Ack releases them.

Hello: sent at start, after the link comes back (socket monitor: DISCONNECTED, then CONNECTED),
and when the learner answers ``Error(code="unknown_server")`` (it restarted). Only one Hello is
outstanding at a time: further ``unknown_server`` answers (to heartbeats queued while the learner
was away) are ignored until its Welcome, or until ``learner_timeout_s`` passes with the link up.
Only the first Welcome after a Hello counts; another one changes nothing (no second grant).

Hostile input: every message from the learner is decoded and validated by ``protocol``; what does
not decode is counted (``slipstream_protocol_errors_total``) and answered with
``Error(code="protocol_error")``. What decodes but cannot be honoured is refused and counted in
``slipstream_rollout_errors_total{kind}`` (kinds: :mod:`rollout_server.metrics`): an assignment is
answered with ``Error(code="assignment_refused", ref_id=<its message id>)`` (the learner sends an
Assignment with its assignment id as message id, releases the lease at once and re-issues it).
A Welcome whose ``weights_endpoint`` this process could not connect to (checked as
``rollout.learner`` is: :func:`protocol.plumbing.sockets.endpoint_problem`) is a protocol error
too: counted, answered with ``protocol_error``, logged once per endpoint (``welcome_refused``,
a warning) and otherwise ignored: the Hello stays unanswered, so it is sent again after
``learner_timeout_s`` (a learner that was fixed or restarted is joined then), nothing is granted,
and manifests are refused until a Welcome names a usable endpoint. The server keeps running and
serving ``/healthz`` (503: not welcomed) rather than exiting: a restart would get the same Welcome.

Restarts and runs: every Hello carries a per-process ``session`` (metadata), so the learner tells
a restarted server (same ``server_id``) from a reconnect and re-issues the old process's leases
at once. A Welcome from another run than the last one (another ``run_id``, or a learner version
below the one this server serves: a learner restarted without ``--resume``) drops the leases and
unacknowledged results of the old run (counted ``new_run``) and rebases the weights receiver:
the learner's current weights are fetched whatever their version, and no work runs before they
are applied (:meth:`WeightsReceiver.rebase`). A failed fetch or update is reported to the learner
as ``Error(code="weights_failed")`` (its circuit breaker). When the learner says
``learner_finished``, the server drains and exits 0 (``exit_on_learner_finished``).

Health (``/healthz``): 200 while welcomed, the link is up and not stopping. ZeroMQ heartbeats
(``ZMQ_HEARTBEAT_IVL`` / ``_TIMEOUT``, answered by the learner's libzmq) take the link down within
``learner_timeout_s`` even when no TCP reset arrives. The learner echoes every Heartbeat, so a
learner whose process hangs with its sockets open shows too: once a Heartbeat came back, one
must have arrived within ``learner_timeout_s``.

A loop that dies of an exception (``recv``, ``pipeline``, ``heartbeat``, ``weights``,
``monitor``) ends the process, whatever else is running: ``crashed`` event (task, error), its
traceback and one ``slipstream rollout: ...`` line on stderr, exit :data:`EXIT_TASK_CRASHED`;
no drain (the dead loop may be the one it needs). ``slipstream run`` restarts such a server.

Shutdown (SIGTERM/SIGINT): stop asking for work, finish every queued and generating assignment
(there is no "return lease" message; finishing is as good and loses nothing), wait for the acks of
all results — bounded by ``drain_timeout_s``; leases not finished by then expire on the learner and
are re-issued — then close the engine and exit 0. Acks cannot come from a learner that said
``learner_finished`` or whose link is down for ``drain_disconnected_s``: then the server stops
waiting at once. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
import traceback
import uuid

import zmq
import zmq.asyncio

import protocol
from protocol.plumbing.curve import CurveClient, CurveServer, load_key_pair, load_public_key
from protocol.plumbing.http import HttpEndpoint
from protocol.plumbing.process import EventLog, cancel_all, supervise, wait_event
from protocol.plumbing.sockets import (
    bind,
    check_endpoint,
    check_peer_endpoint,
    make_socket,
    reachable_endpoint,
    route_address,
)
from protocol.plumbing.stacks import dump_stacks, install_stack_dump, stacks_dir
from protocol.plumbing.unfinished import MONITOR_EVENTS, UnfinishedGuard
from protocol.plumbing.watchdog import Waiting, Watchdog
from rollout_server.config import RolloutConfig
from rollout_server.engine import Engine
from rollout_server.engines import create_engine
from rollout_server.episodes import EpisodeRunner, ObservationTokens, load_environments
from rollout_server.metrics import RolloutMetrics
from rollout_server.outbox import Outbox
from rollout_server.pipeline import Limits, Pipeline, Refused
from rollout_server.receiver import WeightsReceiver, ZmqChunkChannel
from rollout_server.relay import RelayServer, RelayStore
from rollout_server.rewards import Rewarder
from rollout_server.weights import default_weights_limit

UNACKED_CREDIT_FACTOR = 4
HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
EXIT_TASK_CRASHED = 4
"""The exit code when one of the server's loops died of an exception (a bug, or a failure nothing
handles): the process ends rather than stay up with that loop gone, so a supervisor restarts it."""


class RolloutService:
    """One rollout server. The constructor checks the config, binds ``/metrics`` and then loads
    the model (so a taken port or a bad endpoint fails in a second, not after a model load);
    :meth:`run` connects to the learner and serves until stopped."""

    def __init__(self, cfg: RolloutConfig, model_path: str):
        self.cfg = cfg
        check_endpoint(cfg.learner, "rollout.learner")
        self.curve = self._curve_keys()           # key files are checked before the model loads
        self.server_id = cfg.server_id or f"{socket.gethostname()}-{os.getpid()}"
        self.session = uuid.uuid4().hex[:16]      # this process (a restart is a new session)
        self.engine: Engine | None = None
        self.run_id: str | None = None
        self.metrics = RolloutMetrics()
        self.log = EventLog("rollout", run_id=lambda: self.run_id,
                            version=lambda: self.engine.version if self.engine is not None else None)
        self.clock = time.monotonic
        self.stopping = asyncio.Event()
        self.abort = asyncio.Event()          # a second signal: do not wait for the drain
        self.progress = asyncio.Event()       # set whenever generation finishes or an ack arrives
        self.version_changed = asyncio.Event()   # set whenever the engine applied new weights
        self.welcomed = asyncio.Event()
        self.hello_sent_at: float | None = None    # a Hello not yet answered by a Welcome
        self.learner_finished = False
        self.link_up = False                  # the socket monitor's view of the learner link
        self.link_down_since: float | None = None
        self.had_link = False
        self.last_learner_message: float | None = None
        self.learner_echoes = False           # the learner sends Heartbeats (then silence is loss)
        self.withheld = 0                     # credits not granted yet (outbox full, see docstring)
        self.handshake_failures: set[int] = set()   # kinds of refused handshakes already logged
        self.refused_endpoints: set[str] = set()    # bad Welcome endpoints already logged
        self.rewarder: Rewarder | None = None
        self.ctx = zmq.asyncio.Context()
        self.sock: zmq.asyncio.Socket | None = None
        self.guard: UnfinishedGuard | None = None     # the learner socket's, made with it in run()
        self.send_lock = asyncio.Lock()
        self.outbox = Outbox(self.send_frames, self.metrics, cfg.network.ack_timeout_s, self.clock,
                             on_change=self.progress.set)
        self.pipeline: Pipeline | None = None          # needs the engine (its vocabulary)
        self.http = HttpEndpoint(self.metrics.render, self.health,
                                 on_error=lambda status: self.metrics.count("http_request"))
        try:
            port = self._serve_metrics()
            self.metrics_url = f"http://{cfg.network.metrics_host}:{port}"
            # Then the models: a reward model (builtin:reward_model), the policy.
            try:
                self.rewarder = Rewarder(cfg.reward.fn, cfg.reward.weights, cfg.reward.options,
                                         threads=cfg.reward.threads, timeout_s=cfg.reward.timeout_s,
                                         by_dataset=cfg.reward.by_dataset)
            except ValueError as e:        # a spec, an import or a reward model that cannot work
                raise protocol.StartupError(f"rollout.reward: {e}") from None
            try:                           # an environment that cannot load or be called
                environments = load_environments(cfg.environment)
            except ValueError as e:
                raise protocol.StartupError(f"rollout.environment: {e}") from None
            if cfg.threads:
                import torch
                torch.set_num_threads(cfg.threads)
            self.engine = create_engine(cfg, model_path)
        except BaseException:
            self.http.close()
            if self.rewarder is not None:
                self.rewarder.close()
            self.ctx.term()
            raise
        self.model_name = os.path.basename(os.path.normpath(model_path))
        self.metrics.policy_version.set(self.engine.version)
        episodes = None
        env = cfg.environment
        if env.class_name or env.named:       # multi-turn episodes (rollout_server/episodes.py)
            episodes = EpisodeRunner(
                generate=self.engine.generate, decode=self.engine.decode,
                observations=ObservationTokens(self.engine.tokenizer, role=env.role,
                                               chat_template=env.chat_template),
                settings=env, classes=environments, metrics=self.metrics, log=self.log,
                max_model_len=self.engine.max_model_len, clock=self.clock, model_name=self.model_name)
        self.pipeline = Pipeline(
            server_id=self.server_id,
            limits=Limits(max_concurrency=cfg.generation.max_concurrency, max_new_tokens=cfg.generation.max_new_tokens_limit,
                          max_prompt_tokens=cfg.generation.max_prompt_tokens, vocab_size=self.engine.vocab_size,
                          max_model_len=self.engine.max_model_len),
            generate=self.engine.generate, decode=self.engine.decode,
            score=self.rewarder.score_many, emit=self.outbox.put, release=self.release,
            before_batch=self.before_batch,
            metrics=self.metrics, log=self.log, on_change=self.progress.set,
            batch_wait_s=cfg.generation.batch_wait_s, clock=self.clock, episodes=episodes,
            give_back=self.give_back)
        self.relay_store = RelayStore() if cfg.relay.port is not None else None
        self.relay_source: protocol.WeightsSource | None = None    # set once the relay is bound
        self.receiver = WeightsReceiver(
            connect=self._chunk_channel,
            apply=self._apply_weights, report=self.send, version=lambda: self.engine.version,
            server_id=self.server_id, metrics=self.metrics, log=self.log,
            max_weights_bytes=cfg.weights.max_bytes or default_weights_limit(model_path),
            chunk_timeout_s=cfg.weights.chunk_timeout_s, chunk_window=cfg.weights.chunk_window,
            chunk_retries=cfg.weights.chunk_retries, clock=self.clock, keep_base=cfg.weights.delta,
            relay=self.relay_store, relay_timeout_s=cfg.relay.timeout_s,
            on_failed=lambda message: self.send(protocol.Error(code="weights_failed", message=message)))
        w = cfg.watchdog
        self.watchdog = Watchdog(
            self.server_id, diagnose=self.waiting_on, log=self.log, stall_s=lambda: w.stall_s,
            dump_after_s=lambda: w.dump_after_s, abort_after_s=lambda: w.abort_after_s,
            dump=lambda: dump_stacks(stacks_dir(), self.server_id, self.watchdog.loop))
        self.watchdog.export(self.metrics.stalled_seconds, self.metrics.waiting_on)
        self.metrics.learner_connected.set_function(lambda: float(self.connected()))
        self.metrics.requests_inflight.set_function(
            lambda: float(self.pipeline.assigned + self.outbox.samples))

    def _curve_keys(self) -> CurveClient | None:
        """The CURVE keys for the learner link (``security.curve``), or None."""
        sec = self.cfg.security
        if not sec.curve:
            return None
        public, secret = load_key_pair(sec.secret_key_file, "rollout.security.secret_key_file")
        server = load_public_key(sec.learner_public_key_file, "rollout.security.learner_public_key_file")
        return CurveClient(public_key=public, secret_key=secret, server_key=server)

    def _serve_metrics(self) -> int:
        """Bind /metrics. The default port, when taken (a second server on this machine), gives
        way to a free one, said in an event; a port the user chose is a StartupError."""
        cfg, what = self.cfg, "rollout.network.metrics_port"
        try:
            return self.http.serve(cfg.network.metrics_host, cfg.network.metrics_port, what)
        except protocol.StartupError:
            if "metrics_port" in cfg.network.model_fields_set or cfg.network.metrics_port == 0:
                raise
        port = self.http.serve(cfg.network.metrics_host, 0, what)
        self.log("metrics_port_in_use", wanted=cfg.network.metrics_port, port=port,
                 hint=f"the default port is taken; serving on {port} (set {what} to choose)")
        return port

    # ---- transport -------------------------------------------------------------------------
    def _chunk_channel(self, endpoint: str, max_bytes: int, relay_key: str | None = None) -> ZmqChunkChannel:
        """A fetch's link: the learner's weights socket (its key), or a peer's relay (``relay_key``:
        that relay's public key, with CURVE on)."""
        curve = self.curve
        if curve is not None and relay_key is not None:
            curve = CurveClient(curve.public_key, curve.secret_key, relay_key.encode())
        return ZmqChunkChannel(self.ctx, endpoint, max_bytes, curve=curve,
                               unfinished_timeout_s=self.cfg.network.unfinished_timeout_s,
                               on_cut=self.connection_cut)

    def _open_relay(self) -> tuple[zmq.asyncio.Socket, RelayServer] | None:
        """Bind the relay socket (rollout.relay.port set): its server and the source Hello names."""
        cfg = self.cfg.relay
        if cfg.port is None:
            return None
        curve = None
        if self.curve is not None:          # a CURVE server with this server's own key pair
            curve = CurveServer(self.curve.public_key, self.curve.secret_key, domain="relay")
        sock = make_socket(self.ctx, zmq.ROUTER, max_message_bytes=64 << 10, hwm=64, curve=curve)
        try:
            port = bind(sock, cfg.bind_host, cfg.port, "rollout.relay.port")
        except BaseException:
            sock.close(0)
            raise
        host = cfg.advertise_host or route_address(self.cfg.learner)
        endpoint = f"tcp://{host}:{port}"
        self.relay_source = protocol.WeightsSource(
            endpoint=endpoint, public_key=self.curve.public_key.decode() if self.curve is not None else "")
        self.receiver.relay_endpoint = endpoint
        server = RelayServer(self.relay_store, sock, wait_s=cfg.wait_s, metrics=self.metrics, log=self.log)
        self.log("relay", endpoint=endpoint, curve=self.curve is not None)
        return sock, server

    async def send(self, message: protocol.Message) -> None:
        await self.send_frames(protocol.encode(message))

    async def send_frames(self, frames: list) -> None:
        async with self.send_lock:
            await self.sock.send_multipart(frames, copy=False)

    def _learner_socket(self) -> zmq.asyncio.Socket:
        cfg = self.cfg
        sock = make_socket(self.ctx, zmq.DEALER, max_message_bytes=cfg.network.max_message_bytes,
                           identity=self.server_id.encode(), curve=self.curve)
        sock.setsockopt(zmq.RECONNECT_IVL, int(cfg.network.reconnect_ivl_s * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(cfg.network.reconnect_ivl_max_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(cfg.network.heartbeat_interval_s * 1000)))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(cfg.network.learner_timeout_s * 1000)))
        sock.setsockopt(zmq.HEARTBEAT_TTL, max(100, int(cfg.network.learner_timeout_s * 1000)))
        return sock

    # ---- main ------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal)
        remove_stacks = install_stack_dump(self.server_id, stacks_dir(), self.log)   # kill -USR1
        self.sock = self._learner_socket()
        # One monitor per socket (libzmq): monitor_loop hands the guard its connection events.
        self.guard = UnfinishedGuard(self.sock, "learner", max_bytes=self.cfg.network.max_message_bytes,
                                     open_s=self.cfg.network.unfinished_timeout_s, curve=self.curve is not None,
                                     router=False, on_cut=self.connection_cut, own_monitor=False)
        monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                               | MONITOR_EVENTS | HANDSHAKE_FAILURES)
        self.sock.connect(self.cfg.learner)
        self.log("runtime", **getattr(self.engine, "runtime", {}))   # device, dtype, and why
        self.log("ready", server_id=self.server_id, learner=self.cfg.learner,
                 metrics=f"{self.metrics_url}/metrics", healthz=f"{self.metrics_url}/healthz")
        tasks = []
        crash = None
        relay = None
        try:
            relay = self._open_relay()
            await self.say_hello()
            tasks = [asyncio.create_task(coro, name=name) for name, coro in (
                ("recv", self.recv_loop()), ("pipeline", self.pipeline.run()),
                ("heartbeat", self.heartbeat_loop()), ("weights", self.receiver.run()),
                ("monitor", self.monitor_loop(monitor)), ("unfinished", self.guard.run()),
                *((("relay", relay[1].serve()),) if relay is not None else ()))]
            self.watchdog.start()
            await supervise(tasks, self.stopping, self.log)        # logs a task that crashed
            crash = first_crash(tasks)
            if crash is None:
                self.log("stopping", unacked=len(self.outbox), queued=len(self.pipeline.queue),
                         assigned=self.pipeline.assigned)
                drained = await self.drain(tasks)
                self.log("drained", ok=drained, unacked=len(self.outbox),
                         assigned=self.pipeline.assigned)
                crash = first_crash(tasks)
                if crash is not None:
                    self.log("crashed", task=crash.get_name(), error=repr(crash.exception()))
        finally:
            self.watchdog.stop()
            await cancel_all(tasks)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            remove_stacks()
            self.sock.disable_monitor()
            monitor.close(0)
            self.guard.close()
            self.sock.close(0)
            if relay is not None:
                relay[0].close(0)
            await self.close()
        if crash is not None:
            return self.crashed(crash)
        self.log("stopped")
        return 0

    def crashed(self, task: asyncio.Task) -> int:
        """A loop died (see the module docstring): its traceback and one line on stderr (the
        launcher shows ``slipstream ...`` lines as they come), and the exit code."""
        error = task.exception()
        traceback.print_exception(error, file=sys.stderr)
        print(f"slipstream rollout: the {task.get_name()!r} task crashed: "
              f"{type(error).__name__}: {str(error)[:500]}; exiting with code {EXIT_TASK_CRASHED}",
              file=sys.stderr, flush=True)
        self.log("stopped", level="error", exit_code=EXIT_TASK_CRASHED, crashed_task=task.get_name())
        return EXIT_TASK_CRASHED

    async def close(self) -> None:
        """Release the engine, the HTTP endpoint, the reward threads and the ZeroMQ context
        (:meth:`run` does this on its way out; call it for a service that never ran). The
        context is destroyed, not terminated: a socket a crashed loop left open would make
        ``term()`` wait for it forever, a process up with nothing running."""
        if self.pipeline is not None and self.pipeline.episodes is not None:
            await self.pipeline.episodes.close()
        await self.engine.close()
        self.http.close()
        self.rewarder.close()
        self.ctx.destroy(linger=0)

    def on_signal(self) -> None:
        if self.stopping.is_set():
            self.abort.set()
        self.stopping.set()

    def busy(self) -> bool:
        return bool(self.pipeline.assigned or len(self.outbox))

    def learner_gone(self) -> bool:
        """No ack can come: the run finished, or the link has been down a while."""
        return self.learner_finished or (
            self.link_down_since is not None
            and self.clock() - self.link_down_since > self.cfg.shutdown.drain_disconnected_s)

    async def drain(self, tasks: list[asyncio.Task]) -> bool:
        """Finish queued and generating work and wait for its acks, up to ``drain_timeout_s``."""
        deadline = self.clock() + self.cfg.shutdown.drain_timeout_s
        while (self.busy() and not self.abort.is_set() and not self.learner_gone()
               and self.clock() < deadline):
            if any(t.done() for t in tasks):          # a loop crashed: nothing more will finish
                return False
            self.progress.clear()
            waiters = [asyncio.create_task(e.wait()) for e in (self.progress, self.abort)]
            # Bounded: the link-down time is checked by polling learner_gone() at least this often.
            await asyncio.wait(waiters, timeout=min(0.5, max(0.0, deadline - self.clock())),
                               return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()
        return not self.busy()

    # ---- the watchdog's view -----------------------------------------------------------------
    def waiting_on(self, idle_s: float) -> Waiting:
        """What this server waits on, in one line (protocol.plumbing.watchdog). Waiting for work
        from a learner that is connected and answering is not a stall: the learner's own watchdog
        says why it gives none."""
        now, learner = self.clock(), self.cfg.learner
        if self.stopping.is_set() or self.learner_finished:
            return Waiting("other", "stopping", expected=True)
        stage = self.pipeline.stage
        if stage is not None and stage[0] != "weights":
            kind, what, since = stage
            doing = "engine generate" if kind == "generate" else "reward scoring"
            return Waiting(kind, f"{doing} has run {now - since:.0f} s on one batch ({what})")
        if self.receiver.busy is not None:
            version, since = self.receiver.busy
            return Waiting("weights", f"fetching and applying weights version {version} has run "
                                      f"{now - since:.0f} s (from {self.receiver.endpoint})")
        if not self.had_link:
            failed = (" (its CURVE handshake was refused: check the keys)"
                      if self.handshake_failures else "; is it running, and is rollout.learner right?")
            return Waiting("learner", f"no connection to the learner at {learner}{failed}")
        if not self.link_up:
            down = now - self.link_down_since if self.link_down_since is not None else idle_s
            return Waiting("learner", f"the link to the learner at {learner} has been down "
                                      f"{down:.0f} s (reconnecting)")
        if not self.welcomed.is_set():
            asked = now - self.hello_sent_at if self.hello_sent_at is not None else idle_s
            refused = (f"; its Welcome named a weights endpoint this server cannot reach "
                       f"({sorted(self.refused_endpoints)[0]})" if self.refused_endpoints else "")
            return Waiting("learner", f"the learner at {learner} has not answered Hello for "
                                      f"{asked:.0f} s{refused}")
        if self.learner_echoes and not self.connected():
            last = self.last_learner_message
            return Waiting("learner", f"the learner at {learner} has sent nothing for "
                                      f"{now - last:.0f} s (its heartbeat echoes stopped)"
                           if last is not None else f"the learner at {learner} has sent nothing")
        if stage is not None:
            return Waiting("weights", f"a batch ({stage[1]}) has waited {now - stage[2]:.0f} s "
                                      f"for the announced weights")
        if self.withheld and len(self.outbox):
            return Waiting("learner", f"{len(self.outbox)} results ({self.outbox.samples} samples) "
                                      f"wait for the learner's acks; {self.withheld} credits held "
                                      "back until they come")
        return Waiting("work", f"no assignment from the learner at {learner} in {idle_s:.0f} s "
                               f"({self.cfg.generation.max_concurrency - self.pipeline.assigned} slots free); "
                               "the learner is connected and answering", expected=True)

    # ---- learner link ----------------------------------------------------------------------
    def connected(self) -> bool:
        """Welcomed, link up, and — for a learner that answers heartbeats — heard from lately."""
        if not (self.welcomed.is_set() and self.link_up):
            return False
        if not self.learner_echoes:
            return True
        last = self.last_learner_message
        return last is not None and self.clock() - last <= self.cfg.network.learner_timeout_s

    def health(self) -> tuple[bool, dict]:
        """/healthz: 200 while connected and serving; 503 before the Welcome, once the learner is
        lost (see :meth:`connected`), and once stopping."""
        connected = self.connected()
        last = self.last_learner_message
        info = {"server_id": self.server_id, "run_id": self.run_id,
                "version": self.engine.version if self.engine is not None else None,
                "connected": connected, "link_up": self.link_up, "stopping": self.stopping.is_set(),
                "last_learner_message_s": None if last is None else round(self.clock() - last, 3),
                "assigned_samples": self.pipeline.assigned if self.pipeline is not None else 0,
                "unacked_results": len(self.outbox)}
        return connected and not self.stopping.is_set(), info

    async def say_hello(self) -> None:
        self.welcomed.clear()
        self.hello_sent_at = self.clock()
        await self.send(protocol.Hello(server_id=self.server_id, engine=self.engine.name,
                                       model=self.model_name, version=self.engine.version,
                                       max_concurrency=self.cfg.generation.max_concurrency,
                                       metadata={"session": self.session}, relay=self.relay_source))

    def hello_outstanding(self) -> bool:
        """A Hello is waiting for its Welcome, and not for longer than ``learner_timeout_s``."""
        return (self.hello_sent_at is not None
                and self.clock() - self.hello_sent_at < self.cfg.network.learner_timeout_s)

    async def rehello(self, reason: str) -> None:
        self.metrics.reconnects.inc()
        self.log("rehello", reason=reason)
        await self.say_hello()

    def connection_cut(self, cut) -> None:
        """A connection the unfinished-message guard ended (protocol.plumbing.unfinished.Cut)."""
        self.metrics.connections_cut.labels(socket=cut.socket, reason=cut.reason).inc()
        self.log("connection_cut", level="warning", socket=cut.socket, peer=cut.peer,
                 reason=cut.reason, unfinished_bytes=cut.unfinished_bytes, detail=cut.detail)

    async def monitor_loop(self, monitor: zmq.asyncio.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            message = parse_monitor_message(await monitor.recv_multipart())
            event = message["event"]
            if event & MONITOR_EVENTS:
                self.guard.connection_event(event, message["value"])
            if event & HANDSHAKE_FAILURES:
                # A refused key or a CURVE mismatch: the link never comes up; say so once per
                # kind of failure (libzmq keeps retrying with backoff).
                if event not in self.handshake_failures:
                    self.handshake_failures.add(event)
                    self.metrics.count("learner_handshake")
                    self.log("learner_handshake_failed", level="error",
                             reason="the learner refused this server's CURVE key (not in its "
                                    "allowed_clients_dir)" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                             else "CURVE on one side only, or the wrong learner public key")
                continue
            if event == zmq.EVENT_CONNECTED:
                again = self.had_link and not self.link_up
                self.link_up, self.had_link, self.link_down_since = True, True, None
                if again:
                    await self.rehello("link re-established")
            elif event == zmq.EVENT_DISCONNECTED and self.link_up:
                self.link_up, self.link_down_since = False, self.clock()
                self.log("disconnected", learner=self.cfg.learner)
            self.progress.set()

    async def _apply_weights(self, update):
        seconds = await self.engine.update_weights(update)
        self.watchdog.progress("weights")
        self.version_changed.set()
        return seconds

    async def before_batch(self, batch: list[protocol.Assignment]) -> None:
        """Before a batch generates: the announced weights (bounded by ``weights_wait_s``), and
        at least the version its assignments were issued at. The learner counts a sample's
        staleness from its tokens' version and bounds it by issuing work for the batch being filled and at most η more
        ahead of training (docs/design.md §3); generated with older weights — an assignment issued right after
        a step can arrive before that step's manifest, which is announced once its checksums are
        done — its samples can be over the limit when trained and are dropped: wasted work. An
        update that does not come in time is counted (``weights_behind``) and the batch runs."""
        deadline = self.clock() + self.cfg.weights.wait_s
        await self.receiver.wait_settled(self.cfg.weights.wait_s)
        needed = max(a.version for a in batch)
        while self.engine.version < needed:
            left = deadline - self.clock()
            self.version_changed.clear()
            if left <= 0 or self.engine.version >= needed:
                break
            if not await wait_event(self.version_changed, left):
                break
        if self.engine.version < needed:
            self.metrics.count("weights_behind")
            self.log("weights_behind", serving=self.engine.version, issued_at=needed,
                     waited_s=round(self.cfg.weights.wait_s, 3))

    async def heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.network.heartbeat_interval_s)      # a period, not a sync point
            idle = self.pipeline.idle_ratio()
            self.metrics.idle_ratio.set(idle)
            await self.send(protocol.Heartbeat(sender_id=self.server_id, version=self.engine.version,
                                               inflight=self.pipeline.assigned, idle_ratio=idle))
            await self.outbox.resend_due()
            if self.hello_sent_at is not None and self.link_up and not self.hello_outstanding():
                await self.rehello("no Welcome within learner_timeout_s")

    async def release(self, n: int) -> None:
        """Credits of finished work go back to the learner (unless stopping or not welcomed:
        the next Welcome grants every free slot)."""
        if self.stopping.is_set() or not self.welcomed.is_set():
            return
        self.withheld += n
        await self.grant()

    async def grant(self) -> None:
        if self.withheld and self.outbox.samples < UNACKED_CREDIT_FACTOR * self.cfg.generation.max_concurrency:
            n, self.withheld = self.withheld, 0
            await self.send(protocol.WorkRequest(server_id=self.server_id, credits=n))

    # ---- messages from the learner ---------------------------------------------------------
    async def recv_loop(self) -> None:
        while True:
            frames = [f.bytes for f in await self.guard.receive(self.sock)]
            self.last_learner_message = self.clock()
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as e:
                self.metrics.protocol_errors.inc()
                self.log("protocol_error", error=str(e)[:500])
                await self.send(protocol.Error(code="protocol_error", message=str(e)[:1000],
                                               ref_id=protocol.message_id(frames)))
                continue
            await self.handle(msg, frames)

    async def give_back(self, a: protocol.Assignment, reason: str) -> None:
        """Hand ``a`` back to the learner for re-issue (a refusal: its lease is released)."""
        await self.send(protocol.Error(code="assignment_refused", ref_id=a.assignment_id,
                                       message=f"assignment {a.assignment_id[:200]!r}: {reason}"[:1000]))

    async def handle(self, msg: protocol.Message, frames: list) -> None:
        if isinstance(msg, protocol.Assignment):
            try:
                self.pipeline.admit(msg)
                self.watchdog.progress("assignment")
            except Refused as r:
                self.metrics.count(r.kind)
                self.log("assignment_refused", assignment_id=msg.assignment_id[:200], kind=r.kind,
                         reason=str(r))
                await self.send(protocol.Error(
                    code="assignment_refused", ref_id=protocol.message_id(frames),
                    message=f"assignment {msg.assignment_id[:200]!r} refused: {r}"))
        elif isinstance(msg, protocol.Ack):
            self.watchdog.progress("ack")
            self.outbox.ack(msg)
            await self.grant()
        elif isinstance(msg, protocol.WeightsAvailable):
            self.receiver.offer(msg)
        elif isinstance(msg, protocol.Heartbeat):
            self.learner_echoes = True
        elif isinstance(msg, protocol.Welcome):
            await self.on_welcome(msg, frames)
        elif isinstance(msg, protocol.Error):
            if msg.code == "unknown_server":
                if not self.hello_outstanding():
                    await self.rehello(msg.message[:200])
            elif msg.code == "learner_finished":
                self.on_learner_finished(msg)
            else:
                if msg.code == "learner_stopping":
                    # Stopped, not finished: its leases end with it, so queued work is dropped;
                    # this server stays up and re-joins a resumed learner on its own.
                    dropped = self.pipeline.drop()
                    self.log("learner_stopping", dropped_queued_samples=dropped)
                self.log("learner_error", code=msg.code[:100], message=msg.message[:500])
        else:
            self.metrics.count("unexpected_message")
            self.log("unexpected_message", type=type(msg).TYPE)

    def on_learner_finished(self, msg: protocol.Error) -> None:
        """The run is over (the normal end, not an error): acks may no longer come; exit once
        drained with ``exit_on_learner_finished``. Said as a ``learner_finished`` event (info),
        the line ``slipstream run`` takes for the end of the run."""
        first = not self.learner_finished
        self.learner_finished = True
        self.progress.set()
        exiting = self.cfg.exit_on_learner_finished
        if first:
            self.log("learner_finished", level="info", action="exiting" if exiting else "staying",
                     message=msg.message[:500])
        if exiting and not self.stopping.is_set():
            self.stopping.set()

    async def on_welcome(self, msg: protocol.Welcome, frames: list) -> None:
        if self.hello_sent_at is None:               # a repeat, or never asked for
            self.log("welcome_ignored", reason="no Hello outstanding")
            return
        try:
            check_peer_endpoint(msg.weights_endpoint, "Welcome.weights_endpoint")
        except protocol.ProtocolError as e:
            await self.refuse_welcome(msg, e, frames)
            return
        self.hello_sent_at = None
        previous, self.run_id = self.run_id, msg.run_id
        # A learner bound to every interface advertises its loopback; from another host its
        # weights socket is at the address this server reached the learner at.
        weights_endpoint = reachable_endpoint(msg.weights_endpoint, self.cfg.learner)
        self.receiver.welcome(weights_endpoint)
        if (previous is not None and msg.run_id != previous) or msg.version < self.engine.version:
            self.new_run(previous, msg)
        self.welcomed.set()
        self.log("welcome", learner_version=msg.version, weights_endpoint=weights_endpoint,
                 **({"advertised": msg.weights_endpoint} if weights_endpoint != msg.weights_endpoint else {}))
        self.withheld = 0 if self.stopping.is_set() else self.cfg.generation.max_concurrency - self.pipeline.assigned
        await self.grant()
        await self.outbox.resend_all()

    async def refuse_welcome(self, msg: protocol.Welcome, error: protocol.ProtocolError,
                             frames: list) -> None:
        """A Welcome naming a weights endpoint no socket could connect to (see the module
        docstring): counted and answered as a protocol error; the Hello stays outstanding."""
        self.metrics.protocol_errors.inc()
        self.receiver.forget_endpoint()
        key = msg.weights_endpoint[:300]
        if key not in self.refused_endpoints and len(self.refused_endpoints) < 64:   # bounded:
            self.refused_endpoints.add(key)                 # a peer may vary it every time
            self.log("welcome_refused", level="warning", error=str(error)[:500],
                     hint=f"the learner advertises a weights endpoint this server cannot connect "
                          f"to; Hello is sent again every {self.cfg.network.learner_timeout_s}s")
        await self.send(protocol.Error(code="protocol_error", message=str(error)[:1000],
                                       ref_id=protocol.message_id(frames)))

    def new_run(self, previous: str | None, msg: protocol.Welcome) -> None:
        """The learner is another run's (see the module docstring): forget the old run's work and
        fetch this run's weights before generating again."""
        queued = self.pipeline.drop()
        unacked = self.outbox.clear()
        self.receiver.rebase()
        self.learner_finished = False
        self.metrics.count("new_run")
        self.log("new_run", level="warning", previous_run_id=previous, learner_version=msg.version,
                 server_version=self.engine.version, dropped_queued_samples=queued,
                 dropped_unacked_samples=unacked,
                 hint="the learner restarted without --resume, or resumed from a checkpoint older "
                      "than this server's weights: fetching its weights, re-tagging")


def first_crash(tasks: list[asyncio.Task]) -> asyncio.Task | None:
    """The first of ``tasks`` that ended with an exception (not cancelled), or None."""
    return next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None),
                None)


def serve(cfg: RolloutConfig, model_path: str) -> int:
    service = RolloutService(cfg, model_path)
    try:
        return asyncio.run(service.run())
    except KeyboardInterrupt:
        return 0
    finally:
        sys.stdout.flush()
