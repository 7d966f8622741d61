"""The GPU paths (``-m gpu``; tests/gpu/run.sh): the learner on CUDA in bf16 with full weights and
with LoRA, the HF engine on CUDA, and one end-to-end run over real sockets. Each also records
a speed figure (tokens/s, step seconds) in ``$SLIPSTREAM_GPU_BENCH_JSON`` for the session note;
nothing asserts on speed."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "learner"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "learner" / "train"))
from config_kit import nested, rollout_config
from learner_testkit import learner_config, running_learner, wait_until  # noqa: E402
from test_trainer import make_batch  # noqa: E402

from learner.config import LearnerConfig, LoraSettings, TrainerConfig  # noqa: E402
from learner.train.trainer import Trainer  # noqa: E402
from rollout_server.engine import GenRequest, WeightUpdate  # noqa: E402
from rollout_server.engines import create_engine  # noqa: E402
from rollout_server.service import RolloutService  # noqa: E402

pytestmark = pytest.mark.gpu


def record(name: str, **figures) -> None:
    """Add ``figures`` under ``name`` to the bench JSON (when run.sh names one) and print them."""
    print(f"[gpu] {name}: {figures}")
    path = os.environ.get("SLIPSTREAM_GPU_BENCH_JSON")
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {}
    data[name] = figures
    p.write_text(json.dumps(data, indent=1))


def trainer(model_dir: str, **overrides) -> Trainer:
    cfg = dict(group_size=4, batch_prompts=2, micro_batch_samples=8, lr=1e-3, seed=0,
               device="cuda", dtype="bfloat16")
    cfg.update(overrides)
    return Trainer(TrainerConfig.of(LearnerConfig(**nested(cfg))), model_dir)


def timed_steps(tr: Trainer, n: int = 3) -> tuple[dict, float]:
    stats = tr.step(make_batch())                     # warm-up (kernels, allocator)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        stats = tr.step(make_batch())
    torch.cuda.synchronize()
    return stats, (time.perf_counter() - t0) / n


def test_learner_full_bf16_on_cuda(tiny_model_dir):
    tr = trainer(tiny_model_dir)
    p = next(tr.model.parameters())
    assert p.device.type == "cuda" and p.dtype == torch.bfloat16
    before = {n: t.detach().float().cpu().clone() for n, t in tr.model.named_parameters()}
    stats, step_s = timed_steps(tr)
    assert np.isfinite(stats["loss"])
    changed = sum(not torch.equal(before[n], t.detach().float().cpu()) for n, t in tr.model.named_parameters())
    assert changed > 0
    published = tr.named_tensors()
    assert published and all(t.dtype == torch.bfloat16 for _, t in published)
    record("learner_full_bf16", step_s=step_s)


def test_learner_lora_bf16_on_cuda(tiny_model_dir):
    tr = trainer(tiny_model_dir, lora=LoraSettings(r=8, alpha=16), kl_coef=0.01)
    base = {n: t.detach().clone() for n, t in tr.model.named_parameters() if "lora_" not in n}
    stats, step_s = timed_steps(tr)
    assert np.isfinite(stats["loss"])
    for n, t in tr.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(base[n], t.detach()), f"{n}: a base weight moved under LoRA"
    published = dict(tr.named_tensors())
    assert published and all("lora_" in n for n in published)
    assert tr.publish_kind == "lora"
    record("learner_lora_bf16", step_s=step_s)


async def test_hf_engine_on_cuda_generates_and_applies_weights(tiny_model_dir):
    engine = create_engine(rollout_config(device="cuda", dtype="bfloat16"), tiny_model_dir)
    try:
        prompt = np.asarray([1, 5, 6, 7], dtype=np.int32)
        req = GenRequest(prompt, n=16, max_new_tokens=32)
        await engine.generate([req])                  # warm-up
        t0 = time.perf_counter()
        out = (await engine.generate([req]))[0]
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for c in out)
        assert len(out) == 16 and all(np.isfinite(c.logprobs).all() for c in out)
        tr = trainer(tiny_model_dir)
        tr.step(make_batch())
        await engine.update_weights(WeightUpdate(version=1, kind="full",
                                                 tensors={n: t.cpu() for n, t in tr.named_tensors()}))
        assert engine.version == 1
        record("hf_engine_bf16_generate", tokens_per_s=tokens / seconds)
    finally:
        await engine.close()


async def test_end_to_end_on_cuda(tmp_path, tiny_model_dir):
    cfg = learner_config(tmp_path, device="cuda", dtype="bfloat16", max_staleness=1)
    async with running_learner(cfg, tiny_model_dir) as svc:
        server = RolloutService(rollout_config(learner=svc.endpoints["rollout"], server_id="gpu",
                                              metrics_port=0, max_concurrency=8, device="cuda",
                                              dtype="bfloat16"), tiny_model_dir)
        task = asyncio.create_task(server.run())
        try:
            t0 = time.perf_counter()
            await wait_until(lambda: server.engine is not None and server.engine.version >= 3
                             or task.done(), 240, "the server at version 3")
            assert not task.done()
            record("end_to_end", seconds_to_version_3=time.perf_counter() - t0)
        finally:
            server.stopping.set()
            server.abort.set()
            assert await asyncio.wait_for(task, 60) == 0
