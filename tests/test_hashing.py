"""The tensor hash (`hashing.tensors_hash`, scheme `TENSOR_HASH`): its bytes as documented, the
same value whatever the threads, and a run made with another scheme refused in one line."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import TINY, cli

from veriloco import hashing
from veriloco.hashing import LEAF, TENSOR_HASH, TensorsHasher, tensors_hash


def reference(tensors: dict[str, torch.Tensor]) -> str:
    """The scheme written out from its description: one sha256 over, per tensor in sorted name
    order, `name|dtype|shape|` and the sha256 of each 1 MiB leaf of its raw bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        for i in range(0, len(raw), 1 << 20):
            h.update(hashlib.sha256(raw[i:i + (1 << 20)]).digest())
    return h.hexdigest()


def mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(655_361, generator=g),  # 2.5 MiB + 4 bytes: three leaves, the last short
        "bf16": torch.randn(300_000, generator=g).bfloat16(),  # over the inline size, one leaf
        "small": torch.randn(7, 3, generator=g),  # hashed in the caller's thread
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(600, 900, generator=g).t(),  # not contiguous: hashed as its values in order
    }


def test_the_hash_is_the_documented_tree() -> None:
    assert LEAF == 1 << 20 and TENSOR_HASH == "sha256-tree/1MiB"
    tensors = mixed()
    assert tensors_hash(tensors) == reference(tensors)
    # not the one sha256 stream of the earlier scheme
    stream = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        stream.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        stream.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    assert tensors_hash(tensors) != stream.hexdigest()


def test_the_hash_does_not_depend_on_threads_or_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = mixed()
    want = reference(tensors)
    for threads in (1, 3):
        monkeypatch.setattr(hashing, "_pool", ThreadPoolExecutor(threads))
        assert tensors_hash(tensors) == want
    monkeypatch.setattr(hashing, "PENDING", LEAF)  # a writer's tensors let go of one by one
    h = TensorsHasher()
    for name in sorted(tensors):
        h.add(name, tensors[name])
        assert h._held <= LEAF
    assert h.hexdigest() == want


def test_every_byte_and_every_name_counts() -> None:
    tensors = mixed()
    want = tensors_hash(tensors)
    last = tensors["big"].clone()
    last[-1] = torch.nextafter(last[-1], torch.tensor(1e9))  # one bit of the last, short leaf
    assert tensors_hash(tensors | {"big": last}) != want
    swapped = tensors["big"].clone()
    swapped[: 2 * 262_144] = torch.cat([swapped[262_144: 2 * 262_144], swapped[:262_144]])  # two leaves swapped
    assert tensors_hash(tensors | {"big": swapped}) != want
    renamed = dict(tensors)
    renamed["small2"] = renamed.pop("small")
    assert tensors_hash(renamed) != want
    assert tensors_hash(tensors | {"small": tensors["small"].reshape(3, 7)}) != want
    with pytest.raises(ValueError, match="sorted order"):
        h = TensorsHasher()
        h.add("b", torch.zeros(1))
        h.add("a", torch.zeros(1))


X = {"x": torch.arange(1 << 20, dtype=torch.float32)}  # made before any fork: the child runs no torch kernel


def _child(q: mp.Queue) -> None:
    q.put(tensors_hash(X))


def test_a_forked_child_hashes_with_threads_of_its_own() -> None:
    want = tensors_hash(X)  # the parent's pool is up; a child that used it would wait forever
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    try:
        assert q.get(timeout=60) == want
    finally:
        p.join(10)
        p.kill()


def test_a_run_of_another_scheme_is_refused(tmp_path, monkeypatch, capsys) -> None:
    run = tmp_path / "run"
    code, err, _ = cli(monkeypatch, capsys, "train", str(TINY), "--train.rounds=1", "--out", str(run), "--quiet")
    assert code == 0, err
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["tensor_hash"] == TENSOR_HASH
    assert f"<th>tensor hash</th><td><code>{TENSOR_HASH}</code>" in (run / "report.html").read_text()
    del manifest["tensor_hash"]  # as the veriloco before it wrote them
    (run / "manifest.json").write_text(json.dumps(manifest))
    for args in (("audit", str(run)), ("train", "--resume", str(run)), ("plan", str(run))):
        code, err, _ = cli(monkeypatch, capsys, *args)
        assert code == 2 and len(err) == 1, err
        assert "one sha256 stream a dict" in err[0] and repr(TENSOR_HASH) in err[0], err
    code, err, out = cli(monkeypatch, capsys, "report", str(run))  # the report checks no hash: it shows the run
    assert code == 0 and out.strip().endswith("report.html"), err
    assert "<th>tensor hash</th><td><code>one sha256 stream a dict</code>" in (run / "report.html").read_text()
    (run / "manifest.json").write_text("{")
    code, err, _ = cli(monkeypatch, capsys, "report", str(run))  # it was a traceback
    assert code == 2 and len(err) == 1 and "manifest.json is not valid JSON" in err[0], err


def test_the_hashers_fit_a_containers_cpu_quota(tmp_path, monkeypatch) -> None:
    from veriloco.hashing import cpu_quota

    assert cpu_quota(tmp_path) is None  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")  # v2: 2.5 CPUs
    assert cpu_quota(tmp_path) == 3
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1 without a quota
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(tmp_path) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")  # half a CPU: still one thread
    assert cpu_quota(tmp_path) == 1
    monkeypatch.setattr(hashing.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(hashing, "cpu_quota", lambda: 4)
    assert hashing.hash_threads() == 4
    monkeypatch.setattr(hashing, "cpu_quota", lambda: None)
    assert hashing.hash_threads() == hashing.MAX_THREADS


def test_blobs_in_threads_keep_their_order_and_the_first_failure() -> None:
    import threading
    import time as _time

    from veriloco.hashing import alongside, in_threads

    def slow_square(x: int) -> int:
        _time.sleep(0.02 * (5 - x))  # the last items finish first
        if x in (2, 4):
            raise ValueError(f"item {x}")
        return x * x

    assert in_threads(lambda x: x * x, range(5)) == [0, 1, 4, 9, 16]
    with pytest.raises(ValueError, match="item 2"):  # the first in order, not the first to fail
        in_threads(slow_square, range(5))
    caller = threading.get_ident()
    assert alongside(threading.get_ident, threading.get_ident)[0] == caller
    assert alongside(threading.get_ident, threading.get_ident)[1] != caller
    boom = lambda: (_ for _ in ()).throw(RuntimeError("side"))  # noqa: E731
    with pytest.raises(RuntimeError, match="side"):
        alongside(lambda: 1, boom)
    with pytest.raises(ValueError, match="item 2"):  # the caller's failure is the one told
        alongside(lambda: slow_square(2), boom)
