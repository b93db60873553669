"""The deployment artifacts are correct, not decorative: Kubernetes manifests validate against the
Kubernetes schemas (``kubernetes-validate``), the monitors against the Prometheus Operator CRDs'
fields, the kustomize overlay builds, the gateway configurations in them load, and the compose
file's services and mounts exist."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from router.config import config_from_dict

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
DOCKER = ROOT / "deploy" / "docker"
K8S_VERSION = "1.31.0"  # a current release the schemas cover; the manifests use only GA APIs

# The fields of monitoring.coreos.com/v1 ServiceMonitor and PodMonitor these manifests use, from
# the Prometheus Operator CRDs (example/prometheus-operator-crd/monitoring.coreos.com_*.yaml);
# unknown fields are errors, as a typo there silently scrapes nothing.
_ENDPOINT = {"type": "object", "additionalProperties": False, "required": ["port"],
             "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^(0|([0-9]+(ms|s|m|h))+)$"},
                            "scheme": {"enum": ["http", "https"]}}}
_SELECTOR = {"type": "object", "additionalProperties": False, "minProperties": 1,
             "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                            "matchExpressions": {"type": "array"}}}
_MONITOR = {
    "ServiceMonitor": {"required": ["selector", "endpoints"],
                       "properties": {"selector": _SELECTOR, "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}},
    "PodMonitor": {"required": ["selector", "podMetricsEndpoints"],
                   "properties": {"selector": _SELECTOR,
                                  "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}},
}


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def base_resources() -> list[tuple[Path, dict]]:
    kustomization = yaml.safe_load((KUBE / "base" / "kustomization.yaml").read_text())
    out = []
    for name in kustomization["resources"]:
        for doc in documents(KUBE / "base" / name):
            out.append((KUBE / "base" / name, doc))
    return out


def validate(doc: dict) -> None:
    kind = doc["kind"]
    if kind in _MONITOR:
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        schema = {"type": "object", "additionalProperties": False, **_MONITOR[kind]}
        jsonschema.validate(doc["spec"], schema)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_base_file_is_listed_in_the_kustomization():
    listed = set(yaml.safe_load((KUBE / "base" / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in (KUBE / "base").glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("path,doc", base_resources(), ids=lambda v: v.name if isinstance(v, Path) else v["kind"])
def test_every_base_manifest_validates_against_its_schema(path, doc):
    validate(doc)


def test_a_manifest_with_a_typo_fails_validation():
    """The checks above can fail: strict schemas reject a misspelt field."""
    deployment = next(d for _, d in base_resources() if d["kind"] == "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)
    monitor = next(d for _, d in base_resources() if d["kind"] == "ServiceMonitor")
    monitor = yaml.safe_load(yaml.safe_dump(monitor))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)


def test_the_wiring_between_manifests_holds():
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in base_resources()}
    gateway = docs[("Deployment", "prefix-router")]["spec"]["template"]
    vllm = docs[("StatefulSet", "vllm")]
    config = config_from_dict(yaml.safe_load(docs[("ConfigMap", "prefix-router")]["data"]["gateway.yaml"]))
    headless = docs[("Service", "vllm")]
    # the gateway discovers the headless Service, on the port vLLM listens on, with its block size
    assert headless["spec"]["clusterIP"] == "None"
    assert config.discovery.dns == headless["metadata"]["name"]
    args = vllm["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--port={config.discovery.port}" in args
    assert f"--block-size={config.routing.block_size}" in args
    assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args
    # selectors select the pods they are meant for
    assert headless["spec"]["selector"].items() <= vllm["spec"]["template"]["metadata"]["labels"].items()
    service = docs[("Service", "prefix-router")]
    assert service["spec"]["selector"].items() <= gateway["metadata"]["labels"].items()
    container = gateway["spec"]["containers"][0]
    port = container["ports"][0]["containerPort"]
    assert port == config.port
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert docs[("Deployment", "prefix-router")]["spec"]["replicas"] >= 2
    # SIGTERM after preStop's sleep, then drain_s for streams: all within the grace period
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pre_stop + config.drain_s < gateway["spec"]["terminationGracePeriodSeconds"]
    monitor = docs[("ServiceMonitor", "prefix-router")]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for kustomize) is not installed")
def test_the_example_overlay_builds_and_validates():
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / "overlays" / "example")], capture_output=True,
                         text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"llm"}
    for doc in docs:
        validate(doc)
    vllm = next(d for d in docs if d["kind"] == "StatefulSet")
    assert vllm["spec"]["replicas"] == 8


def test_the_compose_files_services_mounts_and_gateway_config_exist():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert {"gateway", "prometheus", "grafana"} <= set(services)
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (DOCKER / source).exists(), f"{name} mounts {source}, which does not exist"
    gateway = config_from_dict(yaml.safe_load((DOCKER / "gateway.yaml").read_text()))
    hosts = {r.url.split("//")[1].split(":")[0] for r in gateway.replicas}
    assert hosts and hosts <= set(services), "the gateway points at replicas compose does not run"
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets <= set(services)
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert "USER 10001" in dockerfile and 'ENTRYPOINT ["prefix-router"]' in dockerfile


DASHBOARDS = ROOT / "dashboards"
# monitoring.coreos.com/v1 PrometheusRule, the fields alerts.yaml uses (the Operator's CRD,
# PrometheusRuleSpec): a misspelt key would load and never fire
_RULE = {"type": "object", "additionalProperties": False, "required": ["alert", "expr"],
         "properties": {"alert": {"type": "string"}, "expr": {"type": "string"}, "for": {"type": "string"},
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}
_RULE_SPEC = {"type": "object", "additionalProperties": False, "required": ["groups"],
              "properties": {"groups": {"type": "array", "minItems": 1, "items": {
                  "type": "object", "additionalProperties": False, "required": ["name", "rules"],
                  "properties": {"name": {"type": "string"}, "interval": {"type": "string"},
                                 "rules": {"type": "array", "minItems": 1, "items": _RULE}}}}}}


def test_the_prometheusrule_is_alerts_yaml_wrapped_and_up_to_date():
    import runpy

    render = runpy.run_path(str(DASHBOARDS / "prometheusrule.py"))["render"]
    committed = (DASHBOARDS / "prometheusrule.yaml").read_text()
    assert committed == render(), "dashboards/prometheusrule.yaml is stale: make dashboards/prometheusrule.yaml"
    rule = yaml.safe_load(committed)
    assert rule["spec"]["groups"] == yaml.safe_load((DASHBOARDS / "alerts.yaml").read_text())["groups"]
    jsonschema.validate(rule["spec"], _RULE_SPEC)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for kustomize) is not installed")
def test_the_dashboard_and_rules_kustomization_ships_the_dashboard_for_grafanas_sidecar():
    out = subprocess.run(["kubectl", "kustomize", str(DASHBOARDS)], capture_output=True, text=True, check=True).stdout
    docs = {d["kind"]: d for d in yaml.safe_load_all(out) if d}
    assert set(docs) == {"ConfigMap", "PrometheusRule"}
    config_map = docs["ConfigMap"]
    kubernetes_validate.validate(config_map, K8S_VERSION, strict=True)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"]["prefix-router.json"] == (DASHBOARDS / "prefix-router.json").read_text()
    jsonschema.validate(docs["PrometheusRule"]["spec"], _RULE_SPEC)
