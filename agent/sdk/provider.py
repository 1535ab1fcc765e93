"""The OpenTelemetry tracer provider the SDK's spans are made with.

Owns :func:`set_tracer_provider`, :func:`tracer_provider` and :func:`get_tracer`
(:mod:`agent.sdk.tracing` re-exports them): the server's own provider when it gives one, else
opentelemetry-api's global one; and :func:`set_service_name` / :func:`service_name`, the
``service.name`` the server declares for the spans an agent ships when no provider with a
resource says it (``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` still win). Imports opentelemetry-api lazily, the standard library otherwise.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TRACER_NAME", "get_tracer", "service_name", "set_service_name", "set_tracer_provider", "tracer_provider"]

#: Instrumentation scope name of request spans.
TRACER_NAME = "servewatch.sdk"
_tracer_provider: Any = None
_service_name = ""


def set_service_name(name: str) -> None:
    """Declare the server's ``service.name`` for the spans an agent ships from it (the span
    ring's resource), used when no tracer provider with a resource is installed and neither
    ``OTEL_SERVICE_NAME`` nor ``OTEL_RESOURCE_ATTRIBUTES`` names one (without it such spans
    arrive as ``unknown_service``). Call it before the first span. ``""`` forgets it."""
    global _service_name
    _service_name = str(name).strip()


def service_name() -> str:
    """What :func:`set_service_name` declared (``""``: nothing)."""
    return _service_name


def set_tracer_provider(provider: Any) -> None:
    """Use ``provider`` (an OTel ``TracerProvider``) for SDK spans instead of the global one.

    ``None`` goes back to opentelemetry-api's global provider (a no-op one unless the server
    installed an SDK).
    """
    global _tracer_provider
    _tracer_provider = provider


def get_tracer() -> Any:
    """The tracer SDK spans are made with (``servewatch.sdk`` scope)."""
    from opentelemetry import trace

    return trace.get_tracer(TRACER_NAME, tracer_provider=_tracer_provider)


def tracer_provider() -> Any:
    """The provider :func:`set_tracer_provider` installed, ``None`` for the global one."""
    return _tracer_provider
