"""What a learner without a new step is waiting on, in one line (issue 38; the watchdog asks,
:mod:`protocol.plumbing.watchdog`).

Read from the learner's own state, in this order:

- **expected** (not a stall): stopping, finished, or paused by ``ctl pause``;
- **rank**: a DeepSpeed worker rank whose liveness file stopped (stopped, hung: its process
  stands still; learner.train.ds_group ``stale_ranks``), before anything else: rank 0's step or
  ping waits on it in a collective;
- **step**: a step (or its publish, or the rollout log's fsync) has run this long;
- **checkpoint**: a checkpoint is being copied or written (a blocked disk);
- **no_servers**: waiting for samples and no rollout server is connected;
- **samples**: waiting for samples from the connected servers: what the buffer holds, the last
  valid sample, failed and refused samples by reason with the last error (the sample watch), and
  per server what it holds and when it last said anything.

Only the phase the train loop is in (:attr:`phase`: set by the train loop with :meth:`enter`) and
what the process itself knows (the :class:`WaitingProcess` port: an expected wait, stale DeepSpeed
ranks) come from outside; everything else is read from the components that own it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from protocol.plumbing.watchdog import Waiting

SERVERS_SHOWN = 4
"""Servers named in a line (those holding the most work first; the rest are counted)."""


class WaitingProcess(Protocol):
    """What the process itself knows about a wait (learner.serve.service.LearnerService)."""

    def expected_wait(self) -> str | None:
        """Why no step is due now (stopping, finished, paused: not a stall), or None."""
        ...

    def stale_ranks(self) -> list[dict]:
        """DeepSpeed worker ranks that stopped beating (learner.train.ds_group.stale_ranks)."""
        ...


class LearnerWaiting:
    """``diagnose(idle_s)`` for the learner's watchdog; the train loop calls :meth:`enter`.
    ``batch``: the ``learner.batch`` section (``batch_samples``, read at use); ``endpoints``: the
    process's endpoints (the rollout socket's, once bound)."""

    def __init__(self, *, admission: Any, buffer: Any, sample_watch: Any, checkpoints: Any,
                 batch: Any, endpoints: dict[str, str], process: WaitingProcess,
                 clock: Callable[[], float] = time.monotonic):
        self.admission, self.buffer, self.watch, self.checkpoints = admission, buffer, sample_watch, checkpoints
        self.batch, self.endpoints, self.process, self.clock = batch, endpoints, process, clock
        self.phase = "batch"                  # batch (waiting for samples), step, publish, rollout_log,
        #                                       checkpoint (the step's end: learner.loop)
        self.since = clock()
        self.ever_connected = False

    def enter(self, phase: str) -> None:
        self.phase, self.since = phase, self.clock()

    def __call__(self, idle_s: float) -> Waiting:
        why = self.process.expected_wait()
        if why:
            return Waiting("other", why, expected=True)
        now = self.clock()
        stale = self.process.stale_ranks()
        if stale:
            r = stale[0]
            more = f"; and {len(stale) - 1} more ranks" if len(stale) > 1 else ""
            return Waiting("rank", f"waiting on DeepSpeed rank {r['rank']} (pid {r['pid']} on "
                                   f"{r['host']}): no heartbeat for {r['age_s']:.0f} s, its last "
                                   f"command {r['command']}{more}")
        if self.phase not in ("batch", "checkpoint"):
            what = {"step": "a policy step", "publish": "publishing the new weights",
                    "rollout_log": "the rollout log's fsync after a step"}.get(self.phase, self.phase)
            return Waiting("publish" if self.phase == "publish" else "step",
                           f"{what} has run {now - self.since:.0f} s")
        writing = getattr(self.checkpoints, "writing", None)
        if writing is not None:
            what, version, since = writing
            return Waiting("checkpoint", f"a checkpoint write ({what}, version {version}) has run "
                                         f"{now - since:.0f} s in {self.checkpoints.store.root}")
        return self.samples(idle_s, now)

    def samples(self, idle_s: float, now: float) -> Waiting:
        servers = list(self.admission.servers.values())
        have = (f"the buffer holds {self.buffer.ready_samples} of the {self.batch.batch_samples} samples "
                "a step needs")
        if not servers:
            never = "" if self.ever_connected else " (none has since the start)"
            return Waiting("no_servers", f"waiting for samples: no rollout server is connected to "
                                         f"{self.endpoints.get('rollout', '?')}{never}; {have}")
        self.ever_connected = True
        watch = self.watch
        age = watch.valid_age()
        valid = ("no valid sample yet" if age != age
                 else f"the last valid sample came {age:.0f} s ago")
        parts = [f"waiting for samples: {len(servers)} rollout server"
                 f"{'s' if len(servers) != 1 else ''} connected, {valid}; {have}"]
        if watch.failed or watch.invalid:
            bad = ", ".join(f"{n} {reason}" for reason, n in sorted(watch.failed.items()))
            if watch.invalid:
                bad = ", ".join(filter(None, [bad, f"{watch.invalid} refused"]))
            parts.append(f"failed samples: {bad} ({watch.bad_streak} since the last valid one); "
                         f"last error: {watch.last_error[:200]}")
        if self.admission.paused:
            parts.append("dispatch is paused")
        shown = sorted(servers, key=lambda s: -self.admission.outstanding(s))
        for s in shown[:SERVERS_SHOWN]:
            parts.append(f"{s.server_id}: {self.admission.outstanding(s)} samples leased, "
                         f"{s.credits} credits, last message {now - s.last_seen:.0f} s ago"
                         + (", dropped (weights failures)" if s.dropped else ""))
        if len(shown) > SERVERS_SHOWN:
            parts.append(f"and {len(shown) - SERVERS_SHOWN} more servers")
        return Waiting("samples", "; ".join(parts))
