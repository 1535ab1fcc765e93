"""The py-spy actor on a target in uninterruptible sleep (state D): a real one
(tests/programs/dstate.py: a thread waiting in ``wait_for_vfork_done`` until its child exits),
real py-spy. A blocking dump of it hangs (py-spy waits for every thread to stop; one in D never
does); the actor reads the state first and takes one ``--nonblocking`` dump instead, and after a
blocking attempt that timed out on it, takes that dump rather than give up."""

from __future__ import annotations

from pathlib import Path

import pytest

import agent.actors.pyspy as pyspy_module
from agent.actors.pyspy import PySpyActor, PySpyConfig
from agent.host.targets import ProcessState, process_state, target_of, uninterruptible_threads
from agent.model.events import IncidentOpened, Outcome
from tests.programs.dstate import start, thread_state

TRIGGER = IncidentOpened(incident_id="inc-dstate", trigger="manual")


def _no_thread_stopped(pid: int) -> bool:
    import os

    return all(thread_state(pid, int(tid)) not in ("T", "t") for tid in os.listdir(f"/proc/{pid}/task"))


async def test_a_target_in_d_is_dumped_nonblocking_at_once_and_said_so(spawn, tmp_path: Path) -> None:
    pid, tid = start(spawn)
    target = target_of(pid)
    assert target is not None
    actor = PySpyActor(PySpyConfig(timeout_s=20.0))  # real py-spy, the field's 20 s timeout
    result = await actor.act(TRIGGER, target, timeout_s=40, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    # one attempt, --nonblocking, never a blocking one that would have waited out the 20 s
    assert result.attributes["servewatch.pyspy.attempts"] == 1 and actor.statistics().attempts == 1
    assert actor.statistics().groups_killed == 0
    wchan = uninterruptible_threads(pid)[0].where()
    said = f"pid {pid} (thread {tid}) is in uninterruptible sleep (D) in {wchan}: dumped with --nonblocking"
    assert result.detail.startswith(said), result.detail
    assert result.attributes["servewatch.pyspy.nonblocking"] is True
    assert result.attributes["servewatch.pyspy.uninterruptible_wchan"] == wchan
    assert result.attributes["servewatch.pyspy.uninterruptible_tids"] == (tid,)
    txt = Path(result.artifact_paths[1]).read_text()
    assert "--nonblocking" in txt and f"# {said}" in txt
    # its Python stack is read: the thread sits in the function that entered D
    assert any("uninterruptible_sleep (" in line for line in result.attributes["servewatch.pyspy.stacks"])
    assert process_state(pid) is ProcessState.RUNNING and _no_thread_stopped(pid)


async def test_a_blocking_dump_that_timed_out_on_a_target_in_d_is_followed_by_a_nonblocking_one(
        spawn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pid, tid = start(spawn)
    target = target_of(pid)
    assert target is not None
    real = pyspy_module._dsleep
    reads: list[int] = []

    async def entered_d_just_after_the_first_read(t):  # type: ignore[no-untyped-def]
        reads.append(t.pid)
        return () if len(reads) == 1 else await real(t)

    monkeypatch.setattr(pyspy_module, "_dsleep", entered_d_just_after_the_first_read)
    actor = PySpyActor(PySpyConfig(timeout_s=1.0, native=False))  # real py-spy
    result = await actor.act(TRIGGER, target, timeout_s=2.0, artifact_dir=tmp_path)
    assert result.outcome is Outcome.OK, result.detail
    # the blocking attempt hung on the thread in D and was killed; then one --nonblocking attempt
    assert result.attributes["servewatch.pyspy.attempts"] == 2 and actor.statistics().groups_killed == 1
    assert result.attributes["servewatch.pyspy.nonblocking_after_timeout"] is True
    assert result.attributes["servewatch.pyspy.uninterruptible_tids"] == (tid,)
    assert "the blocking dump timed out; dumped with --nonblocking" in result.detail, result.detail
    assert result.detail.startswith(f"pid {pid} (thread {tid}) is in uninterruptible sleep (D) in ")
    # never left stopped by the killed blocking attempt
    assert process_state(pid) is ProcessState.RUNNING and _no_thread_stopped(pid)
