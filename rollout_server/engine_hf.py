"""Hugging Face transformers generation engine (CPU, tests, small models).

Log-probs: ``generate(output_scores=True)`` returns the *processed* scores of every step — the
logits after the temperature, top-k and top-p warpers, i.e. the distribution the token was actually
sampled from (filtered tokens are -inf). The behavior log-prob of a sampled token is
``log_softmax(processed scores)[token]``. The learner recomputes with the same temperature.

Versions: a ``generate`` call holds the engine lock and runs entirely on the weights it started
with; weight updates take the same lock, so they land between calls and every token of a call is
tagged with one version (the HF engine's in-flight policy is effectively ``finish``).
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import torch

from rollout_server.engine import Completion, GenRequest, WeightUpdate


class HFEngine:
    """transformers engine: model work runs in a worker thread (``*_sync`` methods)."""

    name = "hf"

    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.eval()
        self.model.generation_config.pad_token_id = self.tokenizer.pad_token_id
        self.version = 0
        self.lock = threading.Lock()
        self.generator_seed = seed
        torch.manual_seed(seed)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    def decode(self, token_ids: np.ndarray) -> str:
        return self.tokenizer.decode(token_ids.tolist(), skip_special_tokens=True)

    async def generate(self, requests: list[GenRequest]) -> list[list[Completion]]:
        return await asyncio.to_thread(self.generate_sync, requests)

    async def update_weights(self, update: WeightUpdate) -> float:
        if update.kind != "full":
            raise ValueError(f"HF engine: {update.kind!r} weight updates are not supported yet")
        return await asyncio.to_thread(self.load_weights, update.version, update.tensors)

    async def close(self) -> None:
        return None

    @torch.no_grad()
    def generate_sync(self, requests: list[GenRequest]) -> list[list[Completion]]:
        """Generate ``n`` completions for each request; requests with equal sampling share a call."""
        results: list[list[Completion] | None] = [None] * len(requests)
        by_params: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            by_params.setdefault((r.temperature, r.top_p, r.top_k, r.max_new_tokens), []).append(i)
        with self.lock:
            version = self.version
            for (temperature, top_p, top_k, max_new), idx in by_params.items():
                rows = [(i, requests[i].prompt_token_ids) for i in idx for _ in range(requests[i].n)]
                comps = self._generate_rows([p for _, p in rows], temperature, top_p, top_k, max_new,
                                            version)
                for i in idx:
                    results[i] = []
                for (i, _), c in zip(rows, comps):
                    results[i].append(c)
        return results  # type: ignore[return-value]

    def _generate_rows(self, prompts: list[np.ndarray], temperature: float, top_p: float, top_k: int,
                       max_new: int, version: int) -> list[Completion]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)   # (N, P) left-padded
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.from_numpy(p.astype(np.int64))
            attn[r, width - len(p):] = 1
        out = self.model.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, temperature=temperature,
            top_p=top_p, top_k=top_k, max_new_tokens=max_new, output_scores=True,
            return_dict_in_generate=True, pad_token_id=self.pad_id, eos_token_id=self.eos_id)
        new = out.sequences[:, width:]                                            # (N, T)
        scores = torch.stack(out.scores, dim=1).float()                           # (N, T, V) processed
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        comps = []
        for r in range(len(prompts)):
            toks = new[r]
            eos_pos = (toks == self.eos_id).nonzero()
            if len(eos_pos):
                length, reason = int(eos_pos[0]) + 1, "stop"
            else:
                length, reason = len(toks), "length"
            comps.append(Completion(
                token_ids=toks[:length].numpy().astype(np.int32),
                logprobs=logprobs[r, :length].numpy().astype(np.float32),
                versions=np.full(length, version, dtype=np.int32),
                finish_reason=reason))
        return comps

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> float:
        """Copy full weights in place between generate calls; returns seconds spent waiting+copying."""
        start = time.monotonic()
        params = dict(self.model.named_parameters())
        missing = set(params) - set(tensors)
        unknown = set(tensors) - set(params)
        if missing or unknown:
            raise ValueError(f"weights do not match the model: missing {sorted(missing)[:3]}, "
                             f"unknown {sorted(unknown)[:3]}")
        with self.lock, torch.no_grad():
            for name, p in params.items():
                src = tensors[name]
                if src.shape != p.shape:
                    raise ValueError(f"weights {name}: shape {tuple(src.shape)} != {tuple(p.shape)}")
                p.copy_(src)
            self.version = version
        return time.monotonic() - start
