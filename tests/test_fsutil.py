"""agent.fsutil: atomic, symlink-safe, private writes."""

from __future__ import annotations

import os
import stat

import pytest

from agent import fsutil


def test_atomic_write_replaces_whole_file_with_0600(tmp_path):
    dest = tmp_path / "manifest.json"
    dest.write_text("old")
    assert fsutil.atomic_write_text(dest, '{"a": 1}') == 8
    assert dest.read_text() == '{"a": 1}'
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_atomic_write_replaces_planted_symlink_not_its_target(tmp_path):
    victim = tmp_path / "root-only"
    victim.write_text("secret")
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    fsutil.atomic_write_text(link, "ours")
    assert victim.read_text() == "secret"
    assert not link.is_symlink()
    assert link.read_text() == "ours"


def test_failed_write_leaves_previous_file_and_no_temp(tmp_path, monkeypatch):
    dest = tmp_path / "m.json"
    dest.write_text("complete")

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="No space"):
        fsutil.atomic_write_text(dest, "torn")
    assert dest.read_text() == "complete"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_append_refuses_symlink(tmp_path):
    victim = tmp_path / "v"
    victim.write_text("")
    (tmp_path / "spans.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        fsutil.open_append_nofollow(tmp_path / "spans.jsonl")
    fd = fsutil.open_append_nofollow(tmp_path / "real.jsonl")
    os.write(fd, b"x\n")
    os.close(fd)
    assert (tmp_path / "real.jsonl").read_bytes() == b"x\n"


def test_private_dir_is_0700_and_refuses_symlink(tmp_path):
    d = fsutil.ensure_private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    (tmp_path / "l").symlink_to(tmp_path / "a")
    with pytest.raises(NotADirectoryError):
        fsutil.ensure_private_dir(tmp_path / "l")


def test_remove_stale_temps_removes_only_ours(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".m.json.abcd1234.swtmp").write_text("x")
    (tmp_path / "keep.json").write_text("y")
    assert fsutil.remove_stale_temps(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["keep.json", "sub"]
