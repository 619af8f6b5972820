"""`[data] tokenizer`: a text corpus tokenized once by a local tokenizer.json, committed as tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import TINY, cli, tiny

from veriloco.audit import audit_run
from veriloco.config import ConfigError
from veriloco.data import DataError, load_corpus, tokenize
from veriloco.export import export_run
from veriloco.hashing import sha256_hex
from veriloco.run import train
from veriloco.store import LocalStore

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A byte-level BPE of 300 tokens trained here on a standard-library module (no download)."""
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator([open(os.__file__, encoding="utf-8").read()], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_the_corpus_is_the_tokenizers_ids(tokenizer_file):
    cfg = tiny(f"--data.tokenizer={tokenizer_file}", "--model.vocab_size=300")
    corpus = load_corpus(cfg.data, 300, cfg.model.ctx)
    text = load_corpus(tiny().data, 256, cfg.model.ctx).raw
    assert corpus.kind == "tokenized" and corpus.tokens.dtype == np.uint32
    assert corpus.tokenizer_json == tokenizer_file.read_bytes()
    assert int(corpus.tokens.max()) >= 256 and len(corpus.tokens) < 0.8 * len(text)  # merges, not bytes
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    assert tok.decode(corpus.tokens.tolist()) == text.decode("utf-8", errors="replace")  # byte-level BPE: lossless
    assert tokenize(text, tokenizer_file.read_bytes(), 300) == corpus.raw  # a pure function of text and file


def test_eos_ends_each_document_without_file_headers(tmp_path, tokenizer_file):
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = [("a.txt", "first document\n" * 300), ("b/c.txt", "second one\n" * 300)]
    for name, text in texts:
        (docs / name).parent.mkdir(exist_ok=True)
        (docs / name).write_text(text)
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    eos = tok.token_to_id("<|endoftext|>")
    cfg = tiny(f"--data.source={docs}", f"--data.tokenizer={tokenizer_file}", "--data.eos=<|endoftext|>",
               "--model.vocab_size=300")
    ids = load_corpus(cfg.data, 300, 32).tokens.tolist()
    assert ids == tok.encode(texts[0][1]).ids + [eos] + tok.encode(texts[1][1]).ids + [eos]  # sorted by path
    capped = load_corpus(tiny(f"--data.source={docs}", f"--data.tokenizer={tokenizer_file}",
                              "--data.eos=<|endoftext|>", "--data.max_bytes=4000").data, 300, 32).tokens.tolist()
    assert capped == tok.encode(texts[0][1][:4000]).ids + [eos]  # the first 4000 bytes: part of a.txt
    without = load_corpus(tiny(f"--data.source={docs}", f"--data.tokenizer={tokenizer_file}").data, 300, 32)
    assert eos not in without.tokens.tolist() and tok.decode(without.tokens.tolist()).startswith("# file: a.txt\n")
    with pytest.raises(DataError, match="data.eos '</s>' is not a token of data.tokenizer"):
        load_corpus(tiny(f"--data.source={docs}", f"--data.tokenizer={tokenizer_file}", "--data.eos=</s>").data, 300, 32)
    with pytest.raises(ConfigError, match="data.eos needs data.tokenizer"):
        tiny("--data.eos=</s>")


def test_a_tokenized_run_trains_audits_and_exports_its_tokenizer(tmp_path, tokenizer_file):
    transformers = pytest.importorskip("transformers")
    cfg = tiny(f"--data.tokenizer={tokenizer_file}", "--model.vocab_size=300", "--model.arch=llama",
               "--train.rounds=2")
    run, summary = train(cfg, str(tmp_path / "run"), quiet=True)
    manifest = json.loads((run.root / "manifest.json").read_text())
    assert manifest["tokenizer"] == sha256_hex(tokenizer_file.read_bytes())
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    report = audit_run(run.root)
    assert report.ok, report.first_failure
    out, _ = export_run(run.root, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("def f(x): return x")["input_ids"] == tokenizers.Tokenizer.from_file(str(tokenizer_file)).encode(
        "def f(x): return x").ids

    # sampling encodes and decodes with the run's own tokenizer
    from veriloco.sample import sample

    text, _ = sample(run.root, "def ", tokens=20, temperature=0)
    ids = tokenizers.Tokenizer.from_file(str(tokenizer_file)).encode(text).ids
    assert text and len(ids) <= 40  # 20 tokens of this tokenizer, re-encoded (merges may differ at the seams)

    # the tokenizer kept in the store is checked by the audit
    LocalStore(run.store_dir).path_of(manifest["tokenizer"]).write_bytes(b"{}")
    report = audit_run(run.root)
    assert not report.ok and "the tokenizer the manifest names is not in the store" in report.first_failure


def test_bad_tokenizer_input_is_one_line(tmp_path, tokenizer_file, monkeypatch, capsys):
    with pytest.raises(DataError, match="data.tokenizer has 300 tokens > model.vocab_size 256: set model.vocab_size >= 300"):
        load_corpus(tiny(f"--data.tokenizer={tokenizer_file}").data, 256, 32)
    with pytest.raises(DataError, match="data.tokenizer not found"):
        load_corpus(tiny(f"--data.tokenizer={tmp_path / 'none.json'}").data, 300, 32)
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": 1}')
    with pytest.raises(DataError, match="data.tokenizer is not a tokenizers tokenizer.json"):
        load_corpus(tiny(f"--data.tokenizer={bad}").data, 300, 32)
    tokens = tmp_path / "t.bin"
    np.arange(4096, dtype=np.uint16).tofile(tokens)
    with pytest.raises(DataError, match="data.eos is for text sources that data.tokenizer tokenizes; .* holds token ids already"):
        load_corpus(tiny(f"--data.source={tokens}", f"--data.tokenizer={tokenizer_file}", "--data.eos=x").data, 5000, 32)
    # through the CLI: one line, exit 2, no run directory
    out = tmp_path / "run"
    code, lines, _ = cli(monkeypatch, capsys, "train", str(TINY), f"--data.tokenizer={bad}", "--out", str(out))
    assert code == 2 and len(lines) == 1 and "not a tokenizers tokenizer.json" in lines[0], lines
    assert not out.exists()
    # tokenize's --out under a file: one line (was a FileExistsError's traceback)
    code, lines, _ = cli(monkeypatch, capsys, "tokenize", "stdlib", "--tokenizer", str(tokenizer_file),
                         "--out", str(bad / "t.bin"))
    assert code == 2 and lines == [f"veriloco: error: {bad} is a file, not a directory (making {bad})"], lines
    # a tokenizer that loads but cannot encode (its unk_token is not in its vocabulary): a traceback, was
    wordlevel = tmp_path / "wordlevel.json"
    wordlevel.write_text(json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                                     "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
                                     "decoder": None, "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1},
                                                                "unk_token": "[UNK]"}}))
    code, lines, _ = cli(monkeypatch, capsys, "tokenize", "stdlib", "--tokenizer", str(wordlevel),
                         "--out", str(tmp_path / "w.bin"))
    assert code == 2 and len(lines) == 1 and "data.tokenizer cannot encode the text: WordLevel error" in lines[0], lines
    assert not (tmp_path / "w.bin").exists()


def test_ids_past_uint16_are_written_and_read_as_uint32(tmp_path, monkeypatch, capsys):
    """`veriloco tokenize` chose uint16 by the vocabulary's size (3 here), so the id 70000 wrapped to
    4464; and a uint32 .bin read with the default bin_dtype = uint16 trained on twice its tokens,
    every other one a high half-word. Now the dtype follows the largest id, and the run refuses the
    uint16 read in one line."""
    tok = tmp_path / "wide.json"
    tok.write_text(json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                               "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
                               "decoder": None, "model": {"type": "WordLevel", "unk_token": "[UNK]",
                                                          "vocab": {"[UNK]": 0, "hello": 1, "world": 70000}}}))
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 400)
    out = tmp_path / "t.bin"
    code, lines, stdout = cli(monkeypatch, capsys, "tokenize", str(text), "--tokenizer", str(tok), "--out", str(out))
    assert code == 0, lines
    assert np.fromfile(out, dtype=np.uint32)[:4].tolist() == [1, 70000, 1, 70000]
    with pytest.raises(DataError, match="data.tokenizer has ids up to 70000, past uint16, but data.bin_dtype = uint16"):
        load_corpus(tiny(f"--data.source={out}", f"--data.tokenizer={tok}", "--model.vocab_size=70001").data, 70001, 32)
    corpus = load_corpus(tiny(f"--data.source={out}", f"--data.tokenizer={tok}", "--data.bin_dtype=uint32",
                              "--model.vocab_size=70001").data, 70001, 32)
    assert len(corpus.tokens) == 800


def test_a_text_without_newlines_is_tokenized_in_bounded_pieces(monkeypatch):
    """Pieces were cut only after a newline, so a one-line text (a minified dump) was one piece,
    and its encoding held about 70 times its size (548 MB for 8 MB, against 78 MB with newlines)."""
    from veriloco import data

    one_line = ("word " * 400_000).encode()  # 2 MB, no newline
    pieces = data._pieces(one_line)
    assert len(pieces) >= len(one_line) // data.MAX_PIECE
    assert max(len(p.encode()) for p in pieces) <= data.MAX_PIECE and all(p.endswith(" ") for p in pieces[:-1])
    assert "".join(pieces).encode() == one_line


def test_a_stored_corpus_of_an_unknown_kind_is_refused():
    from veriloco.data import corpus_from_raw

    with pytest.raises(DataError, match="corpus kind 'pickle' is not one of text, bin, tokenized"):
        corpus_from_raw(b"\0" * 4096, "pickle", tiny().data, 256, 32)


def test_a_big_text_source_is_tokenized_a_document_at_a_time_into_a_bin(tmp_path, tokenizer_file, monkeypatch, capsys):
    """`veriloco tokenize`: the ids `[data] tokenizer` and `eos` would make in memory, as a .bin a run
    streams; the tokenizer goes with the run (export, sample) without being rerun."""
    from veriloco.sample import sample

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"{i}.txt").write_text(f"document number {i}\n" * 2000)
    out = tmp_path / "docs.bin"
    code, lines, stdout = cli(monkeypatch, capsys, "tokenize", str(docs), "--tokenizer", str(tokenizer_file), "--out",
                              str(out), "--eos", "<|endoftext|>")
    assert code == 0 and "as uint16" in stdout, lines
    in_memory = load_corpus(tiny(f"--data.source={docs}", f"--data.tokenizer={tokenizer_file}", "--data.eos=<|endoftext|>",
                                 "--data.max_bytes=0").data, 300, 32)
    assert np.array_equal(np.fromfile(out, dtype=np.uint16), in_memory.tokens)
    run, _ = train(tiny(f"--data.source={out}", "--data.bin_dtype=uint16", f"--data.tokenizer={tokenizer_file}",
                        "--data.max_bytes=0", "--model.vocab_size=300", "--train.rounds=1"), str(tmp_path / "run"), quiet=True)
    manifest = json.loads((run.root / "manifest.json").read_text())
    assert manifest["tokenizer"] == sha256_hex(tokenizer_file.read_bytes())
    assert audit_run(run.root).ok
    export_run(run.root, tmp_path / "exported")
    assert (tmp_path / "exported" / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    text, _ = sample(run.root, "document ", tokens=10, temperature=0)  # a .bin run without a tokenizer is refused
    assert text

    # bad input: one line, exit 2, nothing written
    for args, message in [((str(docs), "--tokenizer", str(tokenizer_file), "--out", str(out)), "already exists"),
                          ((str(docs), "--tokenizer", str(tokenizer_file), "--out", str(tmp_path / "x.txt")), "ends in .bin"),
                          ((str(docs), "--tokenizer", str(tokenizer_file), "--out", str(tmp_path / "y.bin"), "--eos", "<nope>"),
                           "is not a token of"),
                          ((str(tmp_path / "none"), "--tokenizer", str(tokenizer_file), "--out", str(tmp_path / "z.bin")),
                           "data.source not found")]:
        code, lines, _ = cli(monkeypatch, capsys, "tokenize", *args)
        assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".bin", ".txt")) == ["docs.bin"]


def _pieces_cut_whole(text: bytes, piece: int, most: int) -> list[str]:
    """How the text is cut for the tokenizer, held whole: after the first newline past `piece`
    bytes of a piece, if one comes before `most` bytes; else after the last space before `most`,
    else before the UTF-8 character that would cross `most` (data._pieces' rule, written out)."""
    out, start = [], 0
    while start < len(text):
        cut = text.find(b"\n", start + piece, start + most)
        if cut >= 0:
            end = cut + 1
        elif len(text) - start <= most:
            end = len(text)
        elif (space := text.rfind(b" ", start + piece, start + most)) >= 0:
            end = space + 1
        else:
            end = start + most
            while end > start + piece and text[end] & 0xC0 == 0x80:
                end -= 1
        out.append(text[start:end].decode("utf-8", errors="replace"))
        start = end
    return out


def test_text_read_in_blocks_is_cut_into_the_pieces_of_the_whole(monkeypatch):
    """What the tokenizer sees depends on the pieces (a tokenizer may mark each piece's start), so
    a text read in blocks of any size is cut where the whole text was."""
    from veriloco import data

    monkeypatch.setattr(data, "TOKENIZE_PIECE", 50)
    monkeypatch.setattr(data, "MAX_PIECE", 200)
    rng = np.random.default_rng(0)
    longest = 0
    for i in range(400):  # some texts with newlines and spaces, some with only one of them, some with neither
        alphabet = [b"ab \n\xc3\xa9", b"ab \xc3\xa9", b"ab\n\xc3\xa9", b"ab\xc3\xa9", b"\xe2\x82\xac"][i % 5]
        text = bytes(rng.choice(np.frombuffer(alphabet, dtype=np.uint8), int(rng.integers(0, 900))))
        cuts = sorted(rng.integers(0, len(text) + 1, int(rng.integers(0, 12))))
        blocks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        pieces = list(data._pieces_of(blocks))
        assert pieces == _pieces_cut_whole(text, 50, 200)
        longest = max(longest, *(len(p.encode()) for p in pieces), 0)
    assert longest <= 200 * 3  # U+FFFD of a stray byte is 3 bytes: never a piece as long as the text


@pytest.mark.parametrize("max_bytes", [0, 5001])
@pytest.mark.parametrize("mode", ["bytes", "tokens", "eos"])
def test_text_is_prepared_as_a_stream_as_if_read_whole(tmp_path, tokenizer_file, monkeypatch, mode, max_bytes):
    """The prepare step reads a text source a block at a time and tokenizes it a few pieces at a
    time, into an unnamed scratch file: the chunks and root are those of the text held whole (the
    oracle here, written out plainly), and the tokenizer runs once."""
    from veriloco import data

    monkeypatch.setattr(data, "TOKENIZE_PIECE", 97)  # small pieces, blocks and batches: every boundary is crossed
    monkeypatch.setattr(data, "READ_BLOCK", 61)
    monkeypatch.setattr(data, "ENCODE_BATCH", 3)
    docs = tmp_path / "docs"
    (docs / "b").mkdir(parents=True)
    files = {"a.txt": "".join(f"ligne {i} é ✓ {'x' * (i % 150)}\n" for i in range(120)).encode(),
             "b/c.txt": b"\xff\xfe no newline, not UTF-8 " * 40, "b/empty.txt": b"", "d.txt": b"last\n" * 30}
    for name, text in files.items():
        (docs / name).write_bytes(text)
    args = [f"--data.source={docs}", "--data.chunk_bytes=1027", f"--data.max_bytes={max_bytes}"]
    if mode != "bytes":
        args += [f"--data.tokenizer={tokenizer_file}", "--model.vocab_size=300"]
    if mode == "eos":
        args += ["--data.eos=<|endoftext|>"]
    cfg = tiny(*args)
    tok, names = tokenizers.Tokenizer.from_file(str(tokenizer_file)), sorted(files)

    def ids_of(text: bytes) -> list[int]:
        return [i for e in tok.encode_batch(_pieces_cut_whole(text, 97, data.MAX_PIECE), add_special_tokens=False) for i in e.ids]

    if mode == "eos":  # each document, cut to max_bytes in all, then the eos token
        ids, left = [], max_bytes or sum(map(len, files.values()))
        for name in names:
            if left <= 0:
                break
            ids += [*ids_of(files[name][:left]), tok.token_to_id("<|endoftext|>")]
            left -= len(files[name])
        expected = np.asarray(ids, dtype=np.uint32).tobytes()
    else:  # the documents with their headers, cut to max_bytes, as one text
        text = b"".join(f"# file: {n}\n".encode() + files[n] + b"\n" for n in names)[: max_bytes or None]
        expected = text if mode == "bytes" else np.asarray(ids_of(text), dtype=np.uint32).tobytes()
    whole = data.corpus_from_raw(expected, "text" if mode == "bytes" else "tokenized", cfg.data, 300, 32)
    (tmp_path / "scratch").mkdir()
    prepared = data.prepare_corpus(cfg.data, 300, 32, scratch=tmp_path / "scratch")
    assert prepared.manifest_bytes() == whole.manifest_bytes()
    assert list((tmp_path / "scratch").iterdir()) == []  # the scratch file has no name: nothing to leave behind
    assert data.load_corpus(cfg.data, 300, 32).manifest_bytes() == whole.manifest_bytes()
    monkeypatch.setattr(data, "_encoded", None)  # storing the chunks does not tokenize again
    put: list[bytes] = []
    with prepared:
        prepared.put_chunks(lambda b: (put.append(bytes(b)), whole.chunk_hashes[len(put) - 1])[1])
    assert put == [bytes(c) for c in whole.chunks]


def test_text_that_changes_while_the_run_is_prepared_is_refused(tmp_path):
    from veriloco.data import prepare_corpus
    from veriloco.hashing import sha256_hex

    text = tmp_path / "text.txt"
    data = tiny(f"--data.source={text}", "--data.chunk_bytes=4096", "--data.max_bytes=0").data
    whole = b"line of text\n" * 630 + b"xx"  # 8192 bytes: 2 whole chunks
    for changed, chunk in [(whole + b"\n" * 10, 2),  # grown: a chunk more than was hashed
                           (whole[:4096], 1),  # shorter: a chunk missing
                           (b"X" + whole[1:], 0)]:  # rewritten
        text.write_bytes(whole)
        prepared = prepare_corpus(data, 256, 32)
        assert len(prepared.manifest["chunks"]) == 2
        text.write_bytes(changed)
        with pytest.raises(DataError, match=f"corpus chunk {chunk} changed while the run was prepared"):
            prepared.put_chunks(sha256_hex)
