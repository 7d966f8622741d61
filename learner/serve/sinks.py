"""Where every step's statistics go besides Prometheus: ``learner.metrics_sinks``.

    jsonl        RUN_DIR/metrics.jsonl, one JSON row per step (always written: `slipstream report`
                 and the tests read it; listing it is optional)
    tensorboard  TensorBoard event files in RUN_DIR/tensorboard/<run id>/ (tensorboardX, the
                 ``tensorboard`` extra): every numeric statistic as a scalar ``train/<name>``,
                 each server's version as ``servers/<server id>``, at step = policy version.
                 ``tensorboard --logdir RUN_DIR/tensorboard`` shows one curve per run.
"""

from __future__ import annotations

import math
from pathlib import Path

from protocol.errors import StartupError


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
        for key, value in record.items():
            if key in ("step", "version", "time") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(f"train/{key}", value, step)
        for server, version in (record.get("server_versions") or {}).items():
            self.writer.add_scalar(f"servers/{server}", version, step)

    def close(self) -> None:
        self.writer.close()


def open_sinks(names: list[str], run_dir: Path, run_id: str) -> list:
    """The sinks besides metrics.jsonl (which the service always writes)."""
    return [TensorBoardSink(run_dir, run_id) for n in dict.fromkeys(names) if n == "tensorboard"]
