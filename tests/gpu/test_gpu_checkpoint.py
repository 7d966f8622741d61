"""GPU group: a checkpoint of a cuda / bf16 trainer (full and LoRA) restores exactly into a fresh
one (weights, optimizer moments on the device, the CUDA RNG state), and the next step runs.
Written without a GPU at hand (skipped there); tests/gpu/run.sh runs it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "learner"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "learner" / "train"))
from config_kit import nested
from test_trainer import make_batch  # noqa: E402

from learner.config import LearnerConfig, LoraSettings, TrainerConfig  # noqa: E402
from learner.state.checkpoint import Checkpointer  # noqa: E402
from learner.train.trainer import Trainer  # noqa: E402

pytestmark = pytest.mark.gpu
STATE = {"run_id": "gpu", "assignment_counter": 0, "data": {"position": 0}, "buffer": {}}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpoint_round_trip_on_cuda_bf16(tmp_path, tiny_model_dir, lora):
    cfg = LearnerConfig(**nested(group_size=4, batch_prompts=2, micro_batch_samples=8, lr=1e-3, seed=0,
                        device="cuda", dtype="bfloat16",
                        lora=LoraSettings(r=8, alpha=16) if lora else None))
    a = Trainer(TrainerConfig.of(cfg), tiny_model_dir)
    a.step(make_batch())
    torch.cuda.manual_seed(1234)
    store = Checkpointer(tmp_path / "ck")
    t0 = time.perf_counter()
    path = store.save(1, STATE, a)
    save_s = time.perf_counter() - t0
    rng = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(99)                                     # moved on: the restore puts it back
    b = Trainer(TrainerConfig.of(cfg), tiny_model_dir)
    t0 = time.perf_counter()
    store.restore_trainer(store.read(path), b)
    load_s = time.perf_counter() - t0
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert q.device.type == "cuda" and q.dtype == p.dtype and torch.equal(p, q), n
    for sa, sb in zip(a.optimizer.state.values(), b.optimizer.state.values(), strict=True):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and sb["exp_avg"].device.type == "cuda"
    assert torch.isfinite(torch.tensor(b.step(make_batch())["loss"]))
    print(f"[gpu] checkpoint {'lora' if lora else 'full'} bf16: save {save_s:.3f}s, load {load_s:.3f}s")
