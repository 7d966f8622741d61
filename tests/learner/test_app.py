"""learner.app, the composition root (issue 37 item 1): the only place a learner component is
built; what it builds is wired through typed ports, not callables reaching back into the service;
and the service and the root hand out (almost) no lambdas."""

from __future__ import annotations

import ast
from pathlib import Path

from config_kit import nested

ROOT = Path(__file__).resolve().parents[2]

COMPONENTS = frozenset({
    "Admission", "Batches", "Control", "Evaluation", "HttpEndpoint", "Intake", "IntakePath",
    "LearnerCheckpoints", "LearnerMetrics", "LearnerOffers", "LearnerRolloutLog", "LearnerWaiting",
    "Publisher", "ResultIngress", "RolloutBuffer", "RolloutLink", "RunState", "SampleWatch",
    "StalenessLimit", "StepRecords", "TrainLoop", "TrainThread", "Watchdog", "WeightsServer",
})
"""A learner process's components (learner.app.Parts and ModelParts)."""


OTHER_ROOTS = {"learner/train/distributed.py": {"Watchdog"}}
"""Other processes' roots: a DeepSpeed worker rank (``worker_main``) is a process of its own, built
of a trainer, a rank beat and a watchdog."""


def constructions(path: Path) -> list[str]:
    """``file:line Name(...)`` for every call of a component's constructor in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in COMPONENTS:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}(...)")
    return out


def lambdas(path: Path) -> int:
    return sum(isinstance(n, ast.Lambda) for n in ast.walk(ast.parse(path.read_text())))


def learner_files() -> list[Path]:
    return sorted(p for p in (ROOT / "learner").rglob("*.py") if p != ROOT / "learner" / "app.py")


def test_only_the_composition_root_builds_the_learners_components():
    found = [c for f in learner_files() for c in constructions(f)
             if c.split()[-1][:-5] not in OTHER_ROOTS.get(str(f.relative_to(ROOT)), ())]
    assert not found, "built outside learner/app.py:\n" + "\n".join(found)
    built = {c.split()[-1][:-5] for c in constructions(ROOT / "learner" / "app.py")}
    assert built == COMPONENTS - {"Evaluation"}, COMPONENTS - built      # (Evaluation.from_config)


def test_the_construction_check_catches_a_planted_component(tmp_path):
    planted = ROOT / "learner" / "serve" / "planted_twin_for_test.py"
    planted.write_text("from learner.serve.admission import Admission\n\n"
                       "def build(buffer):\n    return Admission(buffer, None, None)\n")
    try:
        assert constructions(planted) == ["learner/serve/planted_twin_for_test.py:4 Admission(...)"]
        assert planted in learner_files()
    finally:
        planted.unlink()


def test_the_service_and_the_root_hand_out_no_lambdas():
    """Done-when of issue 37: ``grep -c lambda`` of the service (and of the root it became) <= 3."""
    for f in ("learner/serve/service.py", "learner/app.py"):
        assert lambdas(ROOT / f) <= 3, f


def test_the_components_are_wired_through_ports(tmp_path):
    """Admission and the ingress send through the RolloutLink, admission takes work from the
    offers, the process answers Control and the watchdog's diagnosis, and a live section edited
    by ctl is the very object the components read."""
    from learner.config import LearnerConfig
    from learner.serve.service import LearnerService

    cfg = LearnerConfig(**nested(run_dir=str(tmp_path / "run"), rollout_port=0, weights_port=0,
                                 control_port=0, metrics_port=0))
    svc = LearnerService(cfg, "unused: the model is not loaded")
    assert svc.admission.link is svc.link and svc.admission.offers is svc.offers
    assert svc.admission.settings is cfg.servers and svc.sample_watch.settings is cfg.servers
    assert svc.publisher.servers is svc.admission
    assert svc.control.process is svc and svc.control.admission is svc.admission
    assert svc.control.checkpoints is svc.checkpoints and svc.control.records is svc.records
    assert svc.waiting.process is svc and svc.waiting.endpoints is svc.endpoints
    assert svc.records.algorithm is cfg.algorithm
    cfg.servers.max_inflight_per_server = 3                   # what ctl set does
    assert svc.admission.settings.max_inflight_per_server == 3
