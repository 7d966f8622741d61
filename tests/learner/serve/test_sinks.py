"""The TensorBoard sink: a real learner writes real event files (tensorboardX); read back record by
record (the TFRecord framing, checksums verified) they hold the same numbers as metrics.jsonl."""

from __future__ import annotations

import json
import math
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


# -- W&B (offline) -----------------------------------------------------------------------------------

W_AND_B_BLOCK = 32768


def read_wandb_history(run_file: Path) -> dict[str, dict[int, float]]:
    """The history rows of an offline W&B run file (``run-<id>.wandb``), read record by record:
    its framing is LevelDB's log format (a 7-byte ``:W&B`` file header, 32 KiB blocks, records
    of a 7-byte header ``crc32 u32, length u16, type u8``: full, first, middle, last), each
    record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out: dict[str, dict[int, float]] = {}
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = W_AND_B_BLOCK - pos % W_AND_B_BLOCK
        if left < 7:                                       # a block's tail, too short for a header
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:                                      # zero padding to the end of the block
            pos += W_AND_B_BLOCK - pos % W_AND_B_BLOCK if pos % W_AND_B_BLOCK else 0
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind not in (1, 4):                             # first / middle: more to come
            continue
        record = wandb_internal_pb2.Record.FromString(pending)
        if record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    out.setdefault(key, {})[step] = json.loads(item.value_json)
    return out


async def test_wandb_offline_run_holds_the_step_statistics(tmp_path, tiny_model_dir, monkeypatch):
    """issue 27.10: a real learner with metrics_sinks [wandb] in W&B's offline mode (no network):
    the run file read back holds every row of metrics.jsonl, at step = policy version."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = learner_config(tmp_path, metrics_sinks=["jsonl", "wandb"])
    async with running_learner(cfg, tiny_model_dir) as svc:
        async with HonestServer(svc.endpoints["rollout"]) as good:
            await good.wait_version(3)
        run_dir = Path(svc.run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_file,) = run_dir.glob("wandb/offline-run-*-test/run-test.wandb")
    history = read_wandb_history(run_file)
    assert len(rows) >= 3
    for row in rows:                   # every number of every row, at its step, exactly
        numbers = {k: v for k, v in row.items() if k not in ("step", "version", "time")
                   and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        assert "reward_mean" in numbers and "pg_loss" in numbers
        for key, value in numbers.items():
            assert history.get(f"train/{key}", {}).get(row["step"]) == pytest.approx(value, rel=1e-12), (
                key, row["step"], sorted(history.get(f"train/{key}", {}).items()))
        if "good" in row["server_versions"]:
            assert history["servers/good"][row["step"]] == row["server_versions"]["good"]
    assert "train/run_id" not in history and "train/time" not in history


def test_wandb_that_cannot_start_is_one_startup_error(tmp_path, monkeypatch):
    """Online without an account (and no network here): one line saying what to set."""
    pytest.importorskip("wandb")
    from protocol.errors import StartupError

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "5")
    with pytest.raises(StartupError, match="WANDB_MODE=offline"):
        open_sinks(["wandb"], tmp_path, "r")
