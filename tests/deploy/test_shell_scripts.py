"""The shell scripts the repository ships besides the sbatch script (test_slurm_docker.py): CI's
entry point and the GPU machine's scripts, which no CPU session can run (tests/gpu/), pass
shellcheck, following what they source."""

from __future__ import annotations

import pytest
from external_tools import REPO, require, run_tool

SCRIPTS = [REPO / ".ci" / "run", *sorted((REPO / "tests" / "gpu").glob("*.sh"))]


def test_the_gpu_scripts_are_all_listed():
    names = {p.name for p in SCRIPTS}
    assert {"run", "run.sh", "bench_async.sh", "env.sh", "fetch_wheels.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_script_passes_shellcheck(script):
    r = run_tool([require("shellcheck"), "-x", "--severity=info", str(script)], cwd=REPO)
    assert r.returncode == 0 and not r.stdout, r.stdout
