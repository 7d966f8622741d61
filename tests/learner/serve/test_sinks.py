"""The TensorBoard sink: a real learner writes real event files (tensorboardX); read back record by
record (the TFRecord framing, checksums verified) they hold the same numbers as metrics.jsonl."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from learner_testkit import HonestServer, learner_config, running_learner

from learner.serve.sinks import TensorBoardSink, open_sinks

pytestmark = pytest.mark.slow


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C."""
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(directory: Path) -> dict[str, dict[int, float]]:
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            header = data[pos:pos + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc(header)
            body = data[pos + 12:pos + 12 + length]
            assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == masked_crc(body)
            pos += 16 + length
            event = event_pb2.Event.FromString(body)
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


async def test_tensorboard_event_files_hold_the_step_statistics(tmp_path, tiny_model_dir):
    cfg = learner_config(tmp_path, metrics_sinks=["jsonl", "tensorboard"])
    async with running_learner(cfg, tiny_model_dir) as svc:
        async with HonestServer(svc.endpoints["rollout"]) as good:
            await good.wait_version(3)
        run_dir = Path(svc.run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scalars = read_scalars(run_dir / "tensorboard" / "test")
    assert len(rows) >= 3
    for row in rows:
        for key in ("reward_mean", "entropy", "step_s", "mismatch_kl"):
            assert scalars[f"train/{key}"][row["step"]] == pytest.approx(row[key], rel=1e-6)
        # (a step trained after the server left has no version for it, there or in the events)
        if "good" in row["server_versions"]:
            assert scalars["servers/good"][row["step"]] == row["server_versions"]["good"]
        else:
            assert row["step"] not in scalars.get("servers/good", {})
    assert "train/time" not in scalars and "train/run_id" not in scalars


def test_no_tensorboard_without_asking(tmp_path):
    assert open_sinks(["jsonl"], tmp_path, "r") == []
    sink = TensorBoardSink(tmp_path, "r")
    sink.write({"step": 1, "loss": float("nan"), "ok": True, "reward_mean": 0.5, "run_id": "r"})
    sink.close()
    assert read_scalars(tmp_path / "tensorboard" / "r") == {"train/reward_mean": {1: 0.5}}
