"""Built-in tasks: what to ask, what the right answer is, and which reward scores it.

A task is one module of this package that defines ``TASK = Task(...)``; the module's name is the
task's name, and ``learner.data.dataset: builtin:<name>`` selects it. Nothing else needs to change: the
prompt stream (:class:`learner.data.prompts.PromptSource`), the built-in model's supervised warm-up
(:mod:`learner.models.builtin`) and the reward the rollout servers use (``deploy/config_file.py`` fills
``rollout.reward`` from :attr:`Task.reward` unless the config sets it) all read the task from here.

Only the standard library is imported, so a config can name a task without loading torch.
"""

from __future__ import annotations

import importlib
import pkgutil
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import StartupError

PREFIX = "builtin:"


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer (what the reward compares the completion to)."""

    prompt: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)
    """Extra fields the reward needs besides the answer (they travel in the assignment)."""


@dataclass(frozen=True)
class Task:
    """A prompt generator and the reward that scores its completions."""

    name: str
    """The module name; ``builtin:<name>`` in ``learner.data.dataset``."""
    example: Callable[[random.Random], Example]
    """One example drawn with ``rng`` (the same rng state gives the same example)."""
    reward: str
    """The rollout server's reward spec for this task (a ``rollout.reward`` value)."""
    params: dict[str, Any] = field(default_factory=dict)
    """What defines the task's distribution (part of the built-in model's cache key)."""
    environment: str | None = None
    """For a multi-turn task: the rollout server's environment (a ``rollout.environment`` value;
    the episode's reward is the environment's, docs/agents.md)."""
    warmup: Callable[[random.Random], Example] | None = None
    """The built-in model's warm-up examples, when they are not ``example``'s (a multi-turn task
    warms up on the turns of its episodes: a prompt is the episode so far)."""


def names() -> list[str]:
    """The built-in task names (the modules of this package), sorted."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def is_builtin(spec: str) -> bool:
    return spec.startswith(PREFIX)


def get_task(spec: str) -> Task:
    """``builtin:<name>`` (or the bare name) -> its :class:`Task`; a :class:`StartupError` if unknown."""
    name = spec[len(PREFIX):] if is_builtin(spec) else spec
    if name not in names():
        known = ", ".join(PREFIX + n for n in names())
        raise StartupError(f"learner.data.dataset: unknown built-in task {spec!r}; known: {known} "
                           f"(or give a JSONL file)")
    task = importlib.import_module(f"{__name__}.{name}").TASK
    if not isinstance(task, Task) or task.name != name:
        raise StartupError(f"{__name__}.{name}.TASK must be a Task named {name!r}")
    return task
