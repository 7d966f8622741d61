"""The learner's configuration: a few run-wide keys and one section per component
(docs/design.md §9, docs/configuration.md).

    sections.py   one pydantic model per section (network, batch, optimizer, algorithm, ...)
    model.py      LearnerConfig: the sections together, the checks that span them, the flat
                  layout's keys refused with their new place (MOVED_KEYS)
    keys.py       keys by path: the live-key registry (LIVE_KEYS), lookup, what a key takes

Shared by every wing of the learner, it imports none of them (tests/test_layering.py).
"""

from learner.config.keys import (
    LIVE_KEYS,
    STEP_SETTINGS,
    changed_paths,
    describe_field,
    field_paths,
    get_path,
    model_of,
    resolve_key,
    set_path,
)
from learner.config.model import (
    MOVED_KEYS,
    TRAINER_KEYS,
    LearnerConfig,
    TrainerConfig,
)
from learner.config.sections import *  # noqa: F403 - every section model (sections.__all__)
from learner.config.sections import __all__ as _SECTIONS

__all__ = [
    "LIVE_KEYS",
    "LearnerConfig",
    "TRAINER_KEYS",
    "TrainerConfig",
    "MOVED_KEYS",
    "STEP_SETTINGS",
    "changed_paths",
    "describe_field",
    "field_paths",
    "get_path",
    "model_of",
    "resolve_key",
    "set_path",
    *_SECTIONS,
]
