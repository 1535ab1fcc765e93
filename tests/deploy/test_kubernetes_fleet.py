"""The fleet's scale path in deploy/kubernetes/, checked structurally (no cluster here):

* agents of a job: a DaemonSet (fleet-daemonset.yaml) or a sidecar per pod
  (multinode-with-servewatch.yaml); their command lines parse with the real CLI into settings the
  real loader accepts, peers found through a headless Service that selects exactly the agents'
  pods, mutual TLS from a Secret, the token file a plain 0600 file;
* the collector path: every node's agent routes traces by trace id (the ``loadbalancing``
  exporter) to the gateway replicas behind a headless Service, so one replica holds a whole
  trace; the gateway's ``tail_sampling`` keeps every trace holding servewatch's root spans
  (``incident``, ``job.incident``) and exports to Tempo.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import typer

from agent.cli.app import app
from agent.fleet.config import parse_listen
from exporters.mirror.mirror import INCIDENT_SPAN, JOB_INCIDENT_SPAN
from tests.deploy import (
    KUBERNETES_DIR,
    collector_problems,
    host_port,
    load_yaml_documents,
    otlp_receiver_ports,
)
from tests.deploy.test_kubernetes import (
    backing_workload,
    collector_config,
    find,
    target_container_port,
)

DAEMONSET = KUBERNETES_DIR / "fleet-daemonset.yaml"
MULTINODE = KUBERNETES_DIR / "multinode-with-servewatch.yaml"
TLS_ENV = {"SERVEWATCH_API__TLS_CERT_FILE": "tls_cert_file", "SERVEWATCH_API__TLS_KEY_FILE": "tls_key_file",
           "SERVEWATCH_API__TLS_CLIENT_CA_FILE": "tls_client_ca_file"}


def _container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _run_params(args: list[str]) -> dict[str, Any]:
    assert args[0] == "run"
    command = typer.main.get_command(app)
    return dict(command.commands["run"].make_context("run", list(args[1:]), resilient_parsing=False).params)


def _mounted(workload: dict[str, Any], container: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """The volume a file path of the container lives on, and its key inside that volume."""
    for mount in container["volumeMounts"]:
        base = mount["mountPath"]
        if path == base or path.startswith(base.rstrip("/") + "/"):
            volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
            return volume, mount.get("subPath") or path[len(base):].lstrip("/")
    raise AssertionError(f"{path} is on no volume of {container['name']}")


def agent_settings(workload: dict[str, Any], name: str, tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    """Settings `servewatch run` would build from the container's flags and TLS environment, with
    the token and TLS files made locally (real PEM files) in place of the Secrets'."""
    from agent.runtime.settings import load_settings
    from tests.tls_certs import make_tls_material

    container = _container(workload, name)
    params = _run_params(container["args"])
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    pki = make_tls_material(tmp_path / "pki")
    local = {"tls.crt": pki.server_cert, "tls.key": pki.server_key, "ca.crt": pki.ca_cert}
    api: dict[str, Any] = {}
    for var, key in TLS_ENV.items():
        if var in env:
            volume, item = _mounted(workload, container, env[var])
            assert "secret" in volume, f"{env[var]} is not from a Secret"
            api[key] = local[item]
    token = tmp_path / "api-token"
    token.write_text("x" * 32)
    os.chmod(token, 0o600)
    host, port = parse_listen(params["api_listen"])
    settings = load_settings({
        "data_dir": tmp_path / "data",
        "health": {"url": params.get("health_url")},
        "metrics": {"url": params.get("metrics_url")},
        "target": {"match": params["match"]},
        "api": {"enabled": True, "host": host, "port": port, "token_file": token, **api},
        "fleet": {"job": params["job"], "peers_dns": params["peers_dns"], "allow_insecure_peers": params.get("allow_insecure_peers")},
    })
    return settings, params


@pytest.fixture(scope="module")
def daemonset() -> dict[str, Any]:
    (doc,) = [d for d in load_yaml_documents(DAEMONSET) if d["kind"] == "DaemonSet"]
    return doc


def test_the_daemonset_agent_sees_the_nodes_processes_and_may_ptrace_them(daemonset: dict[str, Any]) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostPID"] is True  # the node's server processes, by title
    agent = _container(daemonset, "servewatch")
    assert agent["securityContext"]["capabilities"]["add"] == ["SYS_PTRACE"]
    assert agent["securityContext"]["allowPrivilegeEscalation"] is False
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    env = {e["name"]: e for e in agent["env"]}
    assert env["SERVEWATCH_HOST_NAME"]["value"] == "$(NODE_NAME)"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # the node's own server, at the node's address (hostNetwork servers)
    params = _run_params(agent["args"])
    (metrics_url,) = params["metrics_url"]  # repeatable: one per server of the node; here the one
    assert metrics_url.startswith("http://$(HOST_IP):")
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    data, _ = _mounted(daemonset, agent, env["SERVEWATCH_DATA_DIR"]["value"])
    assert data["hostPath"]["type"] == "DirectoryOrCreate"  # evidence outlives the pod


@pytest.mark.parametrize("path,kind,name", [(DAEMONSET, "DaemonSet", "servewatch-fleet"), (MULTINODE, "StatefulSet", "sglang-multinode")])
def test_a_jobs_agents_find_each_other_through_a_headless_service_and_talk_mutual_tls(
    path: Path, kind: str, name: str, tmp_path: Path
) -> None:
    docs = load_yaml_documents(path)
    (workload,) = [d for d in docs if d["kind"] == kind]
    (service,) = [d for d in docs if d["kind"] == "Service"]
    settings, params = agent_settings(workload, "servewatch", tmp_path)
    assert settings.fleet.job and settings.api.mutual_tls and settings.api.token_file is not None
    assert not settings.fleet.allow_insecure_peers  # a token over plain HTTP is refused at start
    # --peers-dns names the headless Service that selects exactly these pods, on the API's port
    dns, port = params["peers_dns"].rsplit(":", 1)
    ns = workload["metadata"]["namespace"]
    assert dns in (service["metadata"]["name"], f"{service['metadata']['name']}.{ns}",
                   f"{service['metadata']['name']}.{ns}.svc.cluster.local")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    listen_host, listen_port = parse_listen(params["api_listen"])
    assert listen_host == "0.0.0.0"
    entry = next(p for p in service["spec"]["ports"] if p["port"] == int(port))
    named = {p["name"]: p["containerPort"] for p in _container(workload, "servewatch")["ports"]}
    assert named[entry["targetPort"]] == listen_port
    # the token: a plain 0600 file (subPath); the TLS files: a Secret, read-only
    agent = _container(workload, "servewatch")
    token_volume, key = _mounted(workload, agent, str(params["api_token_file"]))
    assert token_volume["secret"]["defaultMode"] == 0o600 and key == "token"
    assert next(m for m in agent["volumeMounts"] if m["mountPath"] == str(params["api_token_file"]))["subPath"]
    cert_path = next(e["value"] for e in agent["env"] if e["name"] == "SERVEWATCH_API__TLS_CERT_FILE")
    tls_volume, _ = _mounted(workload, agent, cert_path)
    assert tls_volume["secret"]["defaultMode"] & 0o077 == 0


def test_node_agents_route_traces_by_trace_id_to_the_gateway_replicas() -> None:
    agent = find("DaemonSet", "otel-agent", "observability")
    config = collector_config(agent)
    assert collector_problems(config) == []
    [exporter_ref] = config["service"]["pipelines"]["traces"]["exporters"]
    assert exporter_ref.split("/")[0] == "loadbalancing"
    lb = config["exporters"][exporter_ref]
    assert lb["routing_key"] == "traceID"  # every span of one trace reaches one gateway replica
    otlp = lb["protocol"]["otlp"]
    assert otlp["sending_queue"]["enabled"] is True and otlp["retry_on_failure"]["enabled"] is True
    dns = lb["resolver"]["dns"]
    labels = dns["hostname"].split(".")
    service = find("Service", labels[0], labels[1])
    assert service["spec"]["clusterIP"] == "None"  # resolves to every replica, not one virtual IP
    gateway = backing_workload(service)
    assert gateway["kind"] == "StatefulSet" and gateway["spec"]["replicas"] >= 2
    assert target_container_port(service, int(dns["port"]), gateway) == otlp_receiver_ports(collector_config(gateway))["grpc"][1]


def test_the_gateway_tail_samples_and_keeps_every_incident_trace() -> None:
    gateway = find("StatefulSet", "otel-gateway", "observability")
    config = collector_config(gateway)
    assert collector_problems(config) == []
    traces = config["service"]["pipelines"]["traces"]
    assert traces["processors"][0] == "memory_limiter"
    assert "tail_sampling" in traces["processors"] and traces["processors"].index("tail_sampling") < traces["processors"].index("batch")
    sampling = config["processors"]["tail_sampling"]
    policies = {p["name"]: p for p in sampling["policies"]}
    kept = policies["incidents"]
    assert kept["type"] == "ottl_condition"
    conditions = kept["ottl_condition"]["span"]
    for span_name in (INCIDENT_SPAN, JOB_INCIDENT_SPAN):  # servewatch's own root span names
        assert f'name == "{span_name}"' in conditions
    # a sampled trace's late spans (the job verdict comes when every host's evidence is in) pass
    assert sampling["decision_cache"]["sampled_cache_size"] >= sampling["num_traces"]
    assert int(sampling["decision_wait"].rstrip("s")) >= 10
    (backend,) = traces["exporters"]
    host, port = host_port(config["exporters"][backend]["endpoint"])
    assert host.startswith("tempo-") and port == 4317
