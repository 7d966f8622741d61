"""`slipstream run` of a config written in a test, with the test's plug-ins importable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml


def slipstream_run(tmp_path: Path, cfg: dict, subprocess_env: dict, process_groups, *,
                   plugins: dict[str, str] | None = None, timeout_s: float = 300) -> tuple[int, str]:
    """Write ``plugins`` (module file name -> source) and ``cfg`` as run.yaml into ``tmp_path``, run
    ``slipstream run --config`` there (``tmp_path`` on its PYTHONPATH) in a process group of its
    own; its exit code and output (stdout and stderr together)."""
    for name, source in (plugins or {}).items():
        (tmp_path / name).write_text(source)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(subprocess_env, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path),
                                                                        subprocess_env.get("PYTHONPATH")])))
    proc = process_groups.popen([sys.executable, "-m", "deploy.cli", "run", "--config", str(tmp_path / "run.yaml")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out


def step_rows(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir``'s metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
