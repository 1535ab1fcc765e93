"""deploy/kubernetes/multinode-with-servewatch.yaml: two inference pods, a servewatch sidecar in
each, one job whose peers find each other through a headless Service. Checked structurally: the
sidecar's command line parses with the real CLI into valid settings, its --peers-dns names the
headless Service that selects these very pods, and that Service's port reaches the sidecar's API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer

from agent.cli.app import app
from agent.fleet.config import parse_listen
from tests.deploy import KUBERNETES_DIR, load_yaml_documents

MANIFEST = KUBERNETES_DIR / "multinode-with-servewatch.yaml"
DOCS = load_yaml_documents(MANIFEST)


def _one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in DOCS if d["kind"] == kind]
    return doc


@pytest.fixture(scope="module")
def statefulset() -> dict[str, Any]:
    return _one("StatefulSet")


def _container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _run_params(args: list[str]) -> dict[str, Any]:
    """The sidecar's ``servewatch run ...`` parsed by the real command line (unknown flags fail)."""
    assert args[0] == "run"
    command = typer.main.get_command(app)
    ctx = command.commands["run"].make_context("run", list(args[1:]), resilient_parsing=False)
    return dict(ctx.params)


def test_two_inference_pods_each_with_a_servewatch_sidecar(statefulset: dict[str, Any]) -> None:
    spec = statefulset["spec"]
    assert spec["replicas"] == 2
    pod = spec["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["sglang", "servewatch"]
    assert pod["shareProcessNamespace"] is True
    assert _container(statefulset, "servewatch")["securityContext"]["capabilities"]["add"] == ["SYS_PTRACE"]
    server_args = _container(statefulset, "sglang")["args"]
    assert server_args[server_args.index("--nnodes") + 1] == str(spec["replicas"])
    assert server_args[server_args.index("--node-rank") + 1] == "$(NODE_RANK)"
    node_rank = next(e for e in _container(statefulset, "sglang")["env"] if e["name"] == "NODE_RANK")
    assert node_rank["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"


def test_sidecars_are_one_job_whose_peers_come_from_the_headless_service(statefulset: dict[str, Any], tmp_path: Path) -> None:
    sidecar = _container(statefulset, "servewatch")
    params = _run_params(sidecar["args"])
    assert params["job"] == "sglang-multinode"
    assert params["match"] == ["sglang::scheduler*"]
    service = _one("Service")
    ns = statefulset["metadata"]["namespace"]
    # the DNS name is the headless Service of this StatefulSet, in its namespace
    name, port = params["peers_dns"].rsplit(":", 1)
    assert name in (service["metadata"]["name"], f"{service['metadata']['name']}.{ns}",
                    f"{service['metadata']['name']}.{ns}.svc.cluster.local")
    assert service["metadata"]["namespace"] == ns
    assert service["spec"]["clusterIP"] == "None"  # resolves to every pod, not one virtual IP
    assert service["spec"]["publishNotReadyAddresses"] is True  # a hung (unready) server's agent stays reachable
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    # Service port -> targetPort -> the sidecar's API port
    listen_host, listen_port = parse_listen(params["api_listen"])
    assert listen_host == "0.0.0.0"  # reachable from the other pod
    entry = next(p for p in service["spec"]["ports"] if p["port"] == int(port))
    named = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert named[entry["targetPort"]] == listen_port == int(port)


def test_the_token_is_a_0600_plain_file_from_a_secret(statefulset: dict[str, Any]) -> None:
    sidecar = _container(statefulset, "servewatch")
    params = _run_params(sidecar["args"])
    token_path = str(params["api_token_file"])
    mount = next(m for m in sidecar["volumeMounts"] if m["mountPath"] == token_path)
    assert mount["subPath"]  # a regular file: a Secret volume's own paths are symlinks, refused
    assert mount["readOnly"] is True
    volume = next(v for v in statefulset["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["defaultMode"] == 0o600


def test_the_sidecar_settings_load_with_the_real_loader(statefulset: dict[str, Any], tmp_path: Path) -> None:
    """What `servewatch run` would build from these flags and the sidecar's environment (token
    and TLS files made locally at the paths the Secrets are mounted on)."""
    from tests.deploy.test_kubernetes_fleet import agent_settings

    settings, _ = agent_settings(statefulset, "servewatch", tmp_path)
    assert settings.api.enabled and settings.fleet.job == "sglang-multinode"
    assert settings.api.tls and settings.api.mutual_tls and not settings.fleet.allow_insecure_peers
    # both sidecars watch the whole server's progress at pod 0 (the frontend), so both detect a stall
    assert "sglang-multinode-0.sglang-multinode" in settings.metrics.url
