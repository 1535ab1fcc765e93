"""deploy/kubernetes/: valid per the Kubernetes JSON schemas, and the telemetry path is connected.

Schemas come from the kubernetes-validate package (schemas for each Kubernetes minor version ship
inside it; strict mode rejects unknown fields). The path checked end to end:
servewatch sidecar -> Service otel-agent -> agent DaemonSet's OTLP receiver -> its exporter ->
Service otel-gateway -> gateway StatefulSet's OTLP receiver; every exporter between collectors
and to the backend queues on disk (file_storage) on a volume of its pod, and servewatch's own
metrics reach the gateway's Prometheus exporter, with the alert rule and dashboard beside it.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy import (
    COMPOSE_FILE,
    GRAFANA_DASHBOARDS,
    KUBERNETES_DIR,
    PINNED_IMAGE,
    PROMETHEUS_RULES,
    REPO_ROOT,
    collector_problems,
    file_storage_dirs,
    host_port,
    iter_exporters,
    load_yaml,
    load_yaml_documents,
    otlp_receiver_ports,
    persistent_queue_problems,
)

#: Kubernetes minor the manifests target (kubernetes-validate 1.37 ships its schemas).
K8S_VERSION = "1.37"

DOCS: list[tuple[Path, dict[str, Any]]] = [
    (path, doc) for path in sorted(KUBERNETES_DIR.glob("*.yaml")) for doc in load_yaml_documents(path)
]


def doc_id(item: tuple[Path, dict[str, Any]]) -> str:
    path, doc = item
    return f"{path.name}:{doc['kind']}/{doc['metadata']['name']}"


def find(kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
    matches = [
        doc
        for _, doc in DOCS
        if doc["kind"] == kind
        and doc["metadata"]["name"] == name
        and (namespace is None or doc["metadata"].get("namespace") == namespace)
    ]
    assert len(matches) == 1, f"{kind}/{name} in {namespace}: {len(matches)} found"
    return matches[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec(workload)["containers"] if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def service_for(endpoint: str, client_namespace: str) -> tuple[dict[str, Any], int]:
    """The Service an in-cluster endpoint names (``svc``, ``svc.ns``, ``svc.ns.svc[.cluster.local]``)."""
    host, port = host_port(endpoint)
    labels = host.split(".")
    assert labels[2:] in ([], ["svc"], ["svc", "cluster", "local"]), f"{host} is not a Service DNS name"
    namespace = labels[1] if len(labels) > 1 else client_namespace
    return find("Service", labels[0], namespace), port


def backing_workload(service: dict[str, Any]) -> dict[str, Any]:
    """The one workload in the manifests whose pod labels match the Service's selector."""
    selector = service["spec"]["selector"]
    matches = [
        doc
        for _, doc in DOCS
        if doc["kind"] in {"Deployment", "DaemonSet", "StatefulSet"}
        and doc["metadata"]["namespace"] == service["metadata"]["namespace"]
        and selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert len(matches) == 1, f"selector {selector} matches {len(matches)} workloads"
    workload = matches[0]
    assert workload["spec"]["selector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    return workload


def target_container_port(service: dict[str, Any], port: int, workload: dict[str, Any]) -> int:
    """Follow Service port -> targetPort (name or number) -> the container port it reaches."""
    entry = next((p for p in service["spec"]["ports"] if p["port"] == port), None)
    assert entry is not None, f"Service {service['metadata']['name']} has no port {port}"
    target = entry.get("targetPort", port)
    ports = [p for c in pod_spec(workload)["containers"] for p in c.get("ports", [])]
    if isinstance(target, str):
        named = [p["containerPort"] for p in ports if p.get("name") == target]
        assert len(named) == 1, f"targetPort {target!r} names {len(named)} container ports"
        return named[0]
    assert target in [p["containerPort"] for p in ports]
    return target


def collector_config(workload: dict[str, Any]) -> dict[str, Any]:
    """The collector config a workload runs: --config path -> volume mount -> ConfigMap key."""
    spec = pod_spec(workload)
    (c,) = spec["containers"]
    (flag,) = [a for a in c["args"] if a.startswith("--config=")]
    path = Path(flag.removeprefix("--config="))
    mount = next(m for m in c["volumeMounts"] if Path(m["mountPath"]) == path.parent)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    configmap = find("ConfigMap", volume["configMap"]["name"], workload["metadata"]["namespace"])
    return yaml.safe_load(configmap["data"][path.name])


@pytest.fixture(scope="module")
def inference() -> dict[str, Any]:
    (workload,) = [doc for _, doc in DOCS if doc["kind"] == "Deployment" and doc["metadata"]["namespace"] == "inference"]
    return workload


@pytest.mark.parametrize("item", DOCS, ids=doc_id)
def test_manifest_validates_against_the_kubernetes_schema(item: tuple[Path, dict[str, Any]]) -> None:
    _, doc = item
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda spec: spec.update(shareProcessNamespaces=True), "'shareProcessNamespaces' was unexpected"),
        (lambda spec: spec.update(shareProcessNamespace="yes"), "'yes' is not of type 'boolean', 'null'"),
        (lambda spec: spec["containers"][1]["securityContext"]["capabilities"].update(add="SYS_PTRACE"),
         "'SYS_PTRACE' is not of type 'array', 'null'"),
    ],
)
def test_schema_validation_rejects_a_broken_pod_spec(inference: dict[str, Any], mutate, message: str) -> None:
    broken = copy.deepcopy(inference)
    mutate(pod_spec(broken))
    with pytest.raises(kubernetes_validate.ValidationError) as caught:
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    assert message in caught.value.message


def test_manifests_cover_sidecar_agent_and_gateway() -> None:
    kinds = sorted(doc_id(item).split(":", 1)[1] for item in DOCS)
    assert kinds == [
        "ConfigMap/otel-agent-config",
        "ConfigMap/otel-gateway-config",
        "ConfigMap/servewatch-grafana-dashboard",
        "ConfigMap/servewatch-prometheus-rules",
        "DaemonSet/otel-agent",
        "DaemonSet/servewatch-fleet",
        "Deployment/sglang",
        "Namespace/inference",
        "Namespace/observability",
        "Service/otel-agent",
        "Service/otel-gateway",
        "Service/otel-gateway-headless",
        "Service/servewatch-fleet",
        "Service/sglang-multinode",
        "StatefulSet/otel-gateway",
        "StatefulSet/sglang-multinode",
    ]
    namespaces = {doc["metadata"]["name"] for _, doc in DOCS if doc["kind"] == "Namespace"}
    for _, doc in DOCS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] in namespaces, doc_id((Path(), doc))


def test_every_image_is_pinned() -> None:
    for item in DOCS:
        _, doc = item
        if "template" not in doc.get("spec", {}):
            continue
        for c in pod_spec(doc)["containers"]:
            assert PINNED_IMAGE.match(c["image"]), f"{doc_id(item)}: {c['image']!r}"


def test_sidecar_sees_the_server_processes_and_may_ptrace_them(inference: dict[str, Any]) -> None:
    spec = pod_spec(inference)
    assert spec["shareProcessNamespace"] is True
    servewatch = container(inference, "servewatch")
    assert servewatch["securityContext"]["capabilities"]["add"] == ["SYS_PTRACE"]
    assert servewatch["securityContext"]["allowPrivilegeEscalation"] is False
    # Only the agent gets ptrace; the server runs with the runtime's default capabilities.
    server = container(inference, "sglang")
    assert "SYS_PTRACE" not in str(server.get("securityContext", {}))
    # The namespace must allow the added capability and the hostPath.
    assert find("Namespace", "inference")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_sidecar_watches_the_server_it_shares_the_pod_with(inference: dict[str, Any]) -> None:
    server = container(inference, "sglang")
    port = int(server["args"][server["args"].index("--port") + 1])
    assert [p["containerPort"] for p in server["ports"]] == [port]
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"
    servewatch = container(inference, "servewatch")
    args = servewatch["args"]
    assert args[0] == "run"  # deploy/Dockerfile's entrypoint is `servewatch`
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    assert flags == {
        "--health-url": f"http://127.0.0.1:{port}/health",
        "--metrics-url": f"http://127.0.0.1:{port}/metrics",
        "--match": "sglang::scheduler*",
    }
    assert "--enable-metrics" in server["args"]


def test_coredump_pipe_and_bundles_live_on_a_volume_both_containers_mount(inference: dict[str, Any]) -> None:
    server, servewatch = container(inference, "sglang"), container(inference, "servewatch")
    data_dir = env_of(servewatch)["SERVEWATCH_DATA_DIR"]
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (server, servewatch)}
    assert mounts["sglang"][data_dir] == mounts["servewatch"][data_dir]
    volume = next(v for v in pod_spec(inference)["volumes"] if v["name"] == mounts["servewatch"][data_dir])
    assert volume["hostPath"]["type"] == "DirectoryOrCreate"
    # Step counters written by agent.sdk in the server are files in its /dev/shm.
    assert mounts["sglang"]["/dev/shm"] == mounts["servewatch"]["/dev/shm"]
    server_env = env_of(server)
    assert server_env["CUDA_ENABLE_USER_TRIGGERED_COREDUMP"] == "1"
    for name in ("CUDA_COREDUMP_PIPE", "CUDA_COREDUMP_FILE"):
        assert Path(data_dir) in Path(server_env[name]).parents, name


def test_sidecar_sends_otlp_grpc_to_the_node_local_agent(inference: dict[str, Any]) -> None:
    from exporters.otlp.provider import ExportConfig, build_resource, resolve_destination

    servewatch = container(inference, "servewatch")
    env = env_of(servewatch)
    destination = resolve_destination(ExportConfig(), environ=env)
    assert destination.protocol == "grpc"
    # $(VAR) references resolve to downward-API values; each one must be defined on the container.
    # Kubernetes expands a reference only to a variable defined earlier in the list.
    order = [e["name"] for e in servewatch["env"]]
    downward = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in servewatch["env"][: order.index("OTEL_RESOURCE_ATTRIBUTES")]
        if "valueFrom" in e
    }
    expanded = re.sub(r"\$\(([A-Z_]+)\)", lambda m: f"<{downward[m.group(1)]}>", env["OTEL_RESOURCE_ATTRIBUTES"])
    resource = build_resource(ExportConfig(), host_name="n", service_instance_id="i", environ={**env, "OTEL_RESOURCE_ATTRIBUTES": expanded})
    assert resource.attributes["service.name"] == "servewatch"
    assert {k: v for k, v in resource.attributes.items() if k.startswith("k8s.")} == {
        "k8s.namespace.name": "<metadata.namespace>",
        "k8s.pod.name": "<metadata.name>",
        "k8s.pod.uid": "<metadata.uid>",
        "k8s.node.name": "<spec.nodeName>",
    }
    service, port = service_for(destination.endpoint or "", inference["metadata"]["namespace"])
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    agent = backing_workload(service)
    assert agent["kind"] == "DaemonSet"
    assert target_container_port(service, port, agent) == otlp_receiver_ports(collector_config(agent))["grpc"][1]


def test_agent_forwards_to_the_gateway_service_and_port() -> None:
    agent = find("DaemonSet", "otel-agent", "observability")
    config = collector_config(agent)
    assert collector_problems(config) == []
    (exporter_ref, exporter), = iter_exporters(config, "otlp_grpc")
    # metrics go to the gateway Service; traces through the loadbalancing exporter (test_kubernetes_fleet)
    assert config["service"]["pipelines"]["metrics"]["exporters"] == [exporter_ref]
    service, port = service_for(exporter["endpoint"], agent["metadata"]["namespace"])
    assert service["metadata"]["name"] == "otel-gateway"
    gateway = backing_workload(service)
    assert gateway["kind"] == "StatefulSet" and gateway["spec"]["replicas"] >= 2
    gateway_grpc = otlp_receiver_ports(collector_config(gateway))["grpc"]
    assert gateway_grpc[0] == "0.0.0.0"
    assert target_container_port(service, port, gateway) == gateway_grpc[1]
    assert exporter["retry_on_failure"]["enabled"] is True and exporter["sending_queue"]["enabled"] is True


def test_gateway_service_ports_match_the_gateway_receivers() -> None:
    service = find("Service", "otel-gateway", "observability")
    gateway = backing_workload(service)
    receivers = otlp_receiver_ports(collector_config(gateway))
    by_name = {p["name"]: target_container_port(service, p["port"], gateway) for p in service["spec"]["ports"]}
    assert by_name == {"otlp-grpc": receivers["grpc"][1], "otlp-http": receivers["http"][1]}
    assert collector_problems(collector_config(gateway)) == []


def test_collectors_are_probed_on_their_health_check_extension() -> None:
    for kind, name in (("DaemonSet", "otel-agent"), ("StatefulSet", "otel-gateway")):
        workload = find(kind, name, "observability")
        (c,) = pod_spec(workload)["containers"]
        health_port = host_port(collector_config(workload)["extensions"]["health_check"]["endpoint"])[1]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("livenessProbe", "readinessProbe"):
            assert ports[c[probe]["httpGet"]["port"]] == health_port, f"{name} {probe}"
        assert "memory" in c["resources"]["limits"]  # memory_limiter's percentages are of this limit


def test_sidecar_image_is_built_from_the_pinned_python_base() -> None:
    dockerfile = (REPO_ROOT / "deploy" / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM\s+(\S+)", dockerfile, flags=re.MULTILINE)
    assert base == load_yaml(COMPOSE_FILE)["x-python"]["image"]
    assert re.search(r'^ENTRYPOINT \["servewatch"\]$', dockerfile, flags=re.MULTILINE)


def _volume_at(workload: dict[str, Any], directory: str) -> dict[str, Any]:
    """The pod volume (or claim template) the collector's ``directory`` lives on."""
    (c,) = pod_spec(workload)["containers"]
    mount = next((m for m in c["volumeMounts"] if Path(directory) == Path(m["mountPath"]) or Path(m["mountPath"]) in Path(directory).parents), None)
    assert mount is not None, f"{directory} is on no volume: the queue would be in the container's own layer"
    for volume in pod_spec(workload).get("volumes", []):
        if volume["name"] == mount["name"]:
            return volume
    (claim,) = [t for t in workload["spec"].get("volumeClaimTemplates", []) if t["metadata"]["name"] == mount["name"]]
    return {"persistentVolumeClaim": claim}


def test_node_agent_and_gateway_queue_on_disk_and_never_give_up() -> None:
    agent = find("DaemonSet", "otel-agent", "observability")
    gateway = find("StatefulSet", "otel-gateway", "observability")
    for workload in (agent, gateway):
        config = collector_config(workload)
        assert persistent_queue_problems(config) == [], workload["metadata"]["name"]
        assert file_storage_dirs(config)
    # the agent's loadbalancing exporter queues at its own level (outliving per-replica exporters)
    lb = collector_config(agent)["exporters"]["loadbalancing/gateway"]
    assert lb["sending_queue"]["storage"] == "file_storage/queue"
    # the agent (baseline Pod Security: no hostPath) keeps its queue on an emptyDir: a container restart
    (agent_dir,) = file_storage_dirs(collector_config(agent)).values()
    assert "emptyDir" in _volume_at(agent, agent_dir)
    assert find("Namespace", "observability")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    # each gateway replica on its own claim, writable by the collector's user
    (gateway_dir,) = file_storage_dirs(collector_config(gateway)).values()
    claim = _volume_at(gateway, gateway_dir)["persistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"]
    assert pod_spec(gateway)["securityContext"]["fsGroup"] == 10001
    assert gateway["spec"]["serviceName"] == "otel-gateway-headless"


def test_the_gateway_serves_servewatch_metrics_to_prometheus_with_the_alert_and_dashboard() -> None:
    gateway = find("StatefulSet", "otel-gateway", "observability")
    config = collector_config(gateway)
    (ref, exporter), = iter_exporters(config, "prometheus")
    assert config["service"]["pipelines"]["metrics"]["exporters"] == [ref]
    port = host_port(exporter["endpoint"])[1]
    annotations = gateway["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == port
    (c,) = pod_spec(gateway)["containers"]
    assert port in {p["containerPort"] for p in c["ports"]}
    # the agents send servewatch's metrics to the gateway (otlp_grpc/gateway in their metrics pipeline)
    agent = collector_config(find("DaemonSet", "otel-agent", "observability"))
    assert agent["service"]["pipelines"]["metrics"]["exporters"] == ["otlp_grpc/gateway"]
    # the alert rule and the dashboard are the demo stack's own files
    rules = find("ConfigMap", "servewatch-prometheus-rules", "observability")
    assert rules["data"]["servewatch.yaml"] == PROMETHEUS_RULES.read_text()
    dashboard = find("ConfigMap", "servewatch-grafana-dashboard", "observability")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["servewatch-delivery.json"] == (GRAFANA_DASHBOARDS / "servewatch-delivery.json").read_text()
