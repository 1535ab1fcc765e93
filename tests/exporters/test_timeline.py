"""Tests of agent.views.bundle and agent.views.timeline: a realistic bundle (real py-spy stacks) read back
and rendered."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rich.console import Console

import agent.views.timeline as timeline_mod
from agent.views.bundle import (
    BundleCorruptError,
    BundleError,
    BundleNotFoundError,
    IncidentTimeline,
    find_bundle,
    load_incident,
    load_incident_arg,
    newer_manual_dumps,
)
from agent.views.timeline import render_timeline, render_timeline_text, timeline_to_dict
from tests.exporters.bundle_fixture import (
    COREDUMP_SIZE_BYTES,
    EVIL_PID,
    EVIL_TITLE,
    HOST,
    INCIDENT_ID,
    OPENED_NS,
    PROFILE_STEPS,
    REQUESTS,
    ROOT_SPAN_ID,
    SECRET_PROMPT,
    TRACE_ID,
    Bundle,
    write_bundle,
)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    return write_bundle(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def tl(bundle: Bundle) -> IncidentTimeline:
    return load_incident(bundle.data_dir, INCIDENT_ID)


def _minimal(data_dir: Path, incident_id: str, opened_ns: int, **extra: object) -> Path:
    bundle_dir = data_dir / "h1" / incident_id
    bundle_dir.mkdir(parents=True)
    manifest = {"schema": "servewatch.incident/1", "incident_id": incident_id, "trigger": "manual",
                "detail": "d", "host.name": "h1", "trace_id": "", "span_id": "",
                "opened_time_unix_nano": opened_ns, "closed_time_unix_nano": opened_ns + 10**9,
                "duration_s": 1.0, "targets": [], "actions": [], "inflight_requests": 0, **extra}
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest))
    return bundle_dir


def test_all_matches_public_names() -> None:
    public = {n for n, v in vars(timeline_mod).items() if not n.startswith("_") and getattr(v, "__module__", None) == timeline_mod.__name__}
    assert public <= set(timeline_mod.__all__)
    assert all(hasattr(timeline_mod, n) for n in timeline_mod.__all__)


@pytest.mark.parametrize("form", ["bundle_dir", "manifest", "data_dir_id", "data_dir_suffix", "data_dir_latest", "data_dir_alone"])
def test_every_path_form_resolves_to_the_bundle(bundle: Bundle, form: str) -> None:
    args: dict[str, tuple[object, ...]] = {
        "bundle_dir": (bundle.bundle_dir,),
        "manifest": (bundle.bundle_dir / "manifest.json",),
        "data_dir_id": (bundle.data_dir, INCIDENT_ID),
        "data_dir_suffix": (bundle.data_dir, "a1b2c3"),
        "data_dir_latest": (bundle.data_dir, "latest"),
        "data_dir_alone": (str(bundle.data_dir),),
    }
    got = load_incident(*args[form])  # type: ignore[arg-type]
    assert got.incident_id == INCIDENT_ID
    assert Path(got.bundle_dir) == bundle.bundle_dir


@pytest.mark.parametrize("form", ["none", "id", "suffix", "bundle_dir", "manifest", "host_dir"])
def test_cli_argument_is_a_path_or_an_id_under_the_data_dir(bundle: Bundle, form: str, tmp_path: Path) -> None:
    arg = {"none": None, "id": INCIDENT_ID, "suffix": "stall-a1b2c3", "bundle_dir": str(bundle.bundle_dir),
           "manifest": str(bundle.bundle_dir / "manifest.json"), "host_dir": str(bundle.data_dir / HOST)}[form]
    data_dir = bundle.data_dir if form in ("none", "id", "suffix") else tmp_path  # paths need no data dir
    assert Path(load_incident_arg(arg, data_dir=data_dir).bundle_dir) == bundle.bundle_dir


def test_cli_argument_errors_name_the_data_dir(tmp_path: Path) -> None:
    with pytest.raises(BundleNotFoundError, match=f"{tmp_path}: no incident bundles"):
        load_incident_arg(None, data_dir=tmp_path)
    _minimal(tmp_path, "20261129T100000Z-manual-ffffff", 1)
    with pytest.raises(BundleNotFoundError, match="no incident 'zzz'"):
        load_incident_arg("zzz", data_dir=tmp_path)


NOBODY = 65534
as_root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to read as another uid (nobody)")


def _read_as_nobody(read: Callable[[], object]) -> str:
    """``read()`` in a forked child running as nobody (a real other uid): ``ok``, or the error
    it raised as ``<type>: <message>``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                read()
                said = "ok"
            except BaseException as exc:  # noqa: BLE001 - whatever it is, the test shows it
                said = f"{type(exc).__name__}: {exc}"
            os.write(w, said.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        said = fh.read().decode()
    os.waitpid(pid, 0)
    return said


@pytest.fixture
def roots_data() -> Iterator[Path]:
    """Root's 0700 data dir holding one bundle, in a folder anyone may enter."""
    parent = Path(tempfile.mkdtemp(prefix="sw-roots-data-", dir="/tmp"))
    try:
        parent.chmod(0o755)
        data = parent / "servewatch-data"
        data.mkdir(mode=0o700)
        _minimal(data, "20261129T100000Z-stall-abc123", 1)
        data.chmod(0o700)
        yield data
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@as_root_only
@pytest.mark.parametrize("form", ["bundle_dir", "manifest", "missing", "data_dir"])
def test_a_path_under_roots_data_dir_read_without_sudo_says_whose_folder(roots_data: Path, form: str) -> None:
    """The engineer who forgot sudo: a path under root's 0700 data dir (existing or not) is one
    BundleError naming the folder, its owner and what to do, never a PermissionError."""
    bundle = roots_data / "h1" / "20261129T100000Z-stall-abc123"
    arg = {"bundle_dir": bundle, "manifest": bundle / "manifest.json", "missing": roots_data / "nope",
           "data_dir": roots_data}[form]
    said = _read_as_nobody(lambda: load_incident_arg(str(arg), data_dir="/nonexistent"))
    assert said == f"BundleError: cannot read {arg}: {roots_data} is owned by root (0700): run as root (sudo)"


@as_root_only
@pytest.mark.parametrize("arg", [None, "latest", "abc123", "20261129T100000Z-stall-abc123"])
def test_an_id_in_roots_data_dir_read_without_sudo_says_the_permission_not_no_bundles(
    roots_data: Path, arg: str | None
) -> None:
    said = _read_as_nobody(lambda: load_incident_arg(arg, data_dir=roots_data))
    assert said == (f"BundleError: cannot read the incidents in {roots_data}: {roots_data} is owned by root (0700):"
                    " run as root (sudo)")


@as_root_only
def test_a_host_folder_closed_to_this_user_is_named_instead_of_no_bundles(roots_data: Path) -> None:
    roots_data.chmod(0o755)
    (roots_data / "h1").chmod(0o700)
    said = _read_as_nobody(lambda: find_bundle(roots_data, "latest"))
    assert said == (f"BundleError: cannot read the incidents in {roots_data}: {roots_data}/h1 is owned by root (0700):"
                    " run as root (sudo)")


def test_manifest_fields_and_action_offsets(tl: IncidentTimeline, bundle: Bundle) -> None:
    tp0, tp1 = bundle.pids
    assert (tl.trigger, tl.host_name, tl.trace_id, tl.span_id) == ("stall", HOST, TRACE_ID, ROOT_SPAN_ID)
    assert tl.opened_time_unix_nano == OPENED_NS and tl.duration_s == 7.5
    rows = [(a.action, a.pid, a.outcome, round(a.start_offset_s * 1e3, 3), round(a.duration_s * 1e3, 3))
            for a in tl.actions if a.start_offset_s is not None]
    assert rows == [
        ("pyspy.dump", tp0, "ok", 12.5, 850.0),
        ("pyspy.dump", tp1, "ok", 13.0, 910.0),
        ("pyspy.dump", EVIL_PID, "permission_denied", 13.5, 4.0),
        ("cuda.coredump", tp0, "ok", 925.0, 2500.0),
        ("cuda.coredump", tp1, "timed_out", 926.0, 5000.0),
        ("profile.session", tp0, "ok", 5930.0, 1500.0),
    ]
    assert [a.title for a in tl.actions[:3]] == ["demo::scheduler_TP0", "demo::scheduler_TP1", EVIL_TITLE]
    assert tl.actions[4].retryable is True and tl.actions[4].detail == "no core after 5s"
    assert tl.extent_s == pytest.approx(7.5)


def test_hung_frame_from_attribute_and_from_real_stacks(tl: IncidentTimeline, bundle: Bundle) -> None:
    tp0, tp1 = bundle.pids
    by_pid = {s.pid: s for s in tl.stacks}
    assert list(by_pid) == [tp0, tp1, EVIL_PID]
    assert by_pid[tp0].hung_frame == bundle.hung_frames[tp0]
    assert by_pid[tp0].hung_frame_source == "attribute"
    # TP1's dump has no summary attributes: the frame is read from pyspy-<pid>.json, skipping
    # the stdlib waits (Condition.wait, Event.wait) above it.
    assert by_pid[tp1].hung_frame == bundle.hung_frames[tp1]
    assert by_pid[tp1].hung_frame_source == "stacks"
    for pid in (tp0, tp1):
        s = by_pid[pid]
        assert sorted(t.thread_name for t in s.threads) == sorted(bundle.thread_names[pid])
        assert s.thread_count == len(bundle.thread_names[pid])
        hung_thread = next(t for t in s.threads if t.thread_id == s.hung_thread_id)
        assert hung_thread.thread_name == "MainThread"
        assert s.hung_frame_index is not None
        assert hung_thread.frames[s.hung_frame_index].name == "hung_in_fake_allreduce"
    evil = by_pid[EVIL_PID]
    assert (evil.threads, evil.hung_frame, evil.thread_count, evil.title) == ((), None, None, EVIL_TITLE)


def test_coredump_profile_requests_and_artifacts(tl: IncidentTimeline, bundle: Bundle) -> None:
    tp0, tp1 = bundle.pids
    assert [(c.pid, c.outcome, c.size_bytes) for c in tl.coredumps] == [
        (tp0, "ok", COREDUMP_SIZE_BYTES), (tp1, "timed_out", None)]
    assert tl.coredumps[0].path == str(bundle.bundle_dir / f"core.{tp0}.nvcudmp")
    (profile,) = tl.profiles
    assert (profile.pid, profile.steps_captured, profile.duration_s) == (tp0, PROFILE_STEPS, 1.5)
    trace = bundle.bundle_dir / "profile" / f"trace-{tp0}.pt.trace.json"
    assert profile.trace_paths == (str(trace),)
    assert profile.trace_size_bytes == trace.stat().st_size
    assert profile.attributes["servewatch.profile.backend"] == "torch"
    assert [(r.request_id, r.age_s, r.prompt_tokens, r.generated_tokens) for r in tl.requests] == [
        (r["request_id"], r["age_s"], r["prompt_tokens"], r["generated_tokens"]) for r in REQUESTS]
    assert tl.inflight_count == 3
    sizes = {Path(a.path).name: a.size_bytes for a in tl.artifacts}
    assert sizes[f"core.{tp0}.nvcudmp"] == COREDUMP_SIZE_BYTES
    assert sizes[f"pyspy-{tp1}.json"] == (bundle.bundle_dir / f"pyspy-{tp1}.json").stat().st_size
    assert len(tl.artifacts) == 6 and all(a.exists for a in tl.artifacts)


def test_spans_of_the_incident_trace_enrich_once_each(tl: IncidentTimeline, bundle: Bundle) -> None:
    # the file holds another trace and the incident's line twice (a replay): 6 distinct spans
    assert [(s.name, round(s.start_offset_s * 1e3, 3)) for s in tl.spans] == [
        ("incident", 0.0), ("pyspy.dump", 12.5), ("cuda.coredump", 926.0), ("profile.session", 5930.0),
        ("ProfilerStep#3", 6000.0), ("aten::mm", 6001.0)]
    assert tl.spans[2].status_code == 2
    assert tl.spans[5].parent_span_id == tl.spans[4].span_id
    assert tl.span_files == (str(bundle.span_file),)


def test_render_shows_trigger_offsets_outcomes_hung_frames_and_sizes(tl: IncidentTimeline, bundle: Bundle) -> None:
    console = Console(record=True, width=250, force_terminal=True, color_system="standard")
    render_timeline(tl, console)
    styled = console.export_text(styles=True, clear=False)
    text = console.export_text()
    tp0, tp1 = bundle.pids
    assert INCIDENT_ID in text and "stall" in text
    assert f"busy and no forward progress for 31.0s (timeout 30s, forward_ct=1234, pid {tp0})" in text
    for cell in ("12.5", "850.0", "925.0", "2,500.0", "926.0", "5,000.0", "5,930.0", "1,500.0"):
        assert cell in text
    assert bundle.hung_frames[tp0] in text
    assert "11.77 MiB (12,345,678 bytes)" in text
    assert "req-0002" in text and "4096" in text and "31.250" in text
    assert EVIL_TITLE in text  # printed literally: no markup was interpreted
    assert "\x1b[1;32mok" in styled and "\x1b[1;33mtimed_out" in styled and "\x1b[1;31mpermission_denied" in styled
    assert SECRET_PROMPT not in text
    tp1_block = text[text.index(f"pid {tp1} · "):]  # the process block of TP1 (its actions under it)
    line = next(ln for ln in tp1_block.splitlines() if "cuda.coredump" in ln and "timed_out" in ln)
    assert "926.0" in line and "5,000.0" in line


def _unboxed(text: str) -> str:
    """The words of a rendering without panel borders and line breaks (what a reader sees)."""
    return " ".join(text.replace("│", " ").replace("╭", " ").replace("╰", " ").split())


def test_at_80_columns_lines_fit_and_the_last_screen_shows_the_verdict_and_every_hung_frame(
    tl: IncidentTimeline, bundle: Bundle
) -> None:
    """A terminal of 80 columns: nothing wider, no detail cut into a narrow column (whole words),
    and the last 24 lines (one screen) hold the verdict and each process's hung frame."""
    import dataclasses

    tp0, tp1 = bundle.pids
    headline = f"Verdict: culprit rank 1 (pid {tp1}) -- behind: rank 1 never entered all_reduce #7 of pg 0; rank 0 waits in it [confidence high]"
    judged = dataclasses.replace(tl, verdict={"kind": "behind", "hung": True, "culprit_ranks": [1], "culprit_pids": [tp1],
                                              "reason": "behind", "confidence": "high", "headline": headline,
                                              "evidence": [f"rank 0 pid {tp0}; collective", f"rank 1 pid {tp1}; compute"]})
    text = render_timeline_text(judged, width=80)
    assert max(len(line) for line in text.splitlines()) <= 80
    last_screen = _unboxed("\n".join(text.splitlines()[-24:]))
    assert headline in last_screen
    assert f"pid {tp1} (culprit): {bundle.hung_frames[tp1]}" in last_screen
    assert f"pid {tp0}: {bundle.hung_frames[tp0]}" in last_screen
    assert f"pid {EVIL_PID}: unknown" in last_screen
    # every action's detail is whole: a sentence wrapped at word boundaries, never a 10-column strip
    for action in judged.actions:
        if action.detail:
            assert action.detail in _unboxed(text), action.detail
    # the verdict also opens it (above the header), as in the summary and the report
    assert _unboxed(text).index(headline) < _unboxed(text).index("trigger stall")


def test_without_a_verdict_the_last_screen_still_lists_every_hung_frame(tl: IncidentTimeline, bundle: Bundle) -> None:
    text = render_timeline_text(tl, width=80)
    last_screen = _unboxed("\n".join(text.splitlines()[-12:]))
    assert "hung frames · stall" in last_screen and "no verdict recorded" in last_screen
    for pid in bundle.pids:
        assert f"pid {pid}: {bundle.hung_frames[pid]}" in last_screen


def test_plain_text_form_has_no_escape_codes(tl: IncidentTimeline) -> None:
    text = render_timeline_text(tl, width=200)
    assert "\x1b[" not in text
    assert "permission_denied" in text and "hung_in_fake_allreduce" in text


def test_json_form_is_complete_and_never_holds_prompt_text(tl: IncidentTimeline, bundle: Bundle) -> None:
    data = json.loads(json.dumps(timeline_to_dict(tl)))
    assert data["schema"] == "servewatch.timeline/1"
    assert data["incident_id"] == INCIDENT_ID and data["trigger"] == "stall"
    assert data["actions"][3]["start_offset_s"] == pytest.approx(0.925)
    assert data["actions"][3]["end_offset_s"] == pytest.approx(3.425)
    assert data["stacks"][1]["hung_frame"] == bundle.hung_frames[bundle.pids[1]]
    assert data["coredumps"][0]["size_bytes"] == COREDUMP_SIZE_BYTES
    assert data["artifacts"][0]["exists"] is True
    assert data["extent_s"] == pytest.approx(7.5)
    assert SECRET_PROMPT not in json.dumps(data)
    assert "prompt" not in data["requests"][2]


def test_copied_bundle_renders_offline_from_its_own_files(bundle: Bundle, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "incident-copy"
    shutil.copytree(bundle.bundle_dir, copy)
    got = load_incident(copy)
    assert Path(got.bundle_dir) == copy
    assert all(Path(a.path).is_relative_to(copy) and a.exists for a in got.artifacts)
    assert got.coredumps[0].path == str(copy / f"core.{bundle.pids[0]}.nvcudmp")
    assert got.coredumps[0].size_bytes == COREDUMP_SIZE_BYTES
    assert all(Path(s.stacks_path).is_relative_to(copy) for s in got.stacks[:2])
    assert [s.hung_frame for s in got.stacks[:2]] == [bundle.hung_frames[p] for p in bundle.pids]
    assert got.spans == () and len(got.requests) == 3  # no span files travel with it; requests.json does
    text = render_timeline_text(got, width=250)
    assert "permission_denied" in text and bundle.hung_frames[bundle.pids[1]] in text
    enriched = load_incident(copy, span_paths=[bundle.span_file])
    assert len(enriched.spans) == 6


def test_missing_artifacts_are_reported_not_fatal(bundle: Bundle, tmp_path: Path) -> None:
    copy = tmp_path / "partial"
    shutil.copytree(bundle.bundle_dir, copy)
    manifest = copy / "manifest.json"  # as if copied off the host that wrote it: recorded paths are gone
    manifest.write_text(manifest.read_text().replace(str(bundle.bundle_dir), str(tmp_path / "gone" / INCIDENT_ID)))
    tp0, tp1 = bundle.pids
    (copy / f"pyspy-{tp1}.json").write_text("[{not json")
    (copy / f"core.{tp0}.nvcudmp").unlink()
    got = load_incident(copy, span_paths=[])
    s1 = next(s for s in got.stacks if s.pid == tp1)
    assert s1.threads == () and s1.hung_frame is None and s1.error.startswith("JSONDecodeError")
    assert any(f"stacks of pid {tp1} unreadable" in w for w in got.warnings)
    s0 = next(s for s in got.stacks if s.pid == tp0)
    assert s0.hung_frame == bundle.hung_frames[tp0]  # the span attribute still says where
    core = next(a for a in got.artifacts if a.action == "cuda.coredump")
    assert core.exists is False
    text = render_timeline_text(got, width=250)
    assert "stacks unreadable" in text and "missing" in text


def test_latest_is_the_last_opened_and_prefixes_must_be_unique(tmp_path: Path) -> None:
    _minimal(tmp_path, "20261129T100000Z-manual-aaaaaa", 2_000)
    _minimal(tmp_path, "20261129T090000Z-manual-bbbbbb", 3_000)
    assert find_bundle(tmp_path, "latest").name == "20261129T090000Z-manual-bbbbbb"
    assert find_bundle(tmp_path, "aaaaaa").name == "20261129T100000Z-manual-aaaaaa"
    with pytest.raises(BundleError, match="matches 2 incidents") as excinfo:
        find_bundle(tmp_path, "20261129T")
    assert not isinstance(excinfo.value, (BundleNotFoundError, BundleCorruptError))


def test_latest_is_the_incident_that_paged_not_the_manual_dump_taken_after_it(tmp_path: Path) -> None:
    """The Paged section: 1. status, 2. timeline latest, 3. dump; `timeline latest` again still
    shows the stall that paged, and the dumps since are named."""
    opened = 1_796_151_600 * 10**9
    _minimal(tmp_path, "20261201T185000Z-manual-aaaaaa", opened - 600 * 10**9)
    _minimal(tmp_path, "20261201T190000Z-stall-bbbbbb", opened, trigger="stall")
    _minimal(tmp_path, "20261201T191000Z-manual-cccccc", opened + 600 * 10**9)
    _minimal(tmp_path, "20261201T192000Z-manual-dddddd", opened + 1200 * 10**9)
    assert find_bundle(tmp_path, "latest").name == "20261201T190000Z-stall-bbbbbb"
    assert load_incident(tmp_path, "latest").incident_id == "20261201T190000Z-stall-bbbbbb"
    assert newer_manual_dumps(tmp_path) == ["20261201T191000Z-manual-cccccc", "20261201T192000Z-manual-dddddd"]
    # a newer incident the agent opened by itself is the latest again
    _minimal(tmp_path, "20261201T193000Z-health-eeeeee", opened + 1800 * 10**9, trigger="health")
    assert (find_bundle(tmp_path, "latest").name, newer_manual_dumps(tmp_path)) == ("20261201T193000Z-health-eeeeee", [])


def test_with_only_manual_dumps_latest_is_the_last_one(tmp_path: Path) -> None:
    _minimal(tmp_path, "20261201T185000Z-manual-aaaaaa", 1_000)
    _minimal(tmp_path, "20261201T186000Z-manual-bbbbbb", 2_000)
    assert (find_bundle(tmp_path, "latest").name, newer_manual_dumps(tmp_path)) == ("20261201T186000Z-manual-bbbbbb", [])


def test_latest_is_not_an_older_bundle_damaged_today(tmp_path: Path) -> None:
    """An older bundle whose manifest is unreadable (a hand edit, a copy, a disk error) is dated by
    its id, not by the manifest's mtime (now): `latest` is still the last incident, readable."""
    opened = 1_796_151_600 * 10**9  # 2026-12-01T19:00:00Z
    older = _minimal(tmp_path, "20261201T185000Z-manual-aaaaaa", opened - 600 * 10**9)
    _minimal(tmp_path, "20261201T190000Z-stall-bbbbbb", opened)
    (older / "manifest.json").write_text("{")  # damaged after the newer one was written
    assert find_bundle(tmp_path, "latest").name == "20261201T190000Z-stall-bbbbbb"
    assert load_incident(tmp_path, "latest").incident_id == "20261201T190000Z-stall-bbbbbb"
    with pytest.raises(BundleCorruptError, match="not valid JSON"):  # asked for by name: refused
        load_incident(tmp_path, "aaaaaa")


def test_requests_come_from_span_links_without_requests_json(tmp_path: Path) -> None:
    trace_id, root = "1" * 32, "2" * 16
    bundle_dir = _minimal(tmp_path, "20261129T100000Z-health-cccccc", 10**18, trace_id=trace_id, span_id=root)
    span = {"traceId": trace_id, "spanId": root, "name": "incident", "startTimeUnixNano": str(10**18),
            "endTimeUnixNano": str(10**18 + 10**9),
            "links": [{"traceId": "a" * 32, "spanId": "b" * 16,
                       "attributes": [{"key": "servewatch.request.id", "value": {"stringValue": "r-9"}}]}]}
    line = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]})
    (tmp_path / "spans.jsonl").write_text(line + "\n" + line[:40])  # plus a truncated last line
    got = load_incident(bundle_dir)  # the data dir is found from <data_dir>/<host>/<id>
    assert [(r.request_id, r.trace_id, r.span_id) for r in got.requests] == [("r-9", "a" * 32, "b" * 16)]
    assert [s.name for s in got.spans] == ["incident"]


@pytest.mark.parametrize(
    ("setup", "error", "message"),
    [
        ("nothing", BundleNotFoundError, "no such incident bundle or data directory"),
        ("empty_data_dir", BundleNotFoundError, "no incident bundles"),
        ("unknown_id", BundleNotFoundError, "no incident 'nope'"),
        ("not_json", BundleCorruptError, "not valid JSON"),
        ("wrong_schema", BundleCorruptError, "schema 'other/1'"),
        ("no_opened_time", BundleCorruptError, "not a servewatch incident manifest: opened_time_unix_nano: field required"),
        ("actions_not_list", BundleCorruptError, "not a servewatch incident manifest: actions: input should be an array"),
    ],
)
def test_bad_bundles_raise_one_line_errors(tmp_path: Path, setup: str, error: type[BundleError], message: str) -> None:
    args: tuple[object, ...]
    if setup == "nothing":
        args = (tmp_path / "absent",)
    elif setup == "empty_data_dir":
        args = (tmp_path,)
    elif setup == "unknown_id":
        _minimal(tmp_path, "20261129T100000Z-manual-dddddd", 1)
        args = (tmp_path, "nope")
    else:
        bundle_dir = _minimal(tmp_path, "x", 1)
        manifest = bundle_dir / "manifest.json"
        data = json.loads(manifest.read_text())
        if setup == "not_json":
            manifest.write_text("{truncated")
        elif setup == "wrong_schema":
            manifest.write_text(json.dumps({**data, "schema": "other/1"}))
        elif setup == "no_opened_time":
            manifest.write_text(json.dumps({k: v for k, v in data.items() if k != "opened_time_unix_nano"}))
        else:
            manifest.write_text(json.dumps({**data, "actions": {"a": 1}}))
        args = (bundle_dir,)
    with pytest.raises(error, match=message) as excinfo:
        load_incident(*args)  # type: ignore[arg-type]
    assert "\n" not in str(excinfo.value)


def test_hung_frame_rule_skips_native_and_stdlib_waits_like_the_pyspy_actor(tmp_path: Path) -> None:
    pid = 777
    bundle_dir = _minimal(tmp_path, "20261129T100000Z-stall-eeeeee", 10**18, actions=[
        {"action": "pyspy.dump", "pid": pid, "outcome": "ok", "start_time_unix_nano": 10**18,
         "end_time_unix_nano": 10**18 + 10**8, "artifact_paths": [], "attributes": {}},
        {"action": "pyspy.dump", "pid": pid + 1, "outcome": "ok", "start_time_unix_nano": 10**18,
         "end_time_unix_nano": 10**18 + 10**8, "artifact_paths": [],
         "attributes": {"servewatch.pyspy.stacks": ["MainThread: forward (model.py:7)"]}},
    ])
    site = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
    threads = [
        {"thread_id": 1, "thread_name": "pt_autograd_0", "os_thread_id": 780, "active": True, "owns_gil": False,
         "frames": [{"name": "spin", "filename": "/srv/x.py", "short_filename": "x.py", "line": 3}]},
        {"thread_id": 2, "thread_name": "MainThread", "os_thread_id": pid, "active": False, "owns_gil": False,
         "frames": [
             {"name": "pthread_cond_wait", "filename": "libc.so.6", "short_filename": "libc.so.6", "line": 0,
              "module": "/lib/x86_64-linux-gnu/libc.so.6"},
             {"name": "Event.wait", "filename": "/usr/lib/python3.11/threading.py", "short_filename": "threading.py",
              "line": 629},
             {"name": "all_reduce", "filename": site, "short_filename": "torch/distributed/distributed_c10d.py",
              "line": 2050},
             {"name": "forward", "filename": "/srv/model.py", "short_filename": "model.py", "line": 7},
         ]},
    ]
    (bundle_dir / f"pyspy-{pid}.json").write_text(json.dumps(threads))
    got = load_incident(bundle_dir)
    s = got.stacks[0]
    assert s.hung_frame == "all_reduce (torch/distributed/distributed_c10d.py:2050)"
    assert (s.hung_thread_id, s.hung_frame_index, s.hung_frame_source) == (2, 2, "stacks")
    assert s.threads[1].frames[0].label == "pthread_cond_wait (libc.so.6)"
    # no JSON for the second process: the span's bounded summary is kept instead
    assert (got.stacks[1].threads, got.stacks[1].summary) == ((), ("MainThread: forward (model.py:7)",))


async def test_bundle_written_by_the_incident_manager_and_pyspy_actor(tmp_path: Path, spawn, python: str) -> None:
    import subprocess

    import anyio

    from agent.actors.pyspy import PySpyActor
    from agent.host.targets import discover
    from agent.incidents.manager import IncidentConfig, IncidentManager
    from agent.model.bus import EventBus
    from agent.model.events import StacksDumped
    from tests.exporters.bundle_fixture import TITLED_TARGET, wait_until_hung

    proc = spawn([python, str(TITLED_TARGET), "demo::scheduler_TP0", "--threads", "1", "--max-lifetime-s", "60"],
                 stdout=subprocess.PIPE)
    try:
        assert (await anyio.to_thread.run_sync(proc.stdout.readline)).startswith(b"ready")
    finally:
        proc.stdout.close()
    await anyio.to_thread.run_sync(wait_until_hung, proc.pid)
    targets = discover(pids=[proc.pid])
    actor = PySpyActor()

    async def dump_phase(opened, phase_targets, bundle_dir, report):  # type: ignore[no-untyped-def]
        return await actor.dump_all(opened, list(phase_targets), artifact_dir=bundle_dir, report=report)

    manager = IncidentManager(bus=EventBus(), config=IncidentConfig(), data_dir=tmp_path, host_name="h1",
                              discover=lambda: targets, phases=[("pyspy.dump", dump_phase, StacksDumped)])
    record = await manager.open_incident("manual", detail="from a test")

    got = load_incident(tmp_path, "latest")
    assert got.incident_id == record.opened.incident_id and got.trigger == "manual"
    (action,) = got.actions
    assert (action.action, action.pid, action.outcome) == ("pyspy.dump", proc.pid, "ok")
    assert 0 <= action.start_offset_s <= got.duration_s
    (stacks,) = got.stacks
    assert stacks.title == "demo::scheduler_TP0"
    assert stacks.hung_frame_source == "attribute"
    assert stacks.hung_frame is not None and stacks.hung_frame.startswith("hung_in_fake_allreduce (")
    assert stacks.hung_frame_index is not None  # the actor's string is found in the JSON frames
    # the rule used without the span attribute agrees with the actor's
    manifest = Path(got.bundle_dir) / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["actions"][0]["attributes"]["servewatch.pyspy.hung_frame"]
    manifest.write_text(json.dumps(data))
    again = load_incident(got.bundle_dir)
    assert (again.stacks[0].hung_frame, again.stacks[0].hung_frame_source) == (stacks.hung_frame, "stacks")
    assert stacks.hung_frame in render_timeline_text(got, width=250)


def test_piped_timeline_wraps_the_verdict_at_80_columns_never_cuts_it(bundle: Bundle, tmp_path: Path) -> None:
    """``servewatch timeline ... > tl.txt``: stdout is no terminal; every panel line wraps, nothing is cut."""
    import os
    import subprocess
    import sys

    data_dir = tmp_path / "data"
    shutil.copytree(bundle.data_dir, data_dir)
    manifest_path = data_dir / HOST / INCIDENT_ID / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    tp0, tp1 = bundle.pids
    headline = (f"Verdict: culprit rank 0 (pid {tp0}) -- behind: rank 0 never entered all_reduce seq 41 "
                f"while rank 1 (pid {tp1}) waits in hung_in_fake_allreduce (model.py:17) [confidence high]")
    evidence = f"rank 1 (pid {tp1}) waits in all_reduce seq 41 for 31.0 s; rank 0 (pid {tp0}) last completed seq 40"
    manifest["verdict"] = {"headline": headline, "culprit_ranks": [0], "reason": "behind", "confidence": "high",
                           "kind": "behind", "hung": True, "evidence": [evidence]}
    manifest_path.write_text(json.dumps(manifest))
    env = {**os.environ, "COLUMNS": "80", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    proc = subprocess.run([sys.executable, "-m", "agent.cli.app", "timeline", INCIDENT_ID, "--data-dir", str(data_dir)],
                          capture_output=True, env=env, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    text = proc.stdout.decode()
    assert max(len(line) for line in text.splitlines()) <= 80
    flat = " ".join(text.replace("│", " ").split())
    assert " ".join(headline.split()) in flat
    assert " ".join(evidence.split()) in flat
    # the Text-level API wraps the same way
    flat_api = " ".join(render_timeline_text(load_incident(data_dir, INCIDENT_ID), width=80).replace("│", " ").split())
    assert " ".join(headline.split()) in flat_api


@pytest.mark.parametrize(("content", "why"), [
    ("{not json", "unreadable (JSONDecodeError)"),
    (json.dumps({"coordinator": "node-a", "verdict": {"reason": "no headline"}}), "no job verdict with a headline in it"),
    (json.dumps(["a", "list"]), "no job verdict with a headline in it"),
])
def test_a_broken_job_verdict_file_is_a_warning_and_the_bundle_still_reads(tmp_path: Path, content: str, why: str) -> None:
    bundle_dir = _minimal(tmp_path, "20261206T000000Z-manual-aaaaaa", 10**18)
    (bundle_dir / "job-verdict.json").write_text(content)
    got = load_incident(bundle_dir, span_paths=[])
    assert got.job_verdict is None
    assert got.warnings == (f"{bundle_dir / 'job-verdict.json'}: {why}",)
    assert "job verdict ·" not in render_timeline_text(got, width=200)


def test_a_job_verdict_file_is_shown_first_with_the_hosts_not_heard_from(tmp_path: Path) -> None:
    bundle_dir = _minimal(tmp_path, "20261206T000000Z-stall-bbbbbb", 10**18)
    verdict = {"kind": "collective", "hung": True, "culprit_ranks": [2], "culprit_hosts": ["node-c"],
               "headline": "Job verdict: culprit rank 2 on node-c -- behind [confidence high]", "next": "py-spy dump on node-c",
               "missing_hosts": [{"host": "node-d", "ranks": [3], "why": "agent unreachable (timed out)"}],
               "evidence": [f"line {i}" for i in range(20)]}
    (bundle_dir / "job-verdict.json").write_text(json.dumps(
        {"coordinator": "node-a", "hosts_expected": 4, "hosts_with_evidence": 3, "verdict": verdict}))
    got = load_incident(bundle_dir, span_paths=[])
    assert got.warnings == () and got.job_verdict is not None
    assert got.job_verdict["evidence"] == [f"line {i}" for i in range(16)]  # bounded as the local verdict's
    text = render_timeline_text(got, width=200)
    assert text.index("job verdict · coordinated by node-a · evidence from 3 of 4 hosts") < text.index(verdict["headline"])
    assert "no evidence from node-d: agent unreachable (timed out)" in text and "next: py-spy dump on node-c" in text
    assert "line 15" in text and "line 16" not in text
    assert timeline_to_dict(got)["job_verdict"]["culprit_hosts"] == ["node-c"]
