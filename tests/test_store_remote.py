"""FsspecStore over memory:// and file://: round trip, atomic publication, corrupt and missing
blobs, size limit before reading; open_store picks the right class."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from veriloco.hashing import sha256_hex
from veriloco.store import FsspecStore, LocalStore, StoreError, open_store


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> FsspecStore:
    if request.param == "memory":
        return FsspecStore(f"memory://veriloco-test-{uuid.uuid4().hex}/blobs")
    return FsspecStore(f"file://{tmp_path}/blobs")


def test_round_trip_and_listing(store: FsspecStore) -> None:
    blobs = [b"", b"hello", bytes(range(256)) * 40]
    digests = [store.put(b) for b in blobs]
    assert digests == [sha256_hex(b) for b in blobs]
    for d, b in zip(digests, blobs, strict=True):
        assert store.has(d)
        assert store.get(d) == b
    assert store.put(b"hello") == digests[1]  # idempotent
    assert store.digests() == sorted(digests)
    # no temporary names left behind after publication
    assert not [p for p in store.fs.find(store.root) if "/.tmp-" in p]


def test_publication_goes_through_a_temporary_name(
    store: FsspecStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, str]] = []
    real_mv = store.fs.mv

    def spy_mv(src: str, dst: str, **kw: object) -> None:
        assert not store.fs.exists(dst)  # the final name appears only at the rename
        seen.append((src, dst))
        real_mv(src, dst, **kw)

    monkeypatch.setattr(store.fs, "mv", spy_mv)  # fsspec caches fs objects: undo after
    d = store.put(b"atomic")
    assert store.atomic_put is False
    assert len(seen) == 1 and "/.tmp-" in seen[0][0] and seen[0][1] == store.path_of(d)


def test_corrupt_blob_is_detected(store: FsspecStore) -> None:
    d = store.put(b"the real bytes")
    store.fs.pipe_file(store.path_of(d), b"the fake bytes")
    with pytest.raises(StoreError, match=f"blob {d} is corrupt"):
        store.get(d)


@pytest.mark.parametrize("local", [False, True])
def test_verify_streams_and_delete_removes(store: FsspecStore, tmp_path: Path, local: bool) -> None:
    """verify (the audit's check of a checkpoint, read as a stream) and delete (run.keep_checkpoints),
    on a remote store and a local one."""
    s = LocalStore(tmp_path / "local") if local else store
    big = bytes(range(256)) * (1 << 15)  # 8 MiB: two reads of 4 MiB
    d, other = s.put(big), s.put(b"other")
    s.verify(d)
    if local:
        Path(s.path_of(other)).write_bytes(b"forged")
    else:
        s.fs.pipe_file(s.path_of(other), b"forged")
    with pytest.raises(StoreError, match=f"blob {other} is corrupt"):
        s.verify(other)
    assert s.delete(d) and not s.has(d) and not s.delete(d)
    with pytest.raises(StoreError, match=f"blob {d} is missing"):
        s.verify(d)


def test_missing_blob_and_bad_names(store: FsspecStore) -> None:
    d = sha256_hex(b"never stored")
    assert not store.has(d)
    with pytest.raises(StoreError, match=f"blob {d} is missing"):
        store.get(d)
    with pytest.raises(StoreError, match="not a sha256 digest"):
        store.get("../../etc/passwd")
    with pytest.raises(StoreError, match="not a sha256 digest"):
        store.get(d.upper())


def test_size_limit_is_checked_before_reading(
    store: FsspecStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = store.put(b"x" * 1000)
    assert store.get(d, max_bytes=1000) == b"x" * 1000

    def no_read(*a: object, **kw: object) -> bytes:
        raise AssertionError("read an over-limit blob")

    monkeypatch.setattr(store.fs, "cat_file", no_read)
    with pytest.raises(StoreError, match="1000 bytes, over the limit 999"):
        store.get(d, max_bytes=999)


def test_open_store_routes_by_url(tmp_path: Path) -> None:
    assert isinstance(open_store(tmp_path / "a"), LocalStore)
    assert isinstance(open_store(str(tmp_path / "b")), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}/c"), LocalStore)
    remote = open_store(f"memory://veriloco-test-{uuid.uuid4().hex}")
    assert isinstance(remote, FsspecStore)
    # same layout: a blob written by LocalStore is readable through fsspec's file://
    local = LocalStore(tmp_path / "shared")
    d = local.put(b"shared bytes")
    assert FsspecStore(f"file://{tmp_path}/shared").get(d) == b"shared bytes"
