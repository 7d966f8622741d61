"""Control: the commands of ``slipstream ctl`` against a live learner.

    status                 the run's state (version, buffer, servers, counters, settings)
    get   {key}            one config value (any LearnerConfig field); without a key, status
    set   {key, value}     change a runtime setting: max_staleness, stale_policy
    stop                   stop the learner (as SIGTERM)

``set`` assigns through the pydantic ``LearnerConfig`` (``validate_assignment=True``), so the
config object stays the truth and a bad value is refused by the same validation, with the same
message, as in a config file; on success the running component that holds the setting (the
buffer) is told. Every refusal is ``ControlReply(ok=False)`` whose error says what is allowed:
the commands, the settable keys, or what the key takes ("max_staleness takes an integer >= 0").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ValidationError

import protocol
from buffer import RolloutBuffer
from learner.config import LearnerConfig
from learner.metrics import LearnerMetrics

COMMANDS = ("status", "get", "set", "stop")
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def describe(name: str) -> str:
    """What config field ``name`` takes, from its definition: "an integer >= 0", "one of drop, correct"."""
    f = LearnerConfig.model_fields[name]
    if get_origin(f.annotation) is Literal:
        return "one of " + ", ".join(map(str, get_args(f.annotation)))
    bounds = [f"{op} {getattr(m, attr)}" for m in f.metadata for attr, op in _BOUNDS
              if getattr(m, attr, None) is not None]
    return " ".join([_KINDS.get(f.annotation, str(f.annotation)), " and ".join(bounds)]).strip()


class Control:
    """Answers ``ControlRequest``s (see the module docstring).

    Args:
        cfg: the learner's config object; ``set`` changes it.
        buffer: where max_staleness and stale_policy take effect.
        status: the status dict (version, servers, counters, ...).
        stop: asks the learner to stop.
        after_set: awaited after a successful ``set`` (admission re-dispatches: η may have grown).
    """

    def __init__(self, cfg: LearnerConfig, buffer: RolloutBuffer, *, metrics: LearnerMetrics,
                 status: Callable[[], dict], stop: Callable[[], None],
                 after_set: Callable[[], Awaitable[None]] | None = None,
                 log: Callable[..., None] = lambda event, **fields: None):
        self.cfg, self.buffer, self.metrics, self.log = cfg, buffer, metrics, log
        self.status, self.stop, self.after_set = status, stop, after_set
        # The runtime settings: a key is settable exactly when something applies it to the run.
        self.appliers: dict[str, Callable[[Any], None]] = {
            "max_staleness": self._apply_max_staleness,
            "stale_policy": buffer.set_stale_policy,
        }
        self.metrics.max_staleness.set(cfg.max_staleness)

    @property
    def settable(self) -> list[str]:
        return sorted(self.appliers)

    def _apply_max_staleness(self, eta: int) -> None:
        self.buffer.set_max_staleness(eta)
        self.metrics.max_staleness.set(eta)

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
        if req.command == "stop":
            self.log("control_stop")
            self.stop()
            return self._ok({"stopping": True})
        return self._error(f"unknown command {req.command!r}; commands: {', '.join(COMMANDS)}")

    def full_status(self) -> dict:
        return {**self.status(), "settable": self.settable,
                **{k: getattr(self.cfg, k) for k in self.settable}}

    def _get(self, args: dict) -> protocol.ControlReply:
        key = args.get("key")
        if key is None:
            return self._ok(self.full_status())
        if not isinstance(key, str) or key not in LearnerConfig.model_fields:
            return self._error(f"unknown key {key!r}; keys: {', '.join(LearnerConfig.model_fields)}")
        value = getattr(self.cfg, key)
        if isinstance(value, BaseModel):          # a config block (security): its plain fields
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
            why = e.errors()[0].get("msg", str(e))
            return self._error(f"bad value {value!r} for {key}: {why} ({key} takes {describe(key)})")
        new = getattr(self.cfg, key)
        try:
            self.appliers[key](new)
        except ValueError as e:               # the component refused: keep config and run in step
            setattr(self.cfg, key, old)
            return self._error(f"cannot set {key} to {new!r}: {e}")
        self.log("control_set", key=key, value=new, previous=old)
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
