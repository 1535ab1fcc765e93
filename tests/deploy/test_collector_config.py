"""otel-collector/: the collector config, Tempo's config and Grafana's datasources agree.

The demo chain is servewatch -> otel-collector:4317 -> jaeger:4317 / tempo:4317, read back by
Grafana from tempo:3200 and jaeger:16686; servewatch's own metrics -> the collector's Prometheus
exporter -> Prometheus (alert "servewatch is losing spans") -> Grafana. Each hop's port is
asserted against the config of the component on the other side, not against a copy of the number.
"""

from __future__ import annotations

import copy

import pytest

from tests.deploy import (
    COLLECTOR_CONFIG,
    GRAFANA_DASHBOARDS,
    GRAFANA_DATASOURCES,
    PROMETHEUS_CONFIG,
    PROMETHEUS_RULES,
    TEMPO_CONFIG,
    collector_problems,
    component_type,
    host_port,
    iter_exporters,
    load_yaml,
    otlp_receiver_ports,
    persistent_queue_problems,
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
        (lambda c: c["service"]["pipelines"]["metrics"].update(processors=[]),
         "pipeline 'metrics': memory_limiter is not the first processor ([])"),
        (lambda c: c["service"]["extensions"].append("pprof"), "service uses undefined extension 'pprof'"),
        (lambda c: c["receivers"].update({"otlp/2": c["receivers"]["otlp"]}), "receiver 'otlp/2' is defined but not used"),
    ],
)
def test_collector_lint_reports_broken_configs(collector: dict, mutate, expected: str) -> None:
    broken = copy.deepcopy(collector)
    mutate(broken)
    assert collector_problems(broken) == [expected]


def test_memory_limiter_is_the_only_processor_of_every_pipeline(collector: dict) -> None:
    # no batch processor: it would hold spans the receiver acknowledged in memory, in front of
    # the persistent queues (servewatch's requests are batched already)
    for name, pipeline in collector["service"]["pipelines"].items():
        assert [component_type(p) for p in pipeline["processors"]] == ["memory_limiter"], name
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
    assert collector["service"]["pipelines"]["metrics"]["exporters"] == ["prometheus"]


def test_collector_uses_current_component_names(collector: dict) -> None:
    types = {component_type(ref) for kind in ("receivers", "processors", "exporters") for ref in collector[kind]}
    # `logging` was removed for `debug`; `otlp`/`otlphttp` exporters are deprecated aliases.
    assert types == {"otlp", "memory_limiter", "otlp_grpc", "debug", "prometheus"}
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


def test_grafana_datasources_point_at_tempo_api_jaeger_ui_and_prometheus(datasources: dict[str, dict], tempo: dict) -> None:
    assert set(datasources) == {"tempo", "jaeger", "prometheus"}
    assert datasources["tempo"]["url"] == f"http://tempo:{tempo['server']['http_listen_port']}"
    assert host_port(datasources["jaeger"]["url"]) == ("jaeger", 16686)
    assert host_port(datasources["prometheus"]["url"]) == ("prometheus", 9090)
    assert [ds["type"] for ds in datasources.values() if ds.get("isDefault")] == ["tempo"]
    assert len({ds["uid"] for ds in datasources.values()}) == 3
    for ds in datasources.values():
        assert ds["access"] == "proxy"


def test_backend_exporters_queue_on_disk_and_never_give_up(collector: dict) -> None:
    assert persistent_queue_problems(collector) == []
    # the linter itself: a memory-only queue, a missing extension, retries that stop, a batch in front
    broken = copy.deepcopy(collector)
    broken["exporters"]["otlp_grpc/jaeger"]["sending_queue"].pop("storage")
    broken["exporters"]["otlp_grpc/tempo"]["retry_on_failure"]["max_elapsed_time"] = "300s"
    broken["service"]["extensions"].remove("file_storage/queue")
    broken["service"]["pipelines"]["traces"]["processors"].append("batch")
    assert persistent_queue_problems(broken) == [
        "exporter 'otlp_grpc/jaeger': sending_queue is not persistent (no storage)",
        "exporter 'otlp_grpc/tempo': storage 'file_storage/queue' is not in service.extensions",
        "exporter 'otlp_grpc/tempo': retries give up (retry_on_failure.max_elapsed_time is not 0s)",
        "pipeline 'traces': a batch processor holds acknowledged data in memory before the queue",
    ]


def test_prometheus_scrapes_the_collectors_prometheus_exporter() -> None:
    collector = load_yaml(COLLECTOR_CONFIG)
    (ref, exporter), = iter_exporters(collector, "prometheus")
    assert collector["service"]["pipelines"]["metrics"]["exporters"] == [ref]
    assert exporter["resource_to_telemetry_conversion"]["enabled"] is True  # host.name is a label
    prometheus = load_yaml(PROMETHEUS_CONFIG)
    targets = [t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"otel-collector:{host_port(exporter['endpoint'])[1]}"]
    assert prometheus["rule_files"] == ["/etc/prometheus/rules/*.yaml"]


def _servewatch_series() -> dict[str, set[str]]:
    """The Prometheus series servewatch's own metrics become (through the collector's Prometheus
    exporter: dots to underscores, ``_total`` on counters), each with its label names and values
    ``label=value``: read from the real instruments, recording into an in-memory reader."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from exporters.otlp.metrics import Metrics
    from exporters.otlp.processor import ExportStatistics
    from exporters.otlp.shipper import SpanShipper

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics = Metrics(provider)
    metrics.watch_export(lambda: ExportStatistics(*([0] * 10)))
    metrics.watch_metric_export(lambda: type("S", (), {"exported": 0, "spooled": 0, "replayed": 0, "lost": 0})())

    class _NoProcessor:
        def on_end(self, span: object) -> None:
            return None

    SpanShipper(_NoProcessor(), host_name="h").register_metrics(provider)  # type: ignore[arg-type]
    series: dict[str, set[str]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                name = metric.name.replace(".", "_")
                if getattr(metric.data, "is_monotonic", False):
                    name += "_total"
                labels = series.setdefault(name, set())
                for point in metric.data.data_points:
                    labels.update(f"{k.replace('.', '_')}={v}" for k, v in point.attributes.items())
    provider.shutdown()
    return series


def _selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """``name{label=~"a|b"}`` selectors of a PromQL expression: (metric, {label: regex})."""
    import re

    out = []
    for name, body in re.findall(r"([a-z_][a-z0-9_]*)\{([^}]*)\}", expr):
        matchers = dict(re.findall(r'([a-z_][a-z0-9_]*)=~?"([^"]*)"', body))
        out.append((name, matchers))
    return out


def test_the_alert_servewatch_is_losing_spans_names_series_servewatch_exports() -> None:
    import re

    rules = load_yaml(PROMETHEUS_RULES)
    (group,) = rules["groups"]
    (rule,) = group["rules"]
    assert rule["alert"] == "ServewatchLosingSpans"
    assert "servewatch is losing spans" in rule["annotations"]["summary"]
    series = _servewatch_series()
    selectors = _selectors(rule["expr"])
    assert {name for name, _ in selectors} == {
        "servewatch_export_spans_total", "servewatch_spans_channel_total", "servewatch_export_metric_points_total",
    }
    for name, matchers in selectors:
        assert name in series, f"{name} is not a series servewatch exports ({sorted(series)})"
        for label, pattern in matchers.items():
            values = {lv.split("=", 1)[1] for lv in series[name] if lv.startswith(label + "=")}
            assert values, f"{name} has no label {label}"
            for wanted in pattern.split("|"):
                assert wanted in values, f"{name}{{{label}}} never takes {wanted!r} ({sorted(values)})"
            lost = {v for v in values if re.fullmatch(pattern, v)}
            assert not lost & {"exported", "spooled", "replayed", "shipped", "fallback"}, (name, lost)
    assert "host_name" in rule["expr"]  # one alert per host (the resource attribute host.name)


def test_the_grafana_dashboard_graphs_series_servewatch_exports() -> None:
    import json

    provider = load_yaml(GRAFANA_DASHBOARDS / "dashboards.yaml")
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/provisioning/dashboards"
    dashboard = json.loads((GRAFANA_DASHBOARDS / "servewatch-delivery.json").read_text())
    series = _servewatch_series()
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs
    for expr in exprs:
        for name, _ in _selectors(expr) or [(expr.split("(")[-1].split(")")[0], {})]:
            assert name in series, f"the dashboard graphs {name}, not a series servewatch exports"
    uids = {t["datasource"]["uid"] for panel in dashboard["panels"] for t in panel["targets"]}
    assert uids == {ds["uid"] for ds in load_yaml(GRAFANA_DATASOURCES)["datasources"] if ds["type"] == "prometheus"}
