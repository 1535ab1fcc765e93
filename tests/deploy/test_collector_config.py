"""otel-collector/: the collector config, Tempo's config and Grafana's datasources agree.

The demo chain is servewatch -> otel-collector:4317 -> jaeger:4317 / tempo:4317, read back by
Grafana from tempo:3200 and jaeger:16686. Each hop's port is asserted against the config of the
component on the other side, not against a copy of the number.
"""

from __future__ import annotations

import copy

import pytest

from tests.deploy import (
    COLLECTOR_CONFIG,
    GRAFANA_DATASOURCES,
    TEMPO_CONFIG,
    collector_problems,
    component_type,
    host_port,
    iter_exporters,
    load_yaml,
    otlp_receiver_ports,
)


@pytest.fixture(scope="module")
def collector() -> dict:
    return load_yaml(COLLECTOR_CONFIG)


@pytest.fixture(scope="module")
def tempo() -> dict:
    return load_yaml(TEMPO_CONFIG)


@pytest.fixture(scope="module")
def datasources() -> dict[str, dict]:
    doc = load_yaml(GRAFANA_DATASOURCES)
    assert doc["apiVersion"] == 1
    return {ds["type"]: ds for ds in doc["datasources"]}


def test_collector_pipelines_reference_only_defined_components_and_use_all(collector: dict) -> None:
    assert collector_problems(collector) == []
    assert set(collector["service"]["pipelines"]) == {"traces", "metrics"}


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda c: c["service"]["pipelines"]["traces"]["exporters"].append("otlp_grpc/zipkin"),
         "pipeline 'traces' uses undefined exporter 'otlp_grpc/zipkin'"),
        (lambda c: c["exporters"].update({"otlp_grpc/unused": {"endpoint": "x:4317"}}),
         "exporter 'otlp_grpc/unused' is defined but not used"),
        (lambda c: c["service"]["pipelines"]["metrics"]["processors"].reverse(),
         "pipeline 'metrics': memory_limiter is not the first processor (['batch', 'memory_limiter'])"),
        (lambda c: c["service"]["extensions"].append("pprof"), "service uses undefined extension 'pprof'"),
        (lambda c: c["receivers"].update({"otlp/2": c["receivers"]["otlp"]}), "receiver 'otlp/2' is defined but not used"),
    ],
)
def test_collector_lint_reports_broken_configs(collector: dict, mutate, expected: str) -> None:
    broken = copy.deepcopy(collector)
    mutate(broken)
    assert collector_problems(broken) == [expected]


def test_memory_limiter_runs_first_then_batch_in_every_pipeline(collector: dict) -> None:
    for name, pipeline in collector["service"]["pipelines"].items():
        assert [component_type(p) for p in pipeline["processors"]] == ["memory_limiter", "batch"], name
    limiter = collector["processors"]["memory_limiter"]
    assert limiter["check_interval"] == "1s"
    assert 0 < limiter["spike_limit_percentage"] < limiter["limit_percentage"] <= 90


def test_otlp_receivers_listen_on_all_interfaces_at_the_sdk_default_ports(collector: dict) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        DEFAULT_ENDPOINT as HTTP_DEFAULT,
    )

    ports = otlp_receiver_ports(collector)
    # Recent collectors bind to localhost unless told otherwise: unreachable from other containers.
    assert ports == {"grpc": ("0.0.0.0", 4317), "http": ("0.0.0.0", 4318)}
    assert host_port(HTTP_DEFAULT)[1] == ports["http"][1]


def test_otlp_receiver_grpc_port_is_the_grpc_sdk_default(collector: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    exporter = OTLPSpanExporter()
    try:
        # The gRPC exporter keeps its default inline; what it resolved to is the fact to match.
        assert host_port(exporter._endpoint) == ("localhost", otlp_receiver_ports(collector)["grpc"][1])
    finally:
        exporter.shutdown()


def test_traces_go_to_jaeger_tempo_and_debug_over_insecure_otlp_grpc(collector: dict, tempo: dict) -> None:
    traces = collector["service"]["pipelines"]["traces"]
    assert traces["exporters"] == ["otlp_grpc/jaeger", "otlp_grpc/tempo", "debug"]
    targets = {ref: host_port(cfg["endpoint"]) for ref, cfg in iter_exporters(collector, "otlp_grpc")}
    tempo_grpc_port = otlp_receiver_ports(tempo["distributor"]["receivers"]["otlp"]["protocols"])["grpc"][1]
    # Jaeger v2 all-in-one takes OTLP/gRPC on its own default port 4317 (not configurable here).
    assert targets == {"otlp_grpc/jaeger": ("jaeger", 4317), "otlp_grpc/tempo": ("tempo", tempo_grpc_port)}
    for ref, cfg in iter_exporters(collector, "otlp_grpc"):
        assert cfg["tls"] == {"insecure": True}, ref
    assert collector["service"]["pipelines"]["metrics"]["exporters"] == ["debug"]


def test_collector_uses_current_component_names(collector: dict) -> None:
    types = {component_type(ref) for kind in ("receivers", "processors", "exporters") for ref in collector[kind]}
    # `logging` was removed for `debug`; `otlp`/`otlphttp` exporters are deprecated aliases.
    assert types == {"otlp", "memory_limiter", "batch", "otlp_grpc", "debug"}
    assert not {component_type(ref) for ref in collector["exporters"]} & {"logging", "otlp", "otlphttp"}
    assert collector["exporters"]["debug"]["verbosity"] in {"basic", "normal", "detailed"}


def test_tempo_takes_otlp_grpc_on_4317_and_serves_its_api_on_3200(tempo: dict) -> None:
    assert tempo["server"]["http_listen_port"] == 3200
    protocols = tempo["distributor"]["receivers"]["otlp"]["protocols"]
    assert otlp_receiver_ports(protocols) == {"grpc": ("0.0.0.0", 4317)}
    storage = tempo["storage"]["trace"]
    assert storage["backend"] == "local"
    assert storage["wal"]["path"].startswith("/var/tempo/") and storage["local"]["path"].startswith("/var/tempo/")
    # Tempo 3 dropped the ingester/compactor blocks; a 2.x config would fail to start.
    assert not {"ingester", "compactor", "ingester_client"} & set(tempo)


def test_grafana_datasources_point_at_tempo_api_and_jaeger_ui(datasources: dict[str, dict], tempo: dict) -> None:
    assert set(datasources) == {"tempo", "jaeger"}
    assert datasources["tempo"]["url"] == f"http://tempo:{tempo['server']['http_listen_port']}"
    assert host_port(datasources["jaeger"]["url"]) == ("jaeger", 16686)
    assert [ds["type"] for ds in datasources.values() if ds.get("isDefault")] == ["tempo"]
    assert len({ds["uid"] for ds in datasources.values()}) == 2
    for ds in datasources.values():
        assert ds["access"] == "proxy"
