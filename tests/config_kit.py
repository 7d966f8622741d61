"""Test helpers for configs (importable from tests and from the benchmark scripts alike)."""

from __future__ import annotations


def _sections(moved: dict[str, str], flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        if key in moved:
            section, leaf = moved[key].split(".")
            out.setdefault(section, {})[leaf] = value
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def nested(flat: dict | None = None, **more) -> dict:
    """Learner config fields written flat (``lr=1e-3, max_staleness=2``, the names of the flat
    layout) as the sections they belong to (``{"optimizer": {"lr": 1e-3}, "staleness": {...}}``),
    so that a test can say only what it changes. Run-wide keys and whole sections pass through."""
    from learner.config import MOVED_KEYS

    return _sections(MOVED_KEYS, {**(flat or {}), **more})


def rollout_nested(flat: dict | None = None, **more) -> dict:
    """Rollout server config fields written flat (``metrics_port=0, max_concurrency=4``) as their
    sections (``{"network": {"metrics_port": 0}, "generation": {...}}``), like :func:`nested`."""
    from rollout_server.config import MOVED_KEYS

    flat = {**(flat or {}), **more}
    if isinstance(flat.get("reward"), (str, list)):        # the shorthand, beside reward_* keys
        flat["reward"] = {"fn": flat["reward"]}
    return _sections(MOVED_KEYS, flat)


def rollout_config(**flat):
    """A ``RolloutConfig`` from fields written flat (:func:`rollout_nested`)."""
    from rollout_server.config import RolloutConfig

    return RolloutConfig(**rollout_nested(flat))
