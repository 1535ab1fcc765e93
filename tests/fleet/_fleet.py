"""Helpers for fleet tests: token files, free ports, running agents with the API on."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from agent.incidents.manager import IncidentRecord
from agent.runtime.agent import Agent
from agent.runtime.settings import load_settings

TOKEN = "s3cret-token-for-tests"


def token_file(folder: Path, token: str = TOKEN, mode: int = 0o600) -> Path:
    path = folder / "api-token"
    path.write_text(token + "\n")
    os.chmod(path, mode)
    return path


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def settings_for(tmp_path: Path, host: str, port: int, **more: Any):
    base: dict[str, Any] = {
        "data_dir": tmp_path / host,
        "host_name": host,
        "api": {"enabled": True, "host": "127.0.0.1", "port": port, "token_file": token_file(tmp_path)},
        "export": {"metrics": False},
        # loopback peers over plain HTTP: the token may go there (tests of TLS-only peers unset it)
        "fleet": {"allow_insecure_peers": True},
    }
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return load_settings(base)


@asynccontextmanager
async def running_agent(settings: Any) -> AsyncIterator[tuple[Agent, list[IncidentRecord]]]:
    """The agent running (API bound) for the body of the ``async with``; stopped after it."""
    records: list[IncidentRecord] = []
    agent = Agent(settings, on_incident=records.append)
    async with anyio.create_task_group() as tg:
        await tg.start(agent.run)
        try:
            yield agent, records
        finally:
            agent.stop()
