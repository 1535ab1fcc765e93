"""The OpenTelemetry tracer provider the SDK's spans are made with.

Owns :func:`set_tracer_provider`, :func:`tracer_provider` and :func:`get_tracer`
(:mod:`agent.sdk.tracing` re-exports them): the server's own provider when it gives one, else
opentelemetry-api's global one. Imports opentelemetry-api lazily, the standard library otherwise.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TRACER_NAME", "get_tracer", "set_tracer_provider", "tracer_provider"]

#: Instrumentation scope name of request spans.
TRACER_NAME = "servewatch.sdk"
_tracer_provider: Any = None


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
