"""Issue 23 item 1: root never chmods, reads or copies a path a profiled target names.

The attacker is a real other uid (``nobody``, through ``setpriv``) serving a real SDK control
socket. It answers ``profile.start`` and ``status`` like the SDK does, plants symlinks in the
session folder it is told to write to, and reports root-owned files and folders (one with a
setuid bit) as its "trace files". The agent side is the real profiler actor running as root.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.actors.profiler import ProfilerConfig, profile_once
from agent.host.fsutil import SessionFolder
from agent.model.events import Outcome
from tests.security._attack import hostile_sdk_source

NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
NOBODY_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to act as another uid"
)

#: A hostile "SDK" (run as nobody; argv[2]: the victims, JSON): plants symlinks in the session
#: folder it is told to write to and reports root-owned files and folders as its "trace files".
_HOSTILE_SDK = hostile_sdk_source("""
    victims = arg
    try:  # where the folder lets nobody write (it is given to the writer): plant too
        with open(os.path.join(out, "real.trace.json"), "w") as f:
            f.write('{"traceEvents": []}')
        os.symlink(victims["file"], os.path.join(out, "evil-link.trace.json"))
        os.mkdir(os.path.join(out, "evil.gputrace"))
        os.symlink(victims["dir"], os.path.join(out, "evil.gputrace", "inner"))
    except OSError:
        pass
    files = [victims["dir"], victims["file"], victims["suid"],
             os.path.join(out, "..", "..", os.path.basename(victims["dir"])),
             os.path.join(out, "evil-link.trace.json"), os.path.join(out, "evil.gputrace"),
             os.path.join(out, "real.trace.json")]
""")


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A root-owned 0755 folder in /tmp: nobody may pass through it (as under a shared --out)."""
    path = Path(tempfile.mkdtemp(prefix="sw-pub-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _victim_tree(root: Path) -> dict[str, Path]:
    victim = root / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "file").write_text("config")
    (victim / "sub" / "deep").write_text("data")
    suid = victim / "tool"
    suid.write_bytes(b"\x7fELF")
    for p, mode in ((victim, 0o755), (victim / "sub", 0o755), (victim / "file", 0o644),
                    (victim / "sub" / "deep", 0o644), (suid, 0o4755)):
        p.chmod(mode)
    return {"dir": victim, "file": victim / "file", "suid": suid}


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


async def test_a_target_naming_root_files_gets_nothing_chmodded(spawn: Callable, public_dir: Path, tmp_path: Path) -> None:
    import json

    shm = public_dir / "shm"
    shm.mkdir(mode=0o1777)
    shm.chmod(0o1777)
    victims = _victim_tree(public_dir)
    before = _modes(victims["dir"])
    template = str(shm / f"servewatch-{NOBODY}" / "servewatch-ctl.{pid}.sock")  # where nobody's SDK serves it
    proc = spawn([*AS_NOBODY, NOBODY_PYTHON, "-c", _HOSTILE_SDK, template,
                  json.dumps({k: str(v) for k, v in victims.items()})], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")

    out = public_dir / "profiles"
    config = ProfilerConfig(backend="sdk", socket_dir=shm, find_timeout_s=5, request_timeout_s=10)
    result = await profile_once(config, pid=proc.pid, steps=1, out_dir=out, timeout_s=10)

    assert _modes(victims["dir"]) == before  # not one mode bit changed, the setuid bit kept
    assert stat.S_IMODE(victims["suid"].stat().st_mode) == 0o4755
    session = out  # the agent created it now: it is the session folder, given to the writer
    taken = {Path(p).name for p in result.artifact_paths}
    assert taken == {"real.trace.json", "evil.gputrace"}, result
    assert result.outcome is Outcome.OK, result.detail
    for name in taken:  # taken: the agent's own now, private
        st = (session / name).lstat()
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == (0o700 if name.endswith("gputrace") else 0o600)
    st = session.lstat()
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700  # taken back from nobody
    ignored = result.attributes["servewatch.profile.ignored"]
    assert isinstance(ignored, tuple)
    outside = [i for i in ignored if i.endswith("outside the session folder, ignored")]
    assert len(outside) == 4, ignored  # victim dir, file, setuid file, and the '..' escape
    assert any("evil-link.trace.json: a symlink" in i for i in ignored), ignored
    assert any("evil.gputrace/inner: a symlink" in i for i in ignored), ignored
    assert "not taken" in result.detail
    assert (session / "evil-link.trace.json").is_symlink()  # left where it was, not followed


def test_session_folder_takes_only_the_writers_own_single_link_files(tmp_path: Path) -> None:
    """The rules one by one, as root: another uid's file, a hard link, a FIFO, a path through a
    symlinked folder, and a relative or escaping path are refused; the writer's file is taken."""
    folder = SessionFolder.create(tmp_path / "s", writer_uid=NOBODY)
    assert folder.path == tmp_path / "s" and folder.path.stat().st_uid == NOBODY
    own = folder.path / "own.json"
    own.write_text("{}")
    os.chown(own, NOBODY, NOBODY)
    foreign = folder.path / "foreign.json"
    foreign.write_text("{}")  # root's, planted by nobody would be impossible; root's is not the writer's
    linked = folder.path / "linked.json"
    linked.write_text("{}")
    os.chown(linked, NOBODY, NOBODY)
    os.link(linked, tmp_path / "elsewhere")
    os.mkfifo(folder.path / "pipe.json")
    os.chown(folder.path / "pipe.json", NOBODY, NOBODY)
    target = tmp_path / "t"
    target.mkdir()
    (target / "x.json").write_text("{}")
    os.symlink(target, folder.path / "via")
    for p in (linked, target / "x.json"):  # set, not left to the umask (CI runs under 077)
        p.chmod(0o644)
    claimed = folder.claim([own, foreign, linked, folder.path / "pipe.json", folder.path / "via" / "x.json",
                            "relative.json", f"{folder.path}/../s2/x.json"])
    assert claimed.paths == (str(own),)
    assert claimed.size_bytes == 2
    reasons = dict(i.split(": ", 1) for i in claimed.ignored)
    assert reasons[str(foreign)].startswith("owned by uid 0")
    assert "2 links" in reasons[str(linked)]
    assert reasons[str(folder.path / "pipe.json")] == "not a regular file or folder, ignored"
    assert reasons[str(folder.path / "via" / "x.json")] == "a symlink, never followed"
    assert reasons["relative.json"] == reasons[f"{folder.path}/../s2/x.json"] == "outside the session folder, ignored"
    assert stat.S_IMODE(linked.stat().st_mode) == 0o644 and stat.S_IMODE((target / "x.json").stat().st_mode) == 0o644
    assert own.stat().st_uid == 0 and stat.S_IMODE(own.stat().st_mode) == 0o600


def test_an_existing_foreign_out_folder_gets_a_fresh_session_folder(tmp_path: Path) -> None:
    """``--out`` naming a folder someone else can write (here 1777) is never the session folder:
    the agent makes a fresh one inside it, and removes it when the session left nothing."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    folder = SessionFolder.create(shared)
    assert folder.path.parent == shared and folder.path.name.startswith("session-")
    assert stat.S_IMODE(folder.path.stat().st_mode) == 0o700
    own = tmp_path / "own"
    own.mkdir(mode=0o700)
    assert SessionFolder.create(own).path == own  # the agent's own private folder is used as is
    folder.remove_if_empty()
    assert not folder.path.exists() and shared.exists()
