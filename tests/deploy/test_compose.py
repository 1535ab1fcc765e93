"""compose.yaml: valid per the Compose Specification, pinned, and wired to the configs it mounts.

The compose-spec JSON schema comes from the check-jsonschema package, which vendors it
(``check_jsonschema/builtin_schemas/vendor/compose-spec.json``, Apache-2.0, from compose-spec).
"""

from __future__ import annotations

import copy
import json
import shlex
from importlib.resources import files
from pathlib import PurePosixPath

import jsonschema
import pytest

from tests.deploy import (
    COLLECTOR_CONFIG,
    COMPOSE_FILE,
    GRAFANA_DASHBOARDS,
    GRAFANA_DATASOURCES,
    PINNED_IMAGE,
    PROMETHEUS_CONFIG,
    PROMETHEUS_RULES,
    REPO_ROOT,
    TEMPO_CONFIG,
    component_type,
    file_storage_dirs,
    host_port,
    load_yaml,
    otlp_receiver_ports,
    published_container_ports,
)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE_FILE)


@pytest.fixture(scope="module")
def services(compose: dict) -> dict[str, dict]:
    return compose["services"]


@pytest.fixture(scope="module")
def compose_validator() -> jsonschema.protocols.Validator:
    text = files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def bind_mounts(service: dict) -> dict[str, str]:
    """{container path: host path} of a service's bind mounts (short syntax)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith((".", "/")):
            out[target] = source
    return out


def test_compose_file_validates_against_the_compose_spec(compose: dict, compose_validator) -> None:
    errors = sorted(compose_validator.iter_errors(compose), key=str)
    assert errors == []


def test_compose_spec_validation_rejects_a_broken_service(compose: dict, compose_validator) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["servewatch"]["cap_add"] = "SYS_PTRACE"  # must be a list
    broken["services"]["demo"]["helthcheck"] = {}
    messages = sorted(e.message for e in compose_validator.iter_errors(broken))
    assert "'SYS_PTRACE' is not of type 'array'" in messages
    assert any("'helthcheck' was unexpected" in m for m in messages)


def test_stack_has_the_demo_services(services: dict[str, dict]) -> None:
    assert set(services) == {"otel-collector", "jaeger", "tempo", "grafana", "prometheus", "install", "demo", "servewatch"}


def test_every_image_is_pinned_to_a_version(services: dict[str, dict]) -> None:
    images = {name: svc["image"] for name, svc in services.items()}
    for name, image in images.items():
        assert PINNED_IMAGE.match(image), f"{name}: {image!r} is not pinned"
        assert ":latest" not in image
    assert images["otel-collector"].startswith("otel/opentelemetry-collector-contrib:")
    assert images["jaeger"].startswith("jaegertracing/jaeger:2.")  # Jaeger v2 all-in-one
    assert images["tempo"].startswith("grafana/tempo:3.")  # tempo.yaml is a Tempo 3 config
    assert images["grafana"].startswith("grafana/grafana:")
    assert images["prometheus"].startswith("prom/prometheus:v3.")
    assert images["demo"] == images["servewatch"] == images["install"]
    assert images["demo"].startswith("python:3.11.")


def test_dependencies_name_existing_services(services: dict[str, dict]) -> None:
    for name, svc in services.items():
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown {dep}"
    assert services["servewatch"]["depends_on"]["demo"] == {"condition": "service_healthy"}
    assert services["demo"]["depends_on"]["install"] == {"condition": "service_completed_successfully"}
    assert "healthcheck" in services["demo"]


def test_bind_mounted_files_exist_and_reach_the_configured_paths(services: dict[str, dict]) -> None:
    for name, svc in services.items():
        for source in bind_mounts(svc).values():
            assert (REPO_ROOT / source).exists(), f"{name} mounts missing {source}"
    collector = services["otel-collector"]
    config_flag = next(a for a in collector["command"] if a.startswith("--config="))
    mounted = {(REPO_ROOT / src).resolve(): dst for dst, src in bind_mounts(collector).items()}
    assert mounted[COLLECTOR_CONFIG.resolve()] == config_flag.removeprefix("--config=")
    tempo = services["tempo"]
    mounted = {(REPO_ROOT / src).resolve(): dst for dst, src in bind_mounts(tempo).items()}
    assert tempo["command"] == ["-target=all", f"-config.file={mounted[TEMPO_CONFIG.resolve()]}"]
    grafana_dirs = {(REPO_ROOT / src).resolve(): dst for dst, src in bind_mounts(services["grafana"]).items()}
    assert grafana_dirs[GRAFANA_DATASOURCES.parent.resolve()] == "/etc/grafana/provisioning/datasources"
    assert grafana_dirs[GRAFANA_DASHBOARDS.resolve()] == "/etc/grafana/provisioning/dashboards"
    prometheus = services["prometheus"]
    mounted = {(REPO_ROOT / src).resolve(): dst for dst, src in bind_mounts(prometheus).items()}
    assert f"--config.file={mounted[PROMETHEUS_CONFIG.resolve()]}" in prometheus["command"]
    rules_glob = load_yaml(PROMETHEUS_CONFIG)["rule_files"][0]
    assert PurePosixPath(mounted[PROMETHEUS_RULES.resolve()]).match(rules_glob)


def test_tempo_storage_lives_on_its_volume(services: dict[str, dict], compose: dict) -> None:
    tempo_cfg = load_yaml(TEMPO_CONFIG)
    volume_targets = {v.split(":")[1]: v.split(":")[0] for v in services["tempo"]["volumes"]}
    assert volume_targets["/var/tempo"] in compose["volumes"]
    for path in (tempo_cfg["storage"]["trace"]["wal"]["path"], tempo_cfg["storage"]["trace"]["local"]["path"]):
        assert PurePosixPath("/var/tempo") in PurePosixPath(path).parents


def test_published_ports_match_the_configs(services: dict[str, dict]) -> None:
    collector_ports = otlp_receiver_ports(load_yaml(COLLECTOR_CONFIG))
    tempo_cfg = load_yaml(TEMPO_CONFIG)
    datasources = {ds["type"]: ds for ds in load_yaml(GRAFANA_DATASOURCES)["datasources"]}
    published = {name: published_container_ports(svc.get("ports", [])) for name, svc in services.items()}
    assert published["otel-collector"][collector_ports["grpc"][1]] == 4317
    assert published["otel-collector"][collector_ports["http"][1]] == 4318
    assert published["jaeger"] == {host_port(datasources["jaeger"]["url"])[1]: 16686}
    assert published["tempo"] == {tempo_cfg["server"]["http_listen_port"]: 3200}
    assert published["grafana"] == {3000: 3000}
    assert published["prometheus"] == {9090: 9090}
    # Jaeger's and Tempo's OTLP ports stay internal: the host's 4317 belongs to the collector.
    assert all(4317 not in published[name].values() for name in services if name != "otel-collector")


def test_published_ports_are_loopback_only(services: dict[str, dict]) -> None:
    # Anonymous Grafana admin and the demo's /debug/hang stay off the network.
    entries = [str(port) for svc in services.values() for port in svc.get("ports", [])]
    assert len(entries) == 8
    for entry in entries:
        assert entry.startswith("127.0.0.1:"), entry


def test_collector_exports_to_compose_services(services: dict[str, dict]) -> None:
    collector_cfg = load_yaml(COLLECTOR_CONFIG)
    for ref, exporter in collector_cfg["exporters"].items():
        if "endpoint" in exporter and component_type(ref) != "prometheus":  # a pull exporter listens
            host, _ = host_port(exporter["endpoint"])
            assert host in services, f"{ref} sends to {host}, not a compose service"
    # Jaeger v2 binds its receivers to localhost unless JAEGER_LISTEN_HOST says otherwise.
    assert services["jaeger"]["environment"]["JAEGER_LISTEN_HOST"] == "0.0.0.0"


def test_grafana_allows_anonymous_admin_for_the_local_demo(services: dict[str, dict]) -> None:
    env = services["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Admin"


def test_servewatch_shares_the_demo_pid_and_ipc_namespaces_with_ptrace(services: dict[str, dict]) -> None:
    servewatch = services["servewatch"]
    assert servewatch["pid"] == "service:demo"
    assert servewatch["cap_add"] == ["SYS_PTRACE"]
    # The SDK's step counters are files in /dev/shm, which belongs to the IPC namespace.
    assert servewatch["ipc"] == "service:demo"
    assert services["demo"]["ipc"] == "shareable"
    assert "cap_add" not in services["demo"]


def test_servewatch_watches_the_demo_server_it_starts(services: dict[str, dict]) -> None:
    demo_argv = services["demo"]["command"]
    assert demo_argv[:3] == ["python", "-m", "agent.demo.server"]
    port = int(demo_argv[demo_argv.index("--port") + 1])
    assert demo_argv[demo_argv.index("--host") + 1] == "0.0.0.0"
    assert published_container_ports(services["demo"]["ports"]) == {port: port}
    argv = services["servewatch"]["command"]
    assert argv[:2] == ["servewatch", "run"]
    flags = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert flags == {
        "--health-url": f"http://demo:{port}/health",
        "--metrics-url": f"http://demo:{port}/metrics",
        "--match": "demo::scheduler*",
        # An injected hang becomes an incident in seconds, not after the 300 s default.
        "--watchdog-timeout": "20",
    }
    health_probe = " ".join(services["demo"]["healthcheck"]["test"])
    assert f"http://127.0.0.1:{port}/health" in health_probe


def test_servewatch_resolves_its_env_to_the_collectors_grpc_receiver(services: dict[str, dict]) -> None:
    from exporters.otlp.provider import ExportConfig, build_resource, resolve_destination
    from exporters.otlp.transport import make_sender

    env = {k: str(v) for k, v in services["servewatch"]["environment"].items()}
    destination = resolve_destination(ExportConfig(), environ=env)
    assert destination.protocol == "grpc"
    host, port = host_port(destination.endpoint or "")
    assert host in services
    assert port == otlp_receiver_ports(load_yaml(COLLECTOR_CONFIG))["grpc"][1]
    sender = make_sender(destination.endpoint or "", destination.protocol, insecure=destination.insecure)
    try:
        assert sender.target == f"{host}:{port}"
    finally:
        sender.close()
    resource = build_resource(ExportConfig(), host_name="h", service_instance_id="i", environ=env)
    assert resource.attributes["service.name"] == "servewatch"


def test_demo_server_exports_its_request_spans_to_the_same_collector_as_servewatch(services: dict[str, dict]) -> None:
    from exporters.otlp.provider import ExportConfig, resolve_destination
    from exporters.otlp.sdk_export import tracer_provider_from_env

    demo_env = {k: str(v) for k, v in services["demo"]["environment"].items()}
    agent_env = {k: str(v) for k, v in services["servewatch"]["environment"].items()}
    demo, agent = resolve_destination(ExportConfig(), environ=demo_env), resolve_destination(ExportConfig(), environ=agent_env)
    assert (demo.endpoint, demo.protocol) == (agent.endpoint, agent.protocol) and demo.endpoint
    assert demo_env["OTEL_SERVICE_NAME"] == "servewatch-demo"
    assert "otel-collector" in services["demo"]["depends_on"]
    provider = tracer_provider_from_env("servewatch-demo", environ={**demo_env, "SERVEWATCH_DATA_DIR": ""})
    assert provider is not None
    provider.shutdown()


def test_python_services_install_cpu_torch_then_servewatch_from_a_copy(services: dict[str, dict]) -> None:
    install = services["install"]
    assert "./:/src:ro" in install["volumes"]  # read-only: the build happens in a copy
    script = install["command"][-1]
    lines = [shlex.split(line) for line in script.strip().splitlines()]
    pip_lines = [line for line in lines if line[:2] == ["pip", "install"]]
    assert pip_lines == [
        ["pip", "install", "torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"],
        ["pip", "install", "/tmp/src[torch]"],
    ]
    venv_volume = next(v for v in install["volumes"] if v.endswith(":/opt/venv"))
    for name in ("demo", "servewatch"):
        assert venv_volume in services[name]["volumes"]
        assert services[name]["environment"]["PATH"].startswith("/opt/venv/bin:")
        assert services[name]["environment"]["SERVEWATCH_DATA_DIR"] == "/var/lib/servewatch"


def test_the_collectors_persistent_queues_live_on_its_volume(services: dict[str, dict], compose: dict) -> None:
    collector = services["otel-collector"]
    volumes = {v.split(":")[1]: v.split(":")[0] for v in collector["volumes"]}
    dirs = file_storage_dirs(load_yaml(COLLECTOR_CONFIG))
    assert dirs
    for ref, directory in dirs.items():
        mount = next((t for t in volumes if PurePosixPath(directory) == PurePosixPath(t) or PurePosixPath(t) in PurePosixPath(directory).parents), None)
        assert mount is not None, f"{ref}: {directory} is not on a volume (a container restart would lose the queue)"
        assert volumes[mount] in compose["volumes"], f"{ref}: {volumes[mount]} is not a named volume"
    assert collector["user"] == "0:0"  # a named volume is created owned by root
