"""One rank of the DeepSpeed equivalence oracle (run by torchrun from test_deepspeed.py; not a test).

Every rank builds the DeepSpeed trainer; rank 0 drives it as the service would (two steps, the
second after a live config change, then a publish), the others run the real worker loop. Rank 0
writes the stats of both steps and the published tensors to OUT (torch.save).

    torchrun --nproc_per_node 2 ds_oracle_worker.py MODEL_DIR OUT '{"learner": "config"}'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE), str(HERE.parent / "ops")]

from test_trainer import make_batch  # noqa: E402

from learner.config import LearnerConfig  # noqa: E402
from learner.distributed import DeepSpeedTrainer, join_group, worker_main  # noqa: E402

SECOND_STEP = {"ppo_epochs": 1, "kl_coef": 0.0}
"""The live change before the second step (rank 0 sends the trainer's config with each step)."""


def main() -> int:
    model_dir, out, fields = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cfg = LearnerConfig(**fields)
    group = join_group(cfg.deepspeed)
    if group.rank != 0:
        return worker_main(cfg, model_dir, group)
    tr = DeepSpeedTrainer(cfg, model_dir, group)
    stats = [tr.step(make_batch(seed=0))]
    for k, v in SECOND_STEP.items():
        setattr(tr.cfg, k, v)
    stats.append(tr.step(make_batch(seed=1)))
    tensors = {n: t.detach().float().cpu().clone() for n, t in tr.named_tensors()}
    torch.save({"stats": stats, "tensors": tensors, "world": group.world,
                "gather": tr.last_gather}, out)
    tr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
