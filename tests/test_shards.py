"""`[data] source` = a directory of token .bin shards, flat or with llm.c's 1024-byte header (the
FineWeb shards llm.c and modded-nanogpt write): one corpus, their tokens one after another."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cli, tiny

from veriloco.data import DataError, load_corpus, prepare_corpus, token_shards
from veriloco.run import prepare_run


def llmc_shard(path, tokens: np.ndarray, magic: int = 20240520, version: int = 1, count: int | None = None) -> None:
    """A shard as llm.c's dev/data/data_common.py write_datafile writes it."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())


def _shards(tmp_path, sizes=(5000, 7001, 3000)):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, n, dtype=np.uint16) for n in sizes]
    d = tmp_path / "fineweb10B"
    d.mkdir()
    llmc_shard(d / "fineweb_train_000001.bin", parts[0])
    parts[1].tofile(d / "fineweb_train_000002.bin")  # a flat one among them (nanoGPT's, veriloco tokenize's)
    llmc_shard(d / "fineweb_train_000003.bin", parts[2])
    return d, np.concatenate(parts)


@pytest.mark.parametrize("max_bytes", [0, 20000])
def test_the_shards_are_one_corpus_of_their_tokens(tmp_path, max_bytes):
    d, tokens = _shards(tmp_path)
    data = tiny(f"--data.source={d}", "--data.chunk_bytes=1025", f"--data.max_bytes={max_bytes}").data  # chunks span shards
    expected = tokens[: max_bytes // 2] if max_bytes else tokens
    whole = load_corpus(data, 256, 32)
    assert np.array_equal(whole.tokens, expected) and whole.kind == "bin"
    streamed = prepare_corpus(data, 256, 32)  # read a chunk at a time across the shards
    assert streamed.root == whole.root and streamed.manifest == whole.manifest()
    cfg = tiny(f"--data.source={d}", "--data.chunk_bytes=1025", f"--data.max_bytes={max_bytes}")
    run, task = prepare_run(cfg, str(tmp_path / f"run{max_bytes}"))
    assert np.array_equal(task.corpus.tokens[0:len(expected)], expected)  # what the workers read from the store


def test_a_corpus_of_more_chunks_than_a_manifest_holds_is_refused_before_it_is_stored(tmp_path, monkeypatch):
    """Workers and the audit read a corpus manifest of at most MAX_CORPUS_MANIFEST bytes (about a
    million 64 KiB chunks, 61 GiB): a larger corpus prepared, then none of them opened it. Shown
    here with the limit lowered to 20 chunks' worth."""
    from veriloco import data

    d, tokens = _shards(tmp_path)
    monkeypatch.setattr(data, "MAX_CORPUS_MANIFEST", 20 * data.MANIFEST_BYTES_PER_CHUNK + 4096)
    cfg = tiny(f"--data.source={d}", "--data.chunk_bytes=1024")  # 30,002 bytes: 30 chunks
    with pytest.raises(DataError, match=r"makes 30 chunks of data.chunk_bytes = 1024, more than a corpus manifest "
                                        r"holds: set data.chunk_bytes >= 2048"):
        prepare_corpus(cfg.data, 256, 32)
    assert prepare_corpus(tiny(f"--data.source={d}", "--data.chunk_bytes=2048").data, 256, 32).root
    text = tmp_path / "t.txt"  # a text source's chunks are counted as they are hashed, before any is stored
    text.write_bytes(b"some text\n" * 3000)
    with pytest.raises(DataError, match="makes 30 chunks"):
        prepare_corpus(tiny(f"--data.source={text}", "--data.chunk_bytes=1024").data, 256, 32)


def test_a_run_trains_on_shards(tmp_path, monkeypatch, capsys):
    d, _ = _shards(tmp_path)
    code, lines, out = cli(monkeypatch, capsys, "train", "configs/tiny.toml", f"--data.source={d}", "--train.rounds=1",
                           "--out", str(tmp_path / "run"), "--quiet")
    assert code == 0, lines
    code, lines, out = cli(monkeypatch, capsys, "audit", str(tmp_path / "run"))
    assert code == 0 and "audit ok" in out, (lines, out)


def test_shards_that_do_not_add_up_are_one_line(tmp_path, monkeypatch, capsys):
    d, _ = _shards(tmp_path)
    one = tmp_path / "one.bin"
    llmc_shard(one, np.arange(100, dtype=np.uint32), magic=20240801, version=7)  # llm.c's llama-3 shards: uint32
    assert token_shards(tiny(f"--data.source={one}", "--data.bin_dtype=uint32").data)[0].size == 400
    bad = {
        "holds uint32 tokens \\(its llm.c header says so\\) but data.bin_dtype = uint16: set data.bin_dtype = uint32":
            [f"--data.source={one}"],
    }
    short = tmp_path / "short.bin"
    llmc_shard(short, np.arange(100, dtype=np.uint16), count=101)
    bad["its llm.c header says 101 tokens, the file holds 100"] = [f"--data.source={short}"]
    other = tmp_path / "v2.bin"  # llm.c's magic, another version: its 1024 header bytes were read as 512 tokens
    llmc_shard(other, np.arange(100, dtype=np.uint16), version=2)
    bad["its llm.c header \\(magic 20240520\\) has version 2, not 1: a layout veriloco does not read"] = \
        [f"--data.source={other}"]
    odd = tmp_path / "odd" / "a.bin"
    odd.parent.mkdir()
    odd.write_bytes(b"\0" * 4097)
    bad["a.bin has 4097 bytes, not a multiple of uint16"] = [f"--data.source={odd.parent}"]
    (d / "README.md").write_text("FineWeb 10B, GPT-2 tokens")
    bad[f"data.source directory {d} mixes token .bin shards with other files \\(README.md\\)"] = [f"--data.source={d}"]
    for message, overrides in bad.items():
        with pytest.raises(DataError, match=message):
            prepare_corpus(tiny(*overrides).data, 256, 32)
        out = tmp_path / "run"
        code, lines, _ = cli(monkeypatch, capsys, "train", "configs/tiny.toml", *overrides, "--out", str(out))
        assert code == 2 and len(lines) == 1 and not out.exists(), lines
