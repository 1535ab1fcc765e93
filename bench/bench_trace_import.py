"""Torch-trace import over real trace layouts: our streaming reader vs ``ijson`` vs ``json.load``.

Layouts (``--layouts``), each a real trace made at bench time unless noted:

* ``torch-cpu``, ``torch-stacks``, ``torch-shapes``: ``torch.profiler`` (CPU activity) around
  ``--steps`` training steps of a small MLP, plain, ``with_stack=True`` (adds ``python_function``
  events) and ``record_shapes=True`` (nested ``Input Dims``/``Input type``/``Concrete Inputs``
  args), written by torch's own ``export_chrome_trace`` (bench/_traces.py);
* ``vllm``: a real vLLM 0.32 CPU server (``tests/real``'s fixture, tiny Llama) profiled through
  ``/start_profile`` / ``/stop_profile`` while serving completions: the ``.pt.trace.json.gz`` its
  worker writes (skipped, with the reason, when the real vLLM install is not there or another
  session holds it); made once and kept in ``--trace-cache`` (``~/.cache/servewatch/bench-traces``)
  for later runs (``--fresh-vllm`` makes a new one); ``--vllm-trace PATH`` uses a given trace;
* ``synthetic``: the generator this bench used before (GPU-style kernels with heavy args,
  ``baseTimeNanoseconds`` after ``traceEvents``), ``--size-mb``.

Each measurement runs in a fresh subprocess (so its peak RSS is its own; the modules are imported
before its clock starts) and records its CPU seconds (user + system, what a loaded machine moves
least), wall seconds and peak RSS (the interpreter with its imports, ~35 MiB, included):

* ``walk``: read every event of ``traceEvents`` once: ours (:func:`exporters.mirror.torch_trace.iter_trace_events`,
  flat ``args`` skipped by a regex) against ``ijson.items(f, "traceEvents.item", use_float=True)``
  (yajl2 C backend) doing the same walk;
* ``import``: the whole :func:`~exporters.mirror.torch_trace.import_torch_trace` into a counting sink,
  with its reader as shipped and with the ijson walk swapped in (same filter, nesting, spans);
* ``json.load``: the whole file parsed into memory, then a pass over the events (the naive way).

Prints, per layout, events per CPU-second and peak RSS of each, and the ratios ours / ijson and
ours / json.load (medians of ``--repeat`` fresh runs; spread = min..max of the per-run ratios).
The torch and synthetic traces are written to a temporary folder and removed.

    python bench/bench_trace_import.py [--layouts torch-cpu,torch-stacks,torch-shapes,vllm,synthetic]
        [--steps 200] [--size-mb 64] [--repeat 3] [--vllm-trace PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import emit_result

#: File name of the cached vLLM trace in ``--trace-cache``.
VLLM_CACHED = "vllm-0.32-cpu-worker.pt.trace.json.gz"
LAYOUTS = ("torch-cpu", "torch-stacks", "torch-shapes", "vllm", "synthetic")
MODES = ("walk-ours", "walk-ijson", "import-ours", "import-ijson", "json.load")

_EVENT = """  {{
    "ph": "X", "cat": "{cat}", "name": "{name}", "pid": {pid}, "tid": {tid},
    "ts": {ts:.3f}, "dur": {dur:.3f},
    "args": {{
      "External id": {eid},"Record function id": 0, "Sequence number": {eid}, "Fwd thread id": 0, "Ev Idx": {eid}
    }}
  }},
"""
_KERNEL = """  {{
    "ph": "X", "cat": "kernel", "name": "{name}", "pid": 0, "tid": 7,
    "ts": {ts:.3f}, "dur": {dur:.3f},
    "args": {{
      "External id": {eid},
      "queued": 0, "device": 0, "context": 1,
      "stream": 7, "correlation": {eid},
      "registers per thread": 128,
      "shared memory": 0,
      "blocks per SM": 2.5,
      "warps per SM": 10.0,
      "grid": [132, 1, 1],
      "block": [256, 1, 1],
      "est. achieved occupancy %": 25
    }}
  }},
"""
_FLOW = """  {{
    "ph": "s", "id": {eid}, "pid": {pid}, "tid": {tid}, "ts": {ts:.3f},
    "cat": "ac2g", "name": "ac2g"
  }},
"""


def write_synthetic(path: Path, size_bytes: int) -> int:
    """Write a synthetic torch-style trace of about ``size_bytes``; returns its event count."""
    pid = tid = 4242
    ts = 5_115_197_297_000.0
    eid = events = written = step = 0
    with path.open("w") as f:
        head = '{\n  "schemaVersion": 1,\n  "deviceProperties": [],\n  "traceEvents": [\n'
        f.write(head)
        written += len(head)
        while written < size_bytes:
            parts = [_EVENT.format(cat="user_annotation", name=f"ProfilerStep#{step}", pid=pid, tid=tid, ts=ts, dur=2000.0, eid=eid)]
            t = ts + 5
            for layer in range(24):
                eid += 1
                parts.append(_EVENT.format(cat="python_function", name=f"nn.Module: Linear_{layer}", pid=pid, tid=tid, ts=t, dur=70.0, eid=eid))
                parts.append(_EVENT.format(cat="cpu_op", name="aten::linear", pid=pid, tid=tid, ts=t + 1, dur=60.0, eid=eid))
                parts.append(_EVENT.format(cat="cpu_op", name="aten::t", pid=pid, tid=tid, ts=t + 2, dur=3.0, eid=eid))
                parts.append(_EVENT.format(cat="cpu_op", name="aten::addmm", pid=pid, tid=tid, ts=t + 6, dur=50.0, eid=eid))
                parts.append(_EVENT.format(cat="cuda_runtime", name="cudaLaunchKernel", pid=pid, tid=tid, ts=t + 10, dur=8.0, eid=eid))
                parts.append(_FLOW.format(pid=pid, tid=tid, ts=t + 10, eid=eid))
                parts.append(_KERNEL.format(name="sm90_xmma_gemm_bf16bf16_bf16f32", ts=t + 30, dur=25.0, eid=eid))
                t += 80
            chunk = "".join(parts)
            f.write(chunk)
            written += len(chunk)
            events += 1 + 24 * 7
            ts += 2100
            step += 1
        f.write(f'  {{\n    "ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": {ts:.3f}\n  }}\n'
                f'  ],\n  "baseTimeNanoseconds": 1790857026000000000,\n  "traceName": "{path.name}"\n}}\n')
        events += 1
    return events


# --- the child: one measurement in a fresh interpreter ------------------------------------------


def ijson_trace_events(path: str | Path, *, chunk_chars: int = 1 << 20, on_field: Any = None) -> Iterator[list[dict[str, Any]]]:
    """The ijson walk, in :func:`exporters.mirror.torch_trace.iter_trace_events`' shape (batches of
    event dicts; ``args`` kept as ijson builds them). Opens the file as the module does (no
    symlink, regular files only; gzip by name)."""
    import gzip

    import ijson

    from exporters.mirror.torch_trace import _open_binary

    raw = _open_binary(Path(path))
    f = gzip.GzipFile(fileobj=raw, mode="rb") if str(path).endswith(".gz") else raw
    try:
        batch: list[dict[str, Any]] = []
        for ev in ijson.items(f, "traceEvents.item", use_float=True, buf_size=1 << 16):
            batch.append(ev)
            if len(batch) >= 1024:
                yield batch
                batch = []
        if batch:
            yield batch
    finally:
        f.close()
        raw.close()


def _child(mode: str, path: str) -> None:
    import gzip

    import ijson  # noqa: F401 - every import before the clock starts: the walk is measured, not the imports
    from opentelemetry.sdk.resources import Resource

    import exporters.mirror.torch_trace as tt

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    extra: dict[str, object] = {}
    if mode == "json.load":
        opener: Any = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            doc = json.load(f)
        events = sum(1 for ev in doc["traceEvents"] if isinstance(ev, dict))
    elif mode.startswith("walk-"):
        walk = tt.iter_trace_events if mode == "walk-ours" else ijson_trace_events
        events = sum(len(batch) for batch in walk(path))
    else:
        if mode == "import-ijson":
            tt.iter_trace_events = ijson_trace_events  # type: ignore[assignment]

        class CountingSink:
            resource = Resource.get_empty()
            n = 0

            def emit(self, span: object) -> None:
                self.n += 1

        sink = CountingSink()
        stats = tt.import_torch_trace(path, sink, trace_id=1, parent_span_id=1)  # type: ignore[arg-type]
        events = stats.events
        extra = {"spans": sink.n, "kept": stats.kept}
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({
        "mode": mode, "events": events, "wall_s": time.perf_counter() - t0,
        "cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **extra,
    }))  # fmt: skip


def _run(mode: str, path: Path, timeout_s: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(path)], capture_output=True, text=True,
                         timeout=timeout_s, check=True, cwd=ROOT, stdin=subprocess.DEVNULL)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# --- the bench ---------------------------------------------------------------------------------


def _make(layout: str, work: Path, args: argparse.Namespace) -> tuple[Path | None, str]:
    from _traces import TORCH_LAYOUTS, torch_trace, vllm_trace

    if layout in TORCH_LAYOUTS:
        path = torch_trace(layout, work / f"{layout}.pt.trace.json", steps=args.steps)
        return path, f"torch 2.13 profiler, {args.steps} training steps of a small MLP"
    if layout == "vllm":
        if args.vllm_trace is not None:
            return args.vllm_trace, f"given: {args.vllm_trace}"
        cached = args.trace_cache / VLLM_CACHED
        if cached.is_file() and not args.fresh_vllm:
            made = time.strftime("%Y-%m-%d %H:%M", time.localtime(cached.stat().st_mtime))
            return cached, f"real vLLM 0.32 CPU worker trace made {made}, cached in {args.trace_cache}"
        args.trace_cache.mkdir(parents=True, exist_ok=True)
        path, how = vllm_trace(work / "vllm.pt.trace.json.gz")
        if path is None:
            return None, how
        os.replace(path, cached)  # the next run reuses it: making one needs the real server (minutes, a machine-wide lock)
        return cached, how
    n = write_synthetic(work / "synthetic.trace.json", int(args.size_mb * 2**20))
    return work / "synthetic.trace.json", f"synthetic generator, {n} events"


def _eps(r: dict[str, Any]) -> float:
    return float(r["events"]) / max(float(r["cpu_s"]), 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--steps", type=int, default=200, help="profiled training steps of the torch layouts")
    ap.add_argument("--size-mb", type=float, default=64.0, help="synthetic trace size, MiB")
    ap.add_argument("--repeat", type=int, default=3, help="fresh runs of each mode per layout")
    ap.add_argument("--vllm-trace", type=Path, default=None, help="use this vLLM trace instead of making one")
    ap.add_argument("--trace-cache", type=Path, default=Path.home() / ".cache" / "servewatch" / "bench-traces",
                    help="folder keeping the vLLM trace the bench made, for the next run (default ~/.cache/servewatch/bench-traces)")
    ap.add_argument("--fresh-vllm", action="store_true", help="make a new vLLM trace even if one is cached")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per-run limit, SECONDS")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return
    layouts = [name for name in args.layouts.split(",") if name]
    bad = [name for name in layouts if name not in LAYOUTS]
    if bad:
        ap.error(f"--layouts: unknown layout(s) {', '.join(bad)}")
    with tempfile.TemporaryDirectory(prefix="sw-bench-trace-") as tmp:
        for layout in layouts:
            path, how = _make(layout, Path(tmp), args)
            if path is None:
                print(f"{layout}: skipped ({how})")
                continue
            size = path.stat().st_size
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for r in range(args.repeat):
                for mode in MODES[r % len(MODES):] + MODES[: r % len(MODES)]:
                    runs[mode].append(_run(mode, path, args.timeout))
            events = runs["walk-ours"][0]["events"]
            print(f"{layout}: {size / 2**20:.1f} MiB{' (gzip)' if path.name.endswith('.gz') else ''}, {events} events ({how})")
            for mode in MODES:
                rs = runs[mode]
                print(f"  {mode:<13} {statistics.median(_eps(x) for x in rs):>10,.0f} events/CPU-s"
                      f"  CPU {statistics.median(x['cpu_s'] for x in rs):6.2f} s  wall {statistics.median(x['wall_s'] for x in rs):6.2f} s"
                      f"  peak RSS {statistics.median(x['peak_rss_bytes'] for x in rs) / 2**20:7.1f} MiB"
                      + (f"  spans {rs[0]['spans']}" if "spans" in rs[0] else ""))
            if runs["import-ours"][0].get("spans") != runs["import-ijson"][0].get("spans"):
                print(f"  NOTE: the two readers gave different span counts: {runs['import-ours'][0]['spans']} vs {runs['import-ijson'][0]['spans']}")
            for ours, base, name in (("walk-ours", "walk-ijson", "ijson (yajl2_c), same walk"),
                                     ("import-ours", "import-ijson", "import_torch_trace over the ijson walk"),
                                     ("import-ours", "json.load", "json.load of the whole file")):
                speed = [_eps(o) / _eps(b) for o, b in zip(runs[ours], runs[base], strict=True)]
                rss = [o["peak_rss_bytes"] / b["peak_rss_bytes"] for o, b in zip(runs[ours], runs[base], strict=True)]
                print(f"  {ours} / {base}: events per CPU-second {statistics.median(speed):.2f}x ({min(speed):.2f}..{max(speed):.2f}),"
                      f" peak RSS {statistics.median(rss):.2f}x")
                if ours == "walk-ours":  # printed above; the table keeps the import's rows
                    continue
                emit_result(f"trace import [{layout}]: {ours}, events per CPU-second", ours=statistics.median(_eps(x) for x in runs[ours]),
                            baseline=statistics.median(_eps(x) for x in runs[base]), baseline_name=name, unit="events/CPU-s",
                            ratio=statistics.median(speed), spread=(min(speed), max(speed)), note=f"{size / 2**20:.0f} MiB, {args.repeat} runs")
                emit_result(f"trace import [{layout}]: {ours}, peak RSS", ours=statistics.median(x["peak_rss_bytes"] for x in runs[ours]) / 2**20,
                            baseline=statistics.median(x["peak_rss_bytes"] for x in runs[base]) / 2**20, baseline_name=name, unit="MiB",
                            ratio=statistics.median(rss), spread=(min(rss), max(rss)), note=f"{args.repeat} runs")
            path.unlink(missing_ok=True) if path.parent == Path(tmp) else None


if __name__ == "__main__":
    main()
