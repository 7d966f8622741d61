"""The one engine interface every generation backend implements (HF, vLLM).

An engine generates ``n`` completions per request and returns, for every sampled token, its id,
its behavior log-prob (under the distribution it was actually sampled from) and the policy
version of the weights that produced it. It applies weight updates (full weights or a LoRA
adapter) and reports the version it serves. All methods that do model work are coroutines; an
engine keeps heavy work off the event loop (a worker thread, or its own engine processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

import protocol

INFLIGHT_POLICIES = ("finish", "continue", "resubmit")
"""What an engine does with a request that is generating when new weights arrive (docs/design.md §3)."""

_SAMPLING = protocol.SamplingParams()    # the protocol's defaults are the engines' defaults too


@dataclass
class GenRequest:
    prompt_token_ids: np.ndarray   # int32 [P], BOS included
    n: int
    temperature: float = _SAMPLING.temperature
    top_p: float = _SAMPLING.top_p
    top_k: int = _SAMPLING.top_k   # 0 = no top-k
    max_new_tokens: int = _SAMPLING.max_new_tokens
    seed: int | None = None        # completion i drawn from a generator seeded by (seed, i)
    stop: tuple[str, ...] = ()     # a completion ends with the token that completes one (kept)
    stop_token_ids: tuple[int, ...] = ()   # ... or that is one (kept), besides EOS

    @classmethod
    def from_sampling(cls, prompt_token_ids: np.ndarray, n: int,
                      sampling: protocol.SamplingParams) -> GenRequest:
        """The request for an assignment: its sampling parameters, unchanged."""
        return cls(prompt_token_ids, n, temperature=sampling.temperature, top_p=sampling.top_p,
                   top_k=sampling.top_k, max_new_tokens=sampling.max_new_tokens, seed=sampling.seed,
                   stop=tuple(sampling.stop), stop_token_ids=tuple(sampling.stop_token_ids))


@dataclass
class Completion:
    token_ids: np.ndarray          # int32 [T], EOS included when produced
    logprobs: np.ndarray           # float32 [T]
    versions: np.ndarray           # int32 [T]
    finish_reason: str             # "stop" | "length" | "abort"


@dataclass
class WeightUpdate:
    """A new policy version: full weights (every parameter) or a LoRA adapter's tensors."""

    version: int
    kind: str                                   # "full" | "lora"
    tensors: dict[str, Any]                     # name -> torch.Tensor (checkpoint-format names)
    lora_config: dict[str, Any] = field(default_factory=dict)   # PEFT LoraConfig fields (lora)


class Engine(Protocol):
    name: str

    @property
    def version(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold are ``0 .. vocab_size - 1`` (the embedding's rows)."""
        ...

    @property
    def max_model_len(self) -> int | None:
        """Longest prompt + completion the engine can run (None: no hard limit)."""
        ...

    async def generate(self, requests: list[GenRequest]) -> list[list[Completion]]: ...

    async def update_weights(self, update: WeightUpdate) -> float:
        """Apply ``update`` between engine steps; returns seconds; afterwards ``version`` is new."""
        ...

    def decode(self, token_ids: np.ndarray) -> str: ...

    async def close(self) -> None: ...


class TokenizerEngine:
    """What both engines derive from their Hugging Face tokenizer (``self.tokenizer``)."""

    tokenizer: Any

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    def decode(self, token_ids: np.ndarray) -> str:
        return self.tokenizer.decode(np.asarray(token_ids).tolist(), skip_special_tokens=True)


def describe(engine: str, device: str, dtype: str, why: dict[str, str], threads: int) -> dict[str, object]:
    """The engine's decisions as one record (the server's ``runtime`` event), with a ``line``."""
    info: dict[str, object] = {"engine": engine, "device": device, "dtype": dtype, "threads": threads,
                               "why": dict(why)}
    info["line"] = f"engine {engine}; " + "; ".join(
        f"{k} {info[k]}" + (f" ({why[k]})" if k in why else "") for k in ("device", "dtype", "threads"))
    return info
