"""Deterministic batches, Merkle root stability, store integrity, packets."""

from __future__ import annotations

import hashlib

import pytest
import torch

from veriloco.compress import codec_from_spec
from veriloco.config import DataConfig
from veriloco.data import (
    DataError,
    batch,
    batch_offsets,
    corpus_from_raw,
    eval_batches,
    load_corpus,
    stdlib_files,
)
from veriloco.hashing import sha256_hex, tensors_hash
from veriloco.ledger.merkle import root as merkle_root
from veriloco.packet import PacketError, decode_packet, encode_packet
from veriloco.store import LocalStore, StoreError

RAW = bytes(range(256)) * 400  # a fixed synthetic corpus


def corpus(**kw):
    return corpus_from_raw(RAW, "text", DataConfig(chunk_bytes=4096, **kw), 256, 16)


def test_batch_is_a_pure_function_with_golden_tokens():
    c = corpus()
    x1, y1 = batch(c, 7, 2, 3, 4, 8, 16)
    x2, y2 = batch(corpus(), 7, 2, 3, 4, 8, 16)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    # pinned: sha256 of the arguments picks the offsets, on every machine and numpy version
    assert batch_offsets(c, 7, 2, 3, 4, 3, 16) == [87474, 76057, 32440]
    n_positions = c.eval_start - 16 - 1
    spec = [
        int.from_bytes(hashlib.sha256(f"veriloco/batch/7/2/3/4/{i}".encode()).digest()[:8], "little") % n_positions
        for i in range(3)
    ]
    assert spec == [87474, 76057, 32440]
    assert not torch.equal(batch(c, 7, 2, 3, 5, 8, 16)[0], x1)  # another step, other tokens
    assert not torch.equal(batch(c, 7, 1, 3, 4, 8, 16)[0], x1)  # another worker, other tokens
    assert max(batch_offsets(c, 0, 0, 0, 0, 256, 16)) + 17 <= c.eval_start  # never the eval split


def test_eval_batches_fixed_and_held_out():
    c = corpus()
    a, b = eval_batches(c, 3, 4, 16), eval_batches(c, 3, 4, 16)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b, strict=True))


def test_merkle_root_stable_and_sensitive():
    c = corpus()
    assert c.root == merkle_root([bytes.fromhex(h) for h in c.chunk_hashes]).hex()
    assert c.root == "404a26c30c1739bbb7e80b9b40987f6d4fccc97e144d1d16ebd2a877f63e95ff"  # pinned
    flipped = bytearray(RAW)
    flipped[5000] ^= 1
    assert corpus_from_raw(bytes(flipped), "text", DataConfig(chunk_bytes=4096), 256, 16).root != c.root
    # RFC 9162 known values: empty tree and one leaf
    assert merkle_root([]).hex() == sha256_hex(b"")
    assert merkle_root([b""]).hex() == sha256_hex(b"\x00")


def test_stdlib_corpus_selection():
    files = stdlib_files()
    names = [p.name for p in files]
    assert names == sorted(names) and len(names) > 50
    assert not any(n.startswith("test") for n in names)
    c = load_corpus(DataConfig(max_bytes=200_000), 256, 32)
    assert len(c.tokens) == 200_000 and c.raw.startswith(b"# file: ")


def test_user_text_dir_and_bin(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_bytes(b"hello world " * 2000)
    (tmp_path / "d" / "a.txt").write_bytes(b"abc " * 2000)
    c = load_corpus(DataConfig(source=str(tmp_path / "d")), 256, 16)
    assert c.raw.startswith(b"# file: a.txt\n")
    import numpy as np

    np.arange(20000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    cb = load_corpus(DataConfig(source=str(tmp_path / "t.bin")), 20000, 16)
    assert cb.kind == "bin" and cb.tokens.dtype == np.uint16 and int(cb.tokens[5]) == 5
    with pytest.raises(DataError, match="vocab_size"):
        load_corpus(DataConfig(source=str(tmp_path / "t.bin")), 1000, 16)
    with pytest.raises(DataError, match="too small"):
        corpus_from_raw(b"x" * 100, "text", DataConfig(), 256, 64)


def test_store_integrity(tmp_path):
    s = LocalStore(tmp_path / "s")
    d = s.put(b"payload")
    assert d == sha256_hex(b"payload") and s.get(d) == b"payload" and s.put(b"payload") == d
    path = s.path_of(d)
    data = bytearray(path.read_bytes())
    data[0] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="corrupt"):
        s.get(d)
    with pytest.raises(StoreError, match="missing"):
        s.get("0" * 64)
    with pytest.raises(StoreError, match="not a sha256"):
        s.get("../etc/passwd")
    with pytest.raises(StoreError, match="over the limit"):
        s.get(s.put(b"x" * 100), max_bytes=10)
    assert not list((tmp_path / "s").rglob(".tmp-*"))  # no temporary files left behind


def test_packet_round_trip_and_rejections():
    delta = {"a.weight": torch.randn(3, 4), "b": torch.randn(5)}
    codec = codec_from_spec("fp32")
    data = encode_packet(delta, {k: codec for k in delta})
    shapes = {k: tuple(v.shape) for k, v in delta.items()}
    out = decode_packet(data, shapes, 1 << 20)
    assert tensors_hash(out) == tensors_hash(delta)
    with pytest.raises(PacketError, match="over the limit"):
        decode_packet(data, shapes, 10)
    with pytest.raises(PacketError, match="does not match"):
        decode_packet(data, {"a.weight": (3, 4)}, 1 << 20)
    with pytest.raises(PacketError):
        decode_packet(b"\x00" * 7, shapes, 1 << 20)
    with pytest.raises(PacketError):
        decode_packet(data[:-4], shapes, 1 << 20)
    bad = encode_packet({"a.weight": torch.full((3, 4), float("nan")), "b": torch.zeros(5)}, {k: codec for k in delta})
    with pytest.raises(PacketError, match="non-finite"):
        decode_packet(bad, shapes, 1 << 20)


def test_a_store_entry_that_is_no_regular_file_is_a_store_error(tmp_path):
    """A FIFO where a blob goes hung the audit (its size, 0, passed the limit, then its read waited
    forever); a directory was an IsADirectoryError (exit 2, not a failed audit). Both are now a
    StoreError, as a missing or corrupt blob is; so is a ref that is a directory."""
    import os

    store = LocalStore(tmp_path / "s")
    digest = store.put(b"blob")
    store.path_of(digest).unlink()
    os.mkfifo(store.path_of(digest))
    with pytest.raises(StoreError, match="is not a regular file"):
        store.get(digest, max_bytes=1 << 20)
    with pytest.raises(StoreError, match="is not a regular file"):
        store.verify(digest)
    store.path_of(digest).unlink()
    store.path_of(digest).mkdir()
    with pytest.raises(StoreError, match="is not a regular file"):
        store.get(digest)
    (tmp_path / "s" / "refs" / "runs" / "x.sig.json").mkdir(parents=True)
    with pytest.raises(StoreError, match="is not a regular file"):
        store.get_ref("runs/x.sig.json")
    big = store.put(b"x" * 100)
    with pytest.raises(StoreError, match="over the limit 99"):
        store.get(big, max_bytes=99)


def test_a_staged_blob_stays_locked_until_it_is_adopted(tmp_path, monkeypatch):
    """prepare_run closes G_0's staged file for its digest long before it adopts it (it stores the
    corpus meanwhile): closing let go of the lock, and the next StagedBlob in the directory deleted
    it as a killed process's leftover once it was a minute old."""
    import os

    from veriloco.store import StagedBlob

    with StagedBlob(tmp_path) as g0:
        g0.write(b"G_0 bytes")
        digest = g0.close()
        os.utime(g0.path, (0, 0))  # written long ago
        with StagedBlob(tmp_path):  # another launcher's, in the same directory
            pass
        assert g0.path.exists()
        assert LocalStore(tmp_path / "store").adopt(g0) == digest
    assert LocalStore(tmp_path / "store").get(digest) == b"G_0 bytes"


def test_a_staged_blob_adopted_across_filesystems_is_whole_or_absent(tmp_path, monkeypatch):
    """Across filesystems (--out a mount point) the move was a copy straight to the blob's name: a
    full disk left a partial blob there, which every later run then failed on as corrupt."""
    import errno
    import os
    import shutil

    from veriloco import store as store_mod
    from veriloco.store import StagedBlob

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(store_mod.os, "rename", cross_device)
    store = LocalStore(tmp_path / "store")
    copy = shutil.copyfileobj

    def disk_full(src, dst, length=0):
        dst.write(src.read(3))
        raise OSError(errno.ENOSPC, "No space left on device")

    with StagedBlob(tmp_path) as blob:
        blob.write(b"G_0 bytes" * 100)
        monkeypatch.setattr(store_mod.shutil, "copyfileobj", disk_full)
        with pytest.raises(OSError, match="No space left"):
            store.adopt(blob)
        digest = blob.digest
    assert not store.has(digest) and not any(p.name.startswith(".tmp") for p in store.path_of(digest).parent.iterdir())
    monkeypatch.setattr(store_mod.shutil, "copyfileobj", copy)
    with StagedBlob(tmp_path) as blob:
        blob.write(b"G_0 bytes" * 100)
        assert store.adopt(blob) == digest
    assert store.get(digest) == b"G_0 bytes" * 100 and not blob.path.exists()
    assert oct(os.stat(store.path_of(digest)).st_mode & 0o777) == "0o644"


def test_a_name_with_a_trailing_newline_is_no_digest_nor_ref():
    """`$` matches before a final newline: the store took "<64 hex>\\n" as a digest (and made a
    path with a newline of it) and "runs/x\\n" as a ref name."""
    from veriloco.store import check_digest, check_ref

    with pytest.raises(StoreError, match="not a sha256 digest"):
        check_digest("a" * 64 + "\n")
    with pytest.raises(StoreError, match="not a ref name"):
        check_ref("runs/x\n")
    assert check_digest("a" * 64) == "a" * 64 and check_ref("runs/x.sig.json") == "runs/x.sig.json"
