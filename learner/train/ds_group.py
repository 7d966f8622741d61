"""The process group of the DeepSpeed learner's ranks: joining and leaving it, per-rank seeds, the
messages rank 0 sends its workers (a batch, a command) and the heartbeat that keeps idle workers
from timing out; each worker's liveness file (:class:`RankBeat`, read by rank 0's watchdog:
:func:`stale_ranks`); helpers that read a ZeRO engine's local shards."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

from buffer import Batch
from learner.config import DeepSpeedSettings
from protocol.errors import StartupError
from protocol.messages import Sample

_GROUP: Group | None = None


def rank_seed(seed: int, rank: int) -> int:
    """The seed of a rank that has no saved RNG states (module docstring): deterministic in
    (seed, rank), a 63-bit integer torch, python and numpy all take."""
    import numpy as np

    entropy = [int(seed) & 0xFFFFFFFFFFFFFFFF, int(rank)]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]) >> 1


def seed_rank(seed: int, rank: int) -> None:
    """Seed torch (CPU and CUDA), python and numpy of this process from :func:`rank_seed`."""
    import random

    import numpy as np

    value = rank_seed(seed, rank)
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % (1 << 32))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """This process's place in the group: rank, world size, device, and the gloo group that carries
    rank 0's commands and the gathered statistics (the default group carries DeepSpeed's tensors)."""

    def __init__(self, ds: DeepSpeedSettings):
        import torch.distributed as dist

        if "RANK" not in os.environ:        # one process, no launcher: a group of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        cuda = torch.cuda.is_available()
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.timeout = timedelta(seconds=ds.timeout_s)
        if cuda:
            torch.cuda.set_device(self.local_rank)
        if not dist.is_initialized():
            import deepspeed

            deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", timeout=self.timeout,
                                       auto_mpi_discovery=False, verbose=False)
        self.ctl = dist.new_group(backend="gloo", timeout=self.timeout)
        self.device = f"cuda:{self.local_rank}" if cuda else "cpu"
        self.lock = threading.RLock()       # one command (and its collectives) at a time on rank 0

    # -- commands (rank 0 -> the others) and gathered statistics: msgpack, never pickle --
    def send(self, name: str, *args) -> None:
        if self.world > 1:
            self._broadcast(pack([name, list(args)]))

    def receive(self) -> tuple[str, tuple]:
        name, args = unpack(self._broadcast(None))
        return name, tuple(args)

    def _broadcast(self, payload: bytes | None) -> bytes:
        import torch.distributed as dist

        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.ctl)
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None
               else torch.empty(int(size), dtype=torch.uint8))
        dist.broadcast(buf, src=0, group=self.ctl)
        return payload if payload is not None else buf.numpy().tobytes()

    def gather(self, obj) -> list:
        """``obj`` (msgpack-able: numbers, strings, lists, dicts) of every rank, in rank order."""
        import torch.distributed as dist

        if self.world == 1:
            return [obj]
        data = pack(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        dist.all_gather(sizes, size, group=self.ctl)
        longest = max(int(x) for x in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.zeros_like(buf) for _ in range(self.world)]
        dist.all_gather(bufs, buf, group=self.ctl)
        return [unpack(b[:int(n)].numpy().tobytes()) for b, n in zip(bufs, sizes, strict=True)]

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks of a tensor every rank holds."""
        import torch.distributed as dist

        if self.world > 1:
            dist.all_reduce(t)
        return t


def join_group(ds: DeepSpeedSettings) -> Group:
    """This process's :class:`Group`, made once (making one is collective: every rank, once)."""
    global _GROUP
    if _GROUP is None:
        _GROUP = Group(ds)
    return _GROUP


def leave_group() -> None:
    """After a clean end (rank 0 sent ``stop``; a worker received it): destroy this process's
    process groups while every thread is idle. Left to the interpreter's exit, the gloo groups'
    C++ threads can be destroyed still joinable, and a run that finished cleanly aborts
    (``terminate called without an active exception``, exit -6) as it exits."""
    global _GROUP
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = None


def _plain(x):
    """msgpack's fallback: numpy and torch scalars as Python numbers."""
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"cannot send a {type(x).__name__} between ranks")


def pack(obj) -> bytes:
    import msgpack

    return msgpack.packb(obj, default=_plain, use_bin_type=True)


def unpack(data: bytes):
    import msgpack

    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def batch_to_wire(batch: Batch) -> dict:
    return {"samples": [s.to_wire() for s in batch.samples], "version": int(batch.version),
            "staleness": list(batch.staleness), "needs_correction": list(batch.needs_correction),
            "group_sizes": list(batch.group_sizes)}


def batch_from_wire(w: dict) -> Batch:
    return Batch([Sample.from_wire(x, "batch") for x in w["samples"]], version=w["version"],
                 staleness=w["staleness"], needs_correction=w["needs_correction"],
                 group_sizes=w["group_sizes"])


class Heartbeat(threading.Thread):
    """Rank 0: a no-op command every ``interval`` seconds when no other command is running."""

    def __init__(self, group: Group, interval: float):
        super().__init__(name="slipstream-ds-heartbeat", daemon=True)
        self.group, self.interval = group, interval
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            if self.group.lock.acquire(blocking=False):
                try:
                    if not self.stopped.is_set():
                        self.group.send("ping")
                finally:
                    self.group.lock.release()


RANK_BEAT_S = 1.0
"""How often a worker rank rewrites its liveness file."""
RANK_STALE_S = 10.0
"""A worker whose liveness file is older than this is named by rank 0's watchdog (a stopped or
hung process: its beat thread stops with it; a worker busy in a collective still beats)."""


class RankBeat(threading.Thread):
    """A worker rank's liveness file, ``DIR/rank-<r>.json`` (``RUN_DIR/ranks``), rewritten every
    :data:`RANK_BEAT_S`: pid, host, wall time and the command it runs (``command``, set by the
    worker's loop). Removed at :meth:`stop`. Needs the run directory on a filesystem rank 0 reads
    (one host, or a shared one); a rank without a file is not judged."""

    def __init__(self, directory: Path, rank: int):
        super().__init__(name="slipstream-rank-beat", daemon=True)
        self.path = Path(directory) / f"rank-{rank}.json"
        self.rank = rank
        self.command = ("idle", time.time())
        self.stopped = threading.Event()

    def run(self) -> None:
        while True:
            try:
                self.write()
            except OSError:
                pass                          # a disk that refuses it: rank 0 does not judge
            if self.stopped.wait(RANK_BEAT_S):
                return

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        name, since = self.command
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                                   "time": time.time(), "command": name, "since": since}))
        os.replace(tmp, self.path)

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive():
            self.join(timeout=5)
        try:
            self.path.unlink()
        except OSError:
            pass


def stale_ranks(directory: Path, world: int, now: float | None = None) -> list[dict]:
    """The worker ranks (1 .. world-1) whose liveness file is older than :data:`RANK_STALE_S`:
    their file's fields and ``age_s``."""
    now = time.time() if now is None else now
    out = []
    for rank in range(1, world):
        try:
            info = json.loads((Path(directory) / f"rank-{rank}.json").read_text())
            age = now - float(info["time"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if age > RANK_STALE_S:
            out.append({**info, "age_s": age})
    return out


def check_precision(ds: DeepSpeedSettings) -> None:
    """StartupError when this device's DeepSpeed accelerator cannot run the precision (its CPU
    accelerator has no fp16: ``deepspeed.initialize`` would raise "Type fp16 is not supported")."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    ok = {"fp32": True, "bf16": acc.is_bf16_supported(), "fp16": acc.is_fp16_supported()}[ds.precision]
    if not ok:
        raise StartupError(f"learner.deepspeed.precision={ds.precision} is not supported by DeepSpeed's "
                           f"{acc.device_name()} accelerator here: use "
                           f"{' or '.join(p for p in ('bf16', 'fp32') if p != ds.precision)}")


def local_data(p: torch.nn.Parameter) -> torch.Tensor:
    """The tensor this rank holds of a parameter: the ZeRO-3 partition, else the whole tensor."""
    return p.ds_tensor.data if hasattr(p, "ds_tensor") else p.data


def master_weights(engine) -> list[torch.Tensor]:
    """This rank's float32 master partitions (ZeRO-1/2, ZeRO-3), flat."""
    out = []
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        out += [t.data for t in (getattr(engine.optimizer, name, None) or []) if t.numel()]
    return out


def discard_gradients(engine) -> None:
    """Drop the gradients an engine accumulated, without an update: a step through DeepSpeed's
    overflow path (which clears every gradient buffer, partitioned or not), made to see an
    infinite norm. Collective, like any step."""
    opt = engine.optimizer
    name = "_get_norm_groups" if engine.zero_optimization_stage() == 3 else "scaled_global_norm"
    inf = torch.tensor(float("inf"), device=engine.device)
    setattr(opt, name, (lambda *a, **k: [inf]) if name == "_get_norm_groups" else (lambda *a, **k: inf))
    try:
        engine.step()
    finally:
        delattr(opt, name)
