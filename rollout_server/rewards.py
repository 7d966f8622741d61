"""Reward functions: ``reward_fn(prompt, completion, metadata) -> float | dict[str, float]``.

Plug one in with ``rollout.reward: "module:function"`` (sync or async). A dict's parts are summed
into the total. A reward that raises or returns a non-finite value marks the sample failed with
the reason; the server keeps running.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _extract_answer(text: str) -> str | None:
    """GSM8K ``#### 42`` and ``\\boxed{42}`` forms first, else the first number in the text."""
    if "####" in text:
        text = text.split("####", 1)[1]
    else:
        boxed = re.search(r"\\boxed\{([^}]*)\}", text)
        if boxed:
            text = boxed.group(1)
    m = _NUMBER.search(text.replace(",", ""))
    return m.group(0) if m else None


def exact_numeric(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """1.0 if the completion's answer equals ``metadata["answer"]`` numerically, else 0.0."""
    got = _extract_answer(completion)
    want = _extract_answer(str(metadata.get("answer", "")))
    if got is None or want is None:
        return 0.0
    return 1.0 if math.isclose(float(got), float(want), rel_tol=0, abs_tol=1e-9) else 0.0


BUILTIN_REWARDS: dict[str, Callable] = {"builtin:exact_numeric": exact_numeric}


def load_reward(spec: str) -> Callable:
    """``builtin:NAME`` or ``module:function`` -> the callable (raises ValueError with a fix)."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected builtin:exact_numeric or 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name} has no callable {attr!r}")
    return fn


async def score(fn: Callable, prompt: str, completion: str, metadata: dict) -> tuple[float, dict[str, float]]:
    """Call a reward function; returns (total, parts). Raises ValueError for a bad return value."""
    value = fn(prompt, completion, metadata)
    if inspect.isawaitable(value):
        value = await value
    if isinstance(value, dict):
        parts = {str(k): float(v) for k, v in value.items()}
    else:
        parts = {"reward": float(value)}
    total = sum(parts.values())
    if not all(math.isfinite(v) for v in parts.values()):
        raise ValueError(f"reward returned a non-finite value: {parts}")
    return total, parts
