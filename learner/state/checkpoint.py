"""Checkpoints of a learner run, and resuming from one (issue 10; R2 of issue 14).

A checkpoint is a directory ``step-<version>`` under ``checkpoint_dir`` (default
``RUN_DIR/checkpoints``)::

    policy/                 the policy as save_pretrained writes it (for LoRA the PEFT adapter):
                            loadable by transformers (and vLLM) as it is
    trainer.safetensors     every other tensor: optimizer moments, the critic and its optimizer,
                            the torch RNG states
    trainer.json            the rest of Trainer.state_dict() (KL controller, reward moments,
                            optimizer hyper-parameters), tensors named by their key in the file above
    state.json              run id, policy version, data position, the buffer (gate totals, leases,
                            buffered samples, the de-duplication windows), the assignment counter,
                            the python / numpy RNG states
    manifest.json           format, version, run id, and every file above with its size and digest
    COMPLETE                the completion marker: format, version and the manifest's digest

Why it can be trusted. Everything is written into a temporary directory next to the final one,
every file and the directory are fsync'd, the directory is renamed into place, and only then is
the marker written (itself through a rename, fsync'd). A directory without a valid marker is torn
and never used: :meth:`Checkpointer.latest_complete` skips it. Older checkpoints are deleted only
after the new one is complete (``keep_last`` are kept), so a failed write — disk full, a directory
that cannot be written — leaves the previous one intact, and its temporary directory is removed.

Why it is safe to load. Nothing is unpickled: tensors come from safetensors, the rest from JSON
(tests/test_no_pickle.py). Before anything is applied, :meth:`Checkpointer.read` checks the
marker, the format version, the manifest against the marker and every file against the manifest
(size and XXH3-128 digest), and that the versions named by the marker, the manifest, the directory and
state.json agree. Applying then checks every tensor's shape against the live model and optimizer.
Any failure is one line (:class:`protocol.StartupError`) naming the checkpoint and what is wrong.

The reference policy is not saved: it is the initial policy, which a resumed run loads from the
same ``model`` (learner.train.reference). Learning rates follow from the version (learner.train.schedules),
so there is no scheduler state beyond it.

Rolled-back steps. A learner killed after checkpoint ``c`` may have trained steps past ``c``;
resumed from ``c`` it trains them again (from the same buffered samples, and with assignment ids
it issues again). ``trained_ids.jsonl`` is appended to, never truncated: the resume writes a
``resumed_at_version`` line, and the steps of an earlier life at or past that version are rolled
back (:func:`effective_trained_ids` reads the file so).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import random
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from protocol.errors import StartupError
from protocol.process import fsync_path

FORMAT = "slipstream-checkpoint"
FORMAT_VERSION = 1
MARKER = "COMPLETE"
DIGEST = "xxh3_128"
MANIFEST = "manifest.json"
STATE = "state.json"
TRAINER_JSON = "trainer.json"
TRAINER_TENSORS = "trainer.safetensors"
POLICY = "policy"
DIR_RE = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-step-"
OLD_PREFIX = ".old-step-"
EXIT_CHECKPOINT_FAILED = 3
"""Exit code of a learner stopped by a failed checkpoint under ``checkpoint_failure: stop``."""

_TENSOR, _DICT, _TUPLE = "__tensor__", "__dict__", "__tuple__"
ENGINE = "engine"
"""DeepSpeed only: the engines' master weights and Adam moments, gathered (learner.train.distributed)."""
_NOT_SAVED = ("policy", "reference")     # Trainer.state_dict() keys saved otherwise (docstring)


# ---- low-level writes (one place, so a test can make the disk full) ------------------------------

def _write_bytes(path: Path, data: bytes) -> None:
    """Write and fsync one file."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": FORMAT})


def _fsync_tree(root: Path) -> None:
    """fsync every file below ``root``, then every directory (deepest first), then ``root``."""
    dirs = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(dirpath) / name)
        dirs.append(Path(dirpath))
    for d in reversed(dirs):
        fsync_path(d)


def _digest(path: Path) -> str:
    """XXH3-128 of a file (integrity against a torn or corrupted file, as the weights' chunks use;
    several GB/s, where sha256 took a third of a SmolLM2 save)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# ---- nested state <-> JSON + tensors --------------------------------------------------------------

def encode_tree(obj: Any, tensors: dict[str, torch.Tensor], path: str = "",
                _ptrs: set[int] | None = None, copy: bool = False) -> Any:
    """A nested state (dicts with str/int keys, lists, tuples, numbers, tensors) as JSON data; its
    tensors go into ``tensors`` under their path. Tensors sharing memory are stored once each
    (safetensors refuses shared storage), as contiguous CPU copies where they are not already
    (``copy``: always a copy, so the live tensors may change while it is written)."""
    if _ptrs is None:                     # storages already in ``tensors`` (the RNG states, say)
        _ptrs = {u.data_ptr() for u in tensors.values() if u.numel()}
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        copied = t.device.type != "cpu"
        if copied:
            t = t.cpu()                   # a new host tensor
        if not t.is_contiguous():
            t, copied = t.contiguous(), True
        if (copy and not copied) or (t.numel() and t.data_ptr() in _ptrs):
            t = t.clone()
        if t.numel():
            _ptrs.add(t.data_ptr())
        tensors[path] = t
        return {_TENSOR: path}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"checkpoint state: key {k!r} at {path or '/'} is not a str or int")
            items.append([k, encode_tree(v, tensors, f"{path}/{k}", _ptrs, copy)])
        return {_DICT: items}
    if isinstance(obj, tuple):
        return {_TUPLE: [encode_tree(v, tensors, f"{path}/{i}", _ptrs, copy) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_tree(v, tensors, f"{path}/{i}", _ptrs, copy) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint state: {type(obj).__name__} at {path or '/'} cannot be saved")


def decode_tree(node: Any, tensors: dict[str, torch.Tensor], used: set[str] | None = None) -> Any:
    """Inverse of :func:`encode_tree`; ``ValueError`` on anything it would not have written."""
    if isinstance(node, dict):
        if set(node) == {_TENSOR}:
            key = node[_TENSOR]
            if not isinstance(key, str) or key not in tensors:
                raise ValueError(f"tensor {key!r} is not in {TRAINER_TENSORS}")
            if used is not None:
                used.add(key)
            return tensors[key]
        if set(node) == {_DICT} and isinstance(node[_DICT], list):
            out = {}
            for item in node[_DICT]:
                if (not isinstance(item, list) or len(item) != 2
                        or not isinstance(item[0], (str, int)) or isinstance(item[0], bool)):
                    raise ValueError("a dict entry is not a [key, value] pair")
                out[item[0]] = decode_tree(item[1], tensors, used)
            return out
        if set(node) == {_TUPLE} and isinstance(node[_TUPLE], list):
            return tuple(decode_tree(v, tensors, used) for v in node[_TUPLE])
        raise ValueError(f"unexpected object with keys {sorted(node)[:5]}")
    if isinstance(node, list):
        return [decode_tree(v, tensors, used) for v in node]
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    raise ValueError(f"unexpected {type(node).__name__}")


# ---- RNG states ------------------------------------------------------------------------------------

def rng_state(tensors: dict[str, torch.Tensor]) -> dict:
    """Python, numpy and torch (CPU, and every CUDA device when CUDA is initialized) RNG states;
    the torch ones go into ``tensors``."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    tensors["rng/torch"] = torch.get_rng_state()
    cuda = 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = s
            cuda += 1
    return {"python": [version, list(internal), gauss],
            "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
            "cuda_devices": cuda}


def set_rng_state(state: dict, tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss),
                         float(cached)))
    torch.set_rng_state(tensors["rng/torch"].to(torch.uint8))
    n = int(state.get("cuda_devices", 0))
    if n and torch.cuda.is_available() and torch.cuda.device_count() >= n:
        for i in range(n):
            torch.cuda.set_rng_state(tensors[f"rng/cuda/{i}"].to(torch.uint8), i)


# ---- the policy --------------------------------------------------------------------------------

def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def warm_save_imports() -> None:
    """Import now what the first ``save_pretrained`` would import on the train thread: accelerate's
    ``extract_model_from_parallel`` imports DeepSpeed when it is installed (0.3-0.8 s here). Run
    at load, so the first periodic checkpoint does not pause training for it (it paused the demo
    0.27 s against 0.02 s for the later ones). Nothing is lost when it cannot be imported: the
    save then imports what it can, as before."""
    try:
        import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed or broken: the save decides, as before
        pass


def save_policy(trainer: Any, path: Path) -> None:
    """``Trainer.save_policy`` where the trainer has it; else save_pretrained of model and
    tokenizer (a PEFT model saves its adapter only)."""
    if callable(getattr(trainer, "save_policy", None)):
        trainer.save_policy(path)
        return
    trainer.model.save_pretrained(path)
    trainer.tokenizer.save_pretrained(path)


def _policy_tensors(policy: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """("adapter" | "full", tensors) of a saved policy directory."""
    from safetensors.torch import load_file

    adapter = policy / "adapter_model.safetensors"
    if adapter.is_file():
        return "adapter", load_file(str(adapter))
    single = policy / "model.safetensors"
    if single.is_file():
        return "full", load_file(str(single))
    index = policy / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            if "/" in shard or "\\" in shard or shard.startswith("."):
                raise ValueError(f"shard name {shard!r} is not a file of the policy directory")
            out.update(load_file(str(policy / shard)))
        return "full", out
    raise ValueError("policy/ has no model.safetensors, shard index or adapter_model.safetensors")


def load_policy(model: Any, policy: Path) -> None:
    """The saved policy's tensors into ``model``; ValueError on any key or shape that does not fit."""
    kind, tensors = _policy_tensors(policy)
    if kind == "adapter":
        if not is_peft(model):
            raise ValueError("the checkpoint holds a LoRA adapter, the config trains the full model")
        from peft.utils import set_peft_model_state_dict

        own = {k: p.shape for k, p in model.named_parameters() if p.requires_grad}
        result = set_peft_model_state_dict(model, tensors)
        bad = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if bad:
            raise ValueError(f"adapter tensor {bad[0]!r} does not fit the model's LoRA layers")
        for k, p in model.named_parameters():
            if p.requires_grad and p.shape != own[k]:
                raise ValueError(f"adapter tensor {k!r} has shape {tuple(p.shape)}")
        return
    if is_peft(model):
        raise ValueError("the checkpoint holds a full model, the config trains a LoRA adapter")
    live = model.state_dict()
    for k, t in tensors.items():
        if k not in live:
            raise ValueError(f"policy tensor {k!r} is not a tensor of the model")
        if tuple(t.shape) != tuple(live[k].shape):
            raise ValueError(f"policy tensor {k!r} has shape {tuple(t.shape)}, the model "
                             f"{tuple(live[k].shape)}")
    loaded_ptrs = {live[k].data_ptr() for k in tensors}
    missing = [k for k in live if k not in tensors and live[k].data_ptr() not in loaded_ptrs]
    if missing:
        raise ValueError(f"policy tensor {missing[0]!r} is missing ({len(missing)} in all)")
    model.load_state_dict(tensors, strict=False)


def _check_optimizer(name: str, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Shapes of the saved optimizer state against the live parameters (torch checks only the
    group sizes; a moment of the wrong shape would fail at the next step, or broadcast)."""
    groups = state.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{name}: {len(groups) if isinstance(groups, list) else 'no'} parameter "
                         f"groups, the optimizer has {len(optimizer.param_groups)}")
    params: dict[int, torch.Tensor] = {}
    for saved, live in zip(groups, optimizer.param_groups, strict=True):
        ids = saved.get("params") if isinstance(saved, dict) else None
        if not isinstance(ids, list) or len(ids) != len(live["params"]):
            raise ValueError(f"{name}: a parameter group of another size")
        params.update(zip(ids, live["params"], strict=True))
    per_param = state.get("state")
    if not isinstance(per_param, dict):
        raise ValueError(f"{name}: no per-parameter state")
    for idx, entry in per_param.items():
        if idx not in params or not isinstance(entry, dict):
            raise ValueError(f"{name}: state for parameter {idx!r}, which the optimizer does not have")
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[idx].shape:
                raise ValueError(f"{name}: {key} of parameter {idx} has shape {tuple(value.shape)}, "
                                 f"the parameter {tuple(params[idx].shape)}")


# ---- trained ids across lives -------------------------------------------------------------------

def effective_trained_ids(path: Path) -> list[str]:
    """The sample ids of ``trained_ids.jsonl`` that the final weights were trained on, in order:
    a ``resumed_at_version`` line rolls back the earlier lines trained at or past that version."""
    steps: list[tuple[int, list[str]]] = []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if "resumed_at_version" in rec:
            v = int(rec["resumed_at_version"])
            steps = [s for s in steps if s[0] < v]
        else:
            steps.append((int(rec["trained_on_version"]), list(rec["sample_ids"])))
    return [sid for _, ids in steps for sid in ids]


# ---- the checkpointer ----------------------------------------------------------------------------

@dataclass
class Checkpoint:
    """A verified checkpoint, read but not yet applied."""

    path: Path
    manifest: dict
    state: dict


@dataclass
class Pending:
    """A checkpoint taken from the trainer (:meth:`Checkpointer.prepare`), not yet written."""

    version: int
    tmp: Path
    tensors: dict[str, torch.Tensor]
    trainer_json: Any
    state: dict
    policy: str


def _fail(path: Path, what: str) -> StartupError:
    return StartupError(f"checkpoint {path}: {what} (pass another one with --resume PATH, or start "
                        "without --resume)")


class Checkpointer:
    """Writes, lists, verifies and applies checkpoints (module docstring)."""

    def __init__(self, root: str | Path, keep_last: int = 5):
        self.root = Path(root)
        self.keep_last = keep_last

    # -- listing --
    def complete(self) -> list[tuple[int, Path]]:
        """(version, path) of every directory with a readable marker, oldest first (torn ones and
        temporary directories are not listed)."""
        out = []
        if not self.root.is_dir():
            return out
        for p in self.root.iterdir():
            m = DIR_RE.match(p.name)
            if m and p.is_dir() and self._marker(p) is not None:
                out.append((int(m.group(1)), p))
        return sorted(out)

    def latest_complete(self) -> Path | None:
        found = self.complete()
        return found[-1][1] if found else None

    @staticmethod
    def _marker(path: Path) -> dict | None:
        try:
            marker = json.loads((path / MARKER).read_text())
        except (OSError, ValueError):
            return None
        return marker if isinstance(marker, dict) else None

    # -- writing --
    def save(self, version: int, state: dict, trainer: Any) -> Path:
        """Write checkpoint ``step-<version>`` (module docstring); returns its path. On any error
        the temporary directory is removed, older checkpoints are untouched, and it is raised."""
        return self.commit(self.prepare(version, state, trainer))

    def prepare(self, version: int, state: dict, trainer: Any) -> Pending:
        """The part that reads the trainer (call it while no step runs): the policy saved into a
        new temporary directory, every other tensor copied to host memory. :meth:`commit` writes the
        rest without touching the trainer, so training can go on meanwhile."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{version}-", dir=self.root))
        try:
            save_policy(trainer, tmp / POLICY)
            if callable(getattr(trainer, "save_engine_state", None)):   # DeepSpeed (learner.train.distributed)
                trainer.save_engine_state(tmp / ENGINE)
            tensors: dict[str, torch.Tensor] = {}
            rest = {k: v for k, v in trainer.state_dict().items() if k not in _NOT_SAVED}
            trainer_json = encode_tree(rest, tensors, copy=True)
            state = {**state, "version": int(version), "rng": rng_state(tensors)}
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return Pending(int(version), tmp, tensors, trainer_json, state,
                       "adapter" if is_peft(trainer.model) else "full")

    def commit(self, p: Pending) -> Path:
        """Write what :meth:`prepare` took, fsync, rename into place, write the marker, prune."""
        version, tmp = p.version, p.tmp
        final = self.root / f"step-{version}"
        aside: Path | None = None
        placed = False
        try:
            _save_tensors(p.tensors, tmp / TRAINER_TENSORS)
            _write_bytes(tmp / TRAINER_JSON, _json(p.trainer_json))
            _write_bytes(tmp / STATE, _json(p.state))
            files = {}
            for f in sorted(tmp.rglob("*")):
                if f.is_file():
                    files[f.relative_to(tmp).as_posix()] = {"bytes": f.stat().st_size, DIGEST: _digest(f)}
            manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "version": version,
                        "run_id": p.state.get("run_id"), "created": time.time(), "policy": p.policy,
                        "files": files}
            manifest_bytes = _json(manifest)
            _write_bytes(tmp / MANIFEST, manifest_bytes)
            _fsync_tree(tmp)
            if final.exists():                   # the same version again (resumed from an older one)
                aside = self.root / f"{OLD_PREFIX}{version}-{uuid.uuid4().hex[:6]}"
                os.rename(final, aside)
            os.rename(tmp, final)
            placed = True
            fsync_path(self.root)
            marker = {"format": FORMAT, "format_version": FORMAT_VERSION, "version": version,
                      "manifest_digest": xxhash.xxh3_128_hexdigest(manifest_bytes)}
            _write_bytes(final / f".{MARKER}.tmp", _json(marker))
            os.rename(final / f".{MARKER}.tmp", final / MARKER)
            fsync_path(final)
        except BaseException:
            shutil.rmtree(final if placed else tmp, ignore_errors=True)
            if aside is not None and not final.exists():
                with contextlib.suppress(OSError):
                    os.rename(aside, final)
            raise
        finally:
            p.tensors.clear()                    # the host copies go as soon as they are written
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        self.prune()
        return final

    def prune(self) -> list[Path]:
        """Delete complete checkpoints beyond the newest ``keep_last``, and leftovers of writes that
        did not finish (temporary directories; torn ones older than the newest complete)."""
        found = self.complete()
        removed = [p for _, p in found[:-self.keep_last]] if len(found) > self.keep_last else []
        newest = found[-1][0] if found else None
        for p in self.root.iterdir() if self.root.is_dir() else ():
            m = DIR_RE.match(p.name)
            if p.name.startswith(OLD_PREFIX) or (
                    m and newest is not None and int(m.group(1)) < newest and self._marker(p) is None):
                removed.append(p)
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return removed

    def clean_temporary(self) -> None:
        """Remove temporary directories of writes that never finished (a killed learner's)."""
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith(TMP_PREFIX):
                    shutil.rmtree(p, ignore_errors=True)

    # -- reading --
    def resolve(self, spec: str | Path | None) -> Path:
        """The checkpoint a ``--resume`` names: None or "latest" = the latest complete one here."""
        if spec is None or str(spec) == "latest":
            path = self.latest_complete()
            if path is None:
                raise StartupError(f"--resume: no complete checkpoint in {self.root} (a directory "
                                   "without its COMPLETE marker is never used); start without --resume")
            return path
        return Path(spec)

    def read(self, path: str | Path) -> Checkpoint:
        """Verify a checkpoint completely (module docstring) and read its state; StartupError."""
        path = Path(path)
        if not path.is_dir():
            raise _fail(path, "no such directory")
        marker = self._marker(path)
        if marker is None:
            raise _fail(path, f"no valid {MARKER} marker: the checkpoint is incomplete")
        if marker.get("format") != FORMAT or marker.get("format_version") != FORMAT_VERSION:
            raise _fail(path, f"format {marker.get('format')!r} version {marker.get('format_version')!r}, "
                              f"this learner reads {FORMAT!r} version {FORMAT_VERSION}")
        try:
            manifest_bytes = (path / MANIFEST).read_bytes()
        except OSError as e:
            raise _fail(path, f"cannot read {MANIFEST}: {e.strerror}") from None
        if xxhash.xxh3_128_hexdigest(manifest_bytes) != marker.get("manifest_digest"):
            raise _fail(path, f"{MANIFEST} does not match the marker's checksum")
        try:
            manifest = json.loads(manifest_bytes)
        except ValueError as e:
            raise _fail(path, f"{MANIFEST} is not JSON ({e})") from None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or not files:
            raise _fail(path, f"{MANIFEST} lists no files")
        for required in (STATE, TRAINER_JSON, TRAINER_TENSORS):
            if required not in files:
                raise _fail(path, f"{MANIFEST} does not list {required}")
        root = path.resolve()
        for rel, info in files.items():
            p = (path / rel).resolve()
            if root not in p.parents:
                raise _fail(path, f"{MANIFEST} names a file outside the checkpoint: {rel!r}")
            if not p.is_file():
                raise _fail(path, f"{rel} is missing")
            if not isinstance(info, dict) or p.stat().st_size != info.get("bytes"):
                raise _fail(path, f"{rel} has {p.stat().st_size} bytes, the manifest says "
                                  f"{info.get('bytes') if isinstance(info, dict) else '?'}")
            if _digest(p) != info.get(DIGEST):
                raise _fail(path, f"{rel} does not match its checksum in the manifest")
        try:
            state = json.loads((path / STATE).read_text())
        except ValueError as e:
            raise _fail(path, f"{STATE} is not JSON ({e})") from None
        if not isinstance(state, dict):
            raise _fail(path, f"{STATE} is not an object")
        m = DIR_RE.match(path.name)
        versions = {"marker": marker.get("version"), "manifest": manifest.get("version"),
                    STATE: state.get("version")}
        if m:
            versions["directory"] = int(m.group(1))
        if len({json.dumps(v) for v in versions.values()}) != 1 or not isinstance(state.get("version"), int):
            raise _fail(path, "the versions do not agree: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
        for key in ("run_id", "data", "buffer", "assignment_counter", "rng"):
            if key not in state:
                raise _fail(path, f"{STATE} has no {key!r}")
        if manifest.get("run_id") != state["run_id"]:
            raise _fail(path, f"run id {manifest.get('run_id')!r} in the manifest, {state['run_id']!r} "
                              f"in {STATE}")
        return Checkpoint(path, manifest, state)

    def restore_trainer(self, ckpt: Checkpoint, trainer: Any) -> None:
        """Policy, critic, optimizers, KL controller, reward moments and RNG states into a freshly
        built ``trainer`` (same config); StartupError on anything that does not fit."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = ckpt.path
        try:
            if callable(getattr(trainer, "load_engine_state", None)):   # DeepSpeed: weights and
                trainer.load_engine_state(path / ENGINE)                # moments of every rank
            else:
                load_policy(trainer.model, path / POLICY)      # first: LoRA vs full says most
            tensors = load_file(str(path / TRAINER_TENSORS))
            used: set[str] = set()
            rest = decode_tree(json.loads((path / TRAINER_JSON).read_text()), tensors, used)
            if not isinstance(rest, dict):
                raise ValueError(f"{TRAINER_JSON} is not a dict")
            live = trainer.state_dict()
            want = {k for k in live if k not in _NOT_SAVED}
            if set(rest) != want:
                extra, missing = sorted(set(rest) - want), sorted(want - set(rest))
                raise ValueError(f"trainer state has {extra or 'no extra'} and lacks {missing or 'nothing'} "
                                 "(another config: critic, KL or LoRA settings?)")
            for key, value in rest.items():
                if key.endswith("optimizer"):
                    optimizer = trainer.optimizer if key == "optimizer" else getattr(trainer, key)
                    _check_optimizer(key, optimizer, value)
                elif isinstance(live[key], dict) and all(isinstance(t, torch.Tensor) for t in live[key].values()):
                    for name, t in live[key].items():
                        got = value.get(name) if isinstance(value, dict) else None
                        if not isinstance(got, torch.Tensor) or got.shape != t.shape:
                            raise ValueError(f"{key} tensor {name!r}: "
                                             f"{'missing' if got is None else tuple(got.shape)}, "
                                             f"the model {tuple(t.shape)}")
            full = {**rest, "policy": trainer.model.state_dict()}
            if "reference" in live:
                full["reference"] = live["reference"]
            trainer.load_state_dict(full)
            set_rng_state(ckpt.state["rng"], tensors)
        except StartupError:
            raise
        except (ValueError, KeyError, TypeError, RuntimeError, OSError, SafetensorError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise _fail(path, f"does not fit this learner: {msg[:300]}") from None


# ---- the learner's side: when to save, and resuming --------------------------------------------

class LearnerCheckpoints:
    """Checkpoints of one :class:`learner.serve.service.LearnerService` (duck-typed: ``svc`` has cfg,
    run_id, version, prompts, buffer, trainer, assignment_counter, stopping, log, metrics, run_dir).

    When: every ``save_every`` versions, on a stop (SIGTERM / SIGINT / ``ctl stop``) when a step
    was trained since the last one, at the end of training, and on ``ctl checkpoint``. Always
    between steps: the train loop takes its batches through :meth:`next_batch`, which saves when
    one is due and, once the learner is stopping, takes no batch any more, so a stop waits for a
    running step to finish (:meth:`on_stop`) and then saves what it trained.

    Two phases, both in threads (the sockets keep being served): the state is captured on the loop,
    then :meth:`Checkpointer.prepare` saves the policy and copies every other tensor to host
    memory while the train loop waits (``slipstream_checkpoint_pause_seconds``); the write of the
    rest (:meth:`Checkpointer.commit`: the optimizer moments, digests, fsync, rename, marker)
    goes on beside the next steps. One checkpoint at a time: the next one waits for it, and so
    do a stop and the end of training before they exit.
    """

    def __init__(self, svc: Any):
        from prometheus_client import Counter, Gauge, Histogram

        self.svc = svc
        cfg = svc.cfg
        self.store = Checkpointer(cfg.checkpoint_dir or Path(cfg.run_dir) / "checkpoints", cfg.keep_last)
        self.saved_version = 0                # version 0 is the model as loaded: never saved
        self.failed_stop = False
        self.resumed_from: Path | None = None
        self.idle = asyncio.Event()           # the train loop waits for a batch, or is parked
        self.lock = asyncio.Lock()            # one checkpoint at a time (held until it is written)
        self.capturing = asyncio.Lock()       # held while the trainer is read: no step starts
        self.pending: asyncio.Task | None = None
        r = svc.metrics.registry
        self.m_seconds = Histogram("slipstream_checkpoint_seconds", "Seconds to write a checkpoint",
                                   registry=r, buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.m_version = Gauge("slipstream_checkpoint_version",
                               "Policy version of the last complete checkpoint", registry=r)
        self.m_failures = Counter("slipstream_checkpoint_failures",
                                  "Checkpoints that could not be written (disk full, not writable)",
                                  registry=r)
        self.m_pause = Gauge("slipstream_checkpoint_pause_seconds",
                             "Seconds the last checkpoint held up training (policy saved, the other "
                             "tensors copied to host memory; the rest is written beside training)",
                             registry=r)
        self.m_load = Gauge("slipstream_checkpoint_load_seconds",
                            "Seconds the resume took to verify and apply its checkpoint", registry=r)

    # -- resume --
    def resume(self, spec: str | None) -> Checkpoint:
        """Verify the checkpoint ``spec`` names (cheap checks before the model loads)."""
        path = self.store.resolve(spec)
        return self.store.read(path)

    def apply(self, ckpt: Checkpoint) -> None:
        """Into the service (after its trainer is built): everything :meth:`capture` saved."""
        svc, st = self.svc, ckpt.state
        start = time.monotonic()
        self.store.restore_trainer(ckpt, svc.trainer)
        try:
            svc.run_id = str(st["run_id"])
            svc.version = int(st["version"])
            svc.prompts.load_state_dict(st["data"])
            svc.buffer.load_state_dict(st["buffer"])
            # The config given now wins for the runtime settings the buffer holds (η, stale policy).
            svc.buffer.set_max_staleness(svc.cfg.max_staleness)
            svc.buffer.set_stale_policy(svc.cfg.stale_policy)
            svc.assignment_counter = int(st["assignment_counter"])
        except (ValueError, KeyError, TypeError) as e:
            raise _fail(ckpt.path, f"state.json does not fit this learner: {str(e)[:300]}") from None
        self.saved_version = svc.version
        self.resumed_from = ckpt.path
        self.m_version.set(svc.version)
        seconds = time.monotonic() - start
        self.m_load.set(seconds)
        self.store.clean_temporary()
        svc.log("resumed", checkpoint=str(ckpt.path), resumed_version=svc.version,
                data_position=svc.prompts.state_dict().get("position"),
                assignment_counter=svc.assignment_counter, buffered_samples=svc.buffer.pending_samples,
                leases=len(svc.buffer.leases), load_s=round(seconds, 3))

    def mark_resumed(self, trained_ids: Any) -> None:
        """A ``resumed_at_version`` line in trained_ids.jsonl: steps of an earlier life at or past
        this version were rolled back (:func:`effective_trained_ids`)."""
        if self.resumed_from is not None:
            trained_ids.write({"run_id": self.svc.run_id, "resumed_at_version": self.svc.version,
                               "checkpoint": str(self.resumed_from)})

    # -- saving --
    def capture(self) -> dict:
        """The service's state (on the loop, between steps): plain data for state.json."""
        svc = self.svc
        return {"format": FORMAT, "run_id": svc.run_id, "assignment_counter": svc.assignment_counter,
                "data": svc.prompts.state_dict(), "buffer": svc.buffer.state_dict(binary=False),
                "saved_at": time.time()}

    async def save(self, reason: str, wait: bool = True) -> dict | None:
        """Checkpoint the current version (the caller makes sure no step runs). Returns what was
        written once it is complete (``wait``), or once the trainer was read (not ``wait``: the
        write goes on, :attr:`pending`); None when it failed (logged, counted, and under
        ``checkpoint_failure: stop`` the learner stops)."""
        svc = self.svc
        await self.lock.acquire()
        handed = False
        try:
            async with self.capturing:
                version = svc.version
                state = self.capture()
                start = time.monotonic()
                try:
                    # (the tensor copies on the train thread, where the steps run: see
                    # LearnerService.train_thread; the writing beside the next step, _commit)
                    pending = await asyncio.get_running_loop().run_in_executor(
                        getattr(svc, "train_thread", None), self.store.prepare, version, state,
                        svc.trainer)
                except Exception as e:  # noqa: BLE001 -- any failure to write is reported the same way
                    self.failed(e, version, reason)
                    return None
            paused = time.monotonic() - start
            self.pending = asyncio.create_task(self._commit(pending, reason, start, paused),
                                               name="checkpoint")
            handed = True                     # the commit releases the lock
        finally:
            if not handed:
                self.lock.release()
        if wait:
            return await self.pending
        return {"version": version, "reason": reason, "pause_s": round(paused, 3), "written": False}

    async def _commit(self, pending: Pending, reason: str, start: float, paused: float) -> dict | None:
        try:
            try:
                path = await asyncio.to_thread(self.store.commit, pending)
            except Exception as e:  # noqa: BLE001 -- any failure to write is reported the same way
                self.failed(e, pending.version, reason)
                return None
        finally:
            self.lock.release()
        version, seconds = pending.version, time.monotonic() - start
        self.saved_version = max(self.saved_version, version)
        self.m_seconds.observe(seconds)
        self.m_pause.set(paused)
        self.m_version.set(version)
        info = {"checkpoint": str(path), "version": version, "reason": reason,
                "seconds": round(seconds, 3), "pause_s": round(paused, 3)}
        self.svc.log("checkpoint", **info)
        return info

    async def settled(self) -> None:
        """Wait until no checkpoint is being written."""
        async with self.lock:
            pass

    def failed(self, e: BaseException, version: int, reason: str) -> None:
        svc = self.svc
        self.m_failures.inc()
        code = errno.errorcode.get(getattr(e, "errno", None) or -1, None)
        stop = svc.cfg.checkpoint_failure == "stop"
        svc.log("checkpoint_failed", level="error", version=version, reason=reason,
                directory=str(self.store.root), error=f"{type(e).__name__}: {e}"[:500], errno=code,
                action="stopping (checkpoint_failure: stop)" if stop else
                "training goes on; the previous checkpoint is intact",
                hint="free disk space or make the directory writable (learner.checkpoint_dir)")
        if stop:
            self.failed_stop = True
            svc.stopping.set()

    async def request(self) -> dict:
        """``ctl checkpoint``: write one as soon as no step runs."""
        await self.settled()
        while not (self.idle.is_set() and not self.lock.locked()):
            if self.svc.stopping.is_set():
                raise RuntimeError("the learner is stopping (its final checkpoint follows)")
            await self._wait_idle()
            if self.lock.locked():
                await self.settled()
        info = await self.save("ctl")
        if info is None:
            raise RuntimeError("the checkpoint could not be written (see the checkpoint_failed event)")
        return info

    async def _wait_idle(self) -> None:
        waiter = asyncio.ensure_future(self.idle.wait())
        stop = asyncio.ensure_future(self.svc.stopping.wait())
        try:
            await asyncio.wait([waiter, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            stop.cancel()
        if self.idle.is_set():
            await asyncio.sleep(0)            # let a lock holder finish its turn

    async def next_batch(self):
        """The train loop's batch: saves first when one is due; once stopping, parks for good (the
        stop cancels it there, where no batch is held)."""
        svc = self.svc
        every = svc.cfg.save_every
        if every and svc.version % every == 0 and svc.version > self.saved_version \
                and not svc.stopping.is_set():
            await self.save("periodic", wait=False)
        if svc.stopping.is_set():
            self.idle.set()
            await asyncio.Future()            # cancelled by the stop
        self.idle.set()
        try:
            batch = await svc.buffer.next_batch(svc.version)
        finally:
            self.idle.clear()
        if self.capturing.locked():           # a ctl checkpoint reads the trainer: no step yet
            async with self.capturing:
                pass
        return batch

    async def at_end(self) -> None:
        """After the last step (a checkpoint still being written is waited for)."""
        await self.settled()
        if self.svc.version > self.saved_version and not self.failed_stop:
            await self.save("end")

    async def on_stop(self, train: asyncio.Task) -> int:
        """The learner is stopping: let a running step finish (it is recorded and published), stop
        the train loop where it holds no batch, and save if a step was trained since the last
        checkpoint. Returns the exit code (:data:`EXIT_CHECKPOINT_FAILED` when a failed checkpoint
        stopped the run)."""
        svc = self.svc
        resumed = getattr(getattr(svc, "control", None), "resumed", None)
        if resumed is not None:
            resumed.set()                     # a paused train loop (ctl pause) must see the stop
        while not train.done() and not self.idle.is_set():
            done = asyncio.ensure_future(self.idle.wait())
            await asyncio.wait([done, train], return_when=asyncio.FIRST_COMPLETED)
            done.cancel()
        train.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await train
        await self.settled()
        if not self.failed_stop and svc.version > self.saved_version and svc.trainer is not None:
            await self.save("stop")
        return EXIT_CHECKPOINT_FAILED if self.failed_stop else 0


__all__ = ["EXIT_CHECKPOINT_FAILED", "FORMAT", "FORMAT_VERSION", "Checkpoint", "Checkpointer",
           "LearnerCheckpoints", "decode_tree", "effective_trained_ids", "encode_tree"]

