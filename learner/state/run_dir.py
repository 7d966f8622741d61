"""A run directory belongs to one run (issue 30.2).

Starting a second run in a directory that holds one mixed the two: checkpoints side by side, a
summary and a printed resume command pointing at the older run's checkpoint, and the resumed
older run overwriting the newer one's ``final/``. So a run directory is claimed by the run that
first trains in it: ``RUN_DIR/run.json`` names its run id.

- A fresh start (no ``--resume``) in a directory another run used — ``run.json``, a complete
  checkpoint, a ``final/`` model or a non-empty ``metrics.jsonl`` (what a run from before this
  file left) — is a one-line start-up error that says what to do instead: ``--resume`` to go
  on with that run, or another ``learner.run_dir``. A directory with nothing of a run in it (a
  start that failed on a port in use leaves only ``config.yaml``) is free.
- ``--resume`` continues the directory's own run only: a checkpoint of another run is refused.

:func:`check_free` runs before the model loads (deploy/cli.py); :func:`claim` when the run id is
known (after a resume read its checkpoint), and writes ``run.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from protocol.errors import StartupError

RUN_FILE = "run.json"


def owner(run_dir: Path, checkpoint_dir: Path | None = None) -> str | None:
    """The run id that owns ``run_dir`` ("" for one used before run.json existed), or None."""
    run_dir = Path(run_dir)
    try:
        rid = json.loads((run_dir / RUN_FILE).read_text()).get("run_id")
        if isinstance(rid, str) and rid:
            return rid
    except (OSError, ValueError, AttributeError):
        pass
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        try:
            with open(metrics, "rb") as f:
                rid = json.loads(f.readline()).get("run_id")
            return rid if isinstance(rid, str) and rid else ""
        except (OSError, ValueError, AttributeError):
            return ""
    ckpts = Path(checkpoint_dir) if checkpoint_dir else run_dir / "checkpoints"
    if (run_dir / "final").exists() or any(ckpts.glob("step-*/COMPLETE")):
        return ""
    return None


def _used(run_dir: Path, rid: str) -> str:
    return f"learner.run_dir {str(run_dir)!r} holds {'run ' + rid if rid else 'an earlier run'}"


def check_free(run_dir: str | Path, checkpoint_dir: str | Path | None = None) -> None:
    """A fresh start: StartupError when another run used ``run_dir`` (module docstring)."""
    rid = owner(Path(run_dir), Path(checkpoint_dir) if checkpoint_dir else None)
    if rid is not None:
        raise StartupError(f"{_used(Path(run_dir), rid)}: add --resume to go on with it, or start the "
                           "new run in another directory (--set learner.run_dir=runs/NAME)")


def claim(run_dir: str | Path, run_id: str, resumed: bool, checkpoint_dir: str | Path | None = None) -> None:
    """``run_dir`` is ``run_id``'s from now on (``run.json``); StartupError when another run holds
    it: a fresh start in a used directory, or a resume of another run's checkpoint."""
    run_dir = Path(run_dir)
    rid = owner(run_dir, Path(checkpoint_dir) if checkpoint_dir else None)
    if rid is not None and not resumed:
        check_free(run_dir, checkpoint_dir)
    if resumed and rid and rid != run_id:
        raise StartupError(f"{_used(run_dir, rid)}, and the checkpoint to resume is of run {run_id}: "
                           f"resume it in its own run directory")
    if rid == run_id and (run_dir / RUN_FILE).exists():
        return
    tmp = run_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps({"run_id": run_id}) + "\n")
    os.replace(tmp, run_dir / RUN_FILE)
