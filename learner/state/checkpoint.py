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
``--resume`` (latest) holds every check to one rule: a checkpoint that fails any of them — its
marker missing or garbage, a file damaged — is passed over for the next older one, with a warning
each (:meth:`Checkpointer.read_latest`); one named with ``--resume PATH`` is refused.

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

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from learner.state.tree import decode_tree, encode_tree, rng_state, set_rng_state
from protocol.errors import StartupError
from protocol.plumbing.process import fsync_path

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
DAMAGED_PREFIX = ".damaged-step-"
EXIT_CHECKPOINT_FAILED = 3
"""Exit code of a learner stopped by a failed checkpoint under ``checkpoint_failure: stop``."""

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


# ---- RNG states ------------------------------------------------------------------------------------


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

def effective_trained_ids(path: Path, log: Callable[..., None] | None = None) -> list[str]:
    """The sample ids of ``trained_ids.jsonl`` that the final weights were trained on, in order:
    a ``resumed_at_version`` line rolls back the earlier lines trained at or past that version.

    A torn last line (a write that never finished) is left out, with a ``record_torn`` warning
    through ``log`` when given (the learner cuts it off when it opens the file, before this
    reads it); a bad line anywhere else is a :class:`StartupError` naming it (one line)."""
    from learner.metrics import JsonlLog

    try:
        records, torn = JsonlLog.read(Path(path))
    except ValueError as e:
        raise StartupError(f"{path}: {e}; the file was damaged: remove that line") from None
    if torn and log is not None:
        log("record_torn", level="warning", file=str(path), bytes=len(torn),
            action="skipped: a write that never finished (a crash, a kill or a full disk)")
    steps: list[tuple[int, list[str]]] = []
    for rec in records:
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


class CheckpointRefused(StartupError):
    """A checkpoint that cannot be used: ``path`` and ``what`` is wrong (its one line says both)."""

    def __init__(self, path: Path, what: str):
        super().__init__(f"checkpoint {path}: {what} (pass another one with --resume PATH, or start "
                         "without --resume)")
        self.path, self.what = Path(path), what


def checkpoint_error(path: Path, what: str) -> StartupError:
    return CheckpointRefused(path, what)


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
    def read_latest(self) -> tuple[Checkpoint, list[tuple[Path, str]]]:
        """``--resume`` / ``--resume latest``: the newest checkpoint that verifies (:meth:`read`),
        and each newer ``step-<v>`` directory passed over with why, newest first.

        One rule for everything that fails verification, a marker that is missing or garbage as
        much as a damaged file: the resume falls back to the next older checkpoint and says so
        (the caller warns; learner.state.learner_checkpoints). A checkpoint named with
        ``--resume PATH`` is never replaced by another: it is refused. A passed-over directory
        with a marker is moved aside as ``.damaged-step-<v>-<id>`` (kept for a look, never
        listed nor pruned): left there, it would count among the ``keep_last`` newest and
        prune the good checkpoints the resumed run writes below its version."""
        dirs = sorted(((int(m.group(1)), p) for p in (self.root.iterdir() if self.root.is_dir() else ())
                       if (m := DIR_RE.match(p.name)) and p.is_dir()), reverse=True)
        skipped: list[tuple[Path, str]] = []
        for _, path in dirs:
            try:
                return self.read(path), skipped
            except CheckpointRefused as e:
                skipped.append((self._set_aside(path), e.what))
        if not skipped:
            raise StartupError(f"--resume: no complete checkpoint in {self.root} (a directory "
                               "without its COMPLETE marker is never used); start without --resume")
        why = "; ".join(f"{p.name}: {what}" for p, what in skipped)[:600]
        raise StartupError(f"--resume: no complete checkpoint in {self.root} verifies ({why}); "
                           "start without --resume")

    def _set_aside(self, path: Path) -> Path:
        """A passed-over checkpoint out of the listing (:meth:`read_latest`); where it is now."""
        if not (path / MARKER).exists():
            return path                       # torn: never listed, pruned as before
        aside = self.root / f"{DAMAGED_PREFIX}{path.name.removeprefix('step-')}-{uuid.uuid4().hex[:6]}"
        try:
            os.rename(path, aside)
        except OSError:
            return path
        return aside

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
            raise checkpoint_error(path, "no such directory")
        marker = self._marker(path)
        if marker is None:
            raise checkpoint_error(path, f"no valid {MARKER} marker: the checkpoint is incomplete")
        if marker.get("format") != FORMAT or marker.get("format_version") != FORMAT_VERSION:
            raise checkpoint_error(path, f"format {marker.get('format')!r} version {marker.get('format_version')!r}, "
                              f"this learner reads {FORMAT!r} version {FORMAT_VERSION}")
        try:
            manifest_bytes = (path / MANIFEST).read_bytes()
        except OSError as e:
            raise checkpoint_error(path, f"cannot read {MANIFEST}: {e.strerror}") from None
        if xxhash.xxh3_128_hexdigest(manifest_bytes) != marker.get("manifest_digest"):
            raise checkpoint_error(path, f"{MANIFEST} does not match the marker's checksum")
        try:
            manifest = json.loads(manifest_bytes)
        except ValueError as e:
            raise checkpoint_error(path, f"{MANIFEST} is not JSON ({e})") from None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or not files:
            raise checkpoint_error(path, f"{MANIFEST} lists no files")
        for required in (STATE, TRAINER_JSON, TRAINER_TENSORS):
            if required not in files:
                raise checkpoint_error(path, f"{MANIFEST} does not list {required}")
        root = path.resolve()
        for rel, info in files.items():
            p = (path / rel).resolve()
            if root not in p.parents:
                raise checkpoint_error(path, f"{MANIFEST} names a file outside the checkpoint: {rel!r}")
            if not p.is_file():
                raise checkpoint_error(path, f"{rel} is missing")
            if not isinstance(info, dict) or p.stat().st_size != info.get("bytes"):
                raise checkpoint_error(path, f"{rel} has {p.stat().st_size} bytes, the manifest says "
                                  f"{info.get('bytes') if isinstance(info, dict) else '?'}")
            if _digest(p) != info.get(DIGEST):
                raise checkpoint_error(path, f"{rel} does not match its checksum in the manifest")
        try:
            state = json.loads((path / STATE).read_text())
        except ValueError as e:
            raise checkpoint_error(path, f"{STATE} is not JSON ({e})") from None
        if not isinstance(state, dict):
            raise checkpoint_error(path, f"{STATE} is not an object")
        m = DIR_RE.match(path.name)
        versions = {"marker": marker.get("version"), "manifest": manifest.get("version"),
                    STATE: state.get("version")}
        if m:
            versions["directory"] = int(m.group(1))
        if len({json.dumps(v) for v in versions.values()}) != 1 or not isinstance(state.get("version"), int):
            raise checkpoint_error(path, "the versions do not agree: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
        for key in ("run_id", "data", "buffer", "assignment_counter", "rng"):
            if key not in state:
                raise checkpoint_error(path, f"{STATE} has no {key!r}")
        if manifest.get("run_id") != state["run_id"]:
            raise checkpoint_error(path, f"run id {manifest.get('run_id')!r} in the manifest, {state['run_id']!r} "
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
            raise checkpoint_error(path, f"does not fit this learner: {msg[:300]}") from None


# ---- the learner's side: when to save, and resuming --------------------------------------------


__all__ = ["EXIT_CHECKPOINT_FAILED", "FORMAT", "FORMAT_VERSION", "Checkpoint", "CheckpointRefused",
           "Checkpointer", "checkpoint_error", "effective_trained_ids"]

