"""End-to-end span export: servewatch's lossless processor vs the SDK's default BatchSpanProcessor.

Spans are created with ``agent.sdk.request_span`` (a real TracerProvider, gen_ai attributes) and
exported over OTLP to a loopback receiver (``tests/otlp_receiver.py``: real gRPC / HTTP servers,
in a separate process) in this same run. Two scenarios, each for both setups:

1. burst: ``--spans`` request spans as fast as they can be made, receiver up. Reports spans/s from
   the first span to the last one acknowledged (``provider.shutdown()`` returned) and how many
   never arrived. The default setup (queue 2048, batch 512, 5 s delay) drops the overflow.
2. outage: receiver down during the burst and at exit. Reports how long exit (shutdown) took, then
   brings the receiver back and reports how many spans arrive: servewatch's next run replays its
   spool; the default setup has nothing left to send.

Targets (issue 5): servewatch loses 0 at >= 1.0x the default's throughput; with the receiver down
it exits in <= 3 s and delivers 100% once it is back. Printed, not asserted. ``--tls`` runs the
same with the receiver serving TLS from a generated private CA (issue 11): both setups verify it
(the SDK exporters with the CA's credentials, servewatch with ``TlsFiles``). Runs of the two
setups alternate (default, servewatch, default, ...) so a shared machine's noise hits both.

Usage: ``python bench/bench_export.py [--spans N] [--protocol grpc|http/protobuf] [--repeat R] [--tls]``
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit_result
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from agent.sdk import tracing
from exporters.otlp.processor import LosslessSpanProcessor
from exporters.otlp.spool import Spool
from exporters.otlp.transport import TlsFiles, make_sender
from tests.tls_certs import TlsMaterial, make_tls_material

RESOURCE = Resource.create({"service.name": "bench-server"})
REPO = Path(__file__).resolve().parent.parent


class RemoteReceiver:
    """``tests/otlp_receiver.py`` in its own process (so it does not compete for our GIL)."""

    def __init__(self, tls: TlsMaterial | None = None) -> None:
        self.tls = tls
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.otlp_receiver", *(["--tls", str(tls.ca_cert.parent)] if tls else [])],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        grpc_port, http_port = self._readline(30.0).split()
        scheme = "https" if tls else "http"
        self.grpc_endpoint = f"{scheme}://127.0.0.1:{grpc_port}"
        self.http_endpoint = f"{scheme}://127.0.0.1:{http_port}"

    def _readline(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError("receiver did not answer")
        return self.proc.stdout.readline().strip()

    def _ask(self, command: str, timeout_s: float = 30.0) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._readline(timeout_s)

    def endpoint(self, protocol: str) -> str:
        return self.grpc_endpoint if protocol == "grpc" else self.http_endpoint

    def start(self) -> None:
        self._ask("start")

    def stop(self) -> None:
        self._ask("stop")

    def clear(self) -> None:
        self._ask("clear")

    @property
    def span_count(self) -> int:
        return int(self._ask("count"))

    def wait_for_spans(self, count: int, timeout_s: float) -> int:
        return int(self._ask(f"wait {count} {timeout_s}", timeout_s + 30.0))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._ask("quit", 5.0)
            except (TimeoutError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)


def _default_processor(receiver: RemoteReceiver, protocol: str) -> SpanProcessor:
    tls = receiver.tls
    if protocol == "grpc":
        if tls is not None:
            import grpc

            creds = grpc.ssl_channel_credentials(root_certificates=tls.ca_cert.read_bytes())
            exporter = GrpcSpanExporter(endpoint=receiver.grpc_endpoint, credentials=creds)
        else:
            exporter = GrpcSpanExporter(endpoint=receiver.grpc_endpoint, insecure=True)
    else:
        session = None
        if tls is not None:
            import requests

            # requests lets REQUESTS_CA_BUNDLE (set on some hosts) override the session's CA file
            session = requests.Session()
            session.trust_env = False
        exporter = HttpSpanExporter(endpoint=receiver.http_endpoint + "/v1/traces",
                                    certificate_file=str(tls.ca_cert) if tls is not None else None, session=session)
    return BatchSpanProcessor(exporter)  # the SDK's default settings


def _servewatch_processor(receiver: RemoteReceiver, protocol: str, spool_dir: Path) -> LosslessSpanProcessor:
    tls = TlsFiles(ca_file=str(receiver.tls.ca_cert)) if receiver.tls is not None else None
    return LosslessSpanProcessor(make_sender(receiver.endpoint(protocol), protocol, tls=tls), spool=Spool(spool_dir, max_bytes=1 << 30))


def _burst(provider: TracerProvider, n: int) -> None:
    tracing.set_tracer_provider(provider)
    try:
        for i in range(n):
            with tracing.request_span(f"req-{i}", model="llama-3-8b", max_tokens=128, input_tokens=42) as handle:
                handle.set_output_tokens(7)
    finally:
        tracing.set_tracer_provider(None)


def run_burst(kind: str, receiver: RemoteReceiver, protocol: str, n: int, workdir: Path) -> tuple[float, int]:
    """Returns (delivered spans per second, spans lost)."""
    receiver.clear()
    processor = _default_processor(receiver, protocol) if kind == "default" else _servewatch_processor(receiver, protocol, workdir / f"spool-{kind}-{time.monotonic_ns()}")
    provider = TracerProvider(resource=RESOURCE, shutdown_on_exit=False)
    provider.add_span_processor(processor)
    started = time.perf_counter()
    _burst(provider, n)
    provider.shutdown()  # flushes: the default's force_flush, servewatch's bounded drain
    elapsed_s = time.perf_counter() - started
    receiver.wait_for_spans(n, timeout_s=2.0)  # anything still in flight on the wire
    delivered = receiver.span_count
    return delivered / elapsed_s, n - delivered


def run_outage(kind: str, receiver: RemoteReceiver, protocol: str, n: int, workdir: Path) -> tuple[float, int, float]:
    """Returns (exit seconds with the receiver down, spans delivered once it is back, seconds to deliver them)."""
    receiver.clear()
    receiver.stop()
    spool_dir = workdir / f"spool-outage-{kind}-{time.monotonic_ns()}"
    processor = _default_processor(receiver, protocol) if kind == "default" else _servewatch_processor(receiver, protocol, spool_dir)
    provider = TracerProvider(resource=RESOURCE, shutdown_on_exit=False)
    provider.add_span_processor(processor)
    _burst(provider, n)
    started = time.perf_counter()
    provider.shutdown()
    exit_s = time.perf_counter() - started
    receiver.start()
    back = time.perf_counter()
    if kind == "servewatch":
        next_run = _servewatch_processor(receiver, protocol, spool_dir)  # the agent's next start
        receiver.wait_for_spans(n, timeout_s=60.0)
        next_run.shutdown(3.0)
    else:
        receiver.wait_for_spans(n, timeout_s=1.0)  # nothing is left to send; give stragglers a second
    return exit_s, receiver.span_count, time.perf_counter() - back


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=10_000, help="spans per burst")
    parser.add_argument("--protocol", choices=("grpc", "http/protobuf"), default="grpc")
    parser.add_argument("--repeat", type=int, default=3, help="burst runs per setup; the median is reported")
    parser.add_argument("--skip-default-outage", action="store_true", help="skip the default setup's slow outage run")
    parser.add_argument("--tls", action="store_true", help="the receiver serves TLS (generated private CA); both setups verify it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # the SDK logs every failed export; we count instead

    pki_dir = tempfile.TemporaryDirectory(prefix="servewatch-bench-pki-")
    receiver = RemoteReceiver(make_tls_material(Path(pki_dir.name)) if args.tls else None)
    try:
        with tempfile.TemporaryDirectory(prefix="servewatch-bench-") as tmp:
            workdir = Path(tmp)
            print(f"end-to-end export, {args.spans} request spans per burst, OTLP {args.protocol}"
                  f"{' over TLS (private CA)' if args.tls else ''} to a loopback receiver")
            rates: dict[str, list[float]] = {"default": [], "servewatch": []}
            lost: dict[str, list[int]] = {"default": [], "servewatch": []}
            for _ in range(args.repeat):
                for kind in ("default", "servewatch"):
                    rate, missing = run_burst(kind, receiver, args.protocol, args.spans, workdir)
                    rates[kind].append(rate)
                    lost[kind].append(missing)
            print("\nburst (receiver up)            spans/s (median)   lost per burst (each run)")
            for kind in ("default", "servewatch"):
                print(f"  {kind:<28} {statistics.median(rates[kind]):>14,.0f}   {lost[kind]}")
            ratio = statistics.median(rates["servewatch"]) / statistics.median(rates["default"])
            print(f"  throughput servewatch/default: {ratio:.2f}x   (target >= 1.0x with 0 lost)")
            paired = [b / a for a, b in zip(rates["default"], rates["servewatch"], strict=True)]
            default_name = "the OTel SDK's BatchSpanProcessor at its defaults (queue 2048, batch 512)"
            emit_result(f"span export burst ({args.spans} spans, OTLP {args.protocol}), delivered spans/s", ours=statistics.median(rates["servewatch"]),
                        baseline=statistics.median(rates["default"]), baseline_name=default_name, unit="spans/s", spread=(min(paired), max(paired)),
                        note=f"{args.repeat} paired runs; target >= 1x")
            emit_result(f"span export burst ({args.spans} spans), spans lost", ours=max(lost["servewatch"]), baseline=max(lost["default"]),
                        baseline_name=default_name, unit="spans", ratio=None, note="worst run; target 0")

            print("\noutage (receiver down during burst and exit)   exit s   delivered once back   s to deliver")
            kinds = ("servewatch",) if args.skip_default_outage else ("default", "servewatch")
            outage: dict[str, tuple[float, int]] = {}
            for kind in kinds:
                exit_s, delivered, deliver_s = run_outage(kind, receiver, args.protocol, args.spans, workdir)
                pct = 100.0 * delivered / args.spans
                outage[kind] = (exit_s, delivered)
                print(f"  {kind:<44} {exit_s:>6.2f}   {delivered:>7} ({pct:5.1f}%)   {deliver_s:>10.2f}")
            if "default" in outage:
                default_name = "the OTel SDK's BatchSpanProcessor at its defaults"
                emit_result("collector down: exit (shutdown) time", ours=outage["servewatch"][0], baseline=outage["default"][0],
                            baseline_name=default_name, unit="s", note="target <= 3 s")
                emit_result("collector down: spans delivered once it is back", ours=100.0 * outage["servewatch"][1] / args.spans,
                            baseline=100.0 * outage["default"][1] / args.spans, baseline_name=default_name, unit="%", note="target 100 %")
            print("  targets: servewatch exit <= 3 s and 100% delivered once back")
    finally:
        receiver.close()
        pki_dir.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
