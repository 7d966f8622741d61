"""vLLM generation engine: vLLM's ``AsyncLLM`` in the server process (its engine core and workers
run in processes vLLM starts and stops).

Log-probs: the engine runs with ``logprobs_mode="processed_logprobs"`` (an engine argument) and
every request asks ``SamplingParams(logprobs=0)``, so each sampled token comes back with its
log-prob under the distribution it was actually sampled from (temperature, top-k, top-p applied) —
the same definition as the HF engine. Token ids come straight from vLLM (EOS included when
produced).

Versions: every token is tagged with the policy version of the weights that produced it.
- Full weights: vLLM 0.32 labels every engine step's output with the engine core's weight version
  (``AsyncLLM.update_weight_version``) and returns, on a finished completion, the spans of output
  tokens per label (``CompletionOutput.weight_versions``); we set the label to ``str(version)``
  while generation is paused for the swap, so the tags are exact even when they change
  mid-sequence.
- LoRA: a request keeps the ``LoRARequest`` it was submitted with, so all its tokens carry that
  adapter's version.

Full weights: the tensors (received over ZeroMQ) are written to one safetensors file (in
``/dev/shm`` when present) and every worker reloads them in place through the worker extension
(:mod:`rollout_server.vllm_worker`, ``collective_rpc``) with
``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)``, between engine
steps: ``pause_generation`` (mode by ``inflight_update``, ``clear_cache=True``) -> reload ->
``reset_prefix_cache`` -> set the weight-version label -> ``resume_generation``; ``version``
advances only once this has succeeded.

In-flight policy (``RolloutConfig.generation.inflight_update``), full weights:
- ``finish``: ``pause_generation(mode="wait")`` — running requests finish on the old weights,
  requests arriving meanwhile are queued by vLLM and start on the new ones.
- ``continue``: ``pause_generation(mode="keep")`` — running requests are frozen; ``clear_cache``
  preempts them, so on resume their KV is recomputed with the new weights and the tokens sampled
  after the swap carry the new version (no stale KV is ever reused).
- ``resubmit``: ``pause_generation(mode="abort")`` — running requests are aborted; each aborted
  completion is resubmitted as prompt + partial tokens with the remaining token budget on the new
  weights. Old tokens keep their old version.

LoRA: each version becomes a ``LoRARequest`` (name ``slipstream-v<version>``, a fresh int id),
written as a PEFT adapter directory and loaded with ``add_lora``; new requests use the newest one.
Up to ``max_loras`` versions stay loaded; older ones are removed with ``remove_lora`` and their
directory is deleted once no request uses it (vLLM reloads an evicted adapter from its path if a
request still needs it). ``finish`` needs nothing more; ``continue`` and ``resubmit`` abort the
requests running on older adapters and resubmit their continuation on the newest adapter (a vLLM
request cannot switch adapter mid-sequence, so for LoRA the two policies behave the same).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ops.precision import native_bfloat16
from rollout_server.config import RolloutConfig
from rollout_server.engine import Completion, GenRequest, TokenizerEngine, WeightUpdate, describe

WORKER_EXTENSION = "rollout_server.vllm_worker.SlipstreamWorkerExtension"
GiB = 1 << 30
# pause_generation mode for a full-weight swap, by in-flight policy.
PAUSE_MODE = {"finish": "wait", "continue": "keep", "resubmit": "abort"}
MAX_RESUBMITS = 16          # per completion: an abort loop must not spin forever


@dataclass
class _Lora:
    version: int
    request: Any                 # vllm.lora.request.LoRARequest
    path: str
    refs: int = 0                # vLLM requests currently using it
    loaded: bool = True


@dataclass
class _Running:
    """One vLLM request in flight (bookkeeping for resubmission)."""

    lora: _Lora | None
    epoch: int                   # full-weight abort epoch at submission
    resubmit: bool = False       # set when we abort it on purpose
    stats: dict = field(default_factory=dict)


def _tmp_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _peft_name(name: str) -> str:
    """PEFT state-dict name -> saved-adapter name (drop the adapter name ``.default``)."""
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def _model_max_len(model_path: str) -> int | None:
    try:
        from transformers import AutoConfig

        return getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    except Exception:       # noqa: BLE001 - vLLM reports its own error later if the model is bad
        return None


class VLLMEngine(TokenizerEngine):
    """:class:`rollout_server.engine.Engine` on vLLM's ``AsyncLLM``."""

    name = "vllm"

    def __init__(self, model_path: str, cfg: RolloutConfig):
        opts = cfg.vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.cfg = cfg
        self.inflight_update: str = cfg.generation.inflight_update
        self.max_loras = opts.max_loras
        max_len = opts.max_model_len
        if (model_max := _model_max_len(model_path)) is not None:
            max_len = min(max_len, int(model_max))
        self.max_model_len = max_len
        # auto: on the CPU build the HF engine's and the learner's rule (bfloat16 only where the
        # CPU computes it natively, else float32); on GPUs the model's own dtype (vLLM's auto).
        dtype, why = cfg.runtime.dtype, {}
        if cfg.runtime.dtype == "auto" and current_platform.is_cpu():
            native, reason = native_bfloat16("cpu")
            dtype, why = ("bfloat16" if native else "float32"), {"dtype": f"auto: {reason}"}
        elif cfg.runtime.dtype == "auto":
            why = {"dtype": "auto: vLLM's (the model's own dtype)"}
        self.runtime = describe("vllm", "cpu" if current_platform.is_cpu() else "cuda", dtype, why,
                                cfg.threads)
        kwargs: dict[str, Any] = dict(
            model=model_path, tokenizer=model_path, dtype=dtype, seed=cfg.seed,
            enforce_eager=opts.enforce_eager, max_model_len=max_len,
            tensor_parallel_size=opts.tensor_parallel_size,
            logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
            enable_lora=opts.enable_lora, disable_log_stats=False)
        if opts.enable_lora:
            kwargs.update(max_lora_rank=opts.max_lora_rank, max_loras=opts.max_loras,
                          max_cpu_loras=opts.max_loras)
        if current_platform.is_cpu():
            kwargs["kv_cache_memory_bytes"] = int(opts.kv_cache_gib * GiB)   # VLLM_CPU_KVCACHE_SPACE wins
        else:
            kwargs["gpu_memory_utilization"] = opts.gpu_memory_utilization
        t0 = time.monotonic()
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self.start_seconds = time.monotonic() - t0
        self.tokenizer = self.llm.get_tokenizer()
        self.vocab_size = int(self.llm.model_config.get_vocab_size())
        self._version = 0
        self._labels: dict[str, int] = {"default": 0}   # vLLM weight-version label -> version
        self._ids = itertools.count()
        self._lora_ids = itertools.count(1)
        self._loras: OrderedDict[int, _Lora] = OrderedDict()   # loaded adapter versions, oldest first
        self._current_lora: _Lora | None = None
        self._running: dict[str, _Running] = {}
        self._update_lock = asyncio.Lock()
        self._updating = False
        self._epoch = 0
        self._update_done: asyncio.Event | None = None
        self._closed = False
        self.stats = {"resubmitted": 0, "updates": 0}
        self._adapter_root = tempfile.mkdtemp(prefix="slipstream-lora-", dir=_tmp_root())

    # ---- Engine interface -------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version


    async def generate(self, requests: list[GenRequest]) -> list[list[Completion]]:
        """All requests run concurrently in vLLM (one vLLM request, ``n`` samples, per request)."""
        return list(await asyncio.gather(*(self._generate_one(r) for r in requests)))

    async def update_weights(self, update: WeightUpdate) -> float:
        start = time.monotonic()
        async with self._update_lock:
            if update.kind == "lora":
                await self._update_lora(update)
            elif update.kind == "full":
                await self._update_full(update)
            else:
                raise ValueError(f"unknown weight update kind {update.kind!r}")
            self.stats["updates"] += 1
        return time.monotonic() - start

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        llm, self.llm = self.llm, None
        llm.shutdown()          # stops the engine-core and worker processes
        del llm                 # (a second shutdown from __del__ at interpreter exit would be noisy)
        shutil.rmtree(self._adapter_root, ignore_errors=True)

    # ---- generation -------------------------------------------------------------------------

    def _sampling(self, r: GenRequest, n: int, max_tokens: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # Stop strings and ids (issue 26.3): the stopping tokens stay in the output's token ids
        # (what was sampled), and the text keeps the string too.
        return SamplingParams(n=n, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k if r.top_k > 0 else -1, max_tokens=max_tokens,
                              logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY, seed=r.seed,
                              stop=list(r.stop) or None, stop_token_ids=list(r.stop_token_ids) or None,
                              include_stop_str_in_output=True)

    async def _run(self, prompt: list[int], params, lora: _Lora | None):
        """Submit one vLLM request and return its final ``RequestOutput``."""
        from vllm.inputs import TokensPrompt

        rid = f"slip-{next(self._ids)}"
        run = _Running(lora=lora, epoch=self._epoch)
        self._running[rid] = run
        if lora is not None:
            lora.refs += 1
        final = None
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt), params, rid,
                                               lora_request=lora.request if lora else None):
                final = out
        finally:
            del self._running[rid]
            if lora is not None:
                lora.refs -= 1
                self._maybe_drop_dir(lora)
        assert final is not None
        return final, run

    def _completion(self, c, lora: _Lora | None, fallback: int) -> Completion:
        toks = np.asarray(c.token_ids, dtype=np.int32)
        if len(toks) and (c.logprobs is None or len(c.logprobs) != len(toks)):
            raise RuntimeError(f"vLLM returned {len(toks)} tokens but "
                               f"{None if c.logprobs is None else len(c.logprobs)} log-probs")
        lps = np.array([pos[int(t)].logprob for pos, t in zip(c.logprobs or [], toks)], dtype=np.float32)
        if lora is not None:
            vers = np.full(len(toks), lora.version, dtype=np.int32)
        else:
            vers = np.full(len(toks), fallback, dtype=np.int32)
            for span in c.weight_versions or []:
                vers[span.start:span.end] = self._labels.get(span.version, fallback)
        reason = {"stop": "stop", "length": "length"}.get(c.finish_reason, "abort")
        return Completion(token_ids=toks, logprobs=lps, versions=vers, finish_reason=reason)

    def _should_resubmit(self, run: _Running) -> bool:
        if self._closed:
            return False
        return run.resubmit or (self.inflight_update == "resubmit" and run.epoch != self._epoch) \
            or (self.inflight_update == "resubmit" and self._updating)

    async def _generate_one(self, r: GenRequest) -> list[Completion]:
        prompt = np.asarray(r.prompt_token_ids).astype(np.int64).tolist()
        max_new = min(r.max_new_tokens, self.max_model_len - len(prompt))
        if max_new < 1:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in max_model_len "
                             f"{self.max_model_len}")
        lora = self._current_lora
        fallback = self._version
        final, run = await self._run(prompt, self._sampling(r, r.n, max_new), lora)
        comps = [self._completion(c, lora, fallback) for c in sorted(final.outputs, key=lambda c: c.index)]
        if any(c.finish_reason == "abort" for c in comps) and self._should_resubmit(run):
            comps = list(await asyncio.gather(*(
                self._continue(r, prompt, c, max_new) if c.finish_reason == "abort" else _done(c)
                for c in comps)))
        return comps

    async def _continue(self, r: GenRequest, prompt: list[int], done: Completion, max_new: int) -> Completion:
        """Resubmit an aborted completion: prompt + its tokens, the remaining budget, newest weights."""
        for _ in range(MAX_RESUBMITS):
            if self._update_done is not None:
                await self._update_done.wait()      # the swap that aborted us has been applied
            remaining = max_new - len(done.token_ids)
            if remaining <= 0:
                done.finish_reason = "length"
                return done
            self.stats["resubmitted"] += 1
            lora = self._current_lora
            fallback = self._version
            final, run = await self._run(prompt + done.token_ids.tolist(),
                                         self._sampling(r, 1, remaining), lora)
            more = self._completion(final.outputs[0], lora, fallback)
            done = Completion(token_ids=np.concatenate([done.token_ids, more.token_ids]),
                              logprobs=np.concatenate([done.logprobs, more.logprobs]),
                              versions=np.concatenate([done.versions, more.versions]),
                              finish_reason=more.finish_reason)
            if more.finish_reason != "abort" or not self._should_resubmit(run):
                return done
        return done

    def progress(self) -> dict[str, int]:
        """Output tokens so far of every vLLM request in flight (diagnostics and tests)."""
        out = {}
        for rid, state in list(self.llm.output_processor.request_states.items()):
            if state.detokenizer is not None:
                out[rid] = state.detokenizer.num_output_tokens()
        return out

    # ---- full weights -----------------------------------------------------------------------

    def _write_weights(self, tensors: dict[str, Any]) -> str:
        from safetensors.torch import save_file

        seen: set[int] = set()
        flat = {}
        for name, t in tensors.items():
            t = torch.as_tensor(t).detach().to("cpu")
            if t.untyped_storage().data_ptr() in seen:          # tied weights share storage
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            flat[name] = t.contiguous()
        fd, path = tempfile.mkstemp(prefix="slipstream-weights-", suffix=".safetensors", dir=_tmp_root())
        os.close(fd)
        save_file(flat, path)
        return path

    async def _update_full(self, update: WeightUpdate) -> None:
        path = await asyncio.to_thread(self._write_weights, update.tensors)
        try:
            await self._swap(update.version, self._reload_rpc(path))
        finally:
            os.unlink(path)

    async def _reload_rpc(self, path: str) -> None:
        results = await self.llm.collective_rpc("slipstream_reload_weights", args=(path,))
        self.last_reload = results

    async def _swap(self, version: int, apply) -> None:
        """Pause per policy, run ``apply`` (a coroutine), reset caches, relabel, resume."""
        self._updating = True
        self._update_done = asyncio.Event()
        self._epoch += 1
        try:
            await self.llm.pause_generation(mode=PAUSE_MODE[self.inflight_update], clear_cache=True)
            try:
                await apply
                await self.llm.reset_prefix_cache()
                label = str(version)
                self._labels[label] = version
                await self.llm.update_weight_version(label)
                self._version = version
                self._current_lora = None
            finally:
                await self.llm.resume_generation()
        finally:
            self._updating = False
            self._update_done.set()

    # ---- LoRA -------------------------------------------------------------------------------

    def _write_adapter(self, update: WeightUpdate) -> str:
        from safetensors.torch import save_file

        path = os.path.join(self._adapter_root, f"v{update.version}-{next(self._ids)}")
        os.makedirs(path)
        tensors = {_peft_name(k): torch.as_tensor(v).detach().to("cpu").contiguous()
                   for k, v in update.tensors.items()}
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", **update.lora_config}
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o))
        return path

    async def _update_lora(self, update: WeightUpdate) -> None:
        if not self.cfg.vllm.enable_lora:
            raise ValueError("a LoRA weight update needs vllm.enable_lora: true")
        from vllm.lora.request import LoRARequest

        path = await asyncio.to_thread(self._write_adapter, update)
        request = LoRARequest(f"slipstream-v{update.version}", next(self._lora_ids), path)
        try:
            if not await self.llm.add_lora(request):
                raise RuntimeError(f"vLLM refused LoRA adapter version {update.version}")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        entry = _Lora(update.version, request, path)
        self._loras[update.version] = entry
        self._current_lora = entry
        self._version = update.version
        while len(self._loras) > self.max_loras:
            _, old = self._loras.popitem(last=False)
            old.loaded = False
            await self.llm.remove_lora(old.request.lora_int_id)
            self._maybe_drop_dir(old)
        if self.inflight_update in ("continue", "resubmit"):
            stale = [rid for rid, run in self._running.items()
                     if run.lora is None or run.lora.version != update.version]
            for rid in stale:
                self._running[rid].resubmit = True
            if stale:
                await self.llm.abort(stale)

    def _maybe_drop_dir(self, lora: _Lora) -> None:
        if not lora.loaded and lora.refs == 0:
            shutil.rmtree(lora.path, ignore_errors=True)


async def _done(c: Completion) -> Completion:
    return c
