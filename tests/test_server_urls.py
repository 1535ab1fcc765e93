"""Several servers' URLs, each tied to its server by its port: ``--health-url`` / ``--metrics-url``
given several times (or ``url`` as a list, ``urls``), one watcher each, and a URL's failure opens
its own server's incident with its own server's processes (real servers: tests/programs/engine_server.py,
vLLM 0.32's process shape, under a real ``servewatch run``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agent.host.registry import BuildContext
from agent.runtime.settings import load_settings
from agent.watchers import WATCHERS
from agent.watchers.group import WatcherGroup
from agent.watchers.health import HealthWatcher
from agent.watchers.watchdog import Watchdog
from tests.test_targeting import CLI, cli_env, manifests

ENGINE_SERVER = Path(__file__).with_name("programs") / "engine_server.py"
A, B = "http://127.0.0.1:8001/health", "http://127.0.0.1:8002/health"


@pytest.mark.parametrize(
    ("given", "url", "urls"),
    [
        ({"url": A}, A, ()),  # the single-value form, as before
        ({"url": [A, B]}, A, (B,)),  # a repeated --health-url, a TOML array
        ({"url": [A]}, A, ()),
        ({"url": A, "urls": [B]}, A, (B,)),
        ({"url": [A, B], "urls": ["http://127.0.0.1:9/health"]}, A, (B,)),  # the list is the whole set
        ({}, None, ()),
    ],
)
def test_url_lists_split_into_url_and_urls(given: dict, url: str | None, urls: tuple[str, ...]) -> None:
    settings = load_settings({"health": given, "metrics": {k: [u.replace("/health", "/metrics") for u in v]
                                                           if isinstance(v, list) else v.replace("/health", "/metrics")
                                                           for k, v in given.items()}})
    assert (settings.health.url, settings.health.urls) == (url, urls)
    assert settings.health.all_urls == tuple(u for u in (url, *urls) if u)
    assert settings.metrics.all_urls == tuple(u.replace("/health", "/metrics") for u in settings.health.all_urls)
    # every server URL the agent probes (the verdict ties a URL-only trigger to its port's server)
    assert set(settings.agent_values().server_urls) == {*settings.health.all_urls, *settings.metrics.all_urls}


def test_env_single_value_and_json_list_still_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVEWATCH_HEALTH__URL", A)
    monkeypatch.setenv("SERVEWATCH_METRICS__URLS", json.dumps(["http://127.0.0.1:8002/metrics"]))
    settings = load_settings({})
    assert settings.health.all_urls == (A,)
    assert settings.metrics.all_urls == ("http://127.0.0.1:8002/metrics",)
    with pytest.raises(Exception, match="metrics.urls"):
        load_settings({"metrics": {"url": ["http://127.0.0.1:1/metrics", "ftp://x/metrics"]}})


def test_several_urls_build_one_watcher_each_with_its_own_status_row() -> None:
    settings = load_settings({"health": {"url": [A, B]}, "metrics": {"url": ["http://127.0.0.1:8001/metrics",
                                                                             "http://127.0.0.1:8002/metrics"]}})
    built = WATCHERS.build(settings, BuildContext(agent=settings.agent_values()))
    health, metrics = built["health"], built["metrics"]
    assert isinstance(health, WatcherGroup) and isinstance(metrics, WatcherGroup)
    assert [w.config.url for w in health.watchers] == [A, B]
    assert all(isinstance(w, HealthWatcher) for w in health.watchers)
    assert [w.status.name for w in health.watchers] == ["health 127.0.0.1:8001", "health 127.0.0.1:8002"]
    assert all(isinstance(w, Watchdog) for w in metrics.watchers)
    assert [w.status.name for w in metrics.watchers if w.status] == ["metrics 127.0.0.1:8001", "metrics 127.0.0.1:8002"]
    one = WATCHERS.build(load_settings({"health": {"url": A}}), BuildContext(agent=settings.agent_values()))
    assert isinstance(one["health"], HealthWatcher) and one["health"].status.name == "health"  # as before


def _start_engine_server(spawn, python: str, folder: Path) -> dict:
    folder.mkdir()
    ready = folder / "ready.json"
    proc = spawn([python, str(ENGINE_SERVER), "--ready-file", str(ready), "--tp", "2", "--max-lifetime-s", "120"],
                 stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "engine server did not start"
        time.sleep(0.05)
    return json.loads(ready.read_text())


def _wait(check, timeout_s: float, what) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what()
        time.sleep(0.1)


@pytest.mark.slow
def test_each_health_url_fails_into_its_own_servers_incident(spawn, python, tmp_path: Path) -> None:
    servers = [_start_engine_server(spawn, python, tmp_path / name) for name in ("a", "b")]
    a, b = servers
    pids = [p for s in servers for p in (s["engine"], *s["workers"])]
    env = {**cli_env(tmp_path), "SERVEWATCH_HEALTH__INTERVAL_S": "0.5", "SERVEWATCH_HEALTH__UNHEALTHY_AFTER": "2",
           "SERVEWATCH_HEALTH__TIMEOUT_S": "1"}
    argv = [*CLI, "run", *(x for p in pids for x in ("--pid", str(p))), "--no-pyspy", "--cooldown", "300",
            "--data-dir", "data", "--duration", "100"]
    for s in servers:
        argv += ["--health-url", f"http://127.0.0.1:{s['port']}/health"]
    err = tmp_path / "run.err"
    stopped: list[int] = []
    try:
        with err.open("wb") as err_fh:
            run = spawn(argv, stdout=subprocess.PIPE, stderr=err_fh, cwd=tmp_path, env=env)
        said = err.read_text
        for s in servers:
            _wait(lambda s=s: f"health 127.0.0.1:{s['port']}: 200 OK" in said(), 60, said)
        _wait(lambda: "; 2 servers: " in said(), 30, said)
        for s in (b, a):  # b's frontend stops answering, then a's: two servers, two health incidents
            os.kill(s["frontend"], signal.SIGSTOP)
            stopped.append(s["frontend"])
            count = len(stopped)
            _wait(lambda count=count: len([m for m in manifests(tmp_path / "data") if m["state"] == "closed"]) == count,
                  60, said)
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=60)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    done = manifests(tmp_path / "data")
    assert [m["trigger"] for m in done] == ["health", "health"], said()
    by_url = {next(s["port"] for s in servers if f":{s['port']}/" in m["detail"]): m for m in done}
    for s in servers:  # its own server's processes, its frontend included (the server's tree: issue 32 item 1)
        own = {s["frontend"], s["engine"], *s["workers"]}
        assert {t["pid"] for t in by_url[s["port"]]["targets"]} == own, (s, by_url[s["port"]]["targets"])
    assert "suppressed by cooldown" not in said(), said()
