"""Keys by path: the live-key registry ``ctl set`` follows, path lookup and assignment, what a
key takes (for errors and ``slipstream config --keys``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from learner.config.model import MOVED_KEYS, LearnerConfig


@dataclass(frozen=True)
class LiveKey:
    """A setting ``slipstream ctl set`` may change while the run is live."""

    path: str
    """Its place in the learner config (``staleness.max_staleness``)."""
    when: Literal["now", "next step"]
    """now: the consumer reads it at its next use (or is told at once); next step: the trainer's
    copy of the config gets it between steps, so no step sees half a change."""
    consumer: str
    """Who applies it."""


LIVE_KEYS: dict[str, LiveKey] = {k.path: k for k in (
    LiveKey("staleness.max_staleness", "now", "the buffer's staleness gate"),
    LiveKey("staleness.stale_policy", "now", "the buffer (samples past the limit)"),
    LiveKey("servers.max_inflight_per_server", "now", "admission, at its next dispatch"),
    LiveKey("sampling.temperature", "now", "every assignment issued from then on"),
    LiveKey("algorithm.is_mode", "next step", "the trainer"),
    LiveKey("algorithm.is_cap", "next step", "the trainer"),
    LiveKey("algorithm.clip_anchor", "next step", "the trainer"),
    LiveKey("algorithm.target_kl", "next step", "the trainer"),
    LiveKey("kl.coef", "next step", "the trainer (and its KL controller's value)"),
    LiveKey("optimizer.lr", "next step", "the trainer's optimizer"),
    LiveKey("watchdog.stall_s", "now", "the watchdog, at its next look (every second)"),
    LiveKey("watchdog.dump_after_s", "now", "the watchdog, at its next look"),
    LiveKey("watchdog.abort_after_s", "now", "the watchdog, at its next look"),
)}


STEP_SETTINGS = tuple(k for k, live in LIVE_KEYS.items() if live.when == "next step")
"""Live keys the trainer reads during a step: its copy of the config gets them between steps."""


def field_paths(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Every leaf key of ``model`` by dotted path -> its pydantic ``FieldInfo`` (sections and
    optional blocks such as ``lora`` are walked into; a list or a plain value is a leaf)."""
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = model_of(info.annotation)
        if sub is not None:
            out.update(field_paths(sub, path + "."))
        else:
            out[path] = info
    return out


def model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside ``annotation`` (``X`` or ``X | None``), else None."""
    import typing

    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def resolve_key(key: str) -> str:
    """The learner config path ``key`` names: a dotted path (``optimizer.lr``) or, for short, a
    leaf name that only one section has (``max_staleness``). ``KeyError`` with one line saying what
    to write instead: an old flat key's new place, or the closest paths."""
    import difflib

    paths = field_paths(LearnerConfig)
    if key in paths:
        return key
    leaves = [p for p in paths if p.rsplit(".", 1)[-1] == key]
    if "." not in key and len(leaves) == 1:
        return leaves[0]
    if key in MOVED_KEYS:
        raise KeyError(f"{key} moved to {MOVED_KEYS[key]}")
    if len(leaves) > 1:
        raise KeyError(f"{key} is ambiguous: {' or '.join(leaves)}")
    close = difflib.get_close_matches(key, list(paths), n=3, cutoff=0.6)
    raise KeyError(f"unknown key {key!r}" + (f"; did you mean {' or '.join(close)}?" if close else ""))


def changed_paths(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """``(path, value)`` of every leaf of the dumped config ``new`` that differs from ``old`` (a
    section that is null on one side and not on the other counts as one leaf)."""
    out = []
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            out += changed_paths(before, value, f"{prefix}{key}.")
        elif value != before:
            out.append((f"{prefix}{key}", value))
    return out


def get_path(cfg: BaseModel, path: str) -> Any:
    node = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node


def set_path(cfg: BaseModel, path: str, value: Any) -> None:
    """Assign (validated by the section's model) the value at ``path``."""
    *parents, leaf = path.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part)
    setattr(node, leaf, value)


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def describe_field(info: Any) -> str:
    """What a config field takes, from its definition: "an integer >= 0", "one of drop, correct",
    "a number > 0, or null (off)"."""
    return _takes(info.annotation, info.metadata)


def _takes(annotation: Any, metadata: list = ()) -> str:
    import typing
    from types import UnionType

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, UnionType):
        rest = [a for a in args if a is not type(None)]
        text = " or ".join(_takes(a, metadata) for a in rest)
        return f"{text}, or null (off)" if len(rest) < len(args) else text
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is list:
        return f"a list (each {_takes(args[0]) if args else 'any value'})"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a section (below)"
    bounds = [f"{op} {getattr(m, attr)}" for m in metadata for attr, op in _BOUNDS
              if getattr(m, attr, None) is not None]
    return " ".join([_KINDS.get(annotation, getattr(annotation, "__name__", str(annotation))),
                     " and ".join(bounds)]).strip()
