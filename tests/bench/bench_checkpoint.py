"""Benchmark of learner.state.checkpoint: save, verify and restore seconds of a full checkpoint.

    python tests/bench/bench_checkpoint.py [--models tiny,builtin:smollm2-135m] [--repeat 3]
                                           [--out bench_results/bench_checkpoint.json]

For each model (fp32, CPU): a Trainer after one policy step (so the AdamW moments exist), then
``Checkpointer.save`` (prepare: policy via save_pretrained and the other tensors copied to host
memory, what training waits for — the pause; commit: optimizer and RNG tensors via safetensors,
JSON state, XXH3 digest of every file, fsync, rename, marker), ``Checkpointer.read`` (the full
verification: every file hashed against the manifest) and ``restore_trainer`` into a fresh
Trainer. The baseline, measured in the same process on the same disk: ``safetensors.save_file``
of the same tensors (policy + optimizer moments) without fsync or hashing, and ``load_file`` of
it. Medians of ``--repeat`` runs; the page cache is warm (a second save of the same bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_machine import machine, machine_line  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: config_kit
from config_kit import nested  # noqa: E402

from buffer import Batch  # noqa: E402
from learner.config import LearnerConfig, TrainerConfig  # noqa: E402
from learner.state.checkpoint import Checkpointer  # noqa: E402
from learner.train.trainer import Trainer  # noqa: E402
from protocol import Sample  # noqa: E402

STATE = {"run_id": "bench", "assignment_counter": 0, "data": {"position": 0}, "buffer": {}}


def _batch(vocab: int) -> Batch:
    rng = np.random.default_rng(0)
    samples = []
    for i in range(8):
        g, gi = divmod(i, 4)
        t = 8
        samples.append(Sample(
            sample_id=f"a{g}/{gi}", assignment_id=f"a{g}", group_index=gi, group_size=4,
            prompt_token_ids=rng.integers(4, vocab, 16).astype(np.int32),
            completion_token_ids=rng.integers(4, vocab, t).astype(np.int32),
            behavior_logprobs=np.full(t, -float(np.log(vocab)), dtype=np.float32),
            token_versions=np.zeros(t, dtype=np.int32), reward=float(gi % 2)))
    return Batch(samples, version=0, staleness=[0] * 8, needs_correction=[False] * 8, group_sizes=[4, 4])


def _model_dir(name: str, workdir: Path) -> str:
    if name == "tiny":
        from learner.models.builtin import build_model, build_tokenizer
        path = workdir / "tiny"
        tok = build_tokenizer()
        build_model(tok).save_pretrained(path)
        tok.save_pretrained(path)
        return str(path)
    from deploy.model_source import resolve_model
    return resolve_model(name, log=lambda m: print(f"[setup] {m}", file=sys.stderr))


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def bench(name: str, repeat: int, workdir: Path) -> dict:
    from safetensors.torch import load_file, save_file

    model_dir = _model_dir(name, workdir)
    cfg = LearnerConfig(**nested(group_size=4, batch_prompts=2, micro_batch_samples=8, threads=2, seed=0))
    tr = Trainer(TrainerConfig.of(cfg), model_dir)
    tr.step(_batch(tr.vocab_size))
    fresh = Trainer(TrainerConfig.of(cfg), model_dir)
    store = Checkpointer(workdir / f"ck-{name.replace(':', '_')}", keep_last=1)
    save, pause, verify, restore, raw_save, raw_load = [], [], [], [], [], []
    path = None
    for i in range(repeat):
        t0 = time.perf_counter()
        pending = store.prepare(i + 1, STATE, tr)
        pause.append(time.perf_counter() - t0)
        path = store.commit(pending)
        save.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ck = store.read(path)
        verify.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        store.restore_trainer(ck, fresh)
        restore.append(time.perf_counter() - t0)
        tensors = {f"policy/{k}": v.detach().contiguous() for k, v in tr.model.state_dict().items()
                   if k != "lm_head.weight" or not tr.model.config.tie_word_embeddings}
        for idx, st in tr.optimizer.state_dict()["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim():
                    tensors[f"opt/{idx}/{k}"] = v
        raw = workdir / "raw.safetensors"
        t0 = time.perf_counter()
        save_file(tensors, str(raw))
        raw_save.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        load_file(str(raw))
        raw_load.append(time.perf_counter() - t0)
    med = statistics.median
    params = sum(p.numel() for p in tr.model.parameters())
    return {"model": name, "parameters": params, "checkpoint_bytes": _dir_bytes(path),
            "save_s": med(save), "pause_s": med(pause), "verify_s": med(verify), "restore_s": med(restore),
            "load_s": med(verify) + med(restore), "raw_save_s": med(raw_save), "raw_load_s": med(raw_load),
            "save_vs_raw": med(save) / med(raw_save), "load_vs_raw": (med(verify) + med(restore)) / med(raw_load)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,builtin:smollm2-135m")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="bench_results/bench_checkpoint.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            rows.append(bench(name, args.repeat, Path(tmp)))
    m = machine()
    print(machine_line(m))
    print(f"{'model':24} {'params':>11} {'MiB':>8} {'save s':>8} {'pause s':>8} {'verify s':>9} {'restore s':>10} "
          f"{'raw save':>9} {'raw load':>9} {'save/raw':>9} {'load/raw':>9}")
    for r in rows:
        print(f"{r['model']:24} {r['parameters']:>11,} {r['checkpoint_bytes'] / 2**20:>8.1f} {r['save_s']:>8.3f} "
              f"{r['pause_s']:>8.3f} {r['verify_s']:>9.3f} {r['restore_s']:>10.3f} {r['raw_save_s']:>9.3f} {r['raw_load_s']:>9.3f} "
              f"{r['save_vs_raw']:>9.2f} {r['load_vs_raw']:>9.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "machine": m, "cpus": os.cpu_count(),
                               "torch": torch.__version__, "time": time.time()}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
