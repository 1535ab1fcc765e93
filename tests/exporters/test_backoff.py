"""agent.model.backoff: jittered doubling up to a cap, at least the collector's retry delay."""

from __future__ import annotations

import random

import pytest

from agent.model.backoff import Backoff


def test_waits_double_up_to_the_cap_within_the_jitter_and_reset_starts_over() -> None:
    backoff = Backoff(0.25, 2.0, jitter=0.2, rng=random.Random(7))
    waits = [backoff.next_delay_s() for _ in range(6)]
    for wait, base in zip(waits, [0.25, 0.5, 1.0, 2.0, 2.0, 2.0], strict=True):
        assert base * 0.8 <= wait <= base * 1.2
    backoff.reset()
    assert 0.2 <= backoff.next_delay_s() <= 0.3


def test_the_servers_retry_delay_is_the_least_wait() -> None:
    backoff = Backoff(0.25, 2.0)
    assert backoff.next_delay_s(retry_after_s=30.0) == 30.0
    assert backoff.next_delay_s(retry_after_s=0.0) >= 0.4  # a shorter request does not cut our own wait


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(0, 1)
