"""Digests used everywhere: sha256 of bytes, of tensor dicts, and of canonical JSON.

Canonical JSON (sorted keys, no spaces, UTF-8, no NaN) is what gets signed and hashed, so the
same object gives the same bytes on every machine.

A tensor dict's hash (`tensors_hash`, scheme `TENSOR_HASH`) is a two-level sha256 tree: each
tensor's bytes are cut into 1 MiB leaves, the leaves are hashed by a pool of threads (sha256
lets go of the GIL), and one sha256 runs over every tensor's name, dtype, shape and leaf
digests. The value does not depend on the number of threads, and the work spreads over a
machine's cores: a 1B-parameter model's trace entry (params + AdamW moments, 12 GB) is one sha256
stream of 6-8 s on one core (1.5-1.9 GB/s here), and its leaves hash on every core there is.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

TENSOR_HASH = "sha256-tree/1MiB"  # recorded in a run's manifest: a run is checked with the scheme it was made with
LEAF = 1 << 20  # bytes per leaf; part of the scheme
INLINE = 256 << 10  # a leaf of a tensor this small is hashed in the caller's thread: a hand-off would cost more
MAX_THREADS = 16  # more threads than this outrun the memory's bandwidth before they outrun sha256
PENDING = 256 << 20  # bytes TensorsHasher lets the pool hold before it waits: a writer holds one tensor at a time
_pool: ThreadPoolExecutor | None = None
T, R = TypeVar("T"), TypeVar("R")


def hash_threads() -> int:
    """The leaf hashers' pool size: the CPUs this process may run on (its affinity, and its
    cgroup's CPU quota in a container), at most MAX_THREADS."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus, cpu_quota() or cpus))


def cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPUs the cgroup's CFS quota allows (rounded up), or None without one: a container
    limited to 4 CPUs on a 64-core host sees 64 in its affinity, and 16 busy hashers would spend
    its quota early in each period, then stall every thread of it, the training's too, until the
    next. cgroup v2 (`cpu.max`), else v1 (`cpu/cpu.cfs_quota_us`), as a container sees its own."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return max(1, math.ceil(quota_us / period_us)) if quota_us > 0 and period_us > 0 else None


def _leaf_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(hash_threads(), thread_name_prefix="veriloco-hash")
    return _pool


def _forget_pool() -> None:  # a forked child has none of its parent's threads
    global _pool, _task_pool
    _pool = _task_pool = None


_task_pool: ThreadPoolExecutor | None = None


def in_threads(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """[fn(x) for x in items], the calls spread over `hash_threads()` threads: for independent
    reads and hashes of whole blobs (file reads and sha256 let go of the GIL). The first call to
    raise, in the items' order, raises here. `fn` must not wait on this pool (nor the leaves':
    a tensors_hash inside it is fine, the leaves have a pool of their own)."""
    items = list(items)
    if len(items) < 2:
        return [fn(x) for x in items]
    futures = [_tasks().submit(fn, x) for x in items]
    return [f.result() for f in futures]


def alongside(fn: Callable[[], R], side: Callable[[], T]) -> tuple[R, T]:
    """(fn(), side()), `side` on a thread of the pool while `fn` runs in the caller's thread, so
    that the model-sized work stays on the caller's thread: an audit at 43M params whose outer
    step and checkpoint digest ran on a pool thread peaked 340-660 MB higher (bench/audit_memory.py
    on an uncommitted version; glibc's per-thread malloc arenas are the likely cause, not
    verified). `fn`'s exception is the one raised when both fail."""
    future = _tasks().submit(side)
    try:
        out = fn()
    except BaseException:
        future.cancel() or future.exception()  # not left running past the failure
        raise
    return out, future.result()


def _tasks() -> ThreadPoolExecutor:
    global _task_pool
    if _task_pool is None:
        _task_pool = ThreadPoolExecutor(hash_threads(), thread_name_prefix="veriloco-blobs")
    return _task_pool


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def scheme_problem(manifest: Mapping[str, Any]) -> str | None:
    """Why this code cannot check a run's tensor hashes (its manifest's `tensor_hash` is not
    `TENSOR_HASH`), or None when it can."""
    got = manifest.get("tensor_hash")
    if got == TENSOR_HASH:
        return None
    made = f"veriloco {manifest.get('code_version', '?')}, which hashed tensors as " + (
        repr(got) if got is not None else "one sha256 stream a dict")
    return f"made by {made}; this veriloco hashes them as {TENSOR_HASH!r} and cannot check its hashes: use the veriloco that made it"


def _digest(leaf: memoryview) -> bytes:
    return hashlib.sha256(leaf).digest()


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> bytes:
    """The one byte encoding of a JSON object that we sign and hash."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def json_hash(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj`."""
    return sha256_hex(canonical_json(obj))


def tensors_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """The `TENSOR_HASH` digest of names, dtypes, shapes and raw bytes of `tensors`, in sorted name order.

    Bit-exact: two tensor dicts hash equal iff every tensor is identical, so it is the check that
    all workers hold the same global params and that a replay reproduced a state.
    """
    h = TensorsHasher()
    for name in sorted(tensors):
        h.add(name, tensors[name])
    return h.hexdigest()


class TensorsHasher:
    """`tensors_hash`, fed one tensor at a time in sorted name order (also by a writer that holds
    one tensor at a time: run.prepare_run's G_0). A tensor's large leaves go to the pool and are
    read in order, so a GPU tensor's copy to the host overlaps the hashing of the one before; at
    most PENDING bytes wait in the pool, so a caller's tensors are let go of soon."""

    def __init__(self) -> None:
        self._h, self._last = hashlib.sha256(), None
        self._pending: deque[tuple[bytes, list[Future[bytes] | bytes], int]] = deque()
        self._held = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._last is not None and name <= self._last:
            raise ValueError(f"tensors_hash takes names in sorted order: {name!r} after {self._last!r}")
        self._last = name
        t = tensor.detach().contiguous().cpu()
        header = f"{name}|{t.dtype}|{tuple(t.shape)}|".encode()
        # the raw bytes, read in place (a uint8 view: bf16 has no numpy dtype)
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        if len(data) <= INLINE:
            self._pending.append((header, [_digest(data)] if len(data) else [], 0))
        else:
            pool = _leaf_pool()
            self._pending.append((header, [pool.submit(_digest, data[i:i + LEAF]) for i in range(0, len(data), LEAF)], len(data)))
            self._held += len(data)
        while self._held > PENDING:
            self._drain_one()

    def _drain_one(self) -> None:
        header, leaves, held = self._pending.popleft()
        self._h.update(header)
        for leaf in leaves:
            self._h.update(leaf if isinstance(leaf, bytes) else leaf.result())
        self._held -= held

    def hexdigest(self) -> str:
        while self._pending:
            self._drain_one()
        return self._h.hexdigest()
