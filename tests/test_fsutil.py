"""agent.host.fsutil: atomic, symlink-safe, private writes."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent.host import fsutil


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


def _statfs_type(path) -> str:
    """The filesystem type coreutils' ``stat -f`` names (an independent oracle: statfs(2))."""
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True, timeout=10).stdout.strip()


def test_memory_backed_agrees_with_statfs(tmp_path):
    paths = [tmp_path, tmp_path / "not-yet-created", "/", "/proc/self"]
    if os.path.isdir("/dev/shm"):
        paths.append("/dev/shm")
    for path in paths:
        existing = path if os.path.exists(path) else os.path.dirname(path)
        assert fsutil.memory_backed(path) is (_statfs_type(existing) in ("tmpfs", "ramfs")), path


def test_memory_backed_sees_a_tmpfs_mounted_over_a_disk_folder(tmp_path):
    """In its own mount namespace (real ``unshare -m``), a tmpfs mounted on a folder of a disk
    filesystem: files under it are memory-backed, its sibling is not, and a folder name with a
    space (escaped in mountinfo) is matched."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and util-linux unshare")
    if _statfs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("the temp folder is already on tmpfs")
    mounted = tmp_path / "shm dir"
    sibling = tmp_path / "disk"
    mounted.mkdir()
    sibling.mkdir()
    code = (
        "import sys; from agent.host.fsutil import memory_backed; "
        "print(memory_backed(sys.argv[1]), memory_backed(sys.argv[1] + '/servewatch-steps.1'), memory_backed(sys.argv[2]))"
    )
    script = f'mount -t tmpfs -o size=1m servewatch-test "$1" && exec "{sys.executable}" -c "$0" "$1" "$2"'
    out = subprocess.run(
        [unshare, "-m", "--propagation", "private", "sh", "-c", script, code, str(mounted), str(sibling)],
        capture_output=True, text=True, timeout=60, check=False, cwd=Path(__file__).resolve().parent.parent,
    )
    if out.returncode and "Operation not permitted" in out.stderr:
        pytest.skip(f"mount namespaces not allowed here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False"]
    assert fsutil.memory_backed(mounted) is False  # this process's namespace has no such mount


def _walk_problem(path: Path) -> str | None:
    try:
        fd, _ = fsutil.open_trusted_dir(path)
    except fsutil.UnsafeFolderError as exc:
        return str(exc)
    os.close(fd)
    return None


def test_trusted_walk_creates_0700_follows_own_links_and_refuses_shared_folders(tmp_path):
    """The rules of open_trusted_dir, as the agent's own uid: missing folders made 0700 whatever
    the umask; the agent's own symlink followed (its target judged too); a folder on the way
    writable by others without the sticky bit refused, with the sticky bit allowed."""
    old = os.umask(0o077)
    try:
        fd, made = fsutil.open_trusted_dir(tmp_path / "a" / "b", create=True)
    finally:
        os.umask(old)
    os.close(fd)
    assert made == (tmp_path / "a" / "b", tmp_path / "a")
    assert [stat.S_IMODE(p.stat().st_mode) for p in made] == [0o700, 0o700]
    (tmp_path / "link").symlink_to(tmp_path / "a")
    fd, made = fsutil.open_trusted_dir(tmp_path / "link" / "b")
    assert made == () and os.path.samestat(os.fstat(fd), (tmp_path / "a" / "b").stat())
    os.close(fd)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "x").mkdir(mode=0o700)
    assert _walk_problem(shared / "x") == (
        f"{str(shared)!r} (a folder on its way) is writable by other users without the sticky bit (mode 777): not used")
    assert "(the folder asked for) is writable by other users" in (_walk_problem(shared) or "")
    shared.chmod(0o1777)
    assert _walk_problem(shared / "x") is None and _walk_problem(shared) is None
    assert fsutil.unsafe_folder_reason(shared / "x" / "not" / "yet") is None  # would be made 0700
    (tmp_path / "file").write_text("")
    assert _walk_problem(tmp_path / "file") == f"{str(tmp_path / 'file')!r} is not a folder"
    with pytest.raises(FileNotFoundError):
        fsutil.open_trusted_dir(tmp_path / "missing")


def test_session_folder_is_the_base_only_when_it_is_the_agents_0700_folder(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)  # readable by all (like /etc): a fresh 0700 session folder is made inside
    inside = fsutil.SessionFolder.create(shared)
    assert inside.path.parent == shared and stat.S_IMODE(inside.path.stat().st_mode) == 0o700
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    assert fsutil.SessionFolder.create(private).path == private


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a folder as another uid")
def test_trusted_walk_goes_through_the_sudo_users_folders_only(tmp_path, monkeypatch):
    """``sudo servewatch profile`` from the user's home: that user's folders are trusted (whoever
    set SUDO_UID for a root process is root already); any other user's stay refused."""
    tmp_path.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    os.chown(home, 65534, 65534)
    monkeypatch.delenv("SUDO_UID", raising=False)
    assert _walk_problem(home) == f"{str(home)!r} is owned by uid 65534, not by root or the agent's uid 0: not used"
    monkeypatch.setenv("SUDO_UID", "65534")
    assert fsutil.trusted_uids() == {0, 65534}
    fd, made = fsutil.open_trusted_dir(home / "profiles", create=True)
    os.close(fd)
    assert made == (home / "profiles",) and (home / "profiles").stat().st_uid == 0
    monkeypatch.setenv("SUDO_UID", "1000")
    assert _walk_problem(home) == (
        f"{str(home)!r} is owned by uid 65534, not by root, the agent's uid 0 or sudo's user uid 1000: not used")
    monkeypatch.setenv("SUDO_UID", "not-a-uid")
    assert fsutil.trusted_uids() == {0}
