"""Fixtures of the SDK tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent.sdk import tracing


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """The SDK's tracer records into memory for the test, and is the no-op tracer again after."""
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    tracing.set_tracer_provider(provider)
    yield exp
    tracing.set_tracer_provider(None)
    provider.shutdown()
