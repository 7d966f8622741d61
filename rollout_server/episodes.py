"""Multi-turn episodes (issue 26): the model's turn, the environment's observation, the model's
next turn, ... as one sample, token for token what the engine sampled and was fed.

An **environment** is a class loaded as ``module:Class`` (``rollout.environment``; docs/agents.md),
instantiated once per episode with ``rollout.environment.options``::

    class GuessTheNumber:
        async def reset(self, prompt: str, metadata: dict) -> str | None: ...
        async def step(self, completion: str, state: EpisodeState) -> tuple[obs, parts, done, info]

``reset`` may return an observation that comes before the model's first turn (None: the prompt
is all). ``step`` gets the text of the model's turn and the episode's :class:`EpisodeState`, and
returns the next observation (None: none; the model's next turn follows its own), the turn's
reward parts (a dict of name -> float, or one float, part ``reward``), whether the episode is
done, and an info dict (``tool_calls`` / ``tool_errors``, counts, are added up). The episode's
reward is the sum of every part over its turns. Methods may be plain functions (they run on a
worker thread) or coroutines; an optional ``close()`` runs at the end of the episode.

**Token-exact.** The sample's ``completion_token_ids`` are the concatenation of each turn's
sampled ids (as the engine returned them: never decoded and re-encoded) and each observation's
ids; the prompt of turn k is the issued prompt plus everything before it, so the learner
recomputes over exactly the tokens the engine saw. ``Sample.turn_spans`` marks the model's turns;
the environment's tokens get loss mask 0, behavior log-prob 0 and the version of the turn before
them. An observation is tokenized on its own (:class:`ObservationTokens`): under a chat template,
as the template renders that message after an assistant turn (the model's turn closed with EOS
when it ended otherwise), with the generation prompt of the next assistant turn.

**Limits** (the assignment's ``SamplingParams``): each turn at most ``max_new_tokens``, at most
``max_turns`` turns, at most ``episode_tokens`` after the prompt (a turn is cut to what is left;
an observation that does not fit ends the episode, finish_reason ``length``), and the engine's
``max_model_len``. ``rollout.environment.step_timeout_s`` bounds every reset and step.

**Failures** end that episode, never the server: the environment raises, runs past its timeout,
returns an observation that is not text (or messages) or longer than
``max_observation_tokens``, or a reward that is not a finite number. Counted in
``slipstream_episodes_failed_total{reason}``; then ``rollout.environment.on_failure``: ``fail``,
the sample is sent failed (``Sample.failed`` says why; the learner trains nothing of its group);
``train``, the turns it had are sent as a sample with reward ``failure_reward`` (its metadata's
``failed`` says why; one that failed before its first turn is sent failed); ``reissue``, the
pipeline gives the group back (:mod:`rollout_server.pipeline`).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import protocol
from protocol.messages import PROMPT_MESSAGES_KEY
from rollout_server.agents import (
    AgentSession,
    HistoryError,
    OpenAIEndpoint,
    TurnLimit,
    prompt_messages,
    reward_parts,
)
from rollout_server.engine import Completion, GenRequest
from rollout_server.rewards import load_module

__all__ = ["EPISODE_FAILURES", "AgentProgram", "EpisodeFailed", "EpisodeRunner", "EpisodeState", "ObservationTokens",
           "load_environment", "load_environments"]

EPISODE_FAILURES = ("error", "timeout", "observation", "observation_too_long", "reward", "generate",
                    "history")
"""``slipstream_episodes_failed_total{reason}``: the environment (or agent program) raised, ran
past its timeout, returned an observation that is not text or messages, one too long, a reward
that is not a finite number; the engine failed a turn; an agent's request rewrote the episode's
history (:mod:`rollout_server.agents`)."""

_SEED_MOD = 1 << 63


class EpisodeFailed(Exception):
    """An episode that cannot go on; ``reason`` is one of :data:`EPISODE_FAILURES`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class EpisodeState:
    """What an environment's ``step`` gets besides the model's text: the episode so far."""

    prompt: str
    metadata: dict[str, Any]
    turn: int = 0                      # the model's turn just taken, from 0
    completions: list[str] = field(default_factory=list)       # the model's text, per turn
    observations: list[Any] = field(default_factory=list)      # the environment's, per turn
    data: dict[str, Any] = field(default_factory=dict)         # the environment's own


@dataclass(frozen=True)
class AgentProgram:
    """``agent:module:function``: an agent program that talks to an OpenAI-compatible endpoint
    (:mod:`rollout_server.agents`), called as ``function(base_url, prompt, metadata)``."""

    fn: Callable[..., Any]


def load_environment(spec: str) -> type | AgentProgram:
    """``module:Class`` (the module may be a path/to/file.py) -> the class, checked: it has
    ``reset(prompt, metadata)`` and ``step(completion, state)``; ``agent:module:function`` -> the
    :class:`AgentProgram`, checked: callable as ``function(base_url, prompt, metadata)``
    (ValueError with the fix)."""
    if spec.startswith("agent:"):
        module_name, _, attr = spec[len("agent:"):].rpartition(":")
        if not module_name or not attr:
            raise ValueError(f"environment {spec!r}: expected 'agent:module:function'")
        fn = getattr(load_module(module_name, spec, "environment"), attr, None)
        if not callable(fn):
            raise ValueError(f"environment {spec!r}: {module_name} has no function {attr!r}")
        try:
            inspect.signature(fn).bind(None, None, None)
        except TypeError:
            raise ValueError(f"environment {spec!r}: {attr} cannot be called as "
                             f"{attr}(base_url, prompt, metadata)") from None
        except ValueError:
            pass
        return AgentProgram(fn)
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"environment {spec!r}: expected 'module:Class' (a module may be a "
                         f"path/to/file.py)")
    cls = getattr(load_module(module_name, spec, "environment"), attr, None)
    if not isinstance(cls, type):
        raise ValueError(f"environment {spec!r}: {module_name} has no class {attr!r}")
    for name, arity in (("reset", 2), ("step", 2)):
        method = getattr(cls, name, None)
        if not callable(method):
            raise ValueError(f"environment {spec!r}: {attr} has no {name}() method (docs/agents.md)")
        try:
            inspect.signature(method).bind(None, *([None] * arity))
        except TypeError:
            what = "(prompt, metadata)" if name == "reset" else "(completion, state)"
            raise ValueError(f"environment {spec!r}: {attr}.{name} cannot be called as "
                             f"{name}{what}") from None
        except ValueError:                   # no signature (a builtin): leave it to the call
            pass
    return cls


def _ended(failure: Exception) -> EpisodeFailed:
    """What ended an agent's episode inside a request, as its failure."""
    if isinstance(failure, EpisodeFailed):
        return failure
    if isinstance(failure, HistoryError):
        return EpisodeFailed("history", str(failure))
    return EpisodeFailed("error", f"{type(failure).__name__}: {failure}")


def load_environments(settings: Any) -> dict[str, type | AgentProgram]:
    """Every environment ``rollout.environment`` names, loaded and checked (start-up), by spec."""
    specs = [settings.class_name, *settings.named.values()]
    return {spec: load_environment(spec) for spec in specs if spec}


async def _call(fn: Callable, *args: Any) -> Any:
    """A method that may be a coroutine function or a plain one (then on a worker thread)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    value = await asyncio.to_thread(fn, *args)
    return await value if inspect.isawaitable(value) else value


class ObservationTokens:
    """An observation -> the token ids that follow the model's turn (``tokens``).

    ``chat_template="auto"`` with a tokenizer that has one: the observation (a string in
    ``role``, a ``{"role", "content"}`` message, or a list of them) is rendered as the template
    renders those messages after an assistant turn, with the next assistant turn's generation
    prompt: the text the template adds to a fixed conversation, tokenized alone. Otherwise the
    observation's text (the contents, for messages) is tokenized as it is."""

    _BASE = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]

    def __init__(self, tokenizer: Any, *, role: str = "user", chat_template: str = "auto"):
        self.tokenizer, self.role = tokenizer, role
        self.chat = chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        self._base_text = (tokenizer.apply_chat_template(self._BASE, tokenize=False)
                           if self.chat else "")

    def messages(self, observation: Any) -> list[dict[str, str]]:
        """``observation`` as messages, or :class:`EpisodeFailed` (``observation``)."""
        if isinstance(observation, str):
            return [{"role": self.role, "content": observation}]
        items = [observation] if isinstance(observation, dict) else observation
        if not isinstance(items, list) or not items or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in items):
            raise EpisodeFailed("observation", f"an observation is a string, a {{'role', 'content'}} "
                                               f"message or a list of them, not {type(observation).__name__}")
        return [{"role": m["role"], "content": m["content"]} for m in items]

    def tokens(self, observation: Any, after: np.ndarray) -> list[int]:
        """The ids of ``observation`` after the model's turn ``after`` (its sampled ids)."""
        messages = self.messages(observation)
        if not self.chat:
            return self.tokenizer.encode("".join(m["content"] for m in messages), add_special_tokens=False)
        full = self.tokenizer.apply_chat_template(self._BASE + messages, tokenize=False,
                                                  add_generation_prompt=True)
        if not full.startswith(self._base_text):
            raise EpisodeFailed("observation", "the chat template renders earlier turns differently "
                                               "once an observation follows; set "
                                               "rollout.environment.chat_template: never")
        ids = self.tokenizer.encode(full[len(self._base_text):], add_special_tokens=False)
        if self.eos_id is not None and (len(after) == 0 or int(after[-1]) != self.eos_id):
            ids = [self.eos_id, *ids]     # the turn ended on a stop string or its length: close it
        return ids


@dataclass
class _Episode:
    """One episode being built: the ids after the prompt and what each one is."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[int] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "stop"
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    generate_s: float = 0.0
    truncated: bool = False

    def add_model(self, c: Completion) -> None:
        start = len(self.ids)
        self.ids += c.token_ids.tolist()
        self.logprobs += c.logprobs.tolist()
        self.versions += c.versions.tolist()
        self.spans += [start, len(self.ids)]
        self.finish_reason = c.finish_reason

    def add_environment(self, ids: list[int]) -> None:
        version = self.versions[-1] if self.versions else -1     # before the first turn: filled then
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)


class EpisodeRunner:
    """Runs the episodes of an assignment's group (:meth:`run_group`) -> its samples.

    Handed: ``generate`` (the engine's; the turns of concurrent episodes share its decodes),
    ``decode`` (ids -> text), the :class:`ObservationTokens`, the environment settings
    (``step_timeout_s``, ``max_observation_tokens``, ``options``), ``max_model_len`` (None: no
    limit), and the metrics to count into."""

    def __init__(self, *, generate: Callable[[list[GenRequest]], Awaitable[list[list[Completion]]]],
                 decode: Callable[[np.ndarray], str], observations: ObservationTokens, settings: Any,
                 metrics: Any, log: Callable[..., None], classes: dict[str, Any] | None = None,
                 max_model_len: int | None = None, clock: Callable[[], float] = time.monotonic,
                 model_name: str = "slipstream"):
        self.generate, self.decode, self.observations = generate, decode, observations
        self.settings, self.metrics, self.log = settings, metrics, log
        self.max_model_len, self.clock, self.model_name = max_model_len, clock, model_name
        self.classes = load_environments(settings) if classes is None else classes
        self.endpoint: OpenAIEndpoint | None = None
        if any(isinstance(c, AgentProgram) for c in self.classes.values()):
            self.endpoint = OpenAIEndpoint(port=settings.agent_port,
                                           on_error=lambda status: metrics.count("agent_request"))

    async def close(self) -> None:
        """Stop the agents' endpoint (when there is one)."""
        if self.endpoint is not None:
            await self.endpoint.close()

    def spec_for(self, a: protocol.Assignment) -> str | None:
        return self.settings.spec_for(a.metadata)

    async def run_group(self, a: protocol.Assignment, spec: str) -> list[protocol.Sample]:
        """The ``group_size`` episodes of ``a`` in ``spec``, concurrently: one sample each."""
        return list(await asyncio.gather(*(self.run_episode(a, spec, i) for i in range(a.group_size))))

    async def run_episode(self, a: protocol.Assignment, spec: str, index: int) -> protocol.Sample:
        ep = _Episode()
        state = EpisodeState(prompt=a.prompt_text, metadata=dict(a.metadata))
        failed = None
        env = None
        try:
            target = self.classes[spec]
            if isinstance(target, AgentProgram):
                await self._agent_episode(a, index, target, ep)
            else:
                env = target(**self.settings.options)
                await self._episode(a, index, env, state, ep)
        except EpisodeFailed as e:
            failed = e
        except Exception as e:  # noqa: BLE001 - the environment's constructor: its failure
            failed = EpisodeFailed("error", f"{type(e).__name__}: {e}")
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    await asyncio.wait_for(_call(close), self.settings.step_timeout_s)
                except Exception as e:  # noqa: BLE001 - a failing close fails nothing already done
                    self.log("environment_close_failed", error=f"{type(e).__name__}: {e}"[:300])
        self.metrics.episode_turns.observe(len(ep.spans) // 2)
        self.metrics.environment_seconds.observe(ep.env_s)
        if ep.tool_calls:
            self.metrics.tool_calls.inc(ep.tool_calls)
        if ep.tool_errors:
            self.metrics.tool_errors.inc(ep.tool_errors)
        sid = protocol.sample_id(a.assignment_id, index)
        trained_failure = False
        if failed is not None:
            self.metrics.episodes_failed.labels(reason=failed.reason).inc()
            message = f"environment {failed.reason}: {failed}"[:1000]
            self.log("episode_failed", sample_id=sid, reason=failed.reason, error=message[:500])
            if self.settings.on_failure == "train" and ep.spans:    # its turns are trained,
                ep.parts = {"failure": float(self.settings.failure_reward)}   # at this reward
                failed, trained_failure = None, True
        if failed is None:
            self.metrics.reward.observe(sum(ep.parts.values()))
            if ep.truncated:
                self.metrics.episodes_truncated.inc()
        self.metrics.generated_tokens.inc(sum(e - s for s, e in zip(ep.spans[0::2], ep.spans[1::2])))
        self.metrics.prompt_tokens.inc(len(a.prompt_token_ids))
        self.metrics.samples.inc()
        if failed is not None or not ep.spans:
            return protocol.Sample(
                sample_id=sid, assignment_id=a.assignment_id, group_index=index,
                group_size=a.group_size, prompt_token_ids=a.prompt_token_ids,
                completion_token_ids=np.zeros(0, np.int32), behavior_logprobs=np.zeros(0, np.float32),
                token_versions=np.zeros(0, np.int32), reward=0.0, finish_reason="error",
                failed=(message if failed is not None else "environment: the episode had no turn"),
                sampling_temperature=a.sampling.temperature)
        ids = np.asarray(ep.ids, dtype=np.int32)
        return protocol.Sample(
            sample_id=sid, assignment_id=a.assignment_id, group_index=index,
            group_size=a.group_size, prompt_token_ids=a.prompt_token_ids, completion_token_ids=ids,
            behavior_logprobs=np.asarray(ep.logprobs, dtype=np.float32),
            token_versions=np.asarray(ep.versions, dtype=np.int32),
            reward=float(sum(ep.parts.values())), reward_parts=dict(ep.parts),
            finish_reason=ep.finish_reason,
            timing={"generate_s": ep.generate_s, "environment_s": ep.env_s},
            completion_text=self.decode(ids),
            metadata={"turns": len(ep.spans) // 2, "tool_calls": ep.tool_calls,
                      "tool_errors": ep.tool_errors, "truncated": ep.truncated,
                      **({"failed": message} if trained_failure else {})},
            sampling_temperature=a.sampling.temperature,
            turn_spans=np.asarray(ep.spans, dtype=np.int32))

    # ---- one episode ------------------------------------------------------------------------
    async def _env(self, ep: _Episode, what: str, fn: Callable, *args: Any) -> Any:
        start = self.clock()
        try:
            return await asyncio.wait_for(_call(fn, *args), self.settings.step_timeout_s)
        except asyncio.TimeoutError:
            raise EpisodeFailed("timeout", f"{what} ran past rollout.environment.step_timeout_s "
                                           f"({self.settings.step_timeout_s:g} s)") from None
        except EpisodeFailed:
            raise
        except Exception as e:  # noqa: BLE001 - the environment's bug ends its episode only
            raise EpisodeFailed("error", f"{what} raised {type(e).__name__}: {e}") from None
        finally:
            ep.env_s += self.clock() - start

    def _observe(self, observation: Any, ep: _Episode, budget: int) -> bool:
        """Append ``observation``'s ids; False when they do not fit the episode (it ends)."""
        if observation is None:
            return True
        ids = self.observations.tokens(observation, np.asarray(ep.ids[-1:], dtype=np.int64))
        limit = self.settings.max_observation_tokens
        if len(ids) > limit:
            raise EpisodeFailed("observation_too_long", f"an observation of {len(ids)} tokens > "
                                                        f"rollout.environment.max_observation_tokens {limit}")
        if len(ep.ids) + len(ids) >= budget:       # no room for it and a turn after it
            return False
        ep.add_environment(ids)
        return True

    async def _episode(self, a: protocol.Assignment, index: int, env: Any, state: EpisodeState,
                       ep: _Episode) -> None:
        sp = a.sampling
        prompt = a.prompt_token_ids.tolist()
        budget = self._budget(a)
        first = await self._env(ep, "reset", env.reset, a.prompt_text, dict(a.metadata))
        if not self._observe(first, ep, budget):
            ep.truncated, ep.finish_reason = True, "length"
            return
        before_first = len(ep.ids)
        for turn in range(sp.max_turns):
            room = min(sp.max_new_tokens, budget - len(ep.ids))
            if room <= 0:
                ep.truncated, ep.finish_reason = True, "length"
                return
            completion = await self._turn(a, index, turn, prompt, ep, room)
            if turn == 0 and before_first:        # reset's tokens: the first turn's version
                ep.versions[:before_first] = [ep.versions[before_first]] * before_first
            text = self.decode(completion.token_ids)
            state.turn = turn
            state.completions.append(text)
            result = await self._env(ep, "step", env.step, text, state)
            observation, done = self._take_step(result, ep)
            state.observations.append(observation)
            if done:
                return
            if turn == sp.max_turns - 1 or (completion.finish_reason == "length"
                                            and len(ep.ids) >= budget):
                ep.truncated, ep.finish_reason = True, "length"   # it wanted more turns
                return
            if not self._observe(observation, ep, budget):
                ep.truncated, ep.finish_reason = True, "length"
                return

    async def _turn(self, a: protocol.Assignment, index: int, turn: int, prompt: list[int], ep: _Episode,
                    room: int, stop: tuple[str, ...] = ()) -> Completion:
        """The model's turn ``turn`` (at most ``room`` tokens) on the prompt and the episode so
        far, added to ``ep``."""
        sp = a.sampling
        seed = None if sp.seed is None else ((sp.seed * 1_000_003 + index) * 1_000_003 + turn) % _SEED_MOD
        request = GenRequest(np.asarray(prompt + ep.ids, dtype=np.int32), 1, temperature=sp.temperature,
                             top_p=sp.top_p, top_k=sp.top_k, max_new_tokens=room, seed=seed,
                             stop=tuple(dict.fromkeys((*sp.stop, *stop))),
                             stop_token_ids=tuple(sp.stop_token_ids))
        start = self.clock()
        try:
            (completion,) = (await self.generate([request]))[0]
        except Exception as e:  # noqa: BLE001 - the engine failed this turn: this episode
            raise EpisodeFailed("generate", f"turn {turn}: {type(e).__name__}: {e}") from None
        ep.generate_s += self.clock() - start
        ep.add_model(completion)
        return completion

    def _budget(self, a: protocol.Assignment) -> int:
        sp = a.sampling
        budget = sp.episode_tokens if sp.max_turns > 1 else sp.max_new_tokens
        if self.max_model_len is not None:
            budget = min(budget, self.max_model_len - len(a.prompt_token_ids))
        return budget

    async def _agent_episode(self, a: protocol.Assignment, index: int, program: AgentProgram,
                             ep: _Episode) -> None:
        """An agent program's episode (:mod:`rollout_server.agents`): its chat requests are the
        turns; its return value the reward."""
        sp, prompt, budget = a.sampling, a.prompt_token_ids.tolist(), self._budget(a)
        turns = 0

        async def take_turn(observation: Any, stop: tuple[str, ...], limit: int | None) -> tuple[str, str, int]:
            nonlocal turns
            if observation is not None and not self._observe(observation, ep, budget):
                raise TurnLimit()
            room = min(sp.max_new_tokens, budget - len(ep.ids), limit or sp.max_new_tokens)
            if turns >= sp.max_turns or room <= 0:
                raise TurnLimit()
            completion = await self._turn(a, index, turns, prompt, ep, room, stop)
            turns += 1
            return self.decode(completion.token_ids), completion.finish_reason, len(completion.token_ids)

        messages = prompt_messages(a.prompt_text, a.metadata)
        session = AgentSession(messages, take_turn, model=self.model_name)
        await self.endpoint.start()
        url = self.endpoint.open(session)
        given = messages if PROMPT_MESSAGES_KEY in a.metadata else a.prompt_text
        start = self.clock()
        try:
            value = await asyncio.wait_for(_call(program.fn, url, given, dict(a.metadata)),
                                           self.settings.agent_timeout_s)
        except asyncio.TimeoutError:
            raise EpisodeFailed("timeout", f"the agent ran past rollout.environment.agent_timeout_s "
                                           f"({self.settings.agent_timeout_s:g} s)") from None
        except EpisodeFailed:
            raise
        except Exception as e:  # noqa: BLE001 - the agent's failure ends its episode only
            if session.failed is not None:
                raise _ended(session.failed) from None
            raise EpisodeFailed("error", f"the agent raised {type(e).__name__}: {e}") from None
        finally:
            self.endpoint.close_session(url)
            ep.env_s += self.clock() - start - ep.generate_s
        if session.failed is not None:       # the agent caught the error reply and went on
            raise _ended(session.failed)
        try:
            ep.parts = reward_parts(value)
        except ValueError as e:
            raise EpisodeFailed("reward", str(e)) from None
        if session.truncated:
            ep.truncated, ep.finish_reason = True, "length"

    def _take_step(self, result: Any, ep: _Episode) -> tuple[Any, bool]:
        """``step``'s (observation, parts, done, info) checked into ``ep``; (observation, done)."""
        if not (isinstance(result, tuple) and len(result) == 4):
            raise EpisodeFailed("error", f"step returned {type(result).__name__}; expected "
                                         f"(observation, reward parts, done, info)")
        observation, parts, done, info = result
        try:
            parts = reward_parts(parts)
        except ValueError as e:
            raise EpisodeFailed("reward", str(e)) from None
        for name, value in parts.items():
            ep.parts[name] = ep.parts.get(name, 0.0) + value
        if isinstance(info, dict):
            for key in ("tool_calls", "tool_errors"):
                n = info.get(key, 0)
                if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                    setattr(ep, key, getattr(ep, key) + n)
        if observation is not None and not done:
            self.observations.messages(observation)    # not text: fails here, named
        return observation, bool(done)
