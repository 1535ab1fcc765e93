"""The incident report: one self-contained HTML page drawn from an :class:`IncidentTimeline`.

Owns :func:`render_report_html` and :func:`write_report`. The page is a Jinja2 template
(``agent/views/templates/report.html``, autoescaped: every string from the bundle — titles,
frames, details, paths — is HTML-escaped by the template engine, never by hand) fed a view model
built here. It needs no network and loads nothing: CSS is inline, charts are inline SVG, there
is no script, and a Content-Security-Policy ``default-src 'none'`` forbids any fetch.

Order, for the engineer who has 30 seconds: the verdict and each rank's evidence (hung frame,
threads), a short summary, then the **timeline of the server** (its last forward steps as the
agent saw them, when progress stopped, the requests in flight, when the watchdog fired, then
the evidence captured, each at its time in UTC and local time), then servewatch's own capture
chart, stacks per process, CUDA coredumps, profiles, in-flight requests (never prompt text),
artifacts and warnings. Local time is the time zone of whoever runs ``servewatch report``
(``TZ`` chooses it): the page has no script to ask the browser.

Like everything in ``exporters/``, it mirrors the bundle and decides nothing.

Imports the standard library, jinja2 (the page's template is compiled ahead:
``templates/compiled/``, see :func:`compile_template`), :mod:`agent.model.events` (names), :mod:`agent.host.fsutil`,
:mod:`agent.model.ranks`, :mod:`agent.host.security` (control characters), :mod:`agent.views.bundle` (the model read from a bundle, the one loader
``timeline`` uses too, and the formatters the terminal timeline shares; never rich).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any

from agent.host.fsutil import atomic_write_text
from agent.host.security import strip_control
from agent.model.kinds import Action, Trigger
from agent.model.manifest_view import stack_errors
from agent.model.ranks import rank_among
from agent.views.bundle import (
    ActionRow,
    IncidentTimeline,
    ProcessStacks,
    RequestRow,
    SpanRow,
    format_size,
    job_verdict_title,
    verdict_headline,
)

__all__ = ["CSP", "compile_template", "render_report_html", "report_summary", "write_report"]

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
dl.summary { display: grid; grid-template-columns: max-content 1fr max-content 1fr; gap: 2px 14px; margin: 12px 0 0;
             background: var(--panel); padding: 8px 14px; border-radius: 6px; font-size: 13px; }
dl.summary dt { font-weight: 600; color: var(--muted); } dl.summary dd { margin: 0; word-break: break-all; }
dl.summary dd.mono { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; }
#verdict, #job-verdict { border-left: 6px solid var(--bad); background: #fdecea; padding: 6px 14px 8px; border-radius: 6px; }
#verdict.not-hung, #job-verdict.not-hung { border-left-color: var(--ok); background: #e8f5e9; }
#verdict h2, #job-verdict h2 { border: 0; margin: 4px 0; } #verdict p, #job-verdict p { margin: 4px 0; font-size: 15px; }
#verdict-next code, #job-verdict-next code { white-space: pre-wrap; word-break: break-word; }
#verdict ul, #job-verdict ul { margin: 4px 0; padding-left: 20px; font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; }
#ranks h2 { margin-top: 14px; } tr.culprit td { background: #fdecea; } .badge.culprit { background: var(--bad); color: #fff; }
code.hung-frame { background: #fff3cd; padding: 1px 4px; border-radius: 3px; }
td.dim, code.dim, tr.dim td { color: var(--muted); }
#history td:nth-child(4) { word-break: break-word; } #history tr.key td { font-weight: 700; }
#history tr.h-stall td, #history tr.h-progress_stopped td { color: var(--bad); } #history tr.h-opened td { border-top: 2px solid var(--bad); }
#history tr.evidence.ok td:nth-child(4) { color: var(--fg); } #history tr.evidence.dim td:nth-child(4) { color: var(--dim); }
#history tr.evidence.bad td:nth-child(4) { color: var(--bad); } #history tr.h-request td { color: var(--span); }
p.note { color: var(--muted); font-size: 12px; margin: 0 0 6px; }
.trigger { font-weight: 700; text-transform: uppercase; color: var(--bad); font-size: 14px; margin-left: 6px; }
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


def _outcome_class(outcome: str) -> str:
    return _OUTCOME_CLASS.get(outcome, "bad")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _utc(ns: int) -> str:
    """``2026-12-01 15:17:29.180`` (UTC)."""
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _local(ns: int) -> str:
    """``16:17:29.180 CET``: the time zone of whoever renders the page (``TZ``)."""
    local = datetime.fromtimestamp(ns / 1e9).astimezone()
    return f"{local:%H:%M:%S}.{local.microsecond // 1000:03d} {local.tzname() or ''}".rstrip()


def _offset(seconds: float) -> str:
    """``-3.204 s`` / ``+0.061 s`` / ``0``: time relative to the incident's open."""
    return "0" if abs(seconds) < 5e-4 else f"{seconds:+.3f} s"


def _tick_step_ms(extent_ms: float) -> float:
    """A 1/2/5 x 10^k step giving about 8 ticks over ``extent_ms``."""
    raw = max(extent_ms, 1e-3) / 8
    power = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if raw <= mult * power:
            return mult * power
    return 10 * power


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _pid(pid: int | None) -> str:
    return "-" if pid is None else str(pid)


# --- charts -------------------------------------------------------------------------------------


def _chart(bars: Sequence[dict[str, Any]], extent_s: float, *, svg_id: str, label: str,
           closed_s: float | None = None) -> dict[str, Any]:
    """Geometry of one inline-SVG bar chart: bars placed by start offset, as wide as their duration.

    Each bar dict holds ``name``, ``label``, ``start_s``, ``duration_s``, ``css``, ``data`` (the
    ``data-*`` attributes) and ``tooltip``; this adds the pixel positions the template draws.
    """
    extent_ms = max(extent_s * 1e3, 1e-3)
    step_ms = _tick_step_ms(extent_ms)
    width = _GUTTER_PX + _PLOT_PX + _RIGHT_PX
    height = _AXIS_PX + _ROW_PX * max(len(bars), 1) + 8
    scale = _PLOT_PX / extent_ms  # px per ms
    ticks = [{"x": f"{_GUTTER_PX + i * step_ms * scale:.1f}", "label": f"{i * step_ms:g} ms"}
             for i in range(int(extent_ms // step_ms) + 1)]
    placed = []
    for row, bar in enumerate(bars):
        y = _AXIS_PX + row * _ROW_PX
        x = _GUTTER_PX + max(bar["start_s"], 0.0) * 1e3 * scale
        w = max(bar["duration_s"] * 1e3 * scale, _MIN_BAR_PX)
        label_px = len(bar["label"]) * _CHAR_PX
        label_css = "bar-label"
        if x + w + 6 + label_px <= width:  # after the bar
            lx, anchor = x + w + 6, "start"
        elif w >= label_px + 8:  # inside the bar
            lx, anchor, label_css = x + 4, "start", f"bar-label inside {bar['css']}"
        else:  # before the bar
            lx, anchor = x - 6, "end"
        placed.append({**bar, "y": y, "text_y": y + _BAR_PX - 3, "x": f"{x:.1f}", "w": f"{w:.1f}",
                       "lx": f"{lx:.1f}", "anchor": anchor, "label_css": label_css})
    closed_x = None if closed_s is None else f"{_GUTTER_PX + closed_s * 1e3 * scale:.1f}"
    return {"id": svg_id, "label": label, "width": width, "height": height, "axis_y": _AXIS_PX, "bar_px": _BAR_PX,
            "ticks": ticks, "closed_x": closed_x, "bars": placed}


def _action_bars(actions: Iterable[ActionRow]) -> list[dict[str, Any]]:
    bars = []
    for a in actions:
        if a.start_offset_s is None:
            continue
        pid = "" if a.pid is None else f" pid {a.pid}"
        who = f" {_short(a.title, 22)}" if a.title else ""
        bars.append({
            "name": _short(f"{a.action}{pid}{who}", 42),
            "label": f"{a.action}{pid} · {a.outcome} · {_ms(a.duration_s)} ms",
            "start_s": a.start_offset_s,
            "duration_s": a.duration_s,
            "css": _outcome_class(a.outcome),
            "data": {"action": a.action, "pid": "" if a.pid is None else str(a.pid), "outcome": a.outcome,
                     "start-ms": f"{a.start_offset_s * 1e3:.1f}", "duration-ms": f"{a.duration_s * 1e3:.1f}"},
            "tooltip": f"{a.action}{pid} {a.title}\n+{_ms(a.start_offset_s)} ms for {_ms(a.duration_s)} ms: "
                       f"{a.outcome}\n{a.detail}",
        })
    return bars


def _span_bars(spans: Iterable[SpanRow]) -> list[dict[str, Any]]:
    by_id = {s.span_id: s for s in spans}
    bars = []
    for s in spans:
        depth, parent = 0, by_id.get(s.parent_span_id)
        while parent is not None and depth < 8:
            depth, parent = depth + 1, by_id.get(parent.parent_span_id)
        status = {0: "unset", 1: "ok", 2: "error"}.get(s.status_code, str(s.status_code))
        bars.append({
            "name": _short("\u00a0\u00a0" * depth + s.name, 42),
            "label": f"{s.name} · {_ms(s.duration_s)} ms" + (" · error" if s.status_code == 2 else ""),
            "start_s": s.start_offset_s,
            "duration_s": s.duration_s,
            "css": "span bad" if s.status_code == 2 else "span",
            "data": {"span": s.name, "span-id": s.span_id, "status": status,
                     "start-ms": f"{s.start_offset_s * 1e3:.1f}", "duration-ms": f"{s.duration_s * 1e3:.1f}"},
            "tooltip": f"{s.name} ({s.span_id})\n+{_ms(s.start_offset_s)} ms for {_ms(s.duration_s)} ms, {status}",
        })
    return bars


# --- the view model -----------------------------------------------------------------------------


def _rank_of(tl: IncidentTimeline, pid: int) -> int | None:
    """The rank of ``pid``: what its Flight Recorder read said, else its title's among the incident's
    targets' titles (``_TP1`` -> 1; ``Worker_PP1_TP0`` beside ``Worker_PP0_TP1`` -> 2: :func:`agent.model.ranks.rank_among`)."""
    for a in tl.actions:
        rank = a.attributes.get("servewatch.flightrec.rank") if a.pid == pid else None
        if isinstance(rank, int) and not isinstance(rank, bool):
            return rank
    title = tl.title_of(pid)
    return rank_among(title, [t.title for t in tl.targets]) if title else None


def _threads(tl: IncidentTimeline, pid: int, key: str) -> str:
    for a in tl.actions:
        if a.pid == pid and a.action == Action.PYSPY_DUMP:
            value = a.attributes.get(key)
            if isinstance(value, (list, tuple)):
                return ", ".join(map(str, value))
    return ""


def _ranks(tl: IncidentTimeline) -> list[dict[str, Any]]:
    """Per process the evidence a reader wants first: rank, hung frame, stuck and idle threads."""
    culprits = set((tl.verdict or {}).get("culprit_pids") or ())
    stacks = {s.pid: s for s in tl.stacks}
    rows = []
    for pid in dict.fromkeys([t.pid for t in tl.targets] + [s.pid for s in tl.stacks]):
        hung, hung_css = _hung_cell(tl, pid, stacks.get(pid))
        rank = _rank_of(tl, pid)
        rows.append({"pid": pid, "rank": "-" if rank is None else str(rank), "title": tl.title_of(pid),
                     "hung": hung, "hung_css": hung_css, "culprit": pid in culprits,
                     "stuck": _threads(tl, pid, "servewatch.pyspy.stuck_threads"),
                     "idle": _threads(tl, pid, "servewatch.pyspy.idle_threads")})
    return rows


def _hung_cell(tl: IncidentTimeline, pid: int, s: ProcessStacks | None) -> tuple[str, str]:
    """A process's hung frame for the ranks table, and its css class."""
    if s is not None and s.hung_frame:
        return s.hung_frame, "hung-frame"
    if s is not None and s.threads and not s.hung_frame:
        return "none (no thread stuck)", "dim"
    dumps = [a for a in tl.actions if a.action == Action.PYSPY_DUMP and a.pid == pid]
    return "no stacks: " + ("; ".join(a.outcome for a in dumps) or "no py-spy dump"), "dim"


#: step readings shown per process in the timeline; earlier ones are summed up in one row
_STEPS_SHOWN = 3

_HISTORY_WORDS = {
    "step": "forward step",
    "progress_stopped": "progress stopped",
    "stall": "watchdog fired",
    "health_failed": "health check failing",
    "health_recovered": "health check good",
    "exit": "process exited",
}


def _row(tl: IncidentTimeline, ns: int, kind: str, what: str, *, css: str = "", pid: int | None = None) -> dict[str, Any]:
    return {"utc": _utc(ns), "local": _local(ns), "offset": _offset((ns - tl.opened_time_unix_nano) / 1e9), "ns": ns,
            "kind": kind, "what": what, "css": css, "pid": "" if pid is None else str(pid)}


def _who(tl: IncidentTimeline, pid: int | None) -> str:
    if pid is None:
        return "the server"
    rank = _rank_of(tl, pid)
    return (f"rank {rank} " if rank is not None else "") + f"pid {pid}"


def _server_timeline(tl: IncidentTimeline) -> list[dict[str, Any]]:
    """The server's story in time order: its last forward steps, when progress stopped, the
    requests in flight (when each arrived), when the watchdog fired and the incident opened,
    then each piece of evidence as it was captured, and the close."""
    rows: list[dict[str, Any]] = []
    steps: dict[int | None, list[Any]] = {}
    for h in tl.history:
        if h.kind == "step":
            steps.setdefault(h.pid, []).append(h)
            continue
        word = _HISTORY_WORDS.get(h.kind, h.kind)
        css = "key" if h.kind in ("progress_stopped", "stall", "exit", "health_failed") else ""
        rows.append(_row(tl, h.time_unix_nano, h.kind, f"{word}: {h.detail}" if h.detail else word, css=css, pid=h.pid))
    for pid, readings in steps.items():
        rows += _step_rows(tl, pid, readings)
    rows += [_request_row(tl, r, r.age_s) for r in tl.requests if r.age_s is not None]
    rows.append(_row(tl, tl.opened_time_unix_nano, "opened", f"incident opened ({tl.trigger}): {tl.detail}", css="key"))
    rows += [_evidence_row(tl, a, a.start_offset_s) for a in tl.actions if a.start_offset_s is not None]
    if tl.state != "open":
        rows.append(_row(tl, tl.opened_time_unix_nano + int(tl.duration_s * 1e9), "closed",
                         f"incident {tl.state}" + (f": {tl.interrupted_reason}" if tl.interrupted_reason else ""), css="dim"))
    order = {"steps": 0, "step": 1, "health_failed": 2, "request": 3, "progress_stopped": 4, "stall": 5, "exit": 5,
             "opened": 6, "evidence": 7, "closed": 8}
    rows.sort(key=lambda r: (r["ns"], order.get(r["kind"], 5)))
    return rows


def _step_rows(tl: IncidentTimeline, pid: int | None, readings: list[Any]) -> list[dict[str, Any]]:
    """A process's last :data:`_STEPS_SHOWN` step readings, the earlier ones summed up in one row."""
    rows = []
    shown = readings[-_STEPS_SHOWN:]
    earlier = readings[: -_STEPS_SHOWN]
    if earlier:
        first, last = earlier[0], earlier[-1]
        rows.append(_row(tl, first.time_unix_nano, "steps",
                         f"{_who(tl, pid)}: {len(earlier)} earlier readings, forward_ct {first.forward_ct} to {last.forward_ct}"
                         f" (until {_offset((last.time_unix_nano - tl.opened_time_unix_nano) / 1e9)})", css="dim", pid=pid))
    for h in shown:
        rows.append(_row(tl, h.time_unix_nano, "step", f"{_who(tl, pid)}: forward step, forward_ct={h.forward_ct} ({h.detail})",
                         pid=pid))
    return rows


def _request_row(tl: IncidentTimeline, r: RequestRow, age_s: float) -> dict[str, Any]:
    """A request in flight, at the time it arrived (``age_s`` before the incident opened)."""
    ns = tl.opened_time_unix_nano - int(age_s * 1e9)
    tokens = ", ".join(x for x in (
        f"{r.prompt_tokens} prompt tokens" if r.prompt_tokens is not None else "",
        f"{r.generated_tokens} generated" if r.generated_tokens is not None else "") if x)
    return _row(tl, ns, "request", f"request {r.request_id or '?'} arrived ({_who(tl, r.pid)}"
                + (f"; {tokens}" if tokens else "") + "): still in flight when the incident opened", pid=r.pid)


def _evidence_row(tl: IncidentTimeline, a: ActionRow, start_offset_s: float) -> dict[str, Any]:
    """An action, at the time it started (``start_offset_s`` after the incident opened)."""
    ns = tl.opened_time_unix_nano + int(start_offset_s * 1e9)
    row = _row(tl, ns, "evidence", f"{a.action} {_who(tl, a.pid) if a.pid is not None else ''}: {a.outcome}"
               + (f" ({_ms(a.duration_s)} ms)" if a.duration_s else "") + (f" — {a.detail}" if a.detail else ""),
               css=f"evidence {_outcome_class(a.outcome)}", pid=a.pid)
    row["outcome"] = a.outcome
    return row


def _stacks_view(s: ProcessStacks, tl: IncidentTimeline) -> dict[str, Any]:
    dumps = [a for a in tl.actions if a.action == Action.PYSPY_DUMP and a.pid == s.pid]
    threads = []
    for t in sorted(s.threads, key=lambda t: t.thread_id != s.hung_thread_id):  # the hung thread first
        hung_thread = t.thread_id == s.hung_thread_id
        threads.append({
            "thread_id": t.thread_id, "name": t.thread_name, "active": t.active, "owns_gil": t.owns_gil,
            "hung_thread": hung_thread, "tid": t.os_thread_id if t.os_thread_id is not None else t.thread_id,
            "frames": [{"name": f.name, "where": f.short_filename or f.filename or "?", "line": f.line,
                        "filename": f.filename, "hung": hung_thread and i == s.hung_frame_index}
                       for i, f in enumerate(t.frames)],
        })
    return {
        "pid": s.pid, "title": s.title, "hung_frame": s.hung_frame,
        "hung_source": "py-spy summary" if s.hung_frame_source == "attribute" else "read from the stacks",
        "no_stacks": None if s.threads else ("; ".join(f"{a.outcome}: {a.detail}" if a.detail else a.outcome for a in dumps)
                                             or "no py-spy dump"),
        "summary": list(s.summary), "error": s.error, "threads": threads,
    }


def _view(tl: IncidentTimeline, generated_time_unix_nano: int | None) -> dict[str, Any]:
    bars = _action_bars(tl.actions)
    footer = "Generated by servewatch"
    if generated_time_unix_nano is not None:
        footer += f" at {_iso(generated_time_unix_nano)}"
    return {
        "tl": tl, "csp": CSP, "style": _STYLE, "verdict": _verdict_view(tl), "job_verdict": _job_view(tl), "ranks": _ranks(tl),
        "summary": _summary_rows(tl),
        "trigger_css": "trigger manual" if tl.trigger == Trigger.MANUAL else "trigger",
        "server": _server_timeline(tl), "has_history": bool(tl.history),
        "capture": _chart(bars, tl.extent_s, svg_id="timeline-svg", label="actions by start offset from incident open",
                          closed_s=tl.duration_s) if bars else None,
        "actions": [{"start": _ms(a.start_offset_s), "duration": _ms(a.duration_s), "action": a.action, "pid": _pid(a.pid),
                     "title": a.title, "outcome": a.outcome, "css": _outcome_class(a.outcome),
                     "retryable": "yes" if a.retryable else "no", "detail": a.detail} for a in tl.actions],
        "stacks": [_stacks_view(s, tl) for s in tl.stacks],
        "coredumps": _coredump_rows(tl),
        "profiles": _profile_rows(tl),
        "requests": _request_rows(tl),
        "show_requests": bool(tl.requests or tl.inflight_count),
        "artifacts": [{"action": f.action, "pid": _pid(f.pid), "size": None if f.size_bytes is None else format_size(f.size_bytes),
                       "bytes": f.size_bytes, "path": f.path} for f in tl.artifacts],
        "spans": _chart(_span_bars(tl.spans), tl.extent_s, svg_id="spans-svg", label="spans of the incident trace")
        if tl.spans else None,
        "span_files": ", ".join(tl.span_files),
        "footer": footer,
    }


def _verdict_view(tl: IncidentTimeline) -> dict[str, Any] | None:
    if not tl.verdict:
        return None
    step = tl.verdict.get("next")
    return {"headline": verdict_headline(tl.verdict), "evidence": list(tl.verdict.get("evidence") or [])[:16],
            "hung": tl.verdict.get("hung", True), "next": step if isinstance(step, str) else ""}


def _job_view(tl: IncidentTimeline) -> dict[str, Any] | None:
    job = tl.job_verdict
    return None if job is None else {
        "title": job_verdict_title(job), "headline": job["headline"], "next": job["next"], "hung": job["hung"],
        "evidence": job["evidence"],
        "missing": [f"{m.get('host')}: {m.get('why')}" for m in (job.get("missing_hosts") or [])[:8] if isinstance(m, dict)],
    }


def _summary_rows(tl: IncidentTimeline) -> list[tuple[str, str, str]]:
    """The page's summary table: (label, value, css)."""
    summary = [
        ("Detail", tl.detail, "detail"),
        ("Host", tl.host_name or "?", ""),
        ("Opened", f"{_utc(tl.opened_time_unix_nano)} UTC (local {_local(tl.opened_time_unix_nano)})", ""),
        ("Duration", f"{_ms(tl.duration_s)} ms", ""),
        ("Trace id", tl.trace_id or "-", "mono"),
        ("In flight", str(tl.inflight_count), ""),
        ("Targets", ", ".join(f"{t.pid} {t.title}" for t in tl.targets) or "-", ""),
        ("Bundle", tl.bundle_dir, "mono"),
    ]
    if tl.hard_signal_sent:
        summary.append(("Hard signal", ", ".join(f"{sig} to pid {pid}" for pid, sig in tl.hard_signal_sent.items()), ""))
    return summary


def _coredump_rows(tl: IncidentTimeline) -> list[dict[str, Any]]:
    return [{"pid": _pid(c.pid), "outcome": c.outcome, "css": _outcome_class(c.outcome),
             "size": format_size(c.size_bytes) if c.size_bytes is not None else "-",
             "bytes": f"{c.size_bytes:,}" if c.size_bytes is not None else "-", "path": c.path or "-"}
            for c in tl.coredumps]


def _profile_rows(tl: IncidentTimeline) -> list[dict[str, Any]]:
    return [{"pid": _pid(p.pid), "outcome": p.outcome, "css": _outcome_class(p.outcome), "duration": _ms(p.duration_s),
             "steps": "-" if p.steps_captured is None else str(p.steps_captured), "traces": list(p.trace_paths),
             "size": format_size(p.trace_size_bytes) if p.trace_paths else "",
             "attributes": [f"{k.removeprefix('servewatch.profile.')}={v}" for k, v in p.attributes.items()]}
            for p in tl.profiles]


def _request_rows(tl: IncidentTimeline) -> list[dict[str, Any]]:
    return [{"id": r.request_id or "-", "pid": _pid(r.pid), "age": "-" if r.age_s is None else f"{r.age_s:.3f}",
             "prompt": "-" if r.prompt_tokens is None else str(r.prompt_tokens),
             "generated": "-" if r.generated_tokens is None else str(r.generated_tokens),
             "trace_id": r.trace_id or "-", "span_id": r.span_id or "-"} for r in tl.requests]


#: The page template's source.
_TEMPLATES = Path(__file__).resolve().parent / "templates"
_TEMPLATE_NAME = "report.html"
#: The template compiled ahead by jinja2 (:meth:`jinja2.Environment.compile_templates`, loaded by
#: :class:`jinja2.ModuleLoader`): compiling it at each ``servewatch report`` cost ~20 ms of a
#: ~0.2 s start. :data:`_COMPILED_STAMP` names the source's SHA-256 and the jinja2 version it was
#: compiled from; on any other source or jinja2 the template is compiled from its source as before.
#: Rewritten by :func:`compile_template` (``tests/exporters/test_report.py`` checks it is current).
_COMPILED = _TEMPLATES / "compiled"
_COMPILED_STAMP = _COMPILED / f"{_TEMPLATE_NAME}.stamp"


def _environment_options(jinja2: Any) -> dict[str, Any]:
    return {
        "autoescape": True,  # every value is HTML-escaped unless the template says otherwise (it never does)
        "undefined": jinja2.StrictUndefined,
        "trim_blocks": True,
        "lstrip_blocks": True,
    }


def _stamp(jinja2: Any) -> str:
    """What the compiled template must have been compiled from: this source, this jinja2."""
    import hashlib

    digest = hashlib.sha256((_TEMPLATES / _TEMPLATE_NAME).read_bytes()).hexdigest()
    return f"{_TEMPLATE_NAME} sha256 {digest} jinja2 {jinja2.__version__}\n"


def compile_template(target: str | os.PathLike[str] | None = None) -> Path:
    """Compile the page template ahead (jinja2's own compiler and file layout) with its stamp;
    run after editing ``templates/report.html`` or upgrading jinja2.

    Args:
        target: the folder to write (``None``: :data:`_COMPILED`, the one ``report`` loads).

    Returns:
        The folder written.
    """
    import jinja2

    folder = _COMPILED if target is None else Path(target)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)), **_environment_options(jinja2))
    folder.mkdir(exist_ok=True)
    for old in folder.glob("tmpl_*.py"):
        old.unlink()
    env.compile_templates(str(folder), zip=None, filter_func=lambda name: name == _TEMPLATE_NAME,
                          ignore_errors=False)
    (folder / _COMPILED_STAMP.name).write_text(_stamp(jinja2), encoding="utf-8")
    return folder


@cache
def _template() -> Any:
    """The page template (loaded once; jinja2 imported only by ``servewatch report``): the one
    compiled ahead when it was compiled from this source by this jinja2, else compiled now."""
    import jinja2

    try:
        current = _COMPILED_STAMP.read_text(encoding="utf-8") == _stamp(jinja2)
    except OSError:
        current = False
    if current:
        loader: Any = jinja2.ModuleLoader(str(_COMPILED))
    else:
        loader = jinja2.PackageLoader("agent.views", "templates")
    return jinja2.Environment(loader=loader, **_environment_options(jinja2)).get_template(_TEMPLATE_NAME)


def render_report_html(tl: IncidentTimeline, *, generated_time_unix_nano: int | None = None) -> str:
    """The report page as one HTML string (UTF-8 text, no external references).

    Args:
        tl: the incident timeline.
        generated_time_unix_nano: footer time, ns since the epoch (``None``: omitted, keeping the
            page a pure function of the bundle).

    Returns:
        A complete ``<!DOCTYPE html>`` document.
    """
    # no control or bidi character a target chose reaches the page (nor a terminal, with -o -)
    return strip_control(str(_template().render(**_view(tl, generated_time_unix_nano))), keep_newlines=True)


def write_report(tl: IncidentTimeline, out_path: str | os.PathLike[str], *,
                 generated_time_unix_nano: int | None = None) -> Path:
    """Write the report page to ``out_path`` (replaced atomically; its folder must exist).

    Args:
        tl: the incident timeline (:func:`agent.views.bundle.load_incident`).
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
        :func:`agent.host.manifest.stack_errors`, the count ``dump`` and ``timeline`` print too.
    """
    size = Path(path).stat().st_size
    errors = stack_errors(tl.actions)
    return (
        f"Wrote report of incident {tl.incident_id} to '{path}' ({format_size(size)}). "
        f"Actions: {len(tl.actions)} Processes: {len(tl.stacks)} Errors: {errors}. "
        "Open it in a browser (works offline)."
    )
