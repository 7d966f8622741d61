"""Test helpers for configs (importable from tests and from the benchmark scripts alike)."""

from __future__ import annotations


def nested(flat: dict | None = None, **more) -> dict:
    """Learner config fields written flat (``lr=1e-3, max_staleness=2``, the names of the flat
    layout) as the sections they belong to (``{"optimizer": {"lr": 1e-3}, "staleness": {...}}``),
    so that a test can say only what it changes. Run-wide keys and whole sections pass through."""
    from learner.config import MOVED_KEYS

    out: dict = {}
    for key, value in {**(flat or {}), **more}.items():
        if key in MOVED_KEYS:
            section, leaf = MOVED_KEYS[key].split(".")
            out.setdefault(section, {})[leaf] = value
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out
