"""A fixed load on the demo server, shared by the serving benches.

Owns :class:`LoadGenerator`: ``clients`` threads POST ``/generate`` over plain ``http.client``
(cheap for the client side, which shares the CPUs with the server), either closed-loop (each
client sends its next request as soon as the last one answered) or paced to a total ``rate``.
Every completion is recorded (monotonic end time, latency, ok), so a bench can cut the run into
windows afterwards. Imports the standard library only.
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["LoadGenerator", "WindowStats", "agent_env_of", "bench_workspace", "percentile"]


def bench_workspace(prefix: str) -> tuple[Path, Path, Path, dict[str, str]]:
    """A private work folder for one serving bench: ``(work dir, shm dir, data dir, server environment)``.

    The environment points the SDK at the private shm dir, names the demo service, and drops any
    inherited OTLP endpoint (the bench decides where spans go). The shm dir is a private folder
    in ``/dev/shm`` (tmpfs, the SDK's default and what a real deployment uses), else in the work
    folder. Both folders are removed at exit (logs included: a failing run prints their tail).
    """
    work = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, work, True)
    data = work / "data"
    data.mkdir(mode=0o700)
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        shm = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
        atexit.register(shutil.rmtree, shm, True)
    else:
        shm = work / "shm"
        shm.mkdir(mode=0o700)
    env = {**os.environ, "SERVEWATCH_SHM_DIR": str(shm), "OTEL_SERVICE_NAME": "servewatch-demo"}
    for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        env.pop(k, None)
    return work, shm, data, env


def agent_env_of(env: dict[str, str]) -> dict[str, str]:
    """The environment for the agent watching the bench's server: ``env`` without the server's
    ``OTEL_SERVICE_NAME`` (an agent refuses to ship a span ring that declares the agent's own
    ``service.name``; inheriting the server's name made every bench agent refuse the server's
    spans, and ship none)."""
    return {k: v for k, v in env.items() if k != "OTEL_SERVICE_NAME"}


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


@dataclass(frozen=True)
class WindowStats:
    """Requests completed in one time window."""

    seconds: float
    completed: int
    errors: int
    throughput_rps: float
    p50_s: float
    p99_s: float
    max_s: float


class LoadGenerator:
    """Fixed load on a demo server's ``/generate``.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        clients: concurrent client threads.
        max_new_tokens: tokens per request.
        rate: total requests per second (paced); ``None`` = closed loop.
        timeout_s: per-request timeout, seconds.
    """

    def __init__(self, base_url: str, *, clients: int = 4, max_new_tokens: int = 16, rate: float | None = None,
                 timeout_s: float = 60.0) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.clients = clients
        self.rate = rate
        self.timeout_s = timeout_s
        self.body = json.dumps({"text": "the quick brown fox jumps over the lazy dog", "max_new_tokens": max_new_tokens}).encode()
        self.done: list[tuple[float, float, bool]] = []  # (end monotonic, latency s, ok)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _one(self) -> bool:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request("POST", "/generate", body=self.body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            return resp.status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def _client(self, index: int) -> None:
        period = self.clients / self.rate if self.rate else 0.0
        next_at = time.monotonic() + (period * index / self.clients if period else 0.0)
        while not self._stop.is_set():
            if period:
                delay = next_at - time.monotonic()
                if delay > 0 and self._stop.wait(delay):
                    return
                next_at = max(next_at + period, time.monotonic() - period)
            t0 = time.monotonic()
            ok = self._one()
            t1 = time.monotonic()
            self.done.append((t1, t1 - t0, ok))
            if not ok:
                self._stop.wait(0.2)

    def start(self) -> LoadGenerator:
        for i in range(self.clients):
            t = threading.Thread(target=self._client, args=(i,), name=f"load-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 5)

    def window(self, t0: float, t1: float) -> WindowStats:
        """Stats of the requests that completed in ``[t0, t1)`` (monotonic seconds)."""
        rows = [r for r in list(self.done) if t0 <= r[0] < t1]
        lat = [r[1] for r in rows if r[2]]
        seconds = max(1e-9, t1 - t0)
        return WindowStats(
            seconds=seconds,
            completed=len(lat),
            errors=sum(1 for r in rows if not r[2]),
            throughput_rps=len(lat) / seconds,
            p50_s=percentile(lat, 0.5),
            p99_s=percentile(lat, 0.99),
            max_s=max(lat) if lat else float("nan"),
        )
