"""Reward functions written for TRL or verl, called with their own conventions (issue 39).

``rollout.reward.fn`` takes, beside ``builtin:NAME`` and ``module:function`` (slipstream's own
``fn(prompt, completion, metadata)``):

``trl:module:function`` — a TRL ``GRPOTrainer`` reward function, called once per group (an
assignment's ``group_size`` completions of one prompt) as TRL calls it::

    fn(prompts=[...], completions=[...], completion_ids=[[int, ...], ...], trainer_state=...,
       log_extra=..., log_metric=..., **columns) -> list[float | None]

- ``prompts``: the dataset's prompt as it is, repeated per completion: the chat messages of a
  conversational row (``protocol.PROMPT_MESSAGES_KEY``), else the prompt text;
- ``completions``: the completion text, or ``[{"role": "assistant", "content": text}]`` when the
  prompt is conversational (TRL's convention: ``completion[0]["content"]``);
- ``columns``: every other column of the dataset row (the assignment's metadata without
  slipstream's own keys), one list entry per completion, as TRL passes them; ``answer`` too when
  ``learner.data.answer_key`` names one;
- ``trainer_state``: an object with ``global_step``, the policy version the group was generated
  with (TRL's TrainerState has more; a function that reads other fields fails its samples, said);
  ``log_extra`` and ``log_metric`` are accepted and ignored.

Its return value must be a list of one value per completion (else every sample of the group fails,
saying so). ``None`` means the function does not apply to that sample (TRL's multi-task
convention): that part is left out of the sample's reward; a sample whose every function returned
``None`` has no reward at all and fails ("skipped", counted in
``slipstream_rollout_errors_total{kind="reward"}``, never trained; its group is dropped). TRL's
``async def`` reward functions run on the event loop.

``verl:module:function`` — a verl ``compute_score`` (verl's ``custom_reward_function``), called per
sample as verl calls it::

    fn(data_source=..., solution_str=completion, ground_truth=..., extra_info=...) -> float | dict

``data_source`` and ``extra_info`` are the row's columns of those names (None without);
``ground_truth`` is ``reward_model.ground_truth`` as the row has it (not turned into text), else
the row's answer. A float (int, bool) is the reward; a dict's ``"score"`` is, and its other
numeric keys are reported as parts ``function/key`` that do not add to the total (unless
``rollout.reward.weights`` names them); non-numeric ones (verl's ``pred``) are left out.

A function that cannot be called that way (no ``**kwargs`` in a TRL function, a verl function
that does not take the four keywords) is refused at start-up in one line; errors, timeouts and
bad values at run time fail the samples as native plug-ins do (rollout_server.rewards).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from protocol.messages import PROMPT_MESSAGES_KEY

COMPLETION_IDS = "completion_ids"
"""The metadata key (a copy per sample, set by the server) holding the completion's token ids (a list)."""
POLICY_VERSION = "policy_version"
"""The metadata key (set by the server) holding the policy version that generated the completion."""
SERVER_KEYS = ("completion_tokens", "finish_reason", COMPLETION_IDS, POLICY_VERSION)
"""What the server adds to each sample's copy of the metadata (not dataset columns)."""


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):       # a builtin or C callable: nothing to check
        return None


def check_arity(fn: Callable, spec: str, expect: str, **kwargs: Any) -> None:
    """Refuse (ValueError, one line) a function whose signature cannot take ``kwargs`` by name,
    or (without ``kwargs``) three positional arguments."""
    sig = _signature(fn)
    if sig is None:
        return
    try:
        if kwargs:
            sig.bind(**kwargs)
        else:
            sig.bind(None, None, None)
    except TypeError as e:
        raise ValueError(f"reward {spec!r}: {getattr(fn, '__name__', 'the function')}{sig} cannot be "
                         f"called as {expect} ({e})") from None


def _columns(metadata: dict) -> dict:
    return {k: v for k, v in metadata.items()
            if k not in SERVER_KEYS and not k.startswith("slipstream_")}


class TrlReward:
    """A TRL reward function over one group (see the module docstring)."""

    batched = True
    none_skips = True           # a None is "does not apply" (rollout_server.rewards.Rewarder)

    def __init__(self, fn: Callable, spec: str):
        sig = _signature(fn)
        if sig is not None and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            raise ValueError(f"reward {spec!r}: TRL calls a reward function as f(prompts=, completions=, "
                             f"completion_ids=, **columns), so it needs **kwargs; "
                             f"{getattr(fn, '__name__', 'it')}{sig} has none")
        # Which columns it names is known only at the call (the dataset's): a required argument
        # that is no column fails that group's samples, said.
        self.fn, self.spec = fn, spec
        self.__name__ = getattr(fn, "__name__", spec)
        if inspect.iscoroutinefunction(fn):
            self.score_batch = self._score_async

    def _arguments(self, prompts: list[str], completions: list[str], metadatas: list[dict]) -> dict:
        conversational = [PROMPT_MESSAGES_KEY in m for m in metadatas]
        kw: dict[str, Any] = {
            "prompts": [m[PROMPT_MESSAGES_KEY] if c else p for p, m, c in zip(prompts, metadatas, conversational)],
            "completions": [[{"role": "assistant", "content": t}] if c else t
                            for t, c in zip(completions, conversational)],
            "completion_ids": [[int(x) for x in m.get(COMPLETION_IDS, ())] for m in metadatas],
        }
        columns = [_columns(m) for m in metadatas]
        for key in dict.fromkeys(k for c in columns for k in c):
            if key not in kw:
                kw[key] = [c.get(key) for c in columns]
        versions = [m.get(POLICY_VERSION) for m in metadatas]
        kw["trainer_state"] = SimpleNamespace(global_step=max((v for v in versions if v is not None), default=0))
        kw["log_extra"] = lambda column, values: None
        kw["log_metric"] = lambda name, value: None
        return kw

    def _check(self, values: Any, n: int) -> list:
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
            raise ValueError(f"returned {type(values).__name__}, not a list of {n} rewards "
                             "(one per completion)")
        values = list(values)
        if len(values) != n:
            raise ValueError(f"returned {len(values)} rewards for {n} completions (one per completion)")
        return values

    def score_batch(self, prompts: list[str], completions: list[str], metadatas: list[dict]) -> list:
        return self._check(self.fn(**self._arguments(prompts, completions, metadatas)), len(completions))

    async def _score_async(self, prompts: list[str], completions: list[str], metadatas: list[dict]) -> list:
        return self._check(await self.fn(**self._arguments(prompts, completions, metadatas)), len(completions))


class VerlReward:
    """A verl ``compute_score`` per sample (see the module docstring)."""

    score_key = "score"         # a dict's reward; its other keys are reported, not summed

    def __init__(self, fn: Callable, spec: str):
        check_arity(fn, spec, "compute_score(data_source=, solution_str=, ground_truth=, extra_info=)",
                    data_source=None, solution_str="", ground_truth=None, extra_info=None)
        self.fn, self.spec = fn, spec
        self.__name__ = getattr(fn, "__name__", spec)

    def __call__(self, prompt: str, completion: str, metadata: dict) -> Any:
        rm = metadata.get("reward_model")
        truth = rm["ground_truth"] if isinstance(rm, dict) and "ground_truth" in rm else metadata.get("answer")
        return self.fn(data_source=metadata.get("data_source"), solution_str=completion,
                       ground_truth=truth, extra_info=metadata.get("extra_info"))
