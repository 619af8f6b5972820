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
import multiprocessing
import os
import signal
from collections.abc import Callable
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


def start_workers(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """fn(rank, *args) in nprocs processes; waits for all, re-raises the first failure
    (torch.multiprocessing.ProcessRaisedException / ProcessExitedException), as mp.spawn. Ctrl-C
    (KeyboardInterrupt here) ends them before it is raised on: none is left to run on alone."""
    import torch.multiprocessing as mp

    context()  # sets the preload before the server first starts
    procs = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method=START_METHOD)
    try:
        while not procs.join():
            pass
    except KeyboardInterrupt:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
        for p in procs.processes:
            p.join(30)
        raise
