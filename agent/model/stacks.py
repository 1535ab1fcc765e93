"""The py-spy stack model: ``py-spy dump --json`` → threads and frames, the hung-frame rule, and the
stuck-vs-idle rule. Pure (no I/O, no processes), so the actor that runs py-spy
(:mod:`agent.actors.pyspy`), the verdict (:mod:`agent.verdict.rules`, :mod:`agent.verdict.judge`) and the
exporters (:mod:`agent.views.bundle`) share one copy without importing each other.

Imports the standard library and :mod:`agent.model.safetext` only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from agent.model.lazy import lazy_pattern
from agent.model.safetext import safe_text

__all__ = [
    "COMMUNICATION_LAYERS",
    "MAX_ATTR_CHARS",
    "CommLayer",
    "Frame",
    "ThreadStack",
    "clip",
    "comm_layer",
    "hung_frame",
    "hung_location",
    "idle_and_stuck",
    "parse_dump",
    "parse_faulthandler",
    "parse_threads",
    "render_text",
    "summarize",
    "thread_is_idle",
    "threads_to_json",
]

#: Longest string put in one span attribute of a stack summary, characters.
MAX_ATTR_CHARS = 256


# --- parsing --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Frame:
    """One stack frame as py-spy reports it.

    Attributes:
        name: function name (``Class.method`` for Python 3.11+, symbol for native frames).
        filename: full path of the source file or shared object.
        short_filename: py-spy's shortened file name (package part only).
        line: line number; 0 for native frames.
        module: the shared object of a native frame; ``None`` for a Python frame (per py-spy's
            ``Frame.module``).
    """

    name: str
    filename: str = ""
    short_filename: str = ""
    line: int = 0
    module: str | None = None

    @property
    def unresolved(self) -> bool:
        """A native frame py-spy could not symbolise: ``module`` null and file ``?`` (e.g. its
        shared object was replaced or deleted on disk). Never a hung frame."""
        return self.module is None and self.filename in ("", "?")

    @property
    def native(self) -> bool:
        """Whether this is a native (C/C++) frame rather than a Python one (unresolved included)."""
        return self.module is not None or self.unresolved

    def describe(self) -> str:
        """``function (file:line)``, or ``function (lib.so)`` for a native frame."""
        return self._render(self.short_filename or self.filename)

    @property
    def label(self) -> str:
        """:meth:`describe` with ``?`` for an unknown file (the incident timeline's format)."""
        return self._render(self.short_filename or self.filename or "?")

    def _render(self, where: str) -> str:
        if self.native or self.line <= 0:
            return f"{self.name} ({where})"
        return f"{self.name} ({where}:{self.line})"


@dataclass(frozen=True, slots=True, kw_only=True)
class ThreadStack:
    """One thread of a py-spy dump; ``frames[0]`` is the innermost frame.

    Attributes:
        pid: the process.
        thread_id: Python's thread identifier (``threading.get_ident()``).
        os_thread_id: the kernel's tid, when py-spy could read it.
        thread_name: ``threading`` name (``MainThread``), ``""`` when unknown.
        active: py-spy judged the thread busy (not idle in a wait).
        owns_gil: the thread held the GIL.
        frames: innermost first.
    """

    pid: int
    thread_id: int
    os_thread_id: int | None = None
    thread_name: str = ""
    active: bool = False
    owns_gil: bool = False
    frames: tuple[Frame, ...] = ()

    @property
    def label(self) -> str:
        """The thread's name, else its tid."""
        return self.thread_name or f"thread-{self.os_thread_id or self.thread_id}"

    @property
    def is_main(self) -> bool:
        """The interpreter's main thread (name ``MainThread`` or tid == pid)."""
        return self.thread_name == "MainThread" or self.os_thread_id == self.pid


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _str(value: object) -> str:
    """A JSON string field made safe to write (undecodable bytes as ``\\xNN``), else ``""``."""
    return safe_text(value) if isinstance(value, str) else ""


def parse_dump(json_text: str | bytes) -> list[ThreadStack]:
    """Parse ``py-spy dump --json`` output into threads, main thread first.

    The shape (py-spy 0.4 ``StackTrace`` serialised): a JSON list of threads, each with ``pid``,
    ``thread_id``, ``thread_name``, ``os_thread_id``, ``active``, ``owns_gil`` and ``frames``
    (innermost first; ``name``, ``filename``, ``short_filename``, ``line``, ``module``).

    Args:
        json_text: py-spy's stdout.

    Returns:
        Threads ordered main thread first, then active ones, then the rest (py-spy's order
        within each group).

    Raises:
        ValueError: the text is not JSON or not a list of thread objects.
    """
    if isinstance(json_text, bytes):
        # py-spy copies names byte for byte: invalid UTF-8 must never lose the whole dump
        json_text = json_text.decode("utf-8", "surrogateescape")
    threads = parse_threads(json.loads(json_text))
    threads.sort(key=lambda t: (not t.is_main, not t.active))
    return threads


def parse_threads(data: object, *, pid: int | None = None) -> list[ThreadStack]:
    """Threads of already-decoded ``py-spy dump --json`` output, in py-spy's order.

    Frames that are not JSON objects are skipped; missing or mistyped fields take the
    :class:`Frame` / :class:`ThreadStack` defaults (a frame without a name is ``"?"``).

    Args:
        data: the decoded JSON (a list of thread objects, see :func:`parse_dump`).
        pid: the process the dump belongs to; when given it replaces each thread's ``pid``
            field (which decides :attr:`ThreadStack.is_main` through the kernel tid).

    Returns:
        One :class:`ThreadStack` per thread object, in the order of ``data``.

    Raises:
        ValueError: ``data`` is not a list of thread objects.
    """
    if not isinstance(data, list):
        raise ValueError(f"py-spy --json output is a {type(data).__name__}, expected a list of threads")
    threads: list[ThreadStack] = []
    for item in data:
        if not isinstance(item, dict):
            raise ValueError("py-spy --json output has a thread that is not an object")
        frames = tuple(
            Frame(
                name=_str(f.get("name")) or "?",
                filename=_str(f.get("filename")),
                short_filename=_str(f.get("short_filename")),
                line=_int(f.get("line")),
                module=_str(f.get("module")) if isinstance(f.get("module"), str) else None,
            )
            for f in item.get("frames") or ()
            if isinstance(f, dict)
        )
        os_tid = item.get("os_thread_id")
        threads.append(
            ThreadStack(
                pid=_int(item.get("pid")) if pid is None else pid,
                thread_id=_int(item.get("thread_id")),
                os_thread_id=os_tid if isinstance(os_tid, int) else None,
                thread_name=_str(item.get("thread_name")),
                active=bool(item.get("active")),
                owns_gil=bool(item.get("owns_gil")),
                frames=frames,
            )
        )
    return threads


def render_text(threads: Sequence[ThreadStack], *, header: str = "") -> str:
    """A readable rendering of a dump (like py-spy's text output), innermost frame first.

    Args:
        threads: as returned by :func:`parse_dump`.
        header: first line(s), e.g. ``"Process 42: sglang::scheduler_TP0"``.

    Returns:
        Text ending with a newline.
    """
    lines = [header] if header else []
    for thread in threads:
        flags = ", ".join(f for f, on in (("active", thread.active), ("gil", thread.owns_gil)) if on) or "idle"
        tid = thread.os_thread_id if thread.os_thread_id is not None else thread.thread_id
        lines.append(f'Thread {tid} ({flags}): "{thread.label}"')
        lines.extend(f"    {frame.describe()}" for frame in thread.frames)
    return "\n".join(lines) + "\n"


_STDLIB_PATH = lazy_pattern(r"/lib/python\d+\.\d+t?/(?!.*-packages/)")

#: Where a thread waits for work (its innermost Python frame outside ``threading``): the stdlib's
#: queues, selectors and sockets, asyncio's loop, executor and multiprocessing workers, ZeroMQ
#: (SGLang's schedulers and detokenizer idle in ``zmq`` ``recv``), and the serving frameworks'
#: message queues (:data:`COMMUNICATION_LAYERS` of kind ``message_queue``).
_WORK_WAIT_PATH = lazy_pattern(
    r"/(queue|selectors|socket|ssl|sched)\.py$|/asyncio/|/concurrent/futures/|"
    r"/multiprocessing/(connection|queues|pool|managers|synchronize)\.py$|/zmq/"
)

#: ``threading`` primitives a parked thread waits in (py-spy names them ``Class.method`` on 3.11+).
#: Yield helpers a spin loop calls: the frame that decides is their caller. vLLM's
#: ``vllm/distributed/utils.py`` ``sched_yield`` (``os.sched_yield``), which ``shm_broadcast``'s
#: ``SpinCondition.wait`` calls while a worker waits for work (seen innermost on an idle vLLM
#: 0.32 CPU worker right after a request).
_SPIN_HELPERS = lazy_pattern(r"vllm/distributed/utils\.py$")


def _decider(python: Sequence[Frame]) -> Frame | None:
    """The innermost Python frame outside ``threading``, frozen modules and spin helpers
    (:data:`_SPIN_HELPERS`): the frame whose code decides what the thread waits for."""
    for frame in python:
        if frame.filename.endswith("/threading.py") or frame.filename.startswith("<frozen"):
            continue
        if frame.name == "sched_yield" and _SPIN_HELPERS.search(frame.filename):
            continue
        return frame
    return None


#: A serving framework's scheduler loop that polls for work on the CPU: SGLang's
#: ``Scheduler.event_loop_normal`` / ``event_loop_overlap`` (``sglang/srt/managers/scheduler.py``,
#: 0.5.23) receive without blocking unless ``--sleep-on-idle``, so an idle scheduler is on CPU in
#: ``recv_requests``, ``get_next_batch_to_run`` or its stage metrics. Outside a batch run
#: (:data:`_POLL_LOOP_WORK`) such a thread waits for work. A scheduler stuck inside its own
#: scheduling step (not its forward) looks the same in one snapshot.
_POLL_LOOP_FILE = lazy_pattern(r"sglang/srt/managers/scheduler\.py$")
_POLL_LOOP_NAME = lazy_pattern(r"^(Scheduler\.)?event_loop_\w+$")
#: Frames of a batch being run inside the loop: the scheduler has work (its forward, the model).
_POLL_LOOP_WORK = lazy_pattern(r"(^|\.)(run_batch|process_batch_result\w*|forward\w*)$")
_MODEL_PATH = lazy_pattern(r"/(model_executor|layers|models)/")


def _polls_for_work(python: Sequence[Frame]) -> bool:
    """The thread is in a scheduler loop that polls for work (:data:`_POLL_LOOP_FILE`) and runs no
    batch: no frame between the loop and the innermost one is a batch run or the model's code."""
    for i, frame in enumerate(python):
        if _POLL_LOOP_NAME.search(frame.name or "") and (
                _POLL_LOOP_FILE.search(frame.filename) or _POLL_LOOP_FILE.search(frame.short_filename)):
            inner = python[:i]
            return not any(_POLL_LOOP_WORK.search(f.name or "") or _MODEL_PATH.search(f.filename) for f in inner)
    return False


_PARK_NAMES = frozenset({"wait", "Event.wait", "Condition.wait", "Semaphore.acquire", "BoundedSemaphore.acquire",
                         "Barrier.wait", "_wait_for_tstate_lock"})
#: A thread's own frames above a park that still make it a parked helper: its run function, and
#: at most one helper it calls (``SignalCallback._run`` -> ``Event.wait``; tqdm's ``TMonitor.run``).
_PARK_MAX_OWN_FRAMES = 2
_BOOTSTRAP_NAMES = frozenset({"run", "Thread.run", "_bootstrap", "_bootstrap_inner", "Thread._bootstrap",
                              "Thread._bootstrap_inner"})


@dataclass(frozen=True, slots=True)
class CommLayer:
    """One serving framework's communication layer, as its frames appear in a py-spy stack.

    Attributes:
        name: what it is (``vLLM device communicators``).
        kind: ``collective`` (the thread waits for its peers: a rank there is in a collective),
            ``p2p`` (a point-to-point send or receive: the thread waits for one peer, as a
            pipeline stage waits for the next or previous one), ``rendezvous`` (the job is still
            forming: ``init_process_group``, the TCPStore) or ``message_queue`` (a process waits
            for a message: idle unless work is pending).
        python: regex on a Python frame's file name (``filename`` or ``short_filename``), or ``""``.
        native: regex on a native frame's symbol, or ``""``.
        function: regex on a Python frame's function name (with ``python``, both must match), or ``""``.
        source: where the fact comes from.
    """

    name: str
    kind: str
    python: str = ""
    native: str = ""
    function: str = ""
    source: str = ""

    def matches(self, frame: Frame) -> bool:
        """Whether ``frame`` is in this layer."""
        if frame.native:
            return bool(self.native) and re.search(self.native, frame.name or "", re.IGNORECASE) is not None
        if not self.python:
            return False
        where = f"{frame.filename} {frame.short_filename}"
        if re.search(self.python, where) is None:
            return False
        return not self.function or re.search(self.function, frame.name or "") is not None


#: The communication layers a stack is read against, first match wins (the table in
#: ``docs/verdict-rules.md``). Rendezvous comes before the collectives of the same library
#: (``init_process_group`` is in ``torch/distributed/`` too); a framework's message queue before
#: its collectives (vLLM's ``shm_broadcast`` lives among its device communicators); point-to-point
#: send/recv before the collectives of the same files (``distributed_c10d.py``, ``parallel_state.py``,
#: ``pynccl.py``), and their native waits before gloo's and NCCL's.
COMMUNICATION_LAYERS: tuple[CommLayer, ...] = (
    CommLayer("torch.distributed rendezvous", "rendezvous", python=r"torch/distributed/",
              function=r"(^|\.)(init_process_group|_store_based_barrier|rendezvous|_create_c10d_store|"
                       r"_(env|tcp|file)_rendezvous_handler|init_device_mesh)$",
              source="torch/distributed/distributed_c10d.py, rendezvous.py"),
    CommLayer("torch elastic rendezvous", "rendezvous", python=r"torch/distributed/elastic/rendezvous/",
              source="torch/distributed/elastic/rendezvous/"),
    CommLayer("TCPStore / FileStore wait", "rendezvous", native=r"c10d::(TCPStore|FileStore)|TCPStore::|"
              r"detail::TCPClient|c10d::detail::", source="torch/csrc/distributed/c10d/TCPStore.cpp"),
    CommLayer("vLLM shared-memory message queue", "message_queue",
              python=r"vllm/distributed/device_communicators/shm_broadcast\.py$",
              source="vllm/distributed/device_communicators/shm_broadcast.py (MessageQueue.dequeue)"),
    CommLayer("torch.distributed point-to-point", "p2p", python=r"torch/distributed/distributed_c10d\.py$",
              function=r"(^|\.)(send|recv|isend|irecv|batch_isend_irecv|send_object_list|recv_object_list)$",
              source="torch/distributed/distributed_c10d.py (send, recv, isend, irecv, batch_isend_irecv)"),
    CommLayer("vLLM/SGLang pipeline-parallel send/recv", "p2p",
              python=r"(vllm|sglang/srt)/distributed/(parallel_state|device_communicators/(?!shm_broadcast)\w+)\.py$",
              function=r"(^|\.)(i?send|i?recv|send_recv)(_tensor_dict|_object)?$",
              source="vllm/distributed/parallel_state.py, sglang/srt/distributed/parallel_state.py (GroupCoordinator."
                     "send_tensor_dict, recv_tensor_dict, send_object, recv_object, send, recv), their "
                     "device communicators' send/recv (pynccl.py PyNcclCommunicator.send/recv)"),
    CommLayer("point-to-point native waits", "p2p",
              native=r"(Send|Recv)Work::wait|UnboundBuffer::wait(Send|Recv)|ncclSend|ncclRecv",
              source="libtorch_cpu.so (ProcessGroupGloo::RecvWork::wait, gloo UnboundBuffer::waitRecv: "
                     "Work.wait of irecv/isend, batch_isend_irecv), libnccl (ncclSend, ncclRecv)"),
    CommLayer("DeepEP expert-parallel dispatch/combine", "collective", python=r"(^|[/ ])deep_ep/",
              function=r"(^|\.)((low_latency|intranode|internode)_)?(dispatch|combine)$", native=r"deep_ep::",
              source="deep_ep/buffer.py (Buffer.dispatch, combine, low_latency_dispatch, low_latency_combine: a "
                     "host-side spin until every expert-parallel rank arrives, no torch.distributed call)"),
    CommLayer("vLLM/SGLang pynccl", "collective",
              python=r"(vllm|sglang/srt)/distributed/device_communicators/pynccl(_wrapper)?\.py$",
              source="vllm/distributed/device_communicators/pynccl.py, sglang/srt/distributed/device_communicators/"
                     "pynccl.py (PyNcclCommunicator)"),
    CommLayer("vLLM/SGLang custom all-reduce", "collective",
              python=r"(vllm|sglang/srt)/distributed/device_communicators/(custom_all_reduce\w*|quick_all_reduce|"
                     r"aiter_custom_all_reduce)\.py$",
              source="vllm/distributed/device_communicators/custom_all_reduce.py, sglang/srt/distributed/"
                     "device_communicators/custom_all_reduce.py (CustomAllreduce)"),
    CommLayer("NVSHMEM", "collective", python=r"(^|[/ ])nvshmem/", native=r"nvshmem",
              source="libnvshmem (nvshmem_barrier_all, nvshmem_quiet, nvshmemx_*: a device- or host-side spin on a "
                     "remote flag), nvshmem4py (nvshmem/core/)"),
    CommLayer("vLLM device communicators", "collective", python=r"vllm/distributed/device_communicators/",
              source="cpu_communicator.py, pynccl.py, custom_all_reduce.py, quick_all_reduce.py, all2all.py"),
    CommLayer("vLLM parallel state / communication ops", "collective",
              python=r"vllm/distributed/(parallel_state|communication_op)\.py$",
              source="vllm/distributed/parallel_state.py (GroupCoordinator)"),
    CommLayer("SGLang distributed", "collective", python=r"sglang/srt/distributed/",
              source="sglang/srt/distributed/ (parallel_state.py, device_communicators/)"),
    CommLayer("vLLM/SGLang native all-reduce", "collective",
              native=r"shm_allreduce|shm_all_reduce|wait_for_all|custom_ar|cross_device_reduce|"
                     r"quickreduce|all_reduce_(one|two)_shot",
              source="vLLM csrc/cpu/shm.cpp (torch.ops._C.shm_allreduce), csrc/custom_all_reduce.cuh"),
    CommLayer("NCCL", "collective", native=r"nccl", source="libnccl (pynccl, ProcessGroupNCCL)"),
    CommLayer("torch.distributed collectives", "collective", python=r"torch/distributed/",
              source="torch/distributed/distributed_c10d.py"),
    CommLayer("c10d / gloo native waits", "collective",
              native=r"c10d::|gloo::|ProcessGroup(Gloo|NCCL)|Work::wait", source="libtorch_cpu.so"),
)


def comm_layer(frame: Frame) -> CommLayer | None:
    """The communication layer ``frame`` is in (:data:`COMMUNICATION_LAYERS`), or ``None``."""
    return next((layer for layer in COMMUNICATION_LAYERS if layer.matches(frame)), None)


def _is_plumbing(frame: Frame) -> bool:
    """A Python frame of the standard library (``threading.Event.wait``, ``queue.get``) or a
    frozen module: where everything waits, so not what a hang is about."""
    return frame.filename.startswith("<frozen") or bool(_STDLIB_PATH.search(frame.filename))


#: Native functions a thread blocks in (a lock, a condition, a semaphore, a poll, a sleep): seen
#: innermost before its first Python frame, the thread waits there whatever py-spy's ``active`` flag
#: says (py-spy reads the flag off the OS thread state; a thread woken an instant before the dump,
#: about to re-check its queue's timeout, reads active while still in the wait).
_BLOCKING_NATIVE = lazy_pattern(
    r"^(PyThread_acquire_lock_timed|pthread_cond_(timed|clock)?wait|sem_(timed|clock)?wait|do_futex_wait|"
    r"__futex_abstimed_wait\w*|futex_wait\w*|epoll_p?wait|poll|ppoll|select|pselect6?|clock_nanosleep|nanosleep)$")


def _native_waits(thread: ThreadStack) -> Iterator[str]:
    """The names of the thread's native frames before its first Python frame, innermost first (a
    ``--native`` dump; none without)."""
    for frame in thread.frames:
        if not frame.native:
            return
        yield frame.name or ""


def _blocked_in_native_wait(thread: ThreadStack) -> bool:
    """One of the thread's native frames before its first Python frame is a blocking wait
    (:data:`_BLOCKING_NATIVE`)."""
    return any(_BLOCKING_NATIVE.search(name) for name in _native_waits(thread))


def _few_own_frames(python: Sequence[Frame]) -> bool:
    """At most :data:`_PARK_MAX_OWN_FRAMES` of ``python`` are the thread's own (not its bootstrap)."""
    own = [f for f in python if not (f.filename.endswith("/threading.py") and f.name in _BOOTSTRAP_NAMES)]
    return len(own) <= _PARK_MAX_OWN_FRAMES


def _sleeping_helper(thread: ThreadStack, python: Sequence[Frame]) -> bool:
    """A helper thread (not the main one) that py-spy sees waiting in ``time.sleep`` (CPython's
    ``time_sleep`` among its native frames before its first Python frame: a ``--native`` dump) with
    at most :data:`_PARK_MAX_OWN_FRAMES` frames of its own above its bootstrap: a periodic checker
    between two checks (SGLang's ``WatchdogRaw._watchdog_thread``), not a hang."""
    if thread.is_main or thread.active or not python:
        return False
    return "time_sleep" in _native_waits(thread) and _few_own_frames(python)


def _parked_helper(thread: ThreadStack, python: Sequence[Frame]) -> bool:
    """A helper thread (not the main one) whose whole job is to wait on an ``Event`` or a
    ``Condition``: innermost a ``threading`` park, above it at most :data:`_PARK_MAX_OWN_FRAMES`
    frames of its own, then the thread's bootstrap (vLLM's ``SignalCallback._run``, tqdm's
    ``TMonitor.run``, a timer). A model's forward that waits in ``Event.wait`` is many frames deep,
    or on the main thread: stuck, not parked."""
    if thread.is_main or not python:
        return False
    i = 0
    while i < len(python) and python[i].filename.endswith("/threading.py") and python[i].name in _PARK_NAMES:
        i += 1
    return i > 0 and _few_own_frames(python[i:])


#: A thread the in-process SDK runs for the agent (``servewatch-control``, ``servewatch-presence``,
#: ``servewatch-torch-worker``...): named so by :mod:`agent.sdk`.
_SDK_THREAD_PREFIX = "servewatch-"
_SDK_PATH = lazy_pattern(r"(^|/)agent/sdk/")


def _sdk_helper(thread: ThreadStack, python: Sequence[Frame]) -> bool:
    """One of the SDK's own helper threads whose own frames are all the SDK's: waiting for the
    agent, or serving it (the agent's dump reads the in-flight requests through it while py-spy
    looks): servewatch's doing, never the server's hang. One that runs the server's code (a
    profiler start inside torch) is judged like any thread."""
    if thread.is_main or not thread.thread_name.startswith(_SDK_THREAD_PREFIX):
        return False
    own = [f for f in python if not _is_plumbing(f)]
    return bool(own) and all(_SDK_PATH.search(f.filename) for f in own)


def _waits_for_message(python: Sequence[Frame]) -> bool:
    """The innermost Python frame outside ``threading`` is a work source or a framework's
    message queue."""
    frame = _decider(python)
    if frame is None:
        return bool(python)  # only threading frames (a Timer, a bare Event.wait): idle
    layer = comm_layer(frame)
    return bool(_WORK_WAIT_PATH.search(frame.filename)) or (layer is not None and layer.kind == "message_queue")


def thread_is_idle(thread: ThreadStack) -> bool:
    """Whether a thread is idle: waiting for work, not stuck.

    Idle means py-spy saw it waiting (not ``active``) and the innermost Python frame outside
    ``threading`` is a work source (a queue, selector, socket, event loop, executor or
    multiprocessing worker, ZeroMQ); or it is a parked helper thread (:func:`_parked_helper`:
    vLLM's ``signal-callback``, tqdm's monitor) or one asleep between two checks
    (:func:`_sleeping_helper`: SGLang's watchdog thread); or one of the SDK's own ``servewatch-*`` threads
    in the SDK's own code (:func:`_sdk_helper`: waiting for or serving the agent). A framework's message queue (vLLM's
    ``shm_broadcast`` ``MessageQueue.dequeue``, which spins before it sleeps) is a wait for work
    even while py-spy sees it on CPU, and so is SGLang's scheduler loop polling for requests outside
    a batch run (:func:`_polls_for_work`). A thread waiting in the program's own code (a collective,
    a lock, ``Event.wait`` called from a model) is stuck, not idle; any other running thread is
    never idle.
    """
    python = [f for f in thread.frames if not f.native]
    if _sdk_helper(thread, python):
        return True
    if thread.active:
        first = _decider(python)
        layer = comm_layer(first) if first is not None else None
        if (layer is not None and layer.kind == "message_queue") or _polls_for_work(python):
            return True
        # woken an instant before the dump, still in its wait for work (a queue's timed get)
        return _blocked_in_native_wait(thread) and _waits_for_message(python)
    return _parked_helper(thread, python) or _sleeping_helper(thread, python) or _waits_for_message(python)


def _main_thread(threads: Sequence[ThreadStack]) -> ThreadStack | None:
    """The thread a stall is read from: the first of main thread, active threads, any thread
    with frames that is not idle (see :func:`thread_is_idle`); ``None`` when every thread with
    frames is idle (the process waits for work: nothing is hung).

    Args:
        threads: as returned by :func:`parse_dump` or :func:`parse_threads`.

    Returns:
        That thread, or ``None``.
    """
    for pick in (lambda t: t.is_main, lambda t: t.active, lambda t: True):
        for thread in threads:
            if pick(thread) and thread.frames and not thread_is_idle(thread):
                return thread
    return None


def hung_location(threads: Sequence[ThreadStack]) -> tuple[ThreadStack, int] | None:
    """Where a hung process is stuck, by the rule of :func:`hung_frame`.

    Args:
        threads: as returned by :func:`parse_dump` or :func:`parse_threads`.

    Returns:
        ``(thread, index)`` with ``thread.frames[index]`` the hung frame, or ``None`` when no
        thread is stuck (all idle, or no frames) or the stuck thread has no resolved frame.
    """
    thread = _main_thread(threads)
    if thread is None:
        return None
    python = [i for i, frame in enumerate(thread.frames) if not frame.native]
    index = next((i for i in python if not _is_plumbing(thread.frames[i])), python[0] if python else None)
    if index is None:  # no Python frame: the innermost symbolised native one, never an unresolved one
        index = next((i for i, f in enumerate(thread.frames) if not f.unresolved), None)
    if index is None:
        return None
    return thread, index


def hung_frame(threads: Sequence[ThreadStack]) -> str:
    """The frame a hung process is stuck in, as the demo and the summary show it.

    The thread is the main thread unless it is idle (waiting for work), else the first active
    one, else the first other thread that is not idle. Its innermost Python frame outside the
    standard library is the answer (``hung_in_allreduce (model.py:7)`` rather than
    ``Event.wait (threading.py:629)`` or a libc wait under it); failing that, its innermost
    Python frame; failing that, its innermost symbolised native frame. A frame py-spy could not
    resolve (module null, file ``?``) is never the answer.

    Returns:
        ``"function (file:line)"``, or ``""`` when nothing is stuck (all threads idle, or an
        empty dump).
    """
    location = hung_location(threads)
    if location is None:
        return ""
    thread, index = location
    return thread.frames[index].describe()


def idle_and_stuck(threads: Sequence[ThreadStack]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Labels of the idle threads and of the stuck (not idle) ones, in dump order.

    Threads without frames count as neither.
    """
    idle = tuple(t.label for t in threads if t.frames and thread_is_idle(t))
    stuck = tuple(t.label for t in threads if t.frames and not thread_is_idle(t))
    return idle, stuck


def clip(text: str, limit: int = MAX_ATTR_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def summarize(threads: Sequence[ThreadStack], *, max_threads: int = 16, max_frames: int = 5) -> tuple[str, ...]:
    """Bounded span summary: the innermost frames of each thread.

    Per thread: the innermost symbolised native frame when the thread sits in native code
    (where it waits, e.g. ``PyThread_acquire_lock_timed``), then its innermost Python frames, ``max_frames`` in all, each as
    ``"thread_name: function (file:line)"`` (at most 256 characters).

    Args:
        threads: as returned by :func:`parse_dump` (main thread first).
        max_threads: threads kept (the first ones).
        max_frames: frames kept per thread.

    Returns:
        At most ``max_threads * max_frames`` strings.
    """
    out: list[str] = []
    for thread in threads[:max_threads]:
        picked: list[Frame] = []
        for frame in thread.frames:  # the innermost named native frame it waits in, if any
            if not frame.native:
                break
            if not frame.name.startswith("0x"):
                picked.append(frame)
                break
        picked.extend(f for f in thread.frames if not f.native)
        if not picked:
            picked = list(thread.frames)
        out.extend(clip(f"{thread.label}: {frame.describe()}") for frame in picked[:max_frames])
    return tuple(out)


# --- faulthandler's tracebacks --------------------------------------------------------------------

_FH_THREAD = lazy_pattern(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FH_FRAME = lazy_pattern(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>\S+)')


def parse_faulthandler(text: str, *, pid: int) -> tuple[list[ThreadStack], bool]:
    """Threads of a :mod:`faulthandler` traceback (``faulthandler.dump_traceback``; what torch's
    worker server's ``dump_traceback`` handler returns), innermost frame first, as py-spy's would be.

    faulthandler prints at most 100 frames per thread, innermost first, then ``...``; it names no
    thread, so the thread whose outermost frame is ``<module>`` is taken for the main thread, else
    (its bottom cut off) the last one listed: CPython lists threads newest first, the main thread
    last. Threads with no Python frame (the C++ thread that answered) are left out.

    Returns:
        ``(threads, truncated)``: ``truncated`` when a thread's stack was cut (``...``).
    """
    threads: list[ThreadStack] = []
    frames: list[Frame] = []
    tid: int | None = None
    truncated = False

    def flush() -> None:
        if tid is not None and frames:
            main = frames[-1].name == "<module>"
            threads.append(ThreadStack(pid=pid, thread_id=tid, os_thread_id=pid if main else None,
                                       thread_name="MainThread" if main else "", frames=tuple(frames)))

    for line in text.splitlines():
        m = _FH_THREAD.match(line)
        if m:
            flush()
            tid, frames = int(m.group(1), 16), []
            continue
        f = _FH_FRAME.match(line)
        if f and tid is not None:
            path = safe_text(f.group("file"))
            short = path.split("-packages/", 1)[-1] if "-packages/" in path else path.rsplit("/", 1)[-1]
            frames.append(Frame(name=safe_text(f.group("name")), filename=path, short_filename=short,
                                line=int(f.group("line"))))
        elif line.strip() == "...":
            truncated = True
    flush()
    if threads and not any(t.is_main for t in threads):
        last = threads[-1]
        threads[-1] = ThreadStack(pid=pid, thread_id=last.thread_id, os_thread_id=pid, thread_name="MainThread",
                                  frames=last.frames)
    threads.sort(key=lambda t: not t.is_main)
    return threads, truncated


def threads_to_json(threads: Sequence[ThreadStack]) -> list[dict[str, object]]:
    """Threads as ``py-spy dump --json`` writes them (what :func:`parse_dump` reads back)."""
    return [
        {
            "pid": t.pid, "thread_id": t.thread_id, "thread_name": t.thread_name, "os_thread_id": t.os_thread_id,
            "active": t.active, "owns_gil": t.owns_gil,
            "frames": [{"name": f.name, "filename": f.filename, "short_filename": f.short_filename, "line": f.line,
                        "module": f.module} for f in t.frames],
        }
        for t in threads
    ]
