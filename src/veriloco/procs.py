"""How veriloco starts its local worker processes.

From a forkserver that has already imported torch and the engine (`veriloco.run`): a worker then
starts in a fraction of a second instead of importing torch anew (~2-4 s of CPU each under
`spawn`, paid W * S times per run and again for every elastic restart). Like spawn, and unlike
fork, no state of the launching process (threads, a CUDA context, open gloo groups) is
inherited: the server forks from its own clean state, and arguments are pickled between our own
processes only (never to or from a peer).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from typing import Any

# a platform without fork (Windows) starts each worker with spawn, importing torch anew
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
# torch, the engine, the elastic worker's entry, and torch's pipelining (stages), which brings torch._dynamo
# (~1 s of CPU) that every pipelined worker would pay otherwise; so does the first construction of any torch
# optimizer (the engine's own are not torch optimizers: inner.AdamW, outer.OuterOptimizer)
PRELOAD = ["veriloco.run", "veriloco.elastic", "torch.distributed.pipelining"]


def context() -> BaseContext:
    """The multiprocessing context worker processes start from (its server preloads PRELOAD)."""
    ctx = multiprocessing.get_context(START_METHOD)  # torch.multiprocessing's is this one
    if START_METHOD == "forkserver" and not _running():
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def warm() -> bool:
    """Start the forkserver now, if it is not running, so that its imports (~3 s) overlap what this
    process does before it starts workers (its own imports, a run's corpus and initial weights)
    instead of following it. It stays up until this process exits, as one that `start_workers`
    started does. Imports nothing itself (this module imports no torch). Whether it started one."""
    if START_METHOD != "forkserver" or _running():
        return False
    context()
    forkserver.ensure_running()
    return True


def stop() -> None:
    """Stop this process's forkserver (a command that fails before it needs workers: the server,
    busy with its imports, would hold the command's output open until they are done, so a caller
    reading that output to its end would wait ~3 s for a one-line error). A later `context` or
    `warm` starts a new one."""
    pid = _server_pid()
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _server_pid() -> int | None:
    """The pid of this process's forkserver once it has started (CPython's, read from its private
    state: None where that is not there, and `warm` then only starts it, `stop` does nothing)."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _running() -> bool:
    """Whether this process's forkserver has started (what it preloads is fixed from then on)."""
    return _server_pid() is not None


class Terminated(KeyboardInterrupt):
    """SIGTERM to a launcher while its workers ran (a scheduler preempting the job, `kill PID`):
    handled as Ctrl-C is (`sigterm_as_interrupt`), so that the workers end with the launcher."""

    terminated = True  # what the CLI tells apart (exit 143, not Ctrl-C's 130), as on run.Interrupted


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within: SIGTERM raises Terminated in this process's main thread, as Ctrl-C raises
    KeyboardInterrupt, so a launcher's cleanup (ending its workers) runs before it exits. Python's
    default for SIGTERM is to die at once, and the workers ran on alone, into the run directory.
    Outside the main thread (where no handler can be set) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise Terminated("SIGTERM")

    old = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """In a worker: end this process at once when the launcher that started it ends, however it
    ended (SIGKILL runs no cleanup), instead of training on alone into the run directory, where a
    resume would then race it. A child of multiprocessing (forkserver or spawn) holds a sentinel
    of its parent that reads EOF when the parent is gone: a daemon thread waits on it. (Its OS
    parent is the forkserver, which outlives the launcher while the workers hold its alive pipe,
    so the kernel's parent-death signal would not fire.) A worker started as a plain subprocess
    (elastic's network namespaces) asks the kernel instead (Linux: PR_SET_PDEATHSIG)."""
    from multiprocessing import connection, parent_process

    parent = parent_process()
    if parent is not None and parent.sentinel is not None:
        def watch() -> None:
            connection.wait([parent.sentinel])
            os._exit(1)

        threading.Thread(target=watch, name="veriloco-launcher-watch", daemon=True).start()
        return
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    ppid = os.getppid()
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() != ppid:
        os._exit(1)  # the parent ended before the call took effect: nobody to work for


# how a worker fails when another one did first: the collective it was in lost its peer
PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")
GRACE_S = 5.0  # once one worker failed, how long the others get to end (and say why) before SIGTERM


def start_workers(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """fn(rank, *args) in nprocs processes; waits for all, re-raises a failure
    (torch.multiprocessing.ProcessRaisedException / ProcessExitedException), as mp.spawn: the
    first, unless that one only lost its peer (`PEER_FAILURES`) and another failed of something
    else (`root_cause`). Ctrl-C (KeyboardInterrupt here) or SIGTERM (Terminated) ends them before
    it is raised on: none is left to run on alone."""
    import torch.multiprocessing as mp

    context()  # sets the preload before the server first starts
    with sigterm_as_interrupt():
        _start_and_join(mp, fn, args, nprocs)


def _start_and_join(mp: Any, fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    procs = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method=START_METHOD)
    try:
        while not procs.join(grace_period=GRACE_S):
            pass
    except mp.ProcessRaisedException as e:
        cause = root_cause(e, procs.error_files)
        if cause is e:
            raise
        raise mp.ProcessRaisedException(f"\n\n-- Process {cause[0]:d} terminated with the following error:\n{cause[1]}",
                                        cause[0], procs.processes[cause[0]].pid) from None
    except KeyboardInterrupt:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
        for p in procs.processes:
            p.join(30)
        raise


def root_cause(first: BaseException, error_files: Sequence[str]) -> BaseException | tuple[int, str]:
    """What to report of a failed run: `first` (the failure the launcher saw first), unless all it
    says is that a collective lost its peer (`PEER_FAILURES`) while another process failed of
    something else: then (that process's index, its traceback). A worker that ran out of disk
    space failed its run with its peer's "Connection closed by peer", since the peer, which only
    noticed, exited first. Each error file holds a traceback string that torch's child wrapper
    wrote (our own processes'); it is read with globals refused, so only a str can come out."""
    if not any(m in str(first) for m in PEER_FAILURES):
        return first
    for i, path in enumerate(error_files):
        if i == getattr(first, "error_index", None) or not os.access(path, os.R_OK):
            continue
        try:
            with open(path, "rb") as f:
                trace = _StrOnly(f).load()
        except Exception:  # noqa: BLE001 - a file torch half-wrote: not a cause to report
            continue
        if isinstance(trace, str) and trace.strip() and not any(m in trace for m in PEER_FAILURES):
            return i, trace
    return first


class _StrOnly(pickle.Unpickler):
    """Unpickles plain data only (torch writes a str): any class or function is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")
