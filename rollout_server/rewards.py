"""Reward functions: ``reward_fn(prompt, completion, metadata) -> float | dict[str, float]``.

Configuration (``rollout.reward.fn``, or ``rollout.reward`` itself as a shorthand): one spec or a list of specs, each ``builtin:NAME`` or
``"module:function"`` (sync or async). Every function contributes *parts*: a float becomes one part
named after the function (``exact_numeric``, ``format``, ``my_fn``), a dict contributes its keys.
The total is the sum of the parts, or — when ``rollout.reward.weights`` names parts — the weighted
sum ``Σ w_k · part_k`` (parts not named there weigh 1.0)::

    total = Σ_k w_k · part_k,   w_k = weights.get(k, 1.0)

A reward that raises or returns a non-finite value marks that sample failed with the reason (the
server counts it in ``slipstream_rollout_errors_total{kind="reward"}`` and keeps running).

Where they run: a user's synchronous function (and the reward model) runs in a bounded pool of
worker threads (``rollout.reward.threads``), never on the event loop, so a slow reward cannot stall
heartbeats, acks or weight fetches; an async function runs on the loop (it must not block). Every
call has ``rollout.reward.timeout_s``: a slower call marks its sample failed
(``kind="reward_timeout"``). A thread cannot be stopped, so a call that never returns keeps its
worker; once every worker is stuck, later calls time out too (each counted) instead of queueing
forever. The built-ins are pure and take microseconds: they run inline.

Built-ins: ``exact_numeric`` (GSM8K ``#### 42`` / ``\\boxed{42}`` answer vs ``metadata["answer"]``),
``exact_match`` (the stripped completion equals ``metadata["answer"]``), ``format``
(``format_reward`` when ``format_regex`` matches, else 0), ``length_penalty``
(``-length_penalty_per_token · max(0, tokens - length_free_tokens)``, tokens from
``metadata["completion_tokens"]``, which the server sets), ``reward_model`` (see
:class:`RewardModelScorer`). The service adds ``completion_tokens`` and ``finish_reason`` to a
copy of the assignment's metadata before calling any reward, and ``completion_ids`` (the
completion's token ids, a list of ints: plain data, as the rest of the metadata) and ``policy_version`` (the oldest version among its
tokens).

``trl:module:function`` and ``verl:module:function`` call a TRL or a verl reward function with
its own conventions (:mod:`rollout_server.reward_adapters`). A ``module:function`` that cannot
take ``(prompt, completion, metadata)`` is refused at start-up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import math
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protocol.messages import DATASET_KEY
from rollout_server.config import RewardOptions
from rollout_server.reward_adapters import TrlReward, VerlReward, check_arity

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


def exact_match(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
    """1.0 if the completion, stripped of surrounding whitespace, is ``metadata["answer"]``."""
    return 1.0 if completion.strip() == str(metadata.get("answer", "")).strip() else 0.0


def make_format_reward(pattern: str, value: float) -> Callable:
    """``value`` if ``pattern`` matches anywhere in the completion (``re.search``), else 0.0."""
    rx = re.compile(pattern, re.DOTALL)

    def format(prompt: str, completion: str, metadata: dict[str, Any]) -> float:  # noqa: A001
        return value if rx.search(completion) else 0.0

    return format


def make_length_penalty(per_token: float, free_tokens: int) -> Callable:
    """``-per_token · max(0, completion_tokens - free_tokens)`` (0 for short completions)."""

    def length_penalty(prompt: str, completion: str, metadata: dict[str, Any]) -> float:
        n = int(metadata.get("completion_tokens", len(completion)))
        return -per_token * max(0, n - free_tokens)

    return length_penalty


def _inline(fn: Callable) -> Callable:
    """Mark a built-in as cheap and pure: called on the event loop (a thread hop costs more)."""
    fn.inline = True
    return fn


def load_module(name: str, spec: str, what: str = "reward") -> Any:
    """``name``: a module name, or a path/to/file.py (:func:`_load_file`); ``spec`` and ``what``
    name it in the error."""
    try:
        return _load_file(name, spec, what) if name.endswith(".py") else importlib.import_module(name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import module {name!r} ({e})") from None


def _load_file(path: str, spec: str, what: str = "reward") -> Any:
    """A plug-in module given as a file (verl's custom_reward_function.path): imported under a
    name of its own, its directory first on the import path while it loads (its sibling imports)."""
    import importlib.util
    import sys
    from pathlib import Path

    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ValueError(f"{what} {spec!r}: no such file {str(file)!r}")
    name = f"slipstream_{what}_{file.stem}_{abs(hash(str(file))) % 10**8}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(loader_spec)
    sys.path.insert(0, str(file.parent))
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's module failed to load: one line, at start-up
        first = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{what} {spec!r}: {file} failed to load: {type(e).__name__}: {first}") from None
    finally:
        sys.path.remove(str(file.parent))
    sys.modules[name] = module
    return module


def _import(target: str, spec: str | None = None) -> Callable:
    """``module:function`` -> the callable; ``spec`` is the whole spec, for the error."""
    spec = spec or target
    module_name, _, attr = target.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected builtin:NAME (exact_numeric, format, "
                         f"length_penalty, reward_model), 'module:function', 'trl:module:function' "
                         f"or 'verl:module:function' (a module may be a path/to/file.py)")
    module = load_module(module_name, spec)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name} has no callable {attr!r}")
    return fn


def load_reward(spec: str, options: RewardOptions | None = None) -> Callable:
    """``builtin:NAME`` or ``module:function`` -> the callable (raises ValueError with a fix)."""
    o = options or RewardOptions()
    if spec == "builtin:exact_numeric":
        return _inline(exact_numeric)
    if spec == "builtin:exact_match":
        return _inline(exact_match)
    if spec == "builtin:format":
        return _inline(make_format_reward(o.format_regex, o.format_reward))
    if spec == "builtin:length_penalty":
        return _inline(make_length_penalty(o.length_penalty_per_token, o.length_free_tokens))
    if spec == "builtin:reward_model":
        if not o.reward_model:
            raise ValueError("reward builtin:reward_model needs rollout.reward.options.reward_model "
                             "(a directory with an AutoModelForSequenceClassification + tokenizer)")
        return RewardModelScorer(o.reward_model, chat_template=o.rm_chat_template,
                                 probe_text=o.rm_probe_text, max_length=o.rm_max_length,
                                 batch_size=o.rm_batch_size)
    if spec.startswith("builtin:"):
        raise ValueError(f"reward {spec!r}: unknown built-in; choose builtin:exact_numeric, "
                         f"builtin:exact_match, builtin:format, builtin:length_penalty or "
                         f"builtin:reward_model")
    if spec.startswith("trl:"):
        return TrlReward(_import(spec[4:], spec), spec)
    if spec.startswith("verl:"):
        return VerlReward(_import(spec[5:], spec), spec)
    fn = _import(spec)
    if not getattr(fn, "batched", False):
        check_arity(fn, spec, "fn(prompt, completion, metadata); a TRL or verl function takes "
                    "the trl: or verl: prefix")
    return fn


class RewardModelScorer:
    """A reward model: any HF ``AutoModelForSequenceClassification`` with one label, batched.

    Input: the *text* of prompt and completion (never the policy's token ids), formatted with the
    RM's own chat template (user = prompt, assistant = completion) when it has one, tokenized by the
    RM's own tokenizer. Score: the head's output at the last non-padding token of each row, found
    from the attention mask (not from ``pad_token_id``, which may equal EOS), so left and right
    padding give the same score as the unpadded example. Decoder RMs (Llama, Qwen2, Mistral, GPT-2:
    a per-token ``score`` head) are pooled that way through a hook on the head; encoder RMs (BERT
    style, CLS pooling) use the model's own pooled logits.

    Refuses to start (``ValueError``) when inputs would be garbled:
      * the model has more than one label (no scalar reward);
      * the tokenizer has neither a pad nor an EOS token (cannot batch);
      * ``probe_text`` does not round-trip ``decode(encode(text)) == text`` or encodes to unknown
        tokens (a tokenizer that cannot represent ordinary text);
      * ``chat_template="always"`` and the tokenizer has no chat template.
    """

    batched = True

    def __init__(self, path: str, chat_template: str = "auto", probe_text: str = "The answer is 42.",
                 max_length: int = 2048, batch_size: int = 16, dtype: str = "float32"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        tok = AutoTokenizer.from_pretrained(path)
        if tok.pad_token is None:
            if tok.eos_token is None:
                raise ValueError(f"reward model {path}: its tokenizer has neither a pad nor an EOS "
                                 "token, so inputs cannot be batched; set tokenizer.pad_token and save")
            tok.pad_token = tok.eos_token
        ids = tok.encode(probe_text, add_special_tokens=False)
        back = tok.decode(ids, skip_special_tokens=False)
        if tok.unk_token_id is not None and tok.unk_token_id in ids or back.strip() != probe_text.strip():
            raise ValueError(f"reward model {path}: its tokenizer garbles the probe text {probe_text!r} "
                             f"(decodes to {back!r}); this RM cannot read such completions. Use the "
                             "RM's own tokenizer files, or set reward_options.rm_probe_text to text "
                             "this RM is meant to read")
        has_template = bool(getattr(tok, "chat_template", None))
        if chat_template == "always" and not has_template:
            raise ValueError(f"reward model {path}: reward_options.rm_chat_template=always but its "
                             "tokenizer has no chat template; add one or use rm_chat_template=never")
        self.use_template = has_template and chat_template != "never"
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
        if model.config.num_labels != 1:
            raise ValueError(f"reward model {path}: num_labels={model.config.num_labels}; a reward "
                             "model must output one scalar (num_labels=1)")
        model.config.pad_token_id = tok.pad_token_id
        model.eval()
        tok.truncation_side = "left"          # keep the end of long inputs: it is what gets scored
        self.tok, self.model = tok, model
        self.max_length, self.batch_size = max_length, batch_size
        self.head = getattr(model, "score", None)   # per-token head of decoder RMs
        self._token_scores = None
        self._lock = threading.Lock()             # the hook's output is per call: one at a time
        if self.head is not None:
            self.head.register_forward_hook(lambda m, i, out: setattr(self, "_token_scores", out))

    def text(self, prompt: str, completion: str) -> str:
        if self.use_template:
            return self.tok.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
                tokenize=False)
        return prompt + completion

    def score_texts(self, texts: list[str]) -> list[float]:
        torch = self.torch
        out: list[float] = []
        add_special = not self.use_template     # a chat template writes its own BOS
        for start in range(0, len(texts), self.batch_size):
            enc = self.tok(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                           truncation=True, max_length=self.max_length, add_special_tokens=add_special)
            mask = enc["attention_mask"]                                       # (B, T)
            with torch.no_grad(), self._lock:
                logits = self.model(**enc).logits                              # (B, 1)
                if self.head is not None:
                    tok_scores = self._token_scores                            # (B, T, 1)
                    t = torch.arange(mask.shape[1])
                    last = (t * mask).argmax(dim=1)                            # last mask==1 index
                    logits = tok_scores[torch.arange(mask.shape[0]), last]     # (B, 1)
            out.extend(float(x) for x in logits[:, 0].float())
        return out

    def score_batch(self, prompts: list[str], completions: list[str], metadatas: list[dict]) -> list[float]:
        return self.score_texts([self.text(p, c) for p, c in zip(prompts, completions)])

    def __call__(self, prompt: str, completion: str, metadata: dict) -> float:
        return self.score_batch([prompt], [completion], [metadata])[0]


def _part_name(spec: str) -> str:
    return spec.rpartition(":")[2] or spec


@dataclass
class Scored:
    """One sample's reward: ``total`` and ``parts``, or ``failed`` with the reason."""

    total: float = 0.0
    parts: dict[str, float] | None = None
    failed: str | None = None
    timed_out: bool = False       # failed because a call exceeded reward_timeout_s


def _as_parts(name: str, value: Any, score_key: str | None = None) -> tuple[dict[str, float], set[str]]:
    """A function's value as parts, and the names among them reported beside the total but not in
    it (a verl dict's keys other than ``score_key``)."""
    info: set[str] = set()
    if isinstance(value, dict) and score_key is not None:
        if score_key not in value:
            raise ValueError(f"returned a dict without {score_key!r}: keys {sorted(map(str, value))[:8]}")
        parts = {name: float(value[score_key])}
        for k, v in value.items():
            if k != score_key and isinstance(v, (int, float)):     # verl's "pred" strings are left out
                parts[f"{name}/{k}"] = float(v)
                info.add(f"{name}/{k}")
    elif isinstance(value, dict):
        parts = {str(k): float(v) for k, v in value.items()}
    else:
        parts = {name: float(value)}
    bad = {k: v for k, v in parts.items() if not math.isfinite(v)}
    if bad:
        raise ValueError(f"reward returned a non-finite value: {bad}")
    return parts, info


class RewardPool:
    """A bounded pool of *daemon* worker threads for synchronous reward calls.

    Not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined at interpreter exit, so
    one reward call that never returns would keep a stopping server from exiting. Threads start
    on first use.
    """

    def __init__(self, size: int):
        self.size = size
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():      # timed out while queued
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                fut.set_exception(e)

    async def call(self, timeout_s: float, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` in a worker; ``TimeoutError`` after ``timeout_s`` (queueing included)."""
        with self._lock:
            if len(self._threads) < self.size:
                t = threading.Thread(target=self._worker, daemon=True,
                                     name=f"reward-{len(self._threads)}")
                t.start()
                self._threads.append(t)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fut, fn, args))
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)

    def close(self) -> None:
        """Let idle workers exit (a stuck one is a daemon: it does not hold the process)."""
        with self._lock:
            for _ in self._threads:
                self._queue.put(None)
            self._threads.clear()


class PluginExit(Exception):
    """A reward plug-in's coroutine raised SystemExit (see :data:`PLUGIN_ERRORS`)."""


async def _no_exit(awaitable: Any) -> Any:
    """``await awaitable`` with SystemExit turned into :class:`PluginExit`: asyncio re-raises a
    SystemExit from inside a task out of the event loop itself (``wait_for`` runs its coroutine in a
    task), so it must become an ordinary exception before it leaves the plug-in's coroutine."""
    try:
        return await awaitable
    except SystemExit as e:
        raise PluginExit(f"SystemExit: {e}") from None


PLUGIN_ERRORS = (Exception, SystemExit)
"""What a reward call may raise that fails its samples, not the server: a plug-in's
``sys.exit()`` (or ``exit()``) raises SystemExit, which is no Exception and would otherwise end the
event loop (and the server) from inside a scoring task."""


class Rewarder:
    """Several reward functions combined into ``(total, parts)`` per sample, batched where possible.

    A function with ``batched = True`` (the reward-model scorer) is called once per batch as
    ``fn.score_batch(prompts, completions, metadatas) -> list[float]``; any other function once
    per sample, the samples of a batch concurrently. Functions run in the order configured; a
    sample that failed one is not given to the next. ``by_dataset``: other functions for the
    samples whose metadata names a dataset of a mixture (``protocol.DATASET_KEY``); the rest get
    ``specs``.
    """

    def __init__(self, specs: str | list[str], weights: dict[str, float] | None = None,
                 options: RewardOptions | None = None, threads: int = 4, timeout_s: float = 60.0,
                 by_dataset: dict[str, str | list[str]] | None = None):
        self.fns = self._load(specs, options)
        self.routes = {name: self._load(spec, options, f"by_dataset.{name}")
                       for name, spec in (by_dataset or {}).items()}
        self.weights = dict(weights or {})
        self.timeout_s = timeout_s
        self.pool = RewardPool(threads)

    @staticmethod
    def _load(specs: str | list[str], options: RewardOptions | None, where: str = "fn") -> list:
        specs = [specs] if isinstance(specs, str) else list(specs)
        if not specs:
            raise ValueError(f"{where}: name at least one reward function")
        return [(_part_name(s), load_reward(s, options)) for s in specs]

    async def _call(self, fn: Callable, *args: Any) -> Any:
        """One reward call, off the event loop unless it is an inline built-in or a coroutine."""
        if getattr(fn, "inline", False):
            return fn(*args)
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(_no_exit(fn(*args)), self.timeout_s)
        value = await self.pool.call(self.timeout_s, fn, *args)
        if inspect.isawaitable(value):       # e.g. an object whose __call__ is async
            value = await asyncio.wait_for(_no_exit(value), self.timeout_s)
        return value

    def _failure(self, name: str, e: BaseException) -> tuple[str, bool]:
        if isinstance(e, TimeoutError):
            return f"reward {name}: timed out after {self.timeout_s:g}s", True
        if isinstance(e, PluginExit):
            return f"reward {name}: {e}", False
        return f"reward {name}: {type(e).__name__}: {e}", False

    async def score_many(self, items: list[tuple[str, str, dict]]) -> list[Scored]:
        """Score ``(prompt, completion, metadata)`` items; failures are per sample. Items of a
        dataset with a reward of its own (``by_dataset``) are scored by it, apart."""
        if not self.routes:
            return await self._score(items, self.fns)
        groups: dict[str | None, list[int]] = {}
        for i, item in enumerate(items):
            name = item[2].get(DATASET_KEY)
            groups.setdefault(name if name in self.routes else None, []).append(i)
        out: list[Scored | None] = [None] * len(items)
        for name, idx in groups.items():
            scored = await self._score([items[i] for i in idx], self.fns if name is None else self.routes[name])
            for i, sc in zip(idx, scored, strict=True):
                out[i] = sc
        return out

    async def _score(self, items: list[tuple[str, str, dict]], fns: list) -> list[Scored]:
        parts: list[dict[str, float]] = [{} for _ in items]
        info: list[set[str]] = [set() for _ in items]     # parts reported, not summed
        failed: list[str | None] = [None] * len(items)
        timed_out = [False] * len(items)
        skipped = [0] * len(items)                          # None answers of a TRL function

        def add(i: int, name: str, fn: Callable, value: Any) -> None:
            if value is None and getattr(fn, "none_skips", False):
                skipped[i] += 1
                return
            p, names = _as_parts(name, value, getattr(fn, "score_key", None))
            parts[i].update(p)
            info[i] |= names

        async def one(i: int, name: str, fn: Callable) -> None:
            try:   # a user reward function may raise anything: that sample fails, we go on
                add(i, name, fn, await self._call(fn, *items[i]))
            except PLUGIN_ERRORS as e:
                failed[i], timed_out[i] = self._failure(name, e)

        for name, fn in fns:
            live = [i for i in range(len(items)) if not failed[i]]
            if not live:
                break
            if getattr(fn, "inline", False):          # microseconds each: no task per sample
                for i in live:
                    await one(i, name, fn)
                continue
            if not getattr(fn, "batched", False):
                await asyncio.gather(*(one(i, name, fn) for i in live))
                continue
            columns = [list(c) for c in zip(*(items[i] for i in live))]
            try:
                values = await self._call(fn.score_batch, *columns)
            except PLUGIN_ERRORS as e:  # the whole batch failed: every sample says why
                reason, slow = self._failure(name, e)
                for i in live:
                    failed[i], timed_out[i] = reason, slow
                continue
            for i, v in zip(live, values):
                try:
                    add(i, name, fn, v)
                except PLUGIN_ERRORS as e:
                    failed[i], timed_out[i] = self._failure(name, e)
        out = []
        for i in range(len(items)):
            if not failed[i] and skipped[i] and not parts[i]:
                failed[i] = (f"reward: skipped: every reward function returned None for this sample "
                             f"({skipped[i]} of {len(fns)}; TRL's 'does not apply')")
            if failed[i]:
                out.append(Scored(failed=failed[i], parts={}, timed_out=timed_out[i]))
            else:
                total = sum(self.weights.get(k, 0.0 if k in info[i] else 1.0) * v for k, v in parts[i].items())
                out.append(Scored(total=total, parts=parts[i]))
        return out

    def close(self) -> None:
        self.pool.close()
