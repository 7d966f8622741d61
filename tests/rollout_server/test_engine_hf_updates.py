"""HF engine: in-flight policies (proved by token versions), LoRA through PEFT, request batching."""

from __future__ import annotations

import asyncio
import copy
import threading

import numpy as np
import pytest
import torch
from test_engine_hf import _prompt, _recompute

from rollout_server.engine import GenRequest, WeightUpdate
from rollout_server.engine_hf import HFEngine

UPDATE_AFTER = 3          # tokens generated on version 0 before the update arrives
MAX_NEW = 10


def _update_mid_generation(engine: HFEngine, update: WeightUpdate) -> list:
    """Generate while ``update`` arrives at the step boundary after UPDATE_AFTER tokens."""
    original = engine._step_boundary
    calls = {"n": 0}
    updater: list[threading.Thread] = []

    def boundary():
        calls["n"] += 1
        if calls["n"] == UPDATE_AFTER:          # start the update; wait until it asks for the lock
            t = threading.Thread(target=engine.apply_update, args=(update,))
            t.start()
            updater.append(t)
            with engine._cv:
                assert engine._cv.wait_for(lambda: engine._updates_waiting > 0, timeout=30)
        return original()

    engine._step_boundary = boundary
    try:
        prompt = _prompt(engine, "12+7=")
        (comps,) = engine.generate_sync([GenRequest(prompt, 6, max_new_tokens=MAX_NEW)])
    finally:
        engine._step_boundary = original
    for t in updater:
        t.join(timeout=30)
    assert engine.version == update.version
    return prompt, comps


def _random_full(engine, version):
    g = torch.Generator().manual_seed(version)
    return WeightUpdate(version=version, kind="full", tensors={
        n: torch.randn(p.shape, generator=g) * 0.5 for n, p in engine.model.named_parameters()})


def _long(comps):
    long = [c for c in comps if len(c.token_ids) > UPDATE_AFTER]
    assert long, "every row stopped before the update (EOS); raise MAX_NEW or change the seed"
    return long


def test_finish_keeps_the_starting_version(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, seed=1, inflight_update="finish")
    _, comps = _update_mid_generation(eng, _random_full(eng, 1))
    assert all((c.versions == 0).all() for c in comps)
    assert any(len(c.token_ids) > UPDATE_AFTER for c in comps)


@pytest.mark.parametrize("policy", ["continue", "resubmit"])
def test_continue_and_resubmit_switch_versions_mid_sequence(tiny_model_dir, policy):
    eng = HFEngine(tiny_model_dir, seed=1, inflight_update=policy)
    prompt, comps = _update_mid_generation(eng, _random_full(eng, 1))
    for c in _long(comps):
        np.testing.assert_array_equal(c.versions[:UPDATE_AFTER], 0)
        np.testing.assert_array_equal(c.versions[UPDATE_AFTER:], 1)
    # New tokens' behavior log-probs vs the new weights recomputed over the whole sequence:
    # resubmit re-prefills prompt + partial with the new weights -> exact; continue keeps the KV
    # cache the old weights computed -> the first new tokens differ.
    lp, bt = _recompute(eng, prompt, comps, 1.0)
    new = torch.zeros_like(bt.mask, dtype=torch.bool)                  # (N, L): tokens on v1
    for r, c in enumerate(comps):
        cols = bt.mask[r].nonzero().squeeze(1)                         # this row's completion
        new[r, cols] = torch.from_numpy(c.versions == 1)
    close = torch.isclose(lp[new], bt.behavior_logprobs[new], atol=2e-4)
    if policy == "resubmit":
        assert close.all()
    else:
        assert not close.all()


def _peft_reference(tiny_model_dir, r=4, seed=0):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    cfg = {"r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(**cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ref.eval()
    return ref, cfg, {k: v.clone() for k, v in get_peft_model_state_dict(ref).items()}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids.tolist()], dtype=torch.long)).logits


def test_lora_updates_apply_through_peft(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, seed=2)
    prompt = _prompt(eng, "3+4=")
    base = _logits(eng.model, prompt)
    ref1, cfg, sd1 = _peft_reference(tiny_model_dir, seed=1)
    assert any("lora_A" in k for k in sd1) and all(k.startswith("base_model.model.") for k in sd1)
    eng.apply_update(WeightUpdate(version=1, kind="lora", tensors=sd1, lora_config=dict(cfg)))
    assert eng.version == 1
    got = _logits(eng.model, prompt)
    assert not torch.allclose(got, base, atol=1e-3)
    assert torch.allclose(got, _logits(ref1, prompt), atol=1e-5)
    # Version 2: same adapter shape, new tensors copied in place (config may be omitted).
    ref2, _, sd2 = _peft_reference(tiny_model_dir, seed=2)
    eng.apply_update(WeightUpdate(version=2, kind="lora", tensors=sd2))
    assert eng.version == 2 and torch.allclose(_logits(eng.model, prompt), _logits(ref2, prompt), atol=1e-5)
    # A new rank replaces the adapter.
    ref3, cfg3, sd3 = _peft_reference(tiny_model_dir, r=8, seed=3)
    eng.apply_update(WeightUpdate(version=3, kind="lora", tensors=sd3, lora_config=cfg3))
    assert eng.version == 3 and torch.allclose(_logits(eng.model, prompt), _logits(ref3, prompt), atol=1e-5)
    # Wrong tensors are refused and the version stays.
    with pytest.raises(ValueError, match="do not match the adapter"):
        eng.apply_update(WeightUpdate(version=4, kind="lora", tensors=dict(list(sd3.items())[1:])))
    assert eng.version == 3
    # Behavior log-probs still match a recompute under the adapted model; tokens carry version 3.
    (comps,) = eng.generate_sync([GenRequest(prompt, 4, temperature=0.8, max_new_tokens=6)])
    assert all((c.versions == 3).all() for c in comps)
    lp, bt = _recompute(eng, prompt, comps, 0.8)
    m = bt.mask.bool()
    assert torch.allclose(lp[m], bt.behavior_logprobs[m], atol=2e-4)


def test_lora_update_mid_generation_under_continue(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, seed=4, inflight_update="continue")
    _, cfg, sd = _peft_reference(tiny_model_dir, seed=5)
    _, comps = _update_mid_generation(eng, WeightUpdate(version=1, kind="lora", tensors=sd,
                                                        lora_config=cfg))
    for c in _long(comps):
        assert c.versions[0] == 0 and c.versions[-1] == 1


async def test_concurrent_requests_share_one_decode(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, seed=5)
    prompts = [_prompt(eng, t) for t in ("1+2=", "30+4=", "5+66=")]
    # gather starts the three calls in one turn of the loop, before the decode task first runs:
    # all three are queued when it takes its batch (no timing involved).
    outs = await asyncio.gather(*[eng.generate([GenRequest(p, 2, max_new_tokens=4)]) for p in prompts])
    assert eng.generate_calls == 1
    assert [len(o) for o in outs] == [1, 1, 1] and all(len(o[0]) == 2 for o in outs)
    # Different sampling parameters cannot share a batch: two decodes in one call.
    await asyncio.gather(eng.generate([GenRequest(prompts[0], 1, max_new_tokens=4)]),
                         eng.generate([GenRequest(prompts[1], 1, max_new_tokens=5)]))
    assert eng.generate_calls == 3
    await eng.close()


def test_full_after_lora_is_refused(tiny_model_dir):
    eng = HFEngine(tiny_model_dir, seed=6)
    _, cfg, sd = _peft_reference(tiny_model_dir)
    eng.apply_update(WeightUpdate(version=1, kind="lora", tensors=sd, lora_config=cfg))
    with pytest.raises(ValueError, match="after LoRA"):
        eng.apply_update(WeightUpdate(version=2, kind="full", tensors=copy.copy(sd)))
    assert eng.version == 1
