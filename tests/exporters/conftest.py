"""Fixtures for the export tests: a real OTLP receiver (gRPC + HTTP) per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.otlp_receiver import OtlpReceiver, otlp_receiver_fixture


@pytest.fixture
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A started :class:`~tests.otlp_receiver.OtlpReceiver`, stopped at teardown even on failure."""
    yield from otlp_receiver_fixture()


@pytest.fixture(params=["grpc", "http/protobuf"])
def protocol(request: pytest.FixtureRequest) -> str:
    """Each OTLP protocol in turn."""
    return request.param
