"""Models the learner builds itself (no download): see :mod:`learner.models.builtin`; and the
start-up check of a model directory the user gives (:func:`check_model_dir`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from protocol.errors import StartupError

CONFIG_FILE = "config.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def cache_dir() -> Path:
    """Where built models, converted checkpoints and wheels are kept: ``SLIPSTREAM_CACHE``, else
    ``~/.cache/slipstream``."""
    return Path(os.environ.get("SLIPSTREAM_CACHE", Path.home() / ".cache" / "slipstream"))


def check_model_dir(path: str | Path, key: str = "model") -> None:
    """Refuse, as one line (:class:`StartupError`), a model directory whose ``config.json`` is
    missing, unreadable, not JSON or not a JSON object. ``from_pretrained`` would fail on each of
    these too, but with a traceback from deep inside transformers, after the ports are bound and
    (in ``slipstream run``) the processes started. A directory with only an adapter
    (``adapter_config.json``: loaded through peft onto its base model) has no ``config.json`` of
    its own and passes. The weights are not read here: that is the load itself."""
    d = Path(path)
    f = d / CONFIG_FILE
    if not f.exists():
        if (d / ADAPTER_CONFIG_FILE).exists():
            return
        raise StartupError(f"{key}: {str(d)!r} has no {CONFIG_FILE}: give a Hugging Face model "
                           "directory (what save_pretrained writes)")
    try:
        text = f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StartupError(f"{key}: cannot read {f} ({getattr(e, 'strerror', None) or e}); "
                           "make it readable") from None
    if not text.strip():
        raise StartupError(f"{key}: {f} is empty; restore the model's {CONFIG_FILE} "
                           "(save_pretrained writes it)")
    try:
        config = json.loads(text)
    except ValueError as e:
        raise StartupError(f"{key}: {f} is not JSON ({getattr(e, 'msg', e)} at line "
                           f"{getattr(e, 'lineno', '?')}); restore the model's {CONFIG_FILE}") from None
    if not isinstance(config, dict):
        raise StartupError(f"{key}: {f} holds a JSON {type(config).__name__}, not an object; "
                           f"restore the model's {CONFIG_FILE}")
