"""Structural checks of the demo stack and the deployment examples (no docker, no collector here).

Helpers shared by the deploy tests: where the files are, how to read them, and a small linter for
OpenTelemetry Collector configs (the collector's own ``validate`` command cannot run here).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "compose.yaml"
COLLECTOR_CONFIG = REPO_ROOT / "otel-collector" / "config.yaml"
TEMPO_CONFIG = REPO_ROOT / "otel-collector" / "tempo.yaml"
GRAFANA_DATASOURCES = REPO_ROOT / "otel-collector" / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
GRAFANA_DASHBOARDS = REPO_ROOT / "otel-collector" / "grafana" / "provisioning" / "dashboards"
PROMETHEUS_CONFIG = REPO_ROOT / "otel-collector" / "prometheus.yaml"
PROMETHEUS_RULES = REPO_ROOT / "otel-collector" / "prometheus-rules.yaml"
KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"

#: Component kinds a collector config defines (each a mapping of ``type[/name]`` -> settings).
COMPONENT_KINDS = ("receivers", "processors", "exporters", "connectors", "extensions")
#: The kinds a pipeline lists.
PIPELINE_KINDS = ("receivers", "processors", "exporters")

#: ``repo:tag`` with a version-like tag (``0.162.0``, ``v0.5.20``, ``3.11.17-slim-trixie``).
PINNED_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/-]*:v?\d+(\.\d+)+(-[A-Za-z0-9.-]+)?(@sha256:[0-9a-f]{64})?$")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def component_type(component_id: str) -> str:
    """``otlp_grpc/jaeger`` -> ``otlp_grpc`` (the collector's ``type[/name]`` id)."""
    return component_id.split("/", 1)[0]


def collector_problems(config: dict[str, Any]) -> list[str]:
    """Every reference problem in a collector config, all at once (empty when consistent).

    Checks, as the collector does at startup: each component a pipeline or ``service.extensions``
    lists is defined; and, beyond what it enforces, each defined component is used somewhere and
    ``memory_limiter`` is the first processor of every pipeline.
    """
    problems: list[str] = []
    service = config.get("service") or {}
    pipelines = service.get("pipelines") or {}
    if not pipelines:
        problems.append("service.pipelines is empty")
    connectors = set(config.get("connectors") or {})
    used: dict[str, set[str]] = {kind: set() for kind in COMPONENT_KINDS}
    for name, pipeline in pipelines.items():
        for kind in PIPELINE_KINDS:
            listed = list(pipeline.get(kind) or [])
            if kind != "processors" and not listed:
                problems.append(f"pipeline {name!r} has no {kind}")
            for ref in listed:
                # A connector is an exporter of one pipeline and a receiver of another.
                defining = "connectors" if kind != "processors" and ref in connectors else kind
                used[defining].add(ref)
                if ref not in (config.get(defining) or {}):
                    problems.append(f"pipeline {name!r} uses undefined {kind[:-1]} {ref!r}")
        processors = list(pipeline.get("processors") or [])
        if not processors or component_type(processors[0]) != "memory_limiter":
            problems.append(f"pipeline {name!r}: memory_limiter is not the first processor ({processors})")
    for ref in service.get("extensions") or []:
        used["extensions"].add(ref)
        if ref not in (config.get("extensions") or {}):
            problems.append(f"service uses undefined extension {ref!r}")
    for kind in COMPONENT_KINDS:
        for ref in sorted(set(config.get(kind) or {}) - used[kind]):
            problems.append(f"{kind[:-1]} {ref!r} is defined but not used")
    return problems


def iter_exporters(config: dict[str, Any], type_: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for ref, settings in (config.get("exporters") or {}).items():
        if component_type(ref) == type_:
            yield ref, settings or {}


def host_port(endpoint: str) -> tuple[str, int]:
    """``0.0.0.0:4317`` / ``http://jaeger:16686`` -> (host, port)."""
    parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
    assert parts.hostname is not None and parts.port is not None, f"no host:port in {endpoint!r}"
    return parts.hostname, parts.port


def otlp_receiver_ports(config: dict[str, Any], receiver: str = "otlp") -> dict[str, tuple[str, int]]:
    """{protocol: (host, port)} of an OTLP receiver (collector or Tempo layout)."""
    protocols = config["receivers"][receiver]["protocols"] if "receivers" in config else config
    return {proto: host_port(settings["endpoint"]) for proto, settings in protocols.items()}


def published_container_ports(ports: Iterable[str | int | dict[str, Any]]) -> dict[int, int]:
    """Compose ``ports`` (short or long syntax) -> {container port: host port}."""
    out: dict[int, int] = {}
    for entry in ports:
        if isinstance(entry, dict):
            out[int(entry["target"])] = int(entry.get("published", entry["target"]))
            continue
        spec = str(entry).split("/", 1)[0]
        fields = spec.split(":")
        out[int(fields[-1])] = int(fields[-2]) if len(fields) >= 2 else int(fields[-1])
    return out


#: Exporters that push to another collector or a backend: each must queue on disk.
PUSH_EXPORTERS = ("otlp_grpc", "otlp_http", "loadbalancing", "load_balancing")


def persistent_queue_problems(config: dict[str, Any]) -> list[str]:
    """Every way a collector config could lose data it acknowledged, all at once (empty: none).

    Each exporter that pushes to another collector or a backend (:data:`PUSH_EXPORTERS`) has a
    ``sending_queue`` whose ``storage`` is a ``file_storage`` extension the service runs, and
    retries that never give up (``max_elapsed_time: 0s``); no pipeline feeding such an exporter
    has a ``batch`` processor before it unless a ``tail_sampling`` (which holds traces in memory
    anyway) is there too.
    """
    problems: list[str] = []
    extensions = set((config.get("service") or {}).get("extensions") or [])
    pushing = set()
    for ref, settings in (config.get("exporters") or {}).items():
        if component_type(ref) not in PUSH_EXPORTERS:
            continue
        pushing.add(ref)
        queue = (settings or {}).get("sending_queue") or {}
        storage = queue.get("storage")
        if not queue.get("enabled") or not storage:
            problems.append(f"exporter {ref!r}: sending_queue is not persistent (no storage)")
        elif component_type(storage) != "file_storage" or storage not in (config.get("extensions") or {}):
            problems.append(f"exporter {ref!r}: storage {storage!r} is not a defined file_storage extension")
        elif storage not in extensions:
            problems.append(f"exporter {ref!r}: storage {storage!r} is not in service.extensions")
        retry = (settings or {}).get("retry_on_failure") or {}
        if not retry.get("enabled") or str(retry.get("max_elapsed_time")) not in ("0", "0s"):
            problems.append(f"exporter {ref!r}: retries give up (retry_on_failure.max_elapsed_time is not 0s)")
    for name, pipeline in ((config.get("service") or {}).get("pipelines") or {}).items():
        types = [component_type(p) for p in pipeline.get("processors") or []]
        if set(pipeline.get("exporters") or []) & pushing and "batch" in types and "tail_sampling" not in types:
            problems.append(f"pipeline {name!r}: a batch processor holds acknowledged data in memory before the queue")
    return problems


def file_storage_dirs(config: dict[str, Any]) -> dict[str, str]:
    """{file_storage extension: its directory} of a collector config."""
    return {
        ref: settings["directory"]
        for ref, settings in (config.get("extensions") or {}).items()
        if component_type(ref) == "file_storage"
    }
