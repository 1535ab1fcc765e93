"""Issue 24 item 1, proved: a real ``servewatch run`` agent SIGKILLed at >= 50 random moments of
real stall incidents (py-spy dumps, verdict, bundle, write-ahead spans), against a real OTLP
receiver over gRPC and HTTP, with ``servewatch export`` run between some lives: every span the
incident manifests record (roots and actions) reaches the collector, and each exactly once but
for the documented at-least-once window (an acknowledgement that arrived while the agent was
being killed), at most one duplicated request per kill. See ``tests/kill_loop.py``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.kill_loop import KillLoop
from tests.otlp_receiver import OtlpReceiver
from tests.programs import fake_server

KILLS = int(__import__("os").environ.get("KILL_LOOP_KILLS", "52"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_the_agent_mid_incident_loses_no_recorded_span(
    otlp_receiver: OtlpReceiver, tmp_path: Path, spawn, python: str
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    data = tmp_path / "data"
    server = fake_server.start(spawn, env={**KillLoop.target_env(shm)}, python=python)
    loop = KillLoop(data_dir=data, receiver=otlp_receiver, server=server, shm_dir=shm, rng=random.Random(2024),
                    export_every=7)
    for _ in range(KILLS):
        loop.life()
    result = loop.finish()
    assert result.kills == KILLS
    assert result.incidents >= KILLS and result.expected >= 2 * KILLS
    assert result.lost == [], f"{len(result.lost)} of {result.expected} recorded spans never reached the collector"
    assert result.interrupted > 0  # the kills did land mid-incident
    assert result.duplicated <= result.kills, result  # at most the one request in flight at each kill (one group here)
