"""Control: the commands of ``slipstream ctl`` against a live learner.

    status                 the run's state (version, buffer, servers, counters, settings)
    get   {key}            one config value (any learner config path, e.g. optimizer.lr, or a
                           whole section); without a key, status
    set   {key, value}     change a live setting (``settable`` in the status;
                           learner.config.LIVE_KEYS says who applies each, and when)
    pause                  no new work to the servers and no new policy step until resume
    resume                 undo pause
    checkpoint             write a checkpoint now (between steps)
    stop                   stop the learner (as SIGTERM: a final checkpoint, then out)

Keys are config paths (``staleness.max_staleness``); a leaf name only one section has may stand
for its path (``max_staleness``); an old flat key or a typo gets its new place or the closest
paths (learner.config.resolve_key). ``set`` assigns through the pydantic section
(``validate_assignment=True``) and then validates the whole config again, so the config object
stays the truth and a bad value is refused by the same validation, with the same message, as in
a config file. Where a setting takes effect (``LIVE_KEYS``):

- at once, on the loop: ``staleness.max_staleness``, ``staleness.stale_policy`` (the buffer),
  ``servers.max_inflight_per_server`` (admission; at the next dispatch), ``sampling.temperature``
  (every assignment issued from now on; a re-issued one keeps its own). Samples already generated keep
  the temperature they were drawn at: intake stamps each with its assignment's, and the trainer
  recomputes every row at its own (``Sample.sampling_temperature``), so a batch that mixes
  the two temperatures is still corrected exactly;
- at the next policy step: ``algorithm.is_mode``, ``algorithm.is_cap``, ``algorithm.clip_anchor``,
  ``algorithm.target_kl``, ``kl.coef``, ``optimizer.lr``. A step runs
  in a worker thread and reads its config throughout, so the trainer has its own copy, and the
  changes reach it between steps (:meth:`Control.before_step`): no step sees half a change.

Every change is a ``control_set`` event (old → new), counted in
``slipstream_control_changes_total{key}``, and numeric settings are exported as
``slipstream_setting{key}``. Every refusal is ``ControlReply(ok=False)`` whose error says what is
allowed: the commands, the settable keys, or what the key takes ("staleness.max_staleness takes
an integer >= 0"); the run is untouched.
"""

from __future__ import annotations

import asyncio
import difflib
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

import protocol
from buffer import RolloutBuffer, StalenessLimit
from learner.config import (
    LIVE_KEYS,
    STEP_SETTINGS,
    LearnerConfig,
    describe_field,
    field_paths,
    get_path,
    resolve_key,
    set_path,
)
from learner.metrics import LearnerMetrics

COMMANDS = ("status", "get", "set", "pause", "resume", "checkpoint", "stacks", "stop")


def describe(path: str) -> str:
    """What learner config key ``path`` takes: "an integer >= 0", "one of drop, correct"."""
    return describe_field(field_paths(LearnerConfig)[path])


class ControlledProcess(Protocol):
    """What ``ctl`` asks of the learner process itself (learner.serve.service.LearnerService)."""

    def status(self) -> dict:
        """The status dict (version, servers, counters, ...)."""
        ...

    def stop(self) -> None:
        """Stop the learner (as SIGTERM)."""
        ...

    def dump_stacks(self) -> dict:
        """Write the process's thread and task stacks; where (protocol.plumbing.stacks)."""
        ...

    def has_reference(self) -> bool:
        """Whether the run has a reference policy (``kl.coef`` > 0 needs one: it is loaded at
        start, so a run started without cannot get one live)."""
        ...


class Dispatch(Protocol):
    """Admission as ``ctl`` sees it (learner.serve.admission.Admission)."""

    def pause(self, paused: bool) -> None: ...

    async def dispatch(self) -> None: ...


class Control:
    """Answers ``ControlRequest``s (see the module docstring).

    Args:
        cfg: the learner's config object; ``set`` changes it.
        buffer: where stale_policy takes effect (``staleness``: η's owner, where max_staleness does).
        process: the :class:`ControlledProcess` port (status, stop, stacks, reference policy).
        admission: the :class:`Dispatch` port: paused and resumed; dispatches after a successful
            ``set`` or ``resume`` (η may have grown). None: neither.
        checkpoints: its ``request()`` is awaited by ``checkpoint`` and returns what was written
            (learner.state.learner_checkpoints.LearnerCheckpoints; None: not available).
        records: a ``set`` is also a metrics.jsonl row there (``control(change)``; None: not).
    """

    def __init__(self, cfg: LearnerConfig, buffer: RolloutBuffer, *, metrics: LearnerMetrics,
                 process: ControlledProcess, staleness: StalenessLimit | None = None,
                 admission: Dispatch | None = None, checkpoints: Any = None, records: Any = None,
                 log: Callable[..., None] = lambda event, **fields: None):
        self.cfg, self.buffer, self.metrics, self.log = cfg, buffer, metrics, log
        self.staleness = staleness or buffer.staleness
        """η's owner (buffer.staleness): ``set staleness.max_staleness`` goes there."""
        self.process, self.admission, self.checkpoints, self.records = process, admission, checkpoints, records
        self.resumed = asyncio.Event()            # clear while paused: the train loop waits on it
        self.resumed.set()
        self._pending: dict[str, Any] = {}        # step settings not yet applied to the trainer
        # What applies each live key (LIVE_KEYS) to the run; those read at use time need nothing.
        self.appliers: dict[str, Callable[[Any], None]] = {
            "staleness.max_staleness": self._set_eta,
            "staleness.stale_policy": buffer.set_stale_policy,
            "kl.coef": self._check_kl_coef,
        }
        for key in self.settable:
            self._export(key, get_path(cfg, key))

    def release(self) -> None:
        """The learner stops: a paused train loop must see it (it waits on :attr:`resumed`)."""
        self.resumed.set()

    @property
    def settable(self) -> list[str]:
        return sorted(LIVE_KEYS)

    @property
    def paused(self) -> bool:
        return not self.resumed.is_set()

    def _set_eta(self, value: int) -> None:
        self.staleness.set(value, "ctl")

    def _check_kl_coef(self, value: float) -> None:
        if value > 0 and not self.process.has_reference():
            raise ValueError("this run has no reference policy (it started with kl_coef 0); "
                             "restart with kl.coef > 0 to use a KL term")

    def _export(self, key: str, value: Any) -> None:
        if key == "staleness.max_staleness":
            self.metrics.staleness_limit.set(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self.metrics.setting.labels(key=key).set(value)
        elif value is None:
            self.metrics.setting.labels(key=key).set(float("nan"))

    def before_step(self, trainer: Any) -> None:
        """Hand the step settings changed since the last step to ``trainer`` (call between steps,
        on the loop, while no step runs)."""
        for key, value in self._pending.items():
            set_path(trainer.cfg, key, value)
            if key == "kl.coef":
                trainer.kl_controller.value = float(value)   # adaptive: restarts from the new value
            self.log("control_applied", key=key, value=value)
        self._pending.clear()

    async def handle(self, identity: bytes, msg: protocol.Message) -> protocol.ControlReply:
        """The control socket's handler."""
        if not isinstance(msg, protocol.ControlRequest):
            raise protocol.ProtocolError(f"control socket: {type(msg).TYPE} is not a "
                                         f"{protocol.ControlRequest.TYPE}")
        return await self.request(msg)

    async def request(self, req: protocol.ControlRequest) -> protocol.ControlReply:
        if req.command == "status":
            return self._ok(self.full_status())
        if req.command == "get":
            return self._get(req.args)
        if req.command == "set":
            return await self._set(req.args)
        if req.command in ("pause", "resume"):
            return await self._pause_resume(req.command == "pause")
        if req.command == "checkpoint":
            if self.checkpoints is None:
                return self._error("checkpoints are not available in this learner")
            try:
                return self._ok(await self.checkpoints.request())
            except (OSError, ValueError, RuntimeError) as e:
                return self._error(f"checkpoint failed: {e}")
        if req.command == "stacks":
            try:
                return self._ok(self.process.dump_stacks())
            except OSError as e:
                return self._error(f"cannot write the stacks: {e}")
        if req.command == "stop":
            self.log("control_stop")
            self.process.stop()
            self.release()                        # a paused train loop must see the stop
            return self._ok({"stopping": True})
        return self._error(f"unknown command {req.command!r}; commands: {', '.join(COMMANDS)}")

    async def _pause_resume(self, pause: bool) -> protocol.ControlReply:
        if pause != self.paused:
            if pause:
                self.resumed.clear()
            else:
                self.resumed.set()
            if self.admission is not None:
                self.admission.pause(pause)
            self.metrics.paused.set(int(pause))
            self.log("control_pause" if pause else "control_resume")
            if not pause and self.admission is not None:
                await self.admission.dispatch()
        return self._ok(self.full_status())

    def full_status(self) -> dict:
        return {**self.process.status(), "paused": self.paused, "settable": self.settable,
                **{k: get_path(self.cfg, k) for k in self.settable},
                "pending": dict(self._pending)}

    def _get(self, args: dict) -> protocol.ControlReply:
        key = args.get("key")
        if key is None:
            return self._ok(self.full_status())
        if not isinstance(key, str):
            return self._error(f"get takes a key (a config path such as optimizer.lr), not {key!r}")
        if key not in LearnerConfig.model_fields:      # a section or a run-wide key, else a path
            try:
                key = resolve_key(key)
            except KeyError as e:
                status = self.process.status()                # what status shows, get shows: version, ...
                if key in status:
                    return self._ok({key: status[key]})
                msg = e.args[0]
                if "did you mean" not in msg:          # a misspelt status key (verison)
                    close = difflib.get_close_matches(key, list(status), n=3, cutoff=0.6)
                    msg += f"; did you mean {' or '.join(close)}?" if close else ""
                return self._error(msg)
        value = get_path(self.cfg, key)
        if isinstance(value, BaseModel):          # a config block (security, lora): its plain fields
            value = value.model_dump(mode="json")
        return self._ok({key: value})

    async def _set(self, args: dict) -> protocol.ControlReply:
        key, value = args.get("key"), args.get("value")
        settable = ", ".join(self.settable)
        if "key" not in args or "value" not in args:
            return self._error(f"set takes args {{key, value}}; settable: {settable}")
        if not isinstance(key, str):
            return self._error(f"set takes a key (a config path), not {key!r}; settable: {settable}")
        try:
            key = resolve_key(key)
        except KeyError as e:
            return self._error(f"{e.args[0]}; settable: {settable}")
        if key not in LIVE_KEYS:
            return self._error(f"{key} is not a live setting (restart with it changed); settable: {settable}")
        old = get_path(self.cfg, key)
        *parents, leaf = key.split(".")
        section = get_path(self.cfg, ".".join(parents)) if parents else self.cfg
        try:
            set_path(self.cfg, key, value)
            LearnerConfig.model_validate(self.cfg.model_dump())    # the checks across sections
        except ValidationError as e:
            # the section may already hold the value when a check across fields refuses it: put
            # the old one back, unvalidated (it was valid before)
            section.__dict__[leaf] = old
            why = e.errors()[0].get("msg", str(e))
            return self._error(f"bad value {value!r} for {key}: {why} ({key} takes {describe(key)})")
        new = get_path(self.cfg, key)
        try:
            self.appliers.get(key, lambda v: None)(new)
        except ValueError as e:               # the component refused: keep config and run in step
            section.__dict__[leaf] = old
            return self._error(f"cannot set {key} to {new!r}: {e}")
        if key in STEP_SETTINGS:
            self._pending[key] = new
        self._export(key, new)
        self.metrics.control_changes.labels(key=key).inc()
        changed = {"key": key, "value": new, "previous": old,
                   "takes_effect": "next step" if key in STEP_SETTINGS else "now"}
        self.log("control_set", **changed)
        if self.records is not None:          # a metrics.jsonl row (the report marks it at its step)
            self.records.control(changed)
        if self.admission is not None:
            await self.admission.dispatch()
        return self._ok({**self.full_status(), "changed": changed})

    @staticmethod
    def _ok(result: dict) -> protocol.ControlReply:
        return protocol.ControlReply(ok=True, result=result)

    @staticmethod
    def _error(message: str) -> protocol.ControlReply:
        return protocol.ControlReply(ok=False, error=message)


def control_error_reply(error: protocol.ProtocolError, frames: list) -> protocol.ControlReply:
    """The control socket's answer to bad input (ctl expects a ControlReply, never an Error)."""
    return protocol.ControlReply(ok=False, error=str(error))
