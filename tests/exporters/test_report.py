"""Tests of agent.views.report: the HTML page is rendered by headless Chromium (Debian ``chromium``)
and what the page shows — bars, hung frames, outcomes, no network — is asserted on its DOM."""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

import agent.views.report as report_mod
from agent.views.bundle import IncidentTimeline, load_incident
from agent.views.report import CSP, render_report_html, report_summary, write_report
from tests.exporters.bundle_fixture import (
    COREDUMP_SIZE_BYTES,
    EVIL_PID,
    EVIL_TITLE,
    INCIDENT_ID,
    REQUESTS,
    SECRET_PROMPT,
    Bundle,
    write_bundle,
)

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="the chromium binary is absent (Debian: apt-get install -y chromium)"
)
WINDOW = (1200, 1800)
#: Page console messages (CSP violations among them) go to stderr.
LOGGING = ("--enable-logging=stderr", "--v=0")
CSP_VIOLATION = "violates the following Content Security Policy"
#: Attributes through which a page could load or navigate to something.
URL_ATTRS = ("src", "href", "xlink:href", "action", "formaction", "poster", "data", "srcset", "background")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    return write_bundle(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def tl(bundle: Bundle) -> IncidentTimeline:
    return load_incident(bundle.bundle_dir)


@pytest.fixture(scope="module")
def report(tl: IncidentTimeline, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("out") / "sub"
    folder.mkdir()  # write_report creates no folder
    return write_report(tl, folder / "report.html")


# --- a small DOM from Chromium's serialized DOM ------------------------------------------------

VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"})


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # own text and children's, in order

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def iter(self) -> Iterator[Node]:
        yield self
        for child in self.children:
            yield from child.iter()

    def find_all(self, tag: str, cls: str | None = None) -> list[Node]:
        return [n for n in self.iter() if n.tag == tag and (cls is None or cls in n.classes)]

    def by_id(self, ident: str) -> Node:
        return next(n for n in self.iter() if n.attrs.get("id") == ident)


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        for node in self.stack:
            node.texts.append(data)


def parse_dom(markup: str) -> Node:
    builder = _TreeBuilder()
    builder.feed(markup)
    builder.close()
    return builder.root


def run_chromium(page: Path, profile_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium with background networking off, in its own process group (killed after)."""
    assert CHROMIUM is not None
    argv = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps",
        "--disable-extensions", f"--user-data-dir={profile_dir}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
        *extra, page.as_uri(),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    assert proc.returncode == 0, err[-2000:]
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.fixture(scope="module")
def dom(report: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Node, str]:
    if CHROMIUM is None:
        pytest.skip("the chromium binary is absent (Debian: apt-get install -y chromium)")
    done = run_chromium(report, tmp_path_factory.mktemp("chromium-profile"), *LOGGING, "--dump-dom")
    assert "<svg" in done.stdout, done.stderr[-2000:]
    return parse_dom(done.stdout), done.stderr


# --- without a browser --------------------------------------------------------------------------


def test_all_matches_public_names() -> None:
    assert set(report_mod.__all__) == {"CSP", "compile_template", "render_report_html", "write_report", "report_summary"}


def test_summary_line_says_what_where_and_how_much(report: Path, tl: IncidentTimeline) -> None:
    line = report_summary(tl, report)
    assert line.startswith(f"Wrote report of incident {INCIDENT_ID} to '{report}' (")
    assert "). Actions: 6 Processes: 3 Errors: 1. Open it" in line  # permission_denied; timed_out is a warning


def test_page_is_one_file_with_nothing_to_fetch(report: Path, tl: IncidentTimeline) -> None:
    markup = report.read_text(encoding="utf-8")
    assert report.is_absolute() and report.parent.name == "sub"
    assert markup.startswith("<!DOCTYPE html>")
    assert "://" not in markup  # no URL of any scheme: no http(s), no file, no CDN fonts
    assert not re.search(r"<(script|link|img|iframe|object|embed)\b", markup, re.IGNORECASE)
    assert "url(" not in markup and "@import" not in markup
    (content,) = re.findall(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', markup)
    assert html.unescape(content) == CSP
    assert markup == render_report_html(tl)  # a pure function of the bundle (no time in the footer)
    assert not list(report.parent.glob(".*.tmp"))


def test_bundle_text_is_escaped(report: Path) -> None:
    markup = report.read_text(encoding="utf-8")
    assert "<script>alert(1)</script>" not in markup and "<img src=x" not in markup
    assert "evil &lt;script&gt;alert(1)&lt;/script&gt; &lt;img src=x onerror=alert(2)&gt;" in markup
    assert SECRET_PROMPT not in markup


def test_a_hung_thread_is_never_badged_idle(tl: IncidentTimeline, bundle: Bundle) -> None:
    """The summary's "idle" means waiting for work; py-spy's per-thread flag only says whether the
    thread was on a CPU when sampled. A hung MainThread off the CPU reads "off CPU", not "idle"."""
    root = parse_dom(render_report_html(tl))
    for pid in bundle.pids:
        main = next(t for t in root.by_id(f"pid-{pid}").find_all("details", "thread")
                    if t.attrs["data-thread-name"] == "MainThread")
        badges = [b.text for b in main.find_all("span", "badge")]
        assert "hung thread" in badges and "idle" not in badges, badges
        assert "off CPU" in badges or "on CPU" in badges, badges


def test_footer_time_is_optional(tl: IncidentTimeline) -> None:
    assert "at 2025-11-29T17:35:01.000Z" in render_report_html(tl, generated_time_unix_nano=1_764_437_701_000_000_000)


# --- rendered by Chromium -------------------------------------------------------------------------


@needs_chromium
def test_timeline_bars_are_placed_by_offset_and_sized_by_duration(dom: tuple[Node, str], bundle: Bundle) -> None:
    root, _ = dom
    tp0, tp1 = bundle.pids
    svg = root.by_id("timeline-svg")
    bars = svg.find_all("g", "bar")
    got = [(b.attrs["data-action"], b.attrs["data-pid"], b.attrs["data-outcome"]) for b in bars]
    assert got == [
        ("pyspy.dump", str(tp0), "ok"), ("pyspy.dump", str(tp1), "ok"),
        ("pyspy.dump", str(EVIL_PID), "permission_denied"), ("cuda.coredump", str(tp0), "ok"),
        ("cuda.coredump", str(tp1), "timed_out"), ("profile.session", str(tp0), "ok"),
    ]
    labels = [b.find_all("text", "bar-label")[0].text for b in bars]
    assert labels[4] == f"cuda.coredump pid {tp1} · timed_out · 5,000.0 ms"
    assert labels[2] == f"pyspy.dump pid {EVIL_PID} · permission_denied · 4.0 ms"
    rects = [b.find_all("rect")[0] for b in bars]
    x = [float(r.attrs["x"]) for r in rects]
    w = [float(r.attrs["width"]) for r in rects]
    assert [r.attrs["class"] for r in rects] == ["ok", "ok", "bad", "ok", "warn", "ok"]
    # one scale for all bars: offsets and widths keep the manifest's ratios (ms)
    px_per_ms = (x[5] - x[0]) / (5930 - 12.5)
    assert (x[3] - x[0]) == pytest.approx((925 - 12.5) * px_per_ms, rel=1e-3)
    assert w[4] == pytest.approx(5000 * px_per_ms, rel=1e-3)
    assert w[4] / w[0] == pytest.approx(5000 / 850, rel=1e-2)
    assert w[2] == pytest.approx(2.0)  # a 4 ms action stays visible
    assert float(svg.attrs["width"]) >= x[5] + w[5]


@needs_chromium
def test_stacks_show_every_thread_and_highlight_the_hung_frame(dom: tuple[Node, str], bundle: Bundle) -> None:
    root, _ = dom
    for pid in bundle.pids:
        proc = root.by_id(f"pid-{pid}")
        threads = proc.find_all("details", "thread")
        assert sorted(t.attrs["data-thread-name"] for t in threads) == sorted(bundle.thread_names[pid])
        assert threads[0].attrs["data-thread-name"] == "MainThread"  # the hung thread comes first
        (hung,) = proc.find_all("li", "hung")
        assert re.sub(r"\s+", " ", hung.text).strip() == bundle.hung_frames[pid]
        assert proc.find_all("code", "hung-frame")[0].text == bundle.hung_frames[pid]
        frames = [f.find_all("span", "fn")[0].text for f in threads[0].find_all("li", "frame")]
        assert "hung_in_fake_allreduce" in frames and "main" in frames
    evil = root.by_id(f"pid-{EVIL_PID}")
    assert EVIL_TITLE in evil.text
    assert "No stacks: permission_denied: Permission denied (needs CAP_SYS_PTRACE)" in evil.text


@needs_chromium
def test_summary_outcomes_sizes_and_requests_are_shown(dom: tuple[Node, str], bundle: Bundle) -> None:
    root, _ = dom
    assert root.by_id("incident-id").text == INCIDENT_ID
    assert root.by_id("trigger").text == "stall"
    outcomes = [s.text for s in root.by_id("actions").find_all("span", "outcome")]
    assert outcomes == ["ok", "ok", "permission_denied", "ok", "timed_out", "ok"]
    core = root.by_id("coredump-table").find_all("tr")[1]
    assert f"{COREDUMP_SIZE_BYTES:,}" in core.text and "11.77 MiB" in core.text
    requests = root.by_id("request-table").find_all("tr")[1:]
    assert [r.find_all("td")[0].text for r in requests] == [r["request_id"] for r in REQUESTS]
    assert [r.find_all("td")[3].text for r in requests] == [str(r["prompt_tokens"]) for r in REQUESTS]
    artifacts = root.by_id("artifact-table").text
    assert f"pyspy-{bundle.pids[1]}.json" in artifacts and "missing" not in artifacts
    spans = root.by_id("spans-svg").find_all("g", "bar")
    assert [s.attrs["data-span"] for s in spans][-2:] == ["ProfilerStep#3", "aten::mm"]
    assert SECRET_PROMPT not in root.text


@needs_chromium
def test_page_makes_no_network_requests(dom: tuple[Node, str]) -> None:
    root, stderr = dom
    nodes = list(root.iter())
    assert not [n.tag for n in nodes if n.tag in ("script", "link", "img", "iframe", "object", "embed", "base")]
    assert [n.attrs[a] for n in nodes for a in URL_ATTRS if a in n.attrs] == []
    assert all("url(" not in n.attrs.get("style", "") for n in nodes)
    meta = [n for n in root.find_all("meta") if n.attrs.get("http-equiv", "").lower() == "content-security-policy"]
    assert [m.attrs["content"] for m in meta] == [CSP]
    assert CSP_VIOLATION not in stderr  # no blocked load was even attempted
    assert ":CONSOLE" not in stderr  # nor anything else logged by the page


@needs_chromium
def test_the_violation_check_sees_a_page_that_loads_something(tmp_path: Path) -> None:
    page = tmp_path / "leaky.html"
    page.write_text(f'<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" content="{CSP}">'
                    '</head><body><img src="http://192.0.2.1/pixel.png"></body></html>')
    done = run_chromium(page, tmp_path / "profile", *LOGGING, "--dump-dom")
    assert CSP_VIOLATION in done.stderr and "192.0.2.1" in done.stderr


@needs_chromium
def test_screenshot_renders_the_page(report: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    run_chromium(report, tmp_path / "profile", f"--screenshot={shot}", "--hide-scrollbars")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == WINDOW
    assert len(data) > 50_000  # a blank page of this size compresses to a few KiB


def test_incident_without_actions_still_makes_a_page(tmp_path: Path) -> None:
    bundle_dir = tmp_path / "h1" / "20261129T100000Z-health-000001"
    bundle_dir.mkdir(parents=True)
    (bundle_dir / "manifest.json").write_text(
        '{"schema": "servewatch.incident/1", "incident_id": "20261129T100000Z-health-000001", "trigger": "health",'
        ' "detail": "http://127.0.0.1:30000/health failed 3 probes in a row (HTTP 503)", "host.name": "h1",'
        ' "opened_time_unix_nano": 1000, "closed_time_unix_nano": 2000, "targets": [], "actions": []}')
    markup = render_report_html(load_incident(bundle_dir))
    assert "<p>No actions ran.</p>" in markup and 'id="timeline-svg"' not in markup
    assert 'id="trigger">health</span>' in markup
    assert "http:&#x2F;&#x2F;" not in markup and "http://127.0.0.1:30000/health failed" in markup  # text, not a link
    assert "<a " not in markup and 'id="stacks"' not in markup


def test_write_report_into_a_missing_folder_fails_and_creates_nothing(tl: IncidentTimeline, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_report(tl, tmp_path / "missing" / "report.html")
    assert list(tmp_path.iterdir()) == []


# --- the server's timeline: history, requests, the watchdog, then the evidence ---------------------


def _with_history(tl: IncidentTimeline, bundle: Bundle) -> IncidentTimeline:
    """The fixture incident as an agent that watched the server records it: the last step
    readings, when progress stopped, the watchdog firing, and a verdict naming TP0."""
    from dataclasses import replace

    from agent.views.bundle import HistoryRow

    tp0, tp1 = bundle.pids
    o = tl.opened_time_unix_nano
    ms = 1_000_000

    def row(at_ms: int, kind: str, pid: int | None, ct: int | None, detail: str) -> HistoryRow:
        return HistoryRow(time_unix_nano=o + at_ms * ms, offset_s=at_ms / 1e3, kind=kind, pid=pid, forward_ct=ct, detail=detail)

    history = (
        *(row(-40_000 + 1000 * i, "step", tp0, 1228 + i, "+1 step(s); work pending") for i in range(5)),
        *(row(-40_000 + 1000 * i, "step", tp1, 1228 + i, "+1 step(s); work pending") for i in range(5)),
        row(-36_000, "progress_stopped", tp0, 1232, f"last forward step of pid {tp0} (forward_ct=1232); busy from then on"),
        row(-5, "stall", tp0, 1234, "watchdog fired: busy and no forward progress for 31.0 s (timeout 30 s)"),
    )
    headline = f"Verdict: culprit rank 0 (pid {tp0}) -- behind: rank 0 never entered all_reduce #9 of pg 0 [confidence high]"
    verdict = {"kind": "behind", "hung": True, "culprit_ranks": [0], "culprit_pids": [tp0], "reason": "behind",
               "confidence": "high", "headline": headline, "evidence": [f"rank 0 pid {tp0}; compute", f"rank 1 pid {tp1}; collective"]}
    return replace(tl, history=history, verdict=verdict)


def _document_order(root: Node) -> dict[str, int]:
    order: dict[str, int] = {}
    for i, node in enumerate(root.iter()):
        key = node.attrs.get("id") or ("summary" if "summary" in node.classes and node.tag == "dl" else "")
        if key and key not in order:
            order[key] = i
    return order


def _check_server_timeline(root: Node, bundle: Bundle) -> None:
    tp0, tp1 = bundle.pids
    order = _document_order(root)
    # the 30-second read comes first: the verdict, each rank's evidence, the summary, then the timeline
    assert order["verdict"] < order["rank-table"] < order["summary"] < order["history"] < order["capture"] < order["stacks"]
    ranks = root.by_id("rank-table").find_all("tr", "rank")
    assert [r.attrs["data-pid"] for r in ranks][:2] == [str(tp0), str(tp1)]
    assert "culprit" in ranks[0].classes and "culprit" not in ranks[1].classes
    assert ranks[0].find_all("code", "hung-frame")[0].text == bundle.hung_frames[tp0]
    rows = root.by_id("history").find_all("tr")[1:]
    kinds = [r.attrs["data-kind"] for r in rows]
    # the server's story, in time order: earlier readings summed up, the last steps, progress
    # stopping, the requests in flight, the watchdog, the open, then the evidence as captured
    first = {k: kinds.index(k) for k in ("steps", "step", "progress_stopped", "request", "stall", "opened", "evidence")}
    assert first["steps"] < first["step"] < first["progress_stopped"] < first["request"] < first["stall"] < first["opened"] < first["evidence"]
    assert kinds.count("step") == 6 and kinds.count("steps") == 2  # the last 3 readings per rank shown, the rest summed
    assert kinds[-1] == "closed"
    evidence = [r for r in rows if r.attrs["data-kind"] == "evidence"]
    assert [r.attrs["data-outcome"] for r in evidence] == ["ok", "ok", "permission_denied", "ok", "timed_out", "ok"]
    stopped = rows[kinds.index("progress_stopped")].find_all("td")
    # every moment in UTC, local time and from the open
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}", stopped[0].text)
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}( \S+)?", stopped[1].text)
    assert stopped[2].text == "-36.000 s" and f"pid {tp0}" in stopped[3].text
    requests = [r for r in rows if r.attrs["data-kind"] == "request"]
    assert len(requests) == len(REQUESTS) and all("still in flight" in r.text for r in requests)


def test_the_timeline_tells_the_server_s_story_before_the_evidence(tl: IncidentTimeline, bundle: Bundle) -> None:
    _check_server_timeline(parse_dom(render_report_html(_with_history(tl, bundle))), bundle)


@needs_chromium
def test_the_rendered_page_keeps_that_order(tl: IncidentTimeline, bundle: Bundle, tmp_path: Path) -> None:
    page = write_report(_with_history(tl, bundle), tmp_path / "report.html")
    done = run_chromium(page, tmp_path / "profile", *LOGGING, "--dump-dom")
    _check_server_timeline(parse_dom(done.stdout), bundle)
    assert CSP_VIOLATION not in done.stderr


def test_the_template_compiled_ahead_is_current(tmp_path: Path) -> None:
    """`report` loads the template jinja2 compiled ahead (agent/views/templates/compiled/); after an
    edit of report.html or a jinja2 upgrade, `python -c "from agent.views.report import compile_template;
    compile_template()"` rewrites it (until then `report` compiles the source at each run). Under
    another jinja2 than the one it was compiled by (jinja2 is not pinned), `report` compiles the
    source: that is checked instead of the bytes."""
    import jinja2

    stamped = (report_mod._COMPILED_STAMP.read_text(encoding="utf-8")).split()
    wanted = report_mod._stamp(jinja2).split()
    assert stamped[:3] == wanted[:3], "templates/report.html changed: run compile_template()"
    if stamped != wanted:  # another jinja2 here: the source is compiled at each run, as before
        report_mod._template.cache_clear()
        try:
            assert report_mod._template().environment.loader.__class__.__name__ == "PackageLoader"
        finally:
            report_mod._template.cache_clear()
        return
    fresh = report_mod.compile_template(tmp_path)
    shipped = report_mod._COMPILED
    assert sorted(p.name for p in fresh.iterdir()) == sorted(p.name for p in shipped.iterdir() if p.is_file())
    for path in fresh.iterdir():
        assert (shipped / path.name).read_bytes() == path.read_bytes(), f"{path.name} is stale: run compile_template()"


def test_the_template_compiled_ahead_renders_what_the_source_renders(tl: IncidentTimeline, monkeypatch: pytest.MonkeyPatch) -> None:
    import jinja2

    report_mod._template.cache_clear()
    try:
        ahead = report_mod._template()
        current = report_mod._COMPILED_STAMP.read_text(encoding="utf-8") == report_mod._stamp(jinja2)
        assert ahead.environment.loader.__class__.__name__ == ("ModuleLoader" if current else "PackageLoader")
        page = render_report_html(tl)
        report_mod._template.cache_clear()
        monkeypatch.setattr(report_mod, "_COMPILED_STAMP", report_mod._COMPILED / "no-such.stamp")  # as if stale
        source = report_mod._template()
        assert source.environment.loader.__class__.__name__ == "PackageLoader"
        assert render_report_html(tl) == page
    finally:
        report_mod._template.cache_clear()
