"""The deployment artifacts are correct, not decorative: Kubernetes manifests validate against the
Kubernetes schemas (``kubernetes-validate``), the monitors against the Prometheus Operator CRDs'
fields, the Gateway API and Inference Extension resources against their CRDs' fields, the
kustomizations build, the gateway configurations in them load, the manifests are wired to each
other, and the compose file's services and mounts exist."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from prefix_router.config import config_from_dict

ROOT = Path(__file__).resolve().parents[2]
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


# The fields of the Gateway API's gateway.networking.k8s.io/v1 Gateway and HTTPRoute
# (kubernetes-sigs/gateway-api, config/crd/standard/gateway.networking.k8s.io_*.yaml) and of the
# Inference Extension's inference.networking.k8s.io/v1 InferencePool
# (kubernetes-sigs/gateway-api-inference-extension,
# config/crd/bases/inference.networking.k8s.io_inferencepools.yaml, with its rule that a Service
# needs a port) that these manifests use, with the CRDs' types, enums and patterns, as of
# gateway-api 4564255 and gateway-api-inference-extension 84436a9 (both after the releases the
# README installs; the manifests use only fields InferencePool v1 had from its first release).
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_GROUP = {"type": "string", "maxLength": 253, "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
_KIND = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": "^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"}
_PORT = {"type": "object", "additionalProperties": False, "required": ["number"],
         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
_DURATION = {"type": "string", "pattern": "^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
_GATEWAY_API = {
    "InferencePool": ("inference.networking.k8s.io/v1", {
        "required": ["selector", "targetPorts"],
        "properties": {
            "selector": {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
                         "properties": {"matchLabels": {"type": "object", "minProperties": 1, "maxProperties": 64,
                                                        "additionalProperties": {"type": "string", "maxLength": 63}}}},
            "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": {
                "type": "object", "additionalProperties": False, "required": ["name"],
                "properties": {"group": _GROUP, "kind": _KIND, "name": _NAME, "port": _PORT,
                               "failureMode": {"enum": ["FailOpen", "FailClose"]}},
                "if": {"properties": {"kind": {"const": "Service"}}}, "then": {"required": ["port"]}}}}),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", {
        "properties": {
            "parentRefs": {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["name"],
                "properties": {"group": _GROUP, "kind": _KIND, "name": _NAME, "namespace": {"type": "string"},
                               "sectionName": {"type": "string"}, "port": {"type": "integer"}}}},
            "hostnames": {"type": "array", "items": {"type": "string"}},
            "rules": {"type": "array", "items": {
                "type": "object", "additionalProperties": False,
                "properties": {
                    "name": {"type": "string"},
                    "matches": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False,
                        "properties": {"path": {"type": "object", "additionalProperties": False,
                                                "properties": {"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                                               "value": {"type": "string", "maxLength": 1024}}}}}},
                    "backendRefs": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "required": ["name"],
                        "properties": {"group": _GROUP, "kind": _KIND, "name": _NAME, "namespace": {"type": "string"},
                                       "port": {"type": "integer"}, "weight": {"type": "integer"}}}},
                    "timeouts": {"type": "object", "additionalProperties": False,
                                 "properties": {"request": _DURATION, "backendRequest": _DURATION}}}}}}}),
    "Gateway": ("gateway.networking.k8s.io/v1", {
        "required": ["gatewayClassName", "listeners"],
        "properties": {
            "gatewayClassName": _NAME,
            "listeners": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["name", "port", "protocol"],
                "properties": {"name": _NAME, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                               "protocol": {"type": "string", "minLength": 1}, "hostname": {"type": "string"}}}}}}),
}


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def resources(folder: Path) -> list[tuple[Path, dict]]:
    """Every manifest a kustomization folder applies, following the folders and components it names."""
    out = []
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    for name in kustomization.get("resources", []) + kustomization.get("components", []):
        path = (folder / name).resolve()
        out += resources(path) if path.is_dir() else [(path, doc) for doc in documents(path)]
    return out


def base_resources() -> list[tuple[Path, dict]]:
    return resources(KUBE / "base")


def validate(doc: dict) -> None:
    kind = doc["kind"]
    if kind in _MONITOR:
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        schema = {"type": "object", "additionalProperties": False, **_MONITOR[kind]}
        jsonschema.validate(doc["spec"], schema)
    elif kind in _GATEWAY_API:
        api_version, spec = _GATEWAY_API[kind]
        assert doc["apiVersion"] == api_version
        assert set(doc) <= {"apiVersion", "kind", "metadata", "spec"} and doc["metadata"]["name"]
        jsonschema.validate(doc["spec"], {"type": "object", "additionalProperties": False, **spec})
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("folder", ["gateway", "base", "vllm", "epp", "components/monitoring"])
def test_every_file_of_a_kustomization_is_listed_in_it(folder):
    listed = {n for n in yaml.safe_load((KUBE / folder / "kustomization.yaml").read_text())["resources"]
              if not n.startswith("..")}
    assert listed == {p.name for p in (KUBE / folder).glob("*.yaml")} - {"kustomization.yaml"}


def every_manifest() -> list[tuple[Path, dict]]:
    """Each manifest of base and epp once (both apply ../vllm)."""
    seen = {(p, d["kind"], d["metadata"]["name"]): (p, d) for p, d in resources(KUBE / "base") + resources(KUBE / "epp")}
    return list(seen.values())


@pytest.mark.parametrize("path,doc", every_manifest(), ids=lambda v: v.name if isinstance(v, Path) else v["kind"])
def test_every_manifest_validates_against_its_schema(path, doc):
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
    epp = {d["kind"]: d for _, d in resources(KUBE / "epp")}
    for kind, breaks in [("InferencePool", lambda spec: spec.update(targetPort=spec.pop("targetPorts"))),
                         ("InferencePool", lambda spec: spec["endpointPickerRef"].pop("port")),
                         ("InferencePool", lambda spec: spec["endpointPickerRef"].update(failureMode="FailOpenly")),
                         ("HTTPRoute", lambda spec: spec["rules"][0]["backendRefs"][0].update(Kind="InferencePool")),
                         ("HTTPRoute", lambda spec: spec["rules"][0]["timeouts"].update(request="forever")),
                         ("Gateway", lambda spec: spec.pop("gatewayClassName"))]:
        broken = yaml.safe_load(yaml.safe_dump(epp[kind]))
        validate(broken)
        breaks(broken["spec"])
        with pytest.raises(jsonschema.ValidationError):
            validate(broken)


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


def _overlay(name: str) -> dict[tuple[str, str], dict]:
    """An overlay as ``kubectl kustomize`` renders it, each document validated, by (kind, name)."""
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / "overlays" / name)], capture_output=True, text=True,
                         check=True).stdout
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    for doc in docs.values():
        validate(doc)
    return docs


LEAVES = ["base", "epp", *(f"overlays/{p.name}" for p in sorted((KUBE / "overlays").iterdir()))]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for kustomize) is not installed")
@pytest.mark.parametrize("leaf", LEAVES)
def test_one_images_entry_sets_every_gateway_container_and_no_vllm_image_fetches_a_tokenizer(leaf):
    """What a user applies names the gateway's image in one ``images:`` entry, and the rendered
    gateway and picker pods (their init containers included) run that image and no other."""
    (entry,) = yaml.safe_load((KUBE / leaf / "kustomization.yaml").read_text())["images"]
    assert entry["name"] == "prefix-router"
    wanted = f"{entry['newName']}:{entry['newTag']}"
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / leaf)], capture_output=True, text=True, check=True).stdout
    pods = [d["spec"]["template"]["spec"] for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
    images = {c["image"] for pod in pods for c in pod.get("initContainers", []) + pod["containers"]}
    assert pods and images == {wanted}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for kustomize) is not installed")
def test_the_existing_pods_overlay_is_the_gateway_alone_finding_pods_by_label():
    docs = _overlay("existing-pods")
    assert not [k for k in docs if k[0] in ("StatefulSet", "DaemonSet", "Job")]  # no vLLM workload
    (deployment,) = [d for k, d in docs.items() if k[0] == "Deployment"]
    assert deployment["metadata"]["name"] == "prefix-router"
    config = config_from_dict(yaml.safe_load(docs[("ConfigMap", "prefix-router")]["data"]["gateway.yaml"]))
    assert config.discovery.dns is None and config.discovery.kubernetes.label_selector
    pod = deployment["spec"]["template"]["spec"]
    binding = docs[("RoleBinding", "prefix-router-pod-reader")]
    assert [(s["kind"], s["name"]) for s in binding["subjects"]] == [("ServiceAccount", pod["serviceAccountName"])]
    (init,) = pod["initContainers"]
    assert init["image"] == pod["containers"][0]["image"]
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert env["MODEL"] and env["HF_HUB_OFFLINE"] == "0"
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["tokenizer"] == config.tokenizer


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for kustomize) is not installed")
def test_the_pod_discovery_overlay_lets_the_gateway_read_and_watch_the_pods_it_selects():
    docs = _overlay("pod-discovery")
    config = config_from_dict(yaml.safe_load(docs[("ConfigMap", "prefix-router")]["data"]["gateway.yaml"]))
    assert config.discovery.dns is None
    key, value = config.discovery.kubernetes.label_selector.split("=")
    assert docs[("StatefulSet", "vllm")]["spec"]["template"]["metadata"]["labels"][key] == value
    pod = docs[("Deployment", "prefix-router")]["spec"]["template"]["spec"]
    role = docs[("Role", "prefix-router-pod-reader")]
    binding = docs[("RoleBinding", "prefix-router-pod-reader")]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {"kind": "ServiceAccount", "name": pod["serviceAccountName"]} in binding["subjects"]
    assert ("ServiceAccount", pod["serviceAccountName"]) in docs
    (rule,) = role["rules"]
    assert rule["resources"] == ["pods"] and sorted(rule["verbs"]) == ["get", "list", "watch"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for kustomize) is not installed")
def test_the_disaggregated_overlay_wires_two_pools_to_the_gateway():
    docs = _overlay("disaggregated")
    config = config_from_dict(yaml.safe_load(docs[("ConfigMap", "prefix-router")]["data"]["gateway.yaml"]))
    roles = {}
    for pool, service in ((config.discovery.dns, "decode"), (config.discovery.prefill_dns, "prefill")):
        selector = docs[("Service", pool)]["spec"]["selector"]
        (pods,) = [d for d in docs.values() if d["kind"] == "StatefulSet"
                   and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        args = " ".join(pods["spec"]["template"]["spec"]["containers"][0]["args"])
        roles[service] = json.loads(args.split("--kv-transfer-config=")[1].split("}")[0] + "}")["kv_role"]
        env = {e["name"] for e in pods["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in env
    assert roles == {"decode": "kv_consumer", "prefill": "kv_producer"}
    policy = docs[("NetworkPolicy", "vllm-prefill")]["spec"]
    prefill = docs[("StatefulSet", "vllm-prefill")]["spec"]["template"]["spec"]["containers"][0]
    named = {p["name"] for p in prefill["ports"]}
    assert {p["port"] for rule in policy["ingress"] for p in rule["ports"]} <= named


def test_the_endpoint_pickers_manifests_are_wired_to_each_other_and_to_the_vllm_pods():
    from prefix_router.epp.server import LIVENESS, READINESS

    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in resources(KUBE / "epp")}
    pool = docs[("InferencePool", "vllm")]["spec"]
    vllm = docs[("StatefulSet", "vllm")]["spec"]["template"]
    picker = docs[("Deployment", "prefix-router-epp")]["spec"]["template"]
    service = docs[("Service", "prefix-router-epp")]
    config = config_from_dict(yaml.safe_load(docs[("ConfigMap", "prefix-router-epp")]["data"]["gateway.yaml"]))
    # the pool is the vLLM pods on vLLM's port, and the picker finds the same pods on the same port
    assert pool["selector"]["matchLabels"].items() <= vllm["metadata"]["labels"].items()
    args = vllm["spec"]["containers"][0]["args"]
    assert [p["number"] for p in pool["targetPorts"]] == [config.discovery.port]
    assert f"--port={config.discovery.port}" in args and f"--block-size={config.routing.block_size}" in args
    headless = docs[("Service", config.discovery.dns)]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= vllm["metadata"]["labels"].items()
    # the pool's picker is the picker's Service, on the port that reaches its gRPC server
    ref = pool["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"] and ref.get("kind", "Service") == "Service"
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert port["appProtocol"] == "http2"  # gRPC in cleartext
    container = picker["spec"]["containers"][0]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    grpc_port = int(container["args"][container["args"].index("--grpc-port") + 1])
    assert container["args"][0] == "epp" and named[port["targetPort"]] == grpc_port
    assert named["http"] == config.port
    assert service["spec"]["selector"].items() <= picker["metadata"]["labels"].items()
    # the probes ask the picker's own health services
    assert container["livenessProbe"]["grpc"] == {"port": grpc_port, "service": LIVENESS}
    assert container["readinessProbe"]["grpc"]["port"] == grpc_port
    assert container["readinessProbe"]["grpc"]["service"] in READINESS
    # the route sends the gateway's traffic to the pool
    route = docs[("HTTPRoute", "vllm")]["spec"]
    assert [(p["kind"], p["name"]) for p in route["parentRefs"]] == [("Gateway", "inference")]
    assert ("Gateway", "inference") in docs
    backends = [b for rule in route["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "vllm"}]
    monitor = docs[("ServiceMonitor", "prefix-router-epp")]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for kustomize) is not installed")
def test_the_endpoint_pickers_kustomization_builds_with_the_vllm_pods():
    out = subprocess.run(["kubectl", "kustomize", str(KUBE / "epp")], capture_output=True, text=True,
                         check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert {d["kind"] for d in docs} >= {"InferencePool", "HTTPRoute", "Gateway", "Deployment", "StatefulSet"}
    assert not any(d["metadata"]["name"] == "prefix-router" for d in docs)  # no serve gateway in this mode
    for doc in docs:
        validate(doc)


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
