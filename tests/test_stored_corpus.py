"""Workers read the corpus from the run's store a chunk at a time (`task.StoredCorpus`): the same
batches bit for bit as the whole corpus in memory, a bounded cache, and every chunk checked
against the committed hashes when it is read."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny

from veriloco.data import DataError, batch, eval_batches
from veriloco.hashing import canonical_json
from veriloco.run import prepare_run
from veriloco.store import LocalStore, StoreError
from veriloco.task import StoredCorpus, load_stored_corpus


def _prepared(tmp_path, *overrides):
    cfg = tiny(*overrides)
    run, task = prepare_run(cfg, str(tmp_path / "run"))
    return cfg, LocalStore(run.store_dir), task.corpus_manifest


@pytest.mark.parametrize("source", ["text", "bin"])
def test_the_same_batches_as_the_whole_corpus(tmp_path, source):
    overrides = ["--data.chunk_bytes=1025", "--data.max_bytes=200000"]  # odd chunks: uint16 tokens straddle them
    if source == "bin":
        path = tmp_path / "tokens.bin"
        np.random.default_rng(0).integers(0, 256, 60001, dtype=np.uint16).tofile(path)
        overrides += [f"--data.source={path}", "--data.bin_dtype=uint16"]
    cfg, store, digest = _prepared(tmp_path, *overrides)
    whole, lazy = load_stored_corpus(store, digest, cfg), StoredCorpus(store, digest, cfg, cache_chunks=4)
    assert len(lazy.tokens) == len(whole.tokens) and lazy.eval_start == whole.eval_start and lazy.root == whole.root
    n = len(whole.tokens)
    rng = np.random.default_rng(1)
    for a in [0, n - 1, 1024, 512, *rng.integers(0, n, 50)]:
        b = min(n, a + int(rng.integers(0, 3000)))
        assert np.array_equal(lazy.tokens[a:b], whole.tokens[a:b])
    assert np.array_equal(lazy.tokens[n - 5:n + 10], whole.tokens[n - 5:])  # slices clip as numpy's do
    t, ctx = cfg.train, cfg.model.ctx
    for key in [(0, 0, 0), (1, 3, 2), (2, 7, 4)]:
        for x, y in zip(batch(whole, cfg.run.seed, *key, t.batch_size, ctx), batch(lazy, cfg.run.seed, *key, t.batch_size, ctx),
                        strict=True):
            assert torch.equal(x, y)
    for (xa, ya), (xb, yb) in zip(eval_batches(whole, t.eval_batches, t.batch_size, ctx),
                                  eval_batches(lazy, t.eval_batches, t.batch_size, ctx), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert len(lazy._cache) <= 4  # never more than the cache holds


def test_a_batch_reads_only_its_chunks_and_each_is_checked(tmp_path):
    cfg, store, digest = _prepared(tmp_path, "--data.chunk_bytes=4096")
    lazy = StoredCorpus(store, digest, cfg)
    batch(lazy, cfg.run.seed, 0, 0, 0, cfg.train.batch_size, cfg.model.ctx)
    assert 0 < lazy.reads <= 2 * cfg.train.batch_size < len(lazy.chunk_hashes)  # a sequence spans at most 2 chunks
    # a corrupted chunk fails the batch that reads it, not the opening of the corpus
    chunk = json.loads(store.get(digest))["chunks"][3]
    path = store.path_of(chunk)
    path.write_bytes(b"x" + path.read_bytes()[1:])
    lazy = StoredCorpus(store, digest, cfg)
    with pytest.raises(StoreError, match=f"blob {chunk} is corrupt"):
        lazy.tokens[3 * 4096:3 * 4096 + 10]


def test_a_manifest_that_does_not_add_up_is_refused(tmp_path):
    cfg, store, digest = _prepared(tmp_path, "--data.chunk_bytes=4096")
    man = json.loads(store.get(digest))

    def opened(**changes):
        return StoredCorpus(store, store.put(canonical_json({**man, **changes})), cfg)

    with pytest.raises(StoreError, match="is not the root of the manifest's chunk hashes"):
        opened(chunks=man["chunks"][:-1])
    with pytest.raises(StoreError, match=r"tokens do not fill \d+ chunks of 4096 bytes"):
        opened(tokens=man["tokens"] + 5000)
    with pytest.raises(StoreError, match="is malformed"):
        opened(kind="video")
    with pytest.raises(StoreError, match="is malformed"):
        opened(chunks=["zz"])
    with pytest.raises(DataError, match="too small for ctx"):
        StoredCorpus(store, digest, tiny("--data.chunk_bytes=4096", "--model.ctx=100000"))


def test_the_audit_reads_every_chunk_once_without_holding_them(tmp_path):
    path = tmp_path / "tokens.bin"
    np.random.default_rng(2).integers(0, 200, 40000, dtype=np.uint16).tofile(path)
    cfg, store, digest = _prepared(tmp_path, f"--data.source={path}", "--data.max_bytes=0", "--data.chunk_bytes=1025")
    lazy = StoredCorpus(store, digest, cfg, cache_chunks=3)
    lazy.check_all(cfg.model.vocab_size)
    assert lazy.reads == len(lazy.chunk_hashes) == 79 and len(lazy._cache) <= 3
    with pytest.raises(DataError, match="token .bin has token id 199 >= model.vocab_size 199"):
        StoredCorpus(store, digest, cfg).check_all(199)
    last = store.path_of(lazy.chunk_hashes[-1])
    last.write_bytes(last.read_bytes()[:-2])  # cut short: its hash fails
    with pytest.raises(StoreError, match="is corrupt"):
        StoredCorpus(store, digest, cfg).check_all(cfg.model.vocab_size)


@pytest.mark.parametrize("chunk_bytes, max_bytes", [(1025, 0), (4096, 0), (1025, 30001), (65536, 0)])
def test_a_bin_is_prepared_a_chunk_at_a_time_as_if_read_whole(tmp_path, chunk_bytes, max_bytes):
    from veriloco.data import load_corpus, prepare_corpus

    path = tmp_path / "tokens.bin"
    np.random.default_rng(3).integers(0, 256, 30000, dtype=np.uint16).tofile(path)
    data = tiny(f"--data.source={path}", f"--data.chunk_bytes={chunk_bytes}", f"--data.max_bytes={max_bytes}").data
    whole, streamed = load_corpus(data, 256, 32), prepare_corpus(data, 256, 32)
    assert streamed.manifest_bytes() == whole.manifest_bytes() and streamed.root == whole.root
    put: list[bytes] = []
    streamed.put_chunks(lambda b: (put.append(bytes(b)), whole.chunk_hashes[len(put) - 1])[1])
    assert put == [bytes(c) for c in whole.chunks]


def test_a_streamed_bin_is_checked_as_a_whole_one(tmp_path):
    from veriloco.data import prepare_corpus
    from veriloco.hashing import sha256_hex

    path = tmp_path / "tokens.bin"
    np.arange(20000, dtype=np.uint16).tofile(path)  # ids up to 19999
    data = tiny(f"--data.source={path}", "--data.chunk_bytes=1025", "--data.max_bytes=0").data
    with pytest.raises(DataError, match="token .bin has token id 19999 >= model.vocab_size 256"):
        prepare_corpus(data, 256, 32)
    with pytest.raises(DataError, match="too small for ctx 8000"):
        prepare_corpus(data, 20000, 8000)
    prepared = prepare_corpus(data, 20000, 32)
    path.write_bytes(path.read_bytes()[:1000] + b"\0\0" + path.read_bytes()[1002:])  # rewritten before its chunks are stored
    with pytest.raises(DataError, match="corpus chunk 0 changed while the run was prepared"):
        prepared.put_chunks(sha256_hex)
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(DataError, match="not a multiple of uint16"):
        prepare_corpus(data, 20000, 32)
