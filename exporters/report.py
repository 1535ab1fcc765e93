"""The incident report: one self-contained HTML page drawn from an :class:`IncidentTimeline`.

Owns :func:`render_report_html` and :func:`write_report`. The page needs no network and loads
nothing: CSS is inline, the timeline is inline SVG (one bar per action, placed by its start offset
from the incident's open and as wide as its duration, labelled with action, pid, outcome and
duration), there is no script, and a Content-Security-Policy ``default-src 'none'`` forbids any
fetch. Sections: summary, timeline (plus the trace spans when span files were found), stacks per
process (every thread and frame of the py-spy JSON, hung frame highlighted), CUDA coredumps,
profiles, in-flight requests (never prompt text), artifacts and warnings. Every string from the
bundle — titles, frames, details, paths — is HTML-escaped.

Like everything in ``exporters/``, it mirrors the bundle and decides nothing.

Imports the standard library, :mod:`agent.events` (names), :mod:`agent.fsutil`, :mod:`agent.security` (control characters), :mod:`exporters.bundle`
(the model read from a bundle, the one loader ``timeline`` uses too) and :mod:`exporters.timeline`'s
shared formatters.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from agent.events import Action, Trigger
from agent.fsutil import atomic_write_text
from agent.manifest import stack_errors
from agent.security import strip_control
from exporters.bundle import ActionRow, IncidentTimeline, ProcessStacks, SpanRow
from exporters.timeline import format_size, verdict_headline

__all__ = ["CSP", "render_report_html", "report_summary", "write_report"]

#: The page's Content-Security-Policy: nothing may be fetched; only inline styles apply.
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"

# SVG geometry, in CSS pixels.
_GUTTER_PX = 300  # left column with the row names
_PLOT_PX = 760  # drawing area for the bars
_RIGHT_PX = 40
_ROW_PX = 24
_BAR_PX = 16
_AXIS_PX = 28
_MIN_BAR_PX = 2.0
_CHAR_PX = 6.6  # rough width of one 11px monospace character, to place labels

_OUTCOME_CLASS = {
    "ok": "ok",
    "timed_out": "warn",
    "skipped": "dim",
    "not_armed": "dim",
    "already_stopped": "dim",
    "unsupported": "na",
    "not_python": "na",
    "missing_tool": "na",
}

_STYLE = """
:root { --ok:#2e7d32; --warn:#e0a000; --bad:#c62828; --dim:#9e9e9e; --na:#8e24aa; --span:#1565c0;
        --fg:#1d2330; --muted:#5f6b7a; --line:#d9dee5; --bg:#ffffff; --panel:#f5f7fa; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 1180px; padding: 20px 24px 40px; color: var(--fg); background: var(--bg);
       font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
h1 { font-size: 20px; margin: 0 0 10px; } h2 { font-size: 16px; margin: 28px 0 8px;
     border-bottom: 1px solid var(--line); padding-bottom: 4px; } h3 { font-size: 14px; margin: 14px 0 6px; }
code, .mono, td.num, svg text { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; }
dl.summary { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 0;
             background: var(--panel); padding: 10px 14px; border-radius: 6px; }
dl.summary dt { font-weight: 600; color: var(--muted); } dl.summary dd { margin: 0; word-break: break-all; }
.trigger { font-weight: 700; text-transform: uppercase; color: var(--bad); }
.trigger.manual { color: var(--span); }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: var(--panel); font-weight: 600; } td.num { text-align: right; white-space: nowrap; }
td.path { word-break: break-all; font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; }
.outcome { font-weight: 700; } .outcome.ok { color: var(--ok); } .outcome.warn { color: #a86f00; }
.outcome.bad { color: var(--bad); } .outcome.dim { color: var(--dim); } .outcome.na { color: var(--na); }
.missing { color: var(--bad); }
svg.timeline { display: block; background: var(--panel); border-radius: 6px; margin-bottom: 10px; }
svg .bar rect.ok { fill: var(--ok); } svg .bar rect.warn { fill: var(--warn); } svg .bar rect.bad { fill: var(--bad); }
svg .bar rect.dim { fill: var(--dim); } svg .bar rect.na { fill: var(--na); } svg .bar rect.span { fill: var(--span); }
svg .bar rect.span.bad { fill: var(--bad); }
svg text { font-size: 11px; fill: var(--fg); } svg .row-name { fill: var(--fg); } svg .bar-label { fill: var(--fg); }
svg .bar-label.inside { fill: #ffffff; } svg .bar-label.inside.warn, svg .bar-label.inside.dim { fill: var(--fg); }
svg .tick { stroke: var(--line); } svg .tick-label { fill: var(--muted); font-size: 10px; }
svg .closed { stroke: var(--bad); stroke-dasharray: 4 3; }
.process { border: 1px solid var(--line); border-radius: 6px; padding: 4px 12px 8px; margin: 10px 0; }
.process h3 .title { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-weight: 400; }
p.hung { margin: 4px 0; } p.hung code { background: #fff3cd; padding: 1px 4px; border-radius: 3px; }
details.thread { margin: 4px 0; } details.thread summary { cursor: pointer; font-family: ui-monospace, monospace; }
ol.frames { margin: 2px 0 6px; padding-left: 34px; font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; }
ol.frames li.hung { background: #fff3cd; font-weight: 700; outline: 1px solid #e0a000; }
ol.frames .loc { color: var(--muted); }
.badge { display: inline-block; font-size: 11px; padding: 0 6px; border-radius: 8px; background: var(--line); margin-left: 4px; }
.badge.active { background: #c8e6c9; } .badge.gil { background: #bbdefb; }
.warning { color: #a86f00; } footer { margin-top: 30px; color: var(--muted); font-size: 12px; }
"""


def _e(value: object) -> str:
    """HTML-escape anything (quotes too: values also land in attributes)."""
    return html.escape("" if value is None else str(value), quote=True)


def _outcome_class(outcome: str) -> str:
    return _OUTCOME_CLASS.get(outcome, "bad")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _tick_step_ms(extent_ms: float) -> float:
    """A 1/2/5 x 10^k step giving about 8 ticks over ``extent_ms``."""
    raw = max(extent_ms, 1e-3) / 8
    power = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if raw <= mult * power:
            return mult * power
    return 10 * power


class _Bar:
    """One row of a timeline chart."""

    __slots__ = ("css", "data", "duration_s", "label", "name", "start_s", "tooltip")

    def __init__(self, name: str, label: str, start_s: float, duration_s: float, css: str,
                 data: dict[str, str], tooltip: str) -> None:
        self.name = name
        self.label = label
        self.start_s = start_s
        self.duration_s = duration_s
        self.css = css
        self.data = data
        self.tooltip = tooltip


def _svg_chart(bars: Sequence[_Bar], extent_s: float, *, svg_id: str, label: str,
               closed_s: float | None = None) -> str:
    extent_ms = max(extent_s * 1e3, 1e-3)
    step_ms = _tick_step_ms(extent_ms)
    width = _GUTTER_PX + _PLOT_PX + _RIGHT_PX
    height = _AXIS_PX + _ROW_PX * max(len(bars), 1) + 8
    scale = _PLOT_PX / extent_ms  # px per ms

    out = [(f'<svg class="timeline" id="{_e(svg_id)}" role="img" aria-label="{_e(label)}" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}">')]
    ticks = int(extent_ms // step_ms) + 1
    for i in range(ticks):
        x = _GUTTER_PX + i * step_ms * scale
        out.append(f'<line class="tick" x1="{x:.1f}" y1="{_AXIS_PX - 6}" x2="{x:.1f}" y2="{height - 4}"/>')
        out.append(f'<text class="tick-label" x="{x:.1f}" y="{_AXIS_PX - 10}" text-anchor="middle">'
                   f'{_e(f"{i * step_ms:g} ms")}</text>')
    if closed_s is not None:
        x = _GUTTER_PX + closed_s * 1e3 * scale
        out.append(f'<line class="closed" x1="{x:.1f}" y1="{_AXIS_PX - 6}" x2="{x:.1f}" y2="{height - 4}">'
                   "<title>incident closed</title></line>")
    for row, bar in enumerate(bars):
        y = _AXIS_PX + row * _ROW_PX
        x = _GUTTER_PX + max(bar.start_s, 0.0) * 1e3 * scale
        w = max(bar.duration_s * 1e3 * scale, _MIN_BAR_PX)
        data = " ".join(f'data-{_e(k)}="{_e(v)}"' for k, v in bar.data.items())
        label_px = len(bar.label) * _CHAR_PX
        label_css = "bar-label"
        if x + w + 6 + label_px <= width:  # after the bar
            lx, anchor = x + w + 6, "start"
        elif w >= label_px + 8:  # inside the bar
            lx, anchor, label_css = x + 4, "start", f"bar-label inside {bar.css}"
        else:  # before the bar
            lx, anchor = x - 6, "end"
        out.append(
            f'<g class="bar" {data}><title>{_e(bar.tooltip)}</title>'
            f'<text class="row-name" x="6" y="{y + _BAR_PX - 3}">{_e(bar.name)}</text>'
            f'<rect class="{_e(bar.css)}" x="{x:.1f}" y="{y}" width="{w:.1f}" height="{_BAR_PX}" rx="2"/>'
            f'<text class="{_e(label_css)}" x="{lx:.1f}" y="{y + _BAR_PX - 3}" text-anchor="{anchor}">{_e(bar.label)}</text>'
            "</g>"
        )
    out.append("</svg>")
    return "".join(out)


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _action_bars(actions: Iterable[ActionRow]) -> list[_Bar]:
    bars = []
    for a in actions:
        if a.start_offset_s is None:
            continue
        pid = "" if a.pid is None else f" pid {a.pid}"
        who = f" {_short(a.title, 22)}" if a.title else ""
        bars.append(_Bar(
            name=_short(f"{a.action}{pid}{who}", 42),
            label=f"{a.action}{pid} · {a.outcome} · {_ms(a.duration_s)} ms",
            start_s=a.start_offset_s,
            duration_s=a.duration_s,
            css=_outcome_class(a.outcome),
            data={"action": a.action, "pid": "" if a.pid is None else str(a.pid), "outcome": a.outcome,
                  "start-ms": f"{a.start_offset_s * 1e3:.1f}", "duration-ms": f"{a.duration_s * 1e3:.1f}"},
            tooltip=f"{a.action}{pid} {a.title}\n+{_ms(a.start_offset_s)} ms for {_ms(a.duration_s)} ms: "
                    f"{a.outcome}\n{a.detail}",
        ))
    return bars


def _span_bars(spans: Iterable[SpanRow]) -> list[_Bar]:
    by_id = {s.span_id: s for s in spans}
    bars = []
    for s in spans:
        depth, parent = 0, by_id.get(s.parent_span_id)
        while parent is not None and depth < 8:
            depth, parent = depth + 1, by_id.get(parent.parent_span_id)
        status = {0: "unset", 1: "ok", 2: "error"}.get(s.status_code, str(s.status_code))
        bars.append(_Bar(
            name=_short("\u00a0\u00a0" * depth + s.name, 42),
            label=f"{s.name} · {_ms(s.duration_s)} ms" + (" · error" if s.status_code == 2 else ""),
            start_s=s.start_offset_s,
            duration_s=s.duration_s,
            css="span bad" if s.status_code == 2 else "span",
            data={"span": s.name, "span-id": s.span_id, "status": status,
                  "start-ms": f"{s.start_offset_s * 1e3:.1f}", "duration-ms": f"{s.duration_s * 1e3:.1f}"},
            tooltip=f"{s.name} ({s.span_id})\n+{_ms(s.start_offset_s)} ms for {_ms(s.duration_s)} ms, {status}",
        ))
    return bars


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, table_id: str, num: Sequence[int] = ()) -> str:
    """A table; ``rows`` hold already-escaped cell HTML; columns in ``num`` are right-aligned numbers."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = "".join(f'<td class="num">{c}</td>' if i in num else f"<td>{c}</td>" for i, c in enumerate(row))
        body.append(f"<tr>{cells}</tr>")
    return f'<table id="{_e(table_id)}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _outcome_html(outcome: str) -> str:
    return f'<span class="outcome {_outcome_class(outcome)}">{_e(outcome)}</span>'


def _size_html(size_bytes: int | None) -> str:
    if size_bytes is None:
        return '<span class="missing">missing</span>'
    return f'<span title="{size_bytes:,} bytes">{_e(format_size(size_bytes))}</span>'


def _pid(pid: int | None) -> str:
    return "-" if pid is None else str(pid)


def _stacks_html(s: ProcessStacks, tl: IncidentTimeline) -> str:
    parts = [(f'<article class="process" id="pid-{s.pid}" data-pid="{s.pid}">'
             f'<h3>pid {s.pid} <span class="title">{_e(s.title)}</span></h3>')]
    if s.hung_frame:
        source = "py-spy summary" if s.hung_frame_source == "attribute" else "read from the stacks"
        parts.append(f'<p class="hung">Hung frame: <code class="hung-frame">{_e(s.hung_frame)}</code> '
                     f'<span class="badge">{_e(source)}</span></p>')
    dumps = [a for a in tl.actions if a.action == Action.PYSPY_DUMP and a.pid == s.pid]
    if not s.threads:
        why = "; ".join(f"{a.outcome}: {a.detail}" if a.detail else a.outcome for a in dumps) or "no py-spy dump"
        parts.append(f'<p class="no-stacks">No stacks: {_e(why)}</p>')
        if s.summary:
            items = "".join(f"<li>{_e(line)}</li>" for line in s.summary)
            parts.append(f'<p>Summary from the span:</p><ol class="frames summary">{items}</ol>')
    if s.error:
        parts.append(f'<p class="warning">Stacks file unreadable: {_e(s.error)}</p>')
    threads = sorted(s.threads, key=lambda t: t.thread_id != s.hung_thread_id)  # the hung thread first
    for t in threads:
        hung_thread = t.thread_id == s.hung_thread_id
        badges = "".join([
            '<span class="badge active">active</span>' if t.active else '<span class="badge">idle</span>',
            '<span class="badge gil">holds GIL</span>' if t.owns_gil else "",
            '<span class="badge">hung thread</span>' if hung_thread else "",
        ])
        tid = t.os_thread_id if t.os_thread_id is not None else t.thread_id
        parts.append(f'<details class="thread" open data-thread-id="{t.thread_id}" data-thread-name="{_e(t.thread_name)}">'
                     f'<summary>Thread {tid} "{_e(t.thread_name)}" ({len(t.frames)} frames){badges}</summary>'
                     '<ol class="frames">')
        for i, f in enumerate(t.frames):
            hung = hung_thread and i == s.hung_frame_index
            where = f.short_filename or f.filename or "?"
            parts.append(f'<li class="frame{" hung" if hung else ""}" title="{_e(f.filename)}">'
                         f'<span class="fn">{_e(f.name)}</span> <span class="loc">({_e(where)}:{f.line})</span></li>')
        parts.append("</ol></details>")
    parts.append("</article>")
    return "".join(parts)


def render_report_html(tl: IncidentTimeline, *, generated_time_unix_nano: int | None = None) -> str:
    """The report page as one HTML string (UTF-8 text, no external references).

    Args:
        tl: the incident timeline.
        generated_time_unix_nano: footer time, ns since the epoch (``None``: omitted, keeping the
            page a pure function of the bundle).

    Returns:
        A complete ``<!DOCTYPE html>`` document.
    """
    trig_class = "trigger manual" if tl.trigger == Trigger.MANUAL else "trigger"
    summary = [
        ("Trigger", f'<span class="{trig_class}" id="trigger">{_e(tl.trigger)}</span>'),
        ("Detail", f'<span id="detail">{_e(tl.detail)}</span>'),
        ("Host", _e(tl.host_name or "?")),
        ("Opened", _e(_iso(tl.opened_time_unix_nano))),
        ("Duration", f"{_e(_ms(tl.duration_s))} ms"),
        ("Trace id", f"<code>{_e(tl.trace_id or '-')}</code>"),
        ("Targets", _e(", ".join(f"{t.pid} {t.title}" for t in tl.targets) or "-")),
        ("In flight", _e(tl.inflight_count)),
        ("Bundle", f"<code>{_e(tl.bundle_dir)}</code>"),
    ]
    if tl.hard_signal_sent:
        summary.append(("Hard signal", _e(", ".join(f"{sig} to pid {pid}" for pid, sig in tl.hard_signal_sent.items()))))
    dl = "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in summary)

    verdict_html = ""
    if tl.verdict:  # the cross-rank verdict tops the page
        evidence = "".join(f"<li>{_e(x)}</li>" for x in (tl.verdict.get("evidence") or [])[:16])
        verdict_html = (f'<section id="verdict"><h2>Verdict</h2><p id="verdict-headline"><strong>'
                        f'{_e(verdict_headline(tl.verdict))}</strong></p><ul>{evidence}</ul></section>')
    body = [(f'<header><h1>servewatch incident <code id="incident-id">{_e(tl.incident_id)}</code></h1>'
            f'{verdict_html}<dl class="summary">{dl}</dl></header>')]

    extent = tl.extent_s
    body.append('<section id="timeline"><h2>Timeline</h2>')
    bars = _action_bars(tl.actions)
    if bars:
        body.append(_svg_chart(bars, extent, svg_id="timeline-svg", label="actions by start offset from incident open",
                               closed_s=tl.duration_s))
    else:
        body.append("<p>No actions ran.</p>")
    body.append(_table(
        ["start ms", "duration ms", "action", "pid", "title", "outcome", "retryable", "detail"],
        ([_e(_ms(a.start_offset_s)), _e(_ms(a.duration_s)), _e(a.action), _e(_pid(a.pid)), _e(a.title),
          _outcome_html(a.outcome), "yes" if a.retryable else "no", _e(a.detail)] for a in tl.actions),
        table_id="actions", num=(0, 1, 3),
    ))
    body.append("</section>")

    if tl.stacks:
        body.append('<section id="stacks"><h2>Stacks per process</h2>')
        body.extend(_stacks_html(s, tl) for s in tl.stacks)
        body.append("</section>")

    if tl.coredumps:
        body.append('<section id="coredumps"><h2>CUDA coredumps</h2>')
        body.append(_table(
            ["pid", "outcome", "size", "bytes", "path"],
            ([_e(_pid(c.pid)), _outcome_html(c.outcome),
              _e(format_size(c.size_bytes)) if c.size_bytes is not None else "-",
              f"{c.size_bytes:,}" if c.size_bytes is not None else "-", _e(c.path or "-")] for c in tl.coredumps),
            table_id="coredump-table", num=(0, 2, 3),
        ))
        body.append("</section>")

    if tl.profiles:
        body.append('<section id="profiles"><h2>Profiles</h2>')
        body.append(_table(
            ["pid", "outcome", "duration ms", "steps captured", "trace files", "attributes"],
            ([_e(_pid(p.pid)), _outcome_html(p.outcome), _e(_ms(p.duration_s)),
              "-" if p.steps_captured is None else _e(p.steps_captured),
              "<br>".join(_e(t) for t in p.trace_paths) + (f" ({_e(format_size(p.trace_size_bytes))})" if p.trace_paths else "-"),
              "<br>".join(f"{_e(k.removeprefix('servewatch.profile.'))}={_e(v)}" for k, v in p.attributes.items())]
             for p in tl.profiles),
            table_id="profile-table", num=(0, 2, 3),
        ))
        body.append("</section>")

    if tl.requests or tl.inflight_count:
        body.append(f'<section id="requests"><h2>In-flight requests ({_e(tl.inflight_count)})</h2>')
        body.append(_table(
            ["request id", "pid", "age s", "prompt tokens", "generated tokens", "trace id", "span id"],
            ([_e(r.request_id or "-"), _e(_pid(r.pid)), "-" if r.age_s is None else f"{r.age_s:.3f}",
              "-" if r.prompt_tokens is None else _e(r.prompt_tokens),
              "-" if r.generated_tokens is None else _e(r.generated_tokens),
              f"<code>{_e(r.trace_id or '-')}</code>", f"<code>{_e(r.span_id or '-')}</code>"] for r in tl.requests),
            table_id="request-table", num=(1, 2, 3, 4),
        ))
        body.append("</section>")

    if tl.artifacts:
        body.append('<section id="artifacts"><h2>Artifacts</h2>')
        body.append(_table(
            ["action", "pid", "size", "path"],
            ([_e(f.action), _e(_pid(f.pid)), _size_html(f.size_bytes), _e(f.path)] for f in tl.artifacts),
            table_id="artifact-table", num=(1, 2),
        ))
        body.append("</section>")

    if tl.spans:
        body.append(f'<section id="spans"><h2>Trace spans ({len(tl.spans)})</h2>')
        body.append(_svg_chart(_span_bars(tl.spans), extent, svg_id="spans-svg", label="spans of the incident trace"))
        body.append(f'<p class="mono">from {_e(", ".join(tl.span_files))}</p></section>')

    if tl.warnings:
        body.append('<section id="warnings"><h2>Warnings</h2><ul>')
        body.extend(f'<li class="warning">{_e(w)}</li>' for w in tl.warnings)
        body.append("</ul></section>")

    footer = "Generated by servewatch"
    if generated_time_unix_nano is not None:
        footer += f" at {_iso(generated_time_unix_nano)}"
    body.append(f"<footer>{_e(footer)} from the bundle {_e(tl.bundle_dir)}. Offline page: nothing is loaded.</footer>")

    # no control or bidi character a target chose reaches the page (nor a terminal, with -o -)
    return strip_control(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta http-equiv="Content-Security-Policy" content="{_e(CSP)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>servewatch incident {_e(tl.incident_id)}</title><style>{_STYLE}</style></head>"
        f"<body>{''.join(body)}</body></html>\n",
        keep_newlines=True,
    )


def write_report(tl: IncidentTimeline, out_path: str | os.PathLike[str], *,
                 generated_time_unix_nano: int | None = None) -> Path:
    """Write the report page to ``out_path`` (replaced atomically; its folder must exist).

    Args:
        tl: the incident timeline (:func:`exporters.bundle.load_incident`).
        out_path: the ``.html`` file to write.
        generated_time_unix_nano: footer time, ns since the epoch (``None``: omitted).

    Returns:
        The absolute path written.

    Raises:
        OSError: the file cannot be written (``FileNotFoundError``: no such folder).
    """
    # resolve the folder only: a symlink planted at the file's name is replaced, never followed
    given = Path(os.path.abspath(out_path))
    out = given.parent.resolve() / given.name
    # temp file O_EXCL|O_NOFOLLOW beside it, fsync, rename: never writes through a planted symlink
    atomic_write_text(out, render_report_html(tl, generated_time_unix_nano=generated_time_unix_nano))
    return out


def report_summary(tl: IncidentTimeline, path: str | os.PathLike[str]) -> str:
    """The CLI's closing line for a written report (what, where, how much, how to view it).

    Args:
        tl: the incident reported.
        path: the page written (:func:`write_report`'s return value).

    Returns:
        e.g. ``Wrote report of incident 2025...-stall-a1b2c3 to '/tmp/r.html' (31.20 KiB). Actions: 6
        Processes: 3 Errors: 1. Open it in a browser (works offline).`` Errors are
        :func:`agent.manifest.stack_errors`, the count ``dump`` and ``timeline`` print too.
    """
    size = Path(path).stat().st_size
    errors = stack_errors(tl.actions)
    return (
        f"Wrote report of incident {tl.incident_id} to '{path}' ({format_size(size)}). "
        f"Actions: {len(tl.actions)} Processes: {len(tl.stacks)} Errors: {errors}. "
        "Open it in a browser (works offline)."
    )
