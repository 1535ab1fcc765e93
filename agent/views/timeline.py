"""Incident timelines drawn in the terminal: rich (and plain text) rendering of a bundle.

Owns :func:`render_timeline`, :func:`render_timeline_text`, :func:`timeline_to_dict` and the small
formatters :func:`outcome_style` and :func:`verdict_next` (:func:`format_size` and
:func:`verdict_headline`, shared with the HTML report, are :mod:`agent.views.bundle`'s: the report
imports no rich). Reading a bundle into the :class:`~agent.views.bundle.IncidentTimeline`
model drawn here is :mod:`agent.views.bundle`'s.

Like everything in ``exporters/``, this module decides nothing: it draws what the model holds.
All text from a bundle is printed literally (never read as rich markup) and stripped of control
characters first.

Imports the standard library, rich, :mod:`agent.model.events` (names), :mod:`agent.host.security`
(:func:`~agent.host.security.sanitize`), :mod:`agent.model.stacks` (the idle-thread rule) and
:mod:`agent.views.bundle` (the model).
"""

from __future__ import annotations

import io
from datetime import datetime, timezone
from typing import Any

from rich.console import Console, Group
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from agent.host.security import sanitize
from agent.model.kinds import Trigger
from agent.model.manifest_view import stack_errors
from agent.model.ranks import rank_among
from agent.model.stacks import thread_is_idle
from agent.views.bundle import (
    ActionRow,
    IncidentTimeline,
    ProcessStacks,
    format_size,
    job_verdict_title,
    timeline_to_dict,
    verdict_headline,
)

__all__ = [
    "format_size",
    "outcome_style",
    "render_timeline",
    "render_timeline_text",
    "timeline_to_dict",
    "verdict_headline",
    "verdict_next",
]


# --- output -----------------------------------------------------------------------------------


_OUTCOME_STYLES = {
    "ok": "bold green",
    "timed_out": "bold yellow",
    "skipped": "dim",
    "not_armed": "dim",
    "already_stopped": "dim",
    "unsupported": "magenta",
    "not_python": "magenta",
    "missing_tool": "magenta",
}


def outcome_style(outcome: str) -> str:
    """rich style of an outcome: green ok, yellow timed out, dim not run, magenta not applicable, red failed."""
    return _OUTCOME_STYLES.get(outcome, "bold red")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _pid(pid: int | None) -> str:
    return "-" if pid is None else str(pid)


#: Continuation rows of a verdict's line are indented this many columns more than the line
#: (a hanging indent, as the CLI's own lines on a terminal: where each line starts stays plain).
HANG_INDENT = 4


class _Hanging:
    """One line of text wrapped at words to the width it is given: its first row indented
    ``indent``, its continuation rows ``indent + HANG_INDENT``, never left of the line's own
    text. A word wider than a row is broken (a pasted verdict is never cut), its pieces hanging
    too. Printed literally (never read as markup)."""

    def __init__(self, text: str, *, indent: int = 0, style: str = "") -> None:
        self.text, self.indent, self.style = text, indent, style

    def __rich_console__(self, console: Console, options: Any) -> Any:
        import textwrap

        width = max(options.max_width, self.indent + HANG_INDENT + 1)
        rows = textwrap.wrap(self.text, width=width, initial_indent=" " * self.indent,
                             subsequent_indent=" " * (self.indent + HANG_INDENT), break_on_hyphens=False) or [""]
        for row in rows:
            body = row.lstrip(" ")
            line = Text(row[: len(row) - len(body)], no_wrap=False, overflow="fold", end="\n")
            line.append(body, style=self.style)
            yield line

    def __rich_measure__(self, console: Console, options: Any) -> Any:
        from rich.measure import Measurement

        longest = max((len(w) for w in self.text.split()), default=0)
        return Measurement(min(options.max_width, self.indent + HANG_INDENT + longest),
                           min(options.max_width, self.indent + len(self.text)))


def verdict_next(verdict: dict[str, Any]) -> str:
    """The verdict's ``next: ...`` line (what to run or check next), ``""`` when it has none."""
    step = verdict.get("next")
    return f"next: {step}" if isinstance(step, str) and step else ""


def _verdict_lines(verdict: dict[str, Any]) -> list[Any]:
    """The headline, then its ``next:`` line: each wraps at words under its own text."""
    lines: list[Any] = [_Hanging(verdict_headline(verdict), style="bold red" if verdict.get("culprit_ranks") else "bold")]
    if verdict_next(verdict):
        lines.append(_Hanging(verdict_next(verdict), style="bold"))
    return lines


def _verdict_panel(verdict: dict[str, Any]) -> Panel:
    # each line wraps at words under its own text (a hanging indent) at any width
    lines = _verdict_lines(verdict)
    lines += [_Hanging(str(line), indent=2) for line in (verdict.get("evidence") or [])[:16]]
    return Panel(Group(*lines), title=Text("verdict"), title_align="left",
                 border_style="red" if verdict.get("hung", True) else "green")


def _job_verdict_panel(job: dict[str, Any]) -> Panel:
    """The job's verdict (this host coordinated it): headline, ``next:``, the hosts not heard
    from, then its evidence; shown before this host's own verdict (the job's is the whole story)."""
    lines = _verdict_lines({**job, "culprit_ranks": job.get("culprit_ranks") or []})
    lines += [_Hanging(f"no evidence from {m.get('host')}: {m.get('why')}", indent=2, style="yellow")
              for m in (job.get("missing_hosts") or [])[:8] if isinstance(m, dict)]
    lines += [_Hanging(str(line), indent=2) for line in (job.get("evidence") or [])[:16]]
    return Panel(Group(*lines), title=Text(job_verdict_title(job)), title_align="left",
                 border_style="red" if job.get("hung", True) else "green")


def _local(ns: int) -> str:
    """The viewer's local wall-clock time of ``ns``, with its zone name (``16:17:29 CET``)."""
    local = datetime.fromtimestamp(ns / 1e9).astimezone()
    return f"{local:%Y-%m-%d %H:%M:%S} {local.tzname() or ''}".rstrip()


def _header(tl: IncidentTimeline) -> Panel:
    body = Text(no_wrap=False, overflow="fold")
    body.append("trigger  ", style="bold")
    body.append(tl.trigger, style="bold red" if tl.trigger != Trigger.MANUAL else "bold cyan")
    body.append("  ")
    body.append(tl.detail)
    body.append("\nopened   ", style="bold")
    body.append(f"{_iso(tl.opened_time_unix_nano)} (local {_local(tl.opened_time_unix_nano)})")
    body.append("\nhost     ", style="bold")
    body.append(tl.host_name or "?")
    body.append("   duration ", style="bold")
    body.append(f"{tl.duration_s * 1e3:,.1f} ms")
    body.append("   in flight ", style="bold")
    body.append(str(tl.inflight_count))
    body.append("\ntrace    ", style="bold")
    body.append(tl.trace_id or "-")
    if tl.hard_signal_sent:
        body.append("\nhard     ", style="bold")
        body.append(", ".join(f"{sig} -> {pid}" for pid, sig in tl.hard_signal_sent.items()), style="bold red")
    body.append("\nbundle   ", style="bold")
    body.append(tl.bundle_dir)
    errors = stack_errors(tl.actions)  # the Errors: N of dump's summary and the report
    body.append("\nerrors   ", style="bold")
    body.append(f"{errors} (processes whose stacks could not be captured)", style="bold red" if errors else "")
    if tl.state == "open":
        body.append("\nstate    ", style="bold")
        body.append("OPEN — still running", style="bold yellow")
        body.append(f"; done: {', '.join(tl.phases_done) or 'nothing yet'}")
        if tl.phases_pending:
            body.append(f"; pending: {', '.join(tl.phases_pending)}")
    elif tl.state == "interrupted":
        body.append("\nstate    ", style="bold")
        body.append("INTERRUPTED", style="bold red")
        if tl.interrupted_reason:
            body.append(f" — {tl.interrupted_reason}")
    return Panel(body, title=Text(f"incident {tl.incident_id}", style="bold"), title_align="left")


def _rank_of(tl: IncidentTimeline, pid: int) -> int | None:
    """The rank of ``pid``: what its Flight Recorder read said, else its title's among the incident's
    targets' titles (``_TP1`` -> 1; ``Worker_PP1_TP0`` beside ``Worker_PP0_TP1`` -> 2: :func:`agent.model.ranks.rank_among`)."""
    for a in tl.actions:
        rank = a.attributes.get("servewatch.flightrec.rank") if a.pid == pid else None
        if isinstance(rank, int) and not isinstance(rank, bool):
            return rank
    title = tl.title_of(pid)
    return rank_among(title, [t.title for t in tl.targets]) if title else None


def _who(tl: IncidentTimeline, pid: int) -> Text:
    """``rank 0 · pid 42 · sglang::scheduler_TP0`` (the parts known)."""
    rank = _rank_of(tl, pid)
    parts = ([f"rank {rank}"] if rank is not None else []) + [f"pid {pid}"]
    who = Text(" · ".join(parts), style="bold")
    if tl.title_of(pid):
        who.append(" · " + tl.title_of(pid))
    return who


def _hung_text(s: ProcessStacks | None) -> Text:
    if s is None:
        return Text("no stack captured", style="dim")
    if s.hung_frame:
        hung = Text(s.hung_frame, style="bold yellow")
    elif s.threads and all(thread_is_idle(t) for t in s.threads if t.frames):
        hung = Text("none: all threads idle (waiting for work)", style="dim")
    else:
        hung = Text("unknown", style="dim")
    if s.error:
        hung.append(f"  (stacks unreadable: {s.error})", style="red")
    return hung


def _action_line(a: ActionRow) -> Group:
    """One action: offset, name, outcome and duration on one line; its detail below, indented
    and wrapped at word boundaries (it is a sentence, never cut into a narrow column)."""
    line = Text(f"{_ms(a.start_offset_s):>10} ms  ")
    line.append(f"{a.action:<15} ")
    line.append(f"{a.outcome:<12}", style=outcome_style(a.outcome))
    line.append(f"{_ms(a.duration_s):>10} ms")
    if a.pid is not None and not a.title:
        line.append(f"  pid {a.pid}")
    if not a.detail:
        return Group(line)
    return Group(line, Padding(Text(a.detail, style="dim" if a.outcome in _QUIET else ""), (0, 0, 0, 14)))


#: outcomes that are no news: their detail is shown dim
_QUIET = frozenset({"skipped", "not_armed", "already_stopped", "no_gpu"})


def _processes(tl: IncidentTimeline) -> Group:
    """One block per target process: who it is, its hung frame, then the actions run on it in
    time order; actions bound to no target follow."""
    stacks = {s.pid: s for s in tl.stacks}
    pids = list(dict.fromkeys([t.pid for t in tl.targets] + [s.pid for s in tl.stacks]))
    blocks: list[Any] = [Text("Processes", style="bold italic")]
    for pid in pids:
        who = _who(tl, pid)
        blocks.append(who)
        hung = Text("  hung frame  ", style="bold")
        hung.append_text(_hung_text(stacks.get(pid)))
        blocks.append(Padding(hung, (0, 0, 0, 0)))
        blocks.extend(_action_line(a) for a in tl.actions if a.pid == pid)
    rest = [a for a in tl.actions if a.pid not in pids]
    if rest:
        blocks.append(Text("Other actions", style="bold italic"))
        blocks.extend(_action_line(a) for a in rest)
    return Group(*blocks)


def _closing_panel(tl: IncidentTimeline) -> Panel:
    """What to read last (the screen a paged engineer is left with): the verdict, then each
    process's hung frame, culprits marked."""
    verdict = tl.verdict or {}
    culprits = {int(p) for p in verdict.get("culprit_pids") or () if isinstance(p, int)}
    headline = _verdict_lines(verdict) if verdict else [_Hanging("no verdict recorded", style="dim")]
    if tl.job_verdict:  # the job's verdict above this host's: the screen ends on the whole story
        headline = [*_verdict_lines(tl.job_verdict), *headline]
    frames = Table.grid(padding=(0, 1))
    frames.add_column(no_wrap=True)
    frames.add_column(overflow="fold")  # a long frame wraps in its own column, under itself
    stacks = {s.pid: s for s in tl.stacks}
    for pid in dict.fromkeys([t.pid for t in tl.targets] + [s.pid for s in tl.stacks]):
        frames.add_row(_who_text(tl, pid, culprit=pid in culprits), _hung_text(stacks.get(pid)))
    title = f"verdict · {tl.trigger} · {tl.incident_id}" if verdict else f"hung frames · {tl.trigger} · {tl.incident_id}"
    # a Text: the trigger and id are the bundle's, printed literally (a str title is read as markup)
    return Panel(Group(*headline, frames), title=Text(title), title_align="left",
                 border_style="red" if verdict.get("hung", True) else "green")


def _who_text(tl: IncidentTimeline, pid: int, *, culprit: bool) -> Text:
    """``rank R pid P:`` (a culprit: in red, marked)."""
    rank = _rank_of(tl, pid)
    who = Text((f"rank {rank} " if rank is not None else "") + f"pid {pid}",
               style="bold red" if culprit else "bold")
    who.append(" (culprit):" if culprit else ":", style="bold red" if culprit else "")
    return who


def _coredump_table(tl: IncidentTimeline) -> Table:
    table = Table(title="CUDA coredumps", title_justify="left")
    table.add_column("pid", justify="right")
    table.add_column("outcome")
    table.add_column("size", justify="right")
    table.add_column("path", overflow="fold")
    for c in tl.coredumps:
        size = "-" if c.size_bytes is None else f"{format_size(c.size_bytes)} ({c.size_bytes:,} bytes)"
        table.add_row(_pid(c.pid), Text(c.outcome, style=outcome_style(c.outcome)), size, Text(c.path or "-"))
    return table


def _profile_table(tl: IncidentTimeline) -> Table:
    table = Table(title="Profiles", title_justify="left")
    table.add_column("pid", justify="right")
    table.add_column("outcome")
    table.add_column("dur ms", justify="right")
    table.add_column("steps", justify="right")
    table.add_column("traces", overflow="fold")
    for p in tl.profiles:
        traces = "\n".join(p.trace_paths) or "-"
        if p.trace_paths:
            traces += f"\n({format_size(p.trace_size_bytes)} in {len(p.trace_paths)} files)"
        table.add_row(
            _pid(p.pid),
            Text(p.outcome, style=outcome_style(p.outcome)),
            _ms(p.duration_s),
            "-" if p.steps_captured is None else str(p.steps_captured),
            Text(traces),
        )
    return table


def _requests_table(tl: IncidentTimeline) -> Table:
    table = Table(title=f"In-flight requests ({tl.inflight_count})", title_justify="left")
    table.add_column("request id / trace id", no_wrap=True, min_width=32)
    table.add_column("pid", justify="right")
    table.add_column("age s", justify="right")
    table.add_column("prompt", justify="right")
    table.add_column("generated", justify="right")
    for r in tl.requests:
        cell = Text(r.request_id or "-")
        if r.trace_id:
            cell.append("\n" + r.trace_id, style="dim")
        table.add_row(
            cell,
            _pid(r.pid),
            "-" if r.age_s is None else f"{r.age_s:.3f}",
            "-" if r.prompt_tokens is None else str(r.prompt_tokens),
            "-" if r.generated_tokens is None else str(r.generated_tokens),
        )
    return table


def _in_bundle(tl: IncidentTimeline, path: str) -> str:
    """``path`` relative to the bundle folder (shown in the header) when it is inside it."""
    prefix = tl.bundle_dir.rstrip("/") + "/"
    return path.removeprefix(prefix)


def _artifacts_table(tl: IncidentTimeline) -> Table:
    table = Table(title="Artifacts (in the bundle folder unless a path says otherwise)", title_justify="left")
    table.add_column("action")
    table.add_column("pid", justify="right")
    table.add_column("size", justify="right")
    table.add_column("file", overflow="fold")
    for f in tl.artifacts:
        size = Text(format_size(f.size_bytes), style="" if f.exists else "red")
        table.add_row(Text(f.action), _pid(f.pid), size, Text(_in_bundle(tl, f.path)))
    return table


def _spans_table(tl: IncidentTimeline, limit: int) -> Table:
    table = Table(title=f"Trace spans ({len(tl.spans)})", title_justify="left")
    table.add_column("start ms", justify="right")
    table.add_column("dur ms", justify="right")
    table.add_column("span")
    table.add_column("status")
    for s in tl.spans[:limit]:
        status = {0: "unset", 1: "ok", 2: "error"}.get(s.status_code, str(s.status_code))
        table.add_row(_ms(s.start_offset_s), _ms(s.duration_s), Text(s.name),
                      Text(status, style="red" if s.status_code == 2 else ""))
    if len(tl.spans) > limit:
        table.add_row("", "", Text(f"... {len(tl.spans) - limit} more", style="dim"), "")
    return table


def render_timeline(tl: IncidentTimeline, console: Console, *, max_spans: int = 40) -> None:
    """Print the incident as a timeline, readable at 80 columns: the job's verdict where this host
    coordinated one, the verdict and its evidence,
    the header (trigger, when in UTC and local time, bundle), then per process its hung frame
    and the actions run on it (details wrapped at word boundaries under each action), coredumps,
    profiles, in-flight requests, artifacts, trace spans (when any) and warnings; last, the
    verdict again with every process's hung frame, so a terminal is left showing them.

    All text from the bundle is printed literally (never read as rich markup).

    Args:
        tl: the timeline.
        console: where to print (``Console(record=True)`` in tests, stdout in the CLI).
        max_spans: most trace spans listed.
    """
    tl = sanitize(tl)  # a target's title, frames or request ids never carry escapes to a terminal
    parts: list[Any] = []
    if tl.job_verdict:
        parts.append(_job_verdict_panel(tl.job_verdict))  # the job's first: it saw every host
    if tl.verdict:
        parts.append(_verdict_panel(tl.verdict))  # the verdict first: who is to blame
    parts += [_header(tl), _processes(tl)]
    if any(c.path or c.size_bytes for c in tl.coredumps):
        parts.append(_coredump_table(tl))
    if tl.profiles:
        parts.append(_profile_table(tl))
    if tl.requests or tl.inflight_count:
        parts.append(_requests_table(tl))
    if tl.artifacts:
        parts.append(_artifacts_table(tl))
    if tl.spans:
        parts.append(_spans_table(tl, max_spans))
    for warning in tl.warnings:
        parts.append(Text(f"warning: {warning}", style="yellow", no_wrap=False, overflow="fold"))
    if tl.verdict or tl.stacks:
        parts.append(_closing_panel(tl))  # repeated last: what the screen shows when it ends
    # soft_wrap=False: the CLI's console soft-wraps (no_wrap for every renderable), which would crop
    # panel text at the console width when stdout is a file or pipe; panels and cells wrap instead.
    console.print(Group(*parts), soft_wrap=False)


def render_timeline_text(tl: IncidentTimeline, *, width: int = 120) -> str:
    """The terminal timeline as plain text (no colours), ``width`` columns wide."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    render_timeline(tl, console)
    return buffer.getvalue()
