"""Model selection for the CLI: a ``model`` config value -> a local model directory.

The built-in models themselves (architecture, tokenizer, warm-up, cache) are learner code:
:mod:`learner.models.builtin`. This module only picks between a built-in and a directory.
"""

from __future__ import annotations

from pathlib import Path

# build_model / build_tokenizer are re-exported for callers that still import them from here
# (tests/rollout_server, tests/bench); new code imports learner.models.builtin.
from learner.models.builtin import (  # noqa: F401
    BUILTIN_MODELS,
    build_model,
    build_tokenizer,
    ensure_builtin_model,
)
from protocol.errors import StartupError


def resolve_model(name: str, log=print) -> str:
    """A model reference -> a local directory (building built-ins on first use)."""
    if name.startswith("builtin:"):
        return str(ensure_builtin_model(name, log=log))
    if not Path(name).is_dir():
        raise StartupError(f"model: {name!r}: no such directory (give a local Hugging Face model "
                           f"directory or one of {', '.join(BUILTIN_MODELS)})")
    return name
