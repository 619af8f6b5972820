"""How veriloco starts its local worker processes.

From a forkserver that has already imported torch and the engine (`veriloco.run`): a worker then
starts in a fraction of a second instead of importing torch anew (~2-4 s of CPU each under
`spawn`, paid W * S times per run and again for every elastic restart). Like spawn, and unlike
fork, no state of the launching process (threads, a CUDA context, open gloo groups) is
inherited: the server forks from its own clean state, and arguments are pickled between our own
processes only (never to or from a peer).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

import torch.multiprocessing as mp

# a platform without fork (Windows) starts each worker with spawn, importing torch anew
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
PRELOAD = ["veriloco.run", "veriloco.elastic"]  # torch, the engine, and the elastic worker's entry


def context() -> BaseContext:
    """The multiprocessing context worker processes start from (its server preloads PRELOAD)."""
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_workers(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """fn(rank, *args) in nprocs processes; waits for all, re-raises the first failure
    (torch.multiprocessing.ProcessRaisedException / ProcessExitedException), as mp.spawn."""
    context()  # sets the preload before the server first starts
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method=START_METHOD)
