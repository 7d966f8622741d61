"""Where every step's statistics go besides Prometheus: ``learner.metrics_sinks``.

    jsonl        RUN_DIR/metrics.jsonl, one JSON row per step (always written: `slipstream report`
                 and the tests read it; listing it is optional)
    tensorboard  TensorBoard event files in RUN_DIR/tensorboard/<run id>/ (tensorboardX, the
                 ``tensorboard`` extra): every numeric statistic as a scalar ``train/<name>``,
                 each server's version as ``servers/<server id>``, at step = policy version.
                 ``tensorboard --logdir RUN_DIR/tensorboard`` shows one curve per run.
    wandb        Weights & Biases (the ``wandb`` extra): the same scalars (``train/<name>``,
                 ``servers/<server id>``) at step = policy version, in a W&B run whose id is the
                 run id (a resumed run appends to it), files under RUN_DIR/wandb/. W&B's own
                 variables choose where it goes, as in TRL and verl: ``WANDB_MODE=offline`` writes
                 the run to disk only (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it
                 later), ``WANDB_PROJECT`` (default ``slipstream``), ``WANDB_ENTITY``,
                 ``WANDB_API_KEY``. A W&B that cannot start is a one-line startup error.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from protocol.errors import StartupError


def _scalars(record: dict):
    """(tag, value) of each finite number of a step's row and each server's version."""
    for key, value in record.items():
        if key in ("step", "version", "time") or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            yield f"train/{key}", value
    for server, version in (record.get("server_versions") or {}).items():
        yield f"servers/{server}", version


class TensorBoardSink:
    def __init__(self, run_dir: Path, run_id: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise StartupError("learner.metrics_sinks has tensorboard, which needs tensorboardX: "
                               "pip install 'slipstream[tensorboard]' (or drop it from the list)") from None
        self.dir = Path(run_dir) / "tensorboard" / run_id
        self.writer = SummaryWriter(str(self.dir), flush_secs=10)

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for tag, value in _scalars(record):
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, run_id: str, config: dict | None = None):
        try:
            import wandb
        except ImportError:
            raise StartupError("learner.metrics_sinks has wandb, which needs the wandb package: "
                               "pip install 'slipstream[wandb]' (or drop it from the list)") from None
        self.dir = Path(run_dir)
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "slipstream", id=run_id,
                                  name=run_id, resume="allow", dir=str(self.dir), config=config or {},
                                  settings=wandb.Settings(console="off", silent=True))
        except Exception as e:                                     # no account, no network, ...
            raise StartupError(f"learner.metrics_sinks has wandb, but W&B did not start ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}); set WANDB_MODE=offline to "
                               "write the run to disk only") from None

    def write(self, record: dict) -> None:
        self.run.log(dict(_scalars(record)), step=int(record["step"]))

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before W&B's service process has written the run's last records
        # (an offline run file was seen holding only its header); teardown waits for it to exit.
        wandb.teardown()


def open_sinks(names: list[str], run_dir: Path, run_id: str, config: dict | None = None) -> list:
    """The sinks besides metrics.jsonl (which the service always writes); ``config``: the run's
    resolved config, which W&B keeps with the run."""
    out: list = []
    for name in dict.fromkeys(names):
        if name == "tensorboard":
            out.append(TensorBoardSink(run_dir, run_id))
        elif name == "wandb":
            out.append(WandbSink(run_dir, run_id, config))
    return out
