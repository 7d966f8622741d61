"""Control: the commands of ``slipstream ctl`` against a live learner.

    status                 the run's state (version, buffer, servers, counters, settings)
    get   {key}            one config value (any LearnerConfig field); without a key, status
    set   {key, value}     change a runtime setting (``settable`` in the status)
    pause                  no new work to the servers and no new policy step until resume
    resume                 undo pause
    checkpoint             write a checkpoint now (between steps)
    stop                   stop the learner (as SIGTERM: a final checkpoint, then out)

``set`` assigns through the pydantic ``LearnerConfig`` (``validate_assignment=True``), so the
config object stays the truth and a bad value is refused by the same validation, with the same
message, as in a config file. Where a setting takes effect:

- at once, on the loop: ``max_staleness``, ``stale_policy`` (the buffer),
  ``max_inflight_per_server`` (admission; at the next dispatch), ``temperature`` (every
  assignment issued from now on; a re-issued one keeps its own). Samples already generated keep
  the temperature they were drawn at: intake stamps each with its assignment's, and the trainer
  recomputes every row at its own (learner.train.batching.SAMPLING_TEMPERATURE), so a batch that mixes
  the two temperatures is still corrected exactly;
- at the next policy step: ``is_mode``, ``is_cap``, ``clip_anchor``, ``kl_coef``, ``target_kl``, ``lr``. A step runs
  in a worker thread and reads its config throughout, so the trainer has its own copy, and the
  changes reach it between steps (:meth:`Control.before_step`): no step sees half a change.

Every change is a ``control_set`` event (old → new), counted in
``slipstream_control_changes_total{key}``, and numeric settings are exported as
``slipstream_setting{key}``. Every refusal is ``ControlReply(ok=False)`` whose error says what is
allowed: the commands, the settable keys, or what the key takes ("max_staleness takes an integer
>= 0"); the run is untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

import protocol
from buffer import RolloutBuffer
from learner.config import LearnerConfig
from learner.metrics import LearnerMetrics

COMMANDS = ("status", "get", "set", "pause", "resume", "checkpoint", "stop")
STEP_SETTINGS = ("is_mode", "is_cap", "clip_anchor", "kl_coef", "target_kl", "lr")
"""Settings the trainer reads during a step: applied to its copy of the config between steps."""
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def describe(name: str) -> str:
    """What config field ``name`` takes, from its definition: "an integer >= 0", "one of drop, correct"."""
    f = LearnerConfig.model_fields[name]
    annotation, nullable = f.annotation, False
    if get_origin(annotation) in (Union, UnionType) and type(None) in get_args(annotation):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        annotation, nullable = (rest[0] if len(rest) == 1 else annotation), True
    if get_origin(annotation) is Literal:
        text = "one of " + ", ".join(map(str, get_args(annotation)))
    else:
        bounds = [f"{op} {getattr(m, attr)}" for m in f.metadata for attr, op in _BOUNDS
                  if getattr(m, attr, None) is not None]
        text = " ".join([_KINDS.get(annotation, str(annotation)), " and ".join(bounds)]).strip()
    return f"{text}, or null (off)" if nullable else text


class Control:
    """Answers ``ControlRequest``s (see the module docstring).

    Args:
        cfg: the learner's config object; ``set`` changes it.
        buffer: where max_staleness and stale_policy take effect.
        status: the status dict (version, servers, counters, ...).
        stop: asks the learner to stop.
        after_set: awaited after a successful ``set`` or ``resume`` (admission re-dispatches: η
            may have grown).
        pause: called with True / False on ``pause`` / ``resume`` (admission stops dispatching).
        checkpoint: awaited by ``checkpoint``; returns what was written (None: not available).
        has_reference: whether the run has a reference policy (kl_coef > 0 needs one: it is loaded
            at start, so a run started without cannot get one live).
    """

    def __init__(self, cfg: LearnerConfig, buffer: RolloutBuffer, *, metrics: LearnerMetrics,
                 status: Callable[[], dict], stop: Callable[[], None],
                 after_set: Callable[[], Awaitable[None]] | None = None,
                 pause: Callable[[bool], None] = lambda paused: None,
                 checkpoint: Callable[[], Awaitable[dict]] | None = None,
                 has_reference: Callable[[], bool] = lambda: True,
                 log: Callable[..., None] = lambda event, **fields: None):
        self.cfg, self.buffer, self.metrics, self.log = cfg, buffer, metrics, log
        self.status, self.stop, self.after_set = status, stop, after_set
        self._pause, self.checkpoint, self.has_reference = pause, checkpoint, has_reference
        self.resumed = asyncio.Event()            # clear while paused: the train loop waits on it
        self.resumed.set()
        self._pending: dict[str, Any] = {}        # step settings not yet applied to the trainer
        # The runtime settings: a key is settable exactly when something applies it to the run.
        self.appliers: dict[str, Callable[[Any], None]] = {
            "max_staleness": buffer.set_max_staleness,
            "stale_policy": buffer.set_stale_policy,
            "max_inflight_per_server": lambda n: None,      # admission reads cfg at each dispatch
            "temperature": lambda t: None,                  # read for every new assignment
            "kl_coef": self._check_kl_coef,
            **{k: lambda v: None for k in STEP_SETTINGS if k != "kl_coef"},
        }
        for key in self.settable:
            self._export(key, getattr(cfg, key))

    @property
    def settable(self) -> list[str]:
        return sorted(self.appliers)

    @property
    def paused(self) -> bool:
        return not self.resumed.is_set()

    def _check_kl_coef(self, value: float) -> None:
        if value > 0 and not self.has_reference():
            raise ValueError("this run has no reference policy (it started with kl_coef 0); "
                             "restart with kl_coef > 0 to use a KL term")

    def _export(self, key: str, value: Any) -> None:
        if key == "max_staleness":
            self.metrics.max_staleness.set(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self.metrics.setting.labels(key=key).set(value)
        elif value is None:
            self.metrics.setting.labels(key=key).set(float("nan"))

    def before_step(self, trainer: Any) -> None:
        """Hand the step settings changed since the last step to ``trainer`` (call between steps,
        on the loop, while no step runs)."""
        for key, value in self._pending.items():
            setattr(trainer.cfg, key, value)
            if key == "kl_coef":
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
            if self.checkpoint is None:
                return self._error("checkpoints are not available in this learner")
            try:
                return self._ok(await self.checkpoint())
            except (OSError, ValueError, RuntimeError) as e:
                return self._error(f"checkpoint failed: {e}")
        if req.command == "stop":
            self.log("control_stop")
            self.stop()
            self.resumed.set()                    # a paused train loop must see the stop
            return self._ok({"stopping": True})
        return self._error(f"unknown command {req.command!r}; commands: {', '.join(COMMANDS)}")

    async def _pause_resume(self, pause: bool) -> protocol.ControlReply:
        if pause != self.paused:
            if pause:
                self.resumed.clear()
            else:
                self.resumed.set()
            self._pause(pause)
            self.metrics.paused.set(int(pause))
            self.log("control_pause" if pause else "control_resume")
            if not pause and self.after_set is not None:
                await self.after_set()
        return self._ok(self.full_status())

    def full_status(self) -> dict:
        return {**self.status(), "paused": self.paused, "settable": self.settable,
                **{k: getattr(self.cfg, k) for k in self.settable},
                "pending": dict(self._pending)}

    def _get(self, args: dict) -> protocol.ControlReply:
        key = args.get("key")
        if key is None:
            return self._ok(self.full_status())
        if not isinstance(key, str) or key not in LearnerConfig.model_fields:
            return self._error(f"unknown key {key!r}; keys: {', '.join(LearnerConfig.model_fields)}")
        value = getattr(self.cfg, key)
        if isinstance(value, BaseModel):          # a config block (security, lora): its plain fields
            value = value.model_dump(mode="json")
        return self._ok({key: value})

    async def _set(self, args: dict) -> protocol.ControlReply:
        key, value = args.get("key"), args.get("value")
        settable = ", ".join(self.settable)
        if "key" not in args or "value" not in args:
            return self._error(f"set takes args {{key, value}}; settable: {settable}")
        if not isinstance(key, str) or key not in self.appliers:
            return self._error(f"unknown setting {key!r}; settable: {settable}")
        old = getattr(self.cfg, key)
        try:
            setattr(self.cfg, key, value)
        except ValidationError as e:
            # pydantic has already stored the value when a check across fields (the model
            # validator) refuses it: put the old one back, unvalidated (it was valid before)
            self.cfg.__dict__[key] = old
            why = e.errors()[0].get("msg", str(e))
            return self._error(f"bad value {value!r} for {key}: {why} ({key} takes {describe(key)})")
        new = getattr(self.cfg, key)
        try:
            self.appliers[key](new)
        except ValueError as e:               # the component refused: keep config and run in step
            setattr(self.cfg, key, old)
            return self._error(f"cannot set {key} to {new!r}: {e}")
        if key in STEP_SETTINGS:
            self._pending[key] = new
        self._export(key, new)
        self.metrics.control_changes.labels(key=key).inc()
        self.log("control_set", key=key, value=new, previous=old,
                 takes_effect="next step" if key in STEP_SETTINGS else "now")
        if self.after_set is not None:
            await self.after_set()
        return self._ok(self.full_status())

    @staticmethod
    def _ok(result: dict) -> protocol.ControlReply:
        return protocol.ControlReply(ok=True, result=result)

    @staticmethod
    def _error(message: str) -> protocol.ControlReply:
        return protocol.ControlReply(ok=False, error=message)


def control_error_reply(error: protocol.ProtocolError, frames: list) -> protocol.ControlReply:
    """The control socket's answer to bad input (ctl expects a ControlReply, never an Error)."""
    return protocol.ControlReply(ok=False, error=str(error))
