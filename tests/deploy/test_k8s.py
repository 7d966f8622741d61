"""deploy/k8s, validated offline: the built-in kinds against the Kubernetes 1.37 OpenAPI schemas
(kubernetes-validate, strict: an unknown field fails), the two Prometheus Operator kinds
(ServiceMonitor, PrometheusRule: CRDs, no schema offline) structurally, and what ties the files
together: the config is a real slipstream config, the args parse, selectors, ports, probes,
volumes and Secret items line up."""

from __future__ import annotations

import shlex

import pytest
import yaml
from external_tools import DEPLOY

from deploy.cli import build_parser
from deploy.config_file import SlipstreamConfig, apply_override

K8S = DEPLOY / "k8s"
BUILTIN_KINDS = {"ConfigMap", "Secret", "Service", "StatefulSet", "Deployment"}


def _docs() -> list[dict]:
    return [d for f in sorted(K8S.glob("*.yaml")) if f.name != "kustomization.yaml"
            for d in yaml.safe_load_all(f.read_text()) if d]


def _one(kind: str, name: str) -> dict:
    (doc,) = [d for d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _config() -> dict:
    return yaml.safe_load(_one("ConfigMap", "slipstream-config")["data"]["config.yaml"])


@pytest.mark.parametrize("doc", [d for d in _docs() if d["kind"] in BUILTIN_KINDS],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_builtin_kinds_match_the_kubernetes_schema(doc):
    import kubernetes_validate

    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_schema_check_refuses_an_unknown_field():
    import kubernetes_validate

    doc = _one("Deployment", "slipstream-rollout")
    _pod(doc)["containers"][0]["livenesProbe"] = {}          # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_every_file_is_in_the_kustomization_but_the_secret_placeholders():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret-curve.yaml"}
    assert set(k["resources"]) == files


def test_the_config_is_a_slipstream_config_with_the_pods_overrides():
    data = _config()
    for workload in (_one("StatefulSet", "slipstream-learner"), _one("Deployment", "slipstream-rollout")):
        args = build_parser().parse_args(_pod(workload)["containers"][0]["args"])
        assert args.config == "/etc/slipstream/config.yaml"
        for assignment in args.overrides:                # $(POD_IP) / $(POD_NAME): set by kubelet
            apply_override(data, assignment.replace("$(POD_IP)", "10.0.0.7").replace("$(POD_NAME)", "r-1"))
    cfg = SlipstreamConfig.model_validate(data)
    assert cfg.learner.network.bind_host == "10.0.0.7" and cfg.rollout.server_id == "r-1"
    assert cfg.learner.security.curve and cfg.rollout.security.curve
    assert cfg.rollout.learner == f"tcp://slipstream-learner:{cfg.learner.network.rollout_port}"


def test_services_select_their_pods_on_the_ports_the_config_binds():
    cfg = SlipstreamConfig.model_validate(_config())
    binds = {"rollout": cfg.learner.network.rollout_port, "weights": cfg.learner.network.weights_port,
             "control": cfg.learner.network.control_port, "metrics": cfg.learner.network.metrics_port}
    for service, workload, ports in (
            ("slipstream-learner", _one("StatefulSet", "slipstream-learner"), binds),
            ("slipstream-rollout", _one("Deployment", "slipstream-rollout"), {"metrics": cfg.rollout.network.metrics_port})):
        svc = _one("Service", service)
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        container_ports = {p["name"]: p["containerPort"] for p in _pod(workload)["containers"][0]["ports"]}
        assert container_ports == ports
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in container_ports and p["port"] == container_ports[p["targetPort"]]
    assert _one("StatefulSet", "slipstream-learner")["spec"]["serviceName"] == "slipstream-learner"


@pytest.mark.parametrize("workload", ["StatefulSet/slipstream-learner", "Deployment/slipstream-rollout"])
def test_probes_graceful_termination_and_volumes(workload):
    kind, name = workload.split("/")
    doc = _one(kind, name)
    pod = _pod(doc)
    (c,) = pod["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
    cfg = SlipstreamConfig.model_validate(_config())
    assert pod["terminationGracePeriodSeconds"] > cfg.rollout.shutdown.drain_timeout_s
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["allowPrivilegeEscalation"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    claims = {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
    for m in c["volumeMounts"]:
        assert m["name"] in volumes or m["name"] in claims, m
    # Every key file the config names is an item of the mounted Secret, and the Secret has the key.
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["keys"]
    secret = volumes["keys"]["secret"]
    items = {f"{mount}/{i['path']}": i["key"] for i in secret["items"]}
    sec = cfg.learner.security if kind == "StatefulSet" else cfg.rollout.security
    files = [v for k, v in sec.model_dump().items() if k.endswith("_file") and v]
    dirs = [v for k, v in sec.model_dump().items() if k.endswith("_dir") and v]
    assert files and all(f in items for f in files), (files, items)
    assert all(any(p.startswith(d + "/") for p in items) for d in dirs), (dirs, items)
    assert set(items.values()) <= set(_one("Secret", secret["secretName"])["stringData"])


def test_the_learner_keeps_its_run_directory_on_its_own_volume():
    sts = _one("StatefulSet", "slipstream-learner")
    mounts = {m["name"]: m["mountPath"] for m in _pod(sts)["containers"][0]["volumeMounts"]}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    run_dir = SlipstreamConfig.model_validate(_config()).learner.run_dir
    assert run_dir.startswith(mounts[claim["metadata"]["name"]] + "/")
    assert "$(POD_IP)" in shlex.join(_pod(sts)["containers"][0]["args"])    # advertised to servers


def test_servicemonitor_scrapes_both_services_by_their_metrics_port():
    sm = _one("ServiceMonitor", "slipstream")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    for name in ("slipstream-learner", "slipstream-rollout"):     # = the rules' job labels
        svc = _one("Service", name)
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}


def test_prometheusrule_holds_the_alert_rules():
    rule = _one("PrometheusRule", "slipstream")
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
