"""Model selection for the CLI: a ``model`` config value -> a local model directory.

The built-in models themselves (architecture, tokenizer, warm-up, cache) are learner code:
:mod:`learner.models.builtin`. This module only picks between a built-in and a directory.
"""

from __future__ import annotations

from pathlib import Path

from learner.models.builtin import BUILTIN_MODELS, ensure_builtin_model
from protocol.errors import StartupError


def resolve_model(name: str, log=print) -> str:
    """A model reference -> a local directory (building built-ins on first use)."""
    if name.startswith("builtin:"):
        return str(ensure_builtin_model(name, log=log))
    if not Path(name).is_dir():
        raise StartupError(f"model: {name!r}: no such directory (give a local Hugging Face model "
                           f"directory or one of {', '.join(BUILTIN_MODELS)})")
    return name
