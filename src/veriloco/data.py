"""Corpus, Merkle root, and deterministic batches.

The embedded default corpus is this Python's own standard library source: every top-level
module `<stdlib>/*.py` (found through `sysconfig`), sorted by file name, excluding modules whose
name starts with `test` or `_test`; subpackages (and so `idlelib`, `test/`) are not included.
Each file contributes `# file: <name>\\n` followed by its bytes, so the corpus exists on every
machine with no download (its Merkle root differs between Python versions and is recorded in the
run manifest). A user may instead point `[data] source` at a text file, a directory of text
files (every regular file under it, sorted by relative path), a nanoGPT-style token `.bin`
(a flat array of uint16/uint32 token ids), or a directory of token `.bin` shards, flat or with
llm.c's header (FineWeb shards as llm.c and modded-nanogpt write them: `token_shards`).

A text corpus is bytes unless `[data] tokenizer` names a `tokenizers` tokenizer.json (a local
file: nothing is downloaded). Then the text is tokenized once, when the run is prepared, and the
corpus the run commits to and stores is the token ids (kind "tokenized", uint32): the Merkle root
names the tokens the workers trained on, and the run's store holds them, so an audit needs no
tokenizer. The tokenizer file itself goes into the store and its hash into the manifest
(`veriloco export` puts it beside the model). With a token .bin source, `[data] tokenizer` names
the tokenizer that made its ids (`veriloco tokenize`, `tokenize_to_bin`: a text source tokenized a
document at a time): it is kept the same way and not rerun.

Every source is prepared as a stream (`prepare_corpus`: token files and text a chunk or block at a
time, text that a tokenizer tokenizes a few pieces at a time into a scratch file), so a corpus may be
larger than memory; workers read their batches from the store a chunk at a time too
(`task.StoredCorpus`).

The corpus is cut into `chunk_bytes` chunks whose sha256 hashes are the leaves of a Merkle tree
(RFC 9162 hashing, the same as the ledger's); the root names the corpus in the manifest, and the
chunks go into the run's store so a run directory is self-contained.

`batch(seed, worker, round, step)` is a pure function of its arguments: the sequence offsets
come from sha256 of the arguments (no RNG library whose stream could change between versions),
so anyone holding the corpus can recompute exactly which tokens a worker trained on.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sysconfig
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import DataConfig
from .hashing import canonical_json, sha256_hex
from .ledger.merkle import root as merkle_root
from .records import RunDirError, make_dirs, remove_dirs


class DataError(ValueError):
    """A corpus cannot be read or is unusable (missing, empty, too small for the context)."""


def stdlib_files() -> list[Path]:
    """The fixed, sorted selection of standard-library modules that forms the default corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.glob("*.py")
        if p.is_file() and not p.name.startswith(("test", "_test"))
    ]
    return sorted(files, key=lambda p: p.name)


@dataclass
class Corpus:
    """Tokens of a corpus with its split, chunk hashes and Merkle root."""

    tokens: np.ndarray  # 1-D uint8 (bytes), uint16/uint32 (token .bin) or uint32 (tokenized text)
    raw: bytes  # the bytes that were chunked and hashed (text bytes, the .bin file, or the token ids)
    kind: str  # "text", "bin" or "tokenized"
    chunk_bytes: int
    eval_fraction: float
    tokenizer_json: bytes | None = None  # the tokenizer file of a "tokenized" corpus, when it was loaded from text

    def __post_init__(self) -> None:
        view = memoryview(self.raw)  # the chunks are views of raw, not copies: the corpus is held once
        self.chunks = [view[i : i + self.chunk_bytes] for i in range(0, len(self.raw), self.chunk_bytes)]
        self.chunk_hashes = [sha256_hex(c) for c in self.chunks]
        self.root = merkle_root([bytes.fromhex(h) for h in self.chunk_hashes]).hex()
        n = len(self.tokens)
        self.eval_start = int(n * (1 - self.eval_fraction))

    def manifest(self) -> dict:
        """What the store keeps next to the chunks to rebuild this corpus."""
        return corpus_manifest(self.kind, str(self.tokens.dtype), self.chunk_bytes, self.eval_fraction, self.chunk_hashes,
                               self.root, len(self.tokens))

    def manifest_bytes(self) -> bytes:
        return canonical_json(self.manifest())


def corpus_manifest(kind: str, dtype: str, chunk_bytes: int, eval_fraction: float, chunk_hashes: list[str], root: str,
                    tokens: int) -> dict:
    """The corpus manifest the run's store keeps next to the chunks (`Corpus.manifest`, `prepare_corpus`)."""
    return {"kind": kind, "dtype": dtype, "chunk_bytes": chunk_bytes, "eval_fraction": eval_fraction,
            "chunks": chunk_hashes, "root": root, "tokens": int(tokens)}


MAX_CORPUS_MANIFEST = 64 << 20  # bytes of a stored corpus manifest that a worker and the audit read (task.py)
MANIFEST_BYTES_PER_CHUNK = 67  # a chunk's hash in it: 64 hex digits, quotes and a comma


def check_chunk_count(chunks: int, cfg: DataConfig) -> None:
    """DataError when a corpus of `chunks` chunks makes a manifest larger than the workers read
    (MAX_CORPUS_MANIFEST: about a million chunks, 61 GiB at the default 64 KiB chunks), naming a
    chunk_bytes that fits: before, such a corpus prepared, then no worker (nor the audit) opened it."""
    if chunks * MANIFEST_BYTES_PER_CHUNK + 4096 > MAX_CORPUS_MANIFEST:
        size = chunks * cfg.chunk_bytes
        fits = 1 << (-(-size * MANIFEST_BYTES_PER_CHUNK // (MAX_CORPUS_MANIFEST - 4096)) - 1).bit_length()
        raise DataError(f"the corpus ({size / 2**30:.1f} GiB) makes {chunks} chunks of data.chunk_bytes = "
                        f"{cfg.chunk_bytes}, more than a corpus manifest holds: set data.chunk_bytes >= {fits}")


def eval_start_of(n_tokens: int, eval_fraction: float, ctx: int) -> int:
    """Where a corpus of `n_tokens` starts its held-out tail; DataError when it is too small for `ctx`."""
    start = int(n_tokens * (1 - eval_fraction))
    if start < 4 * (ctx + 1) or n_tokens - start < ctx + 2:
        raise DataError(f"corpus of {n_tokens} tokens is too small for ctx {ctx} with eval_fraction {eval_fraction}")
    return start


KINDS = ("text", "bin", "tokenized")
TOKENIZED_DTYPE = "uint32"


def dtype_of(kind: str, bin_dtype: str) -> np.dtype:
    """The token element type of a corpus of `kind` (a .bin's is `[data] bin_dtype`)."""
    if kind not in KINDS:
        raise DataError(f"corpus kind {kind!r:.40} is not one of {', '.join(KINDS)}")
    return np.dtype({"text": "uint8", "tokenized": TOKENIZED_DTYPE}.get(kind, bin_dtype))


def check_ids(kind: str, top: int | None, vocab_size: int) -> None:
    """DataError unless a corpus of `kind` whose largest token id is `top` (None: not known yet)
    fits a model of `vocab_size` (a byte-level corpus needs 256)."""
    if kind == "text" and vocab_size < 256:
        raise DataError(f"a byte-level corpus needs model.vocab_size >= 256, got {vocab_size}")
    if kind != "text" and top is not None and top >= vocab_size:
        what = "token .bin" if kind == "bin" else "tokenized corpus"
        raise DataError(f"{what} has token id {top} >= model.vocab_size {vocab_size}")


def _tokens_from(raw: bytes, kind: str, dtype: str) -> np.ndarray:
    dt = dtype_of(kind, dtype)
    if len(raw) % dt.itemsize:
        raise DataError(f"token .bin has {len(raw)} bytes, not a multiple of {dt} ({dt.itemsize})")
    return np.frombuffer(raw, dtype=dt)


def documents(source: str) -> list[tuple[str, Path]]:
    """A text source's documents, (name, file), in corpus order: the embedded corpus's modules, a
    directory's files (sorted by relative path), or the one file. DataError if there are none."""
    if source == "stdlib":
        files = stdlib_files()
        if not files:
            raise DataError("no standard-library sources found through sysconfig")
        return [(p.name, p) for p in files]
    path = Path(source)
    if not path.exists():
        raise DataError(f"data.source not found: {path}")
    if path.is_dir():
        files = files_under(path)
        if not files:
            raise DataError(f"data.source directory {path} has no files")
        return [(str(p.relative_to(path)), p) for p in files]
    return [(path.name, path)]


def files_under(directory: Path) -> list[Path]:
    """Every regular file under `directory`, sorted by path: a directory source's corpus order."""
    return sorted(p for p in directory.rglob("*") if p.is_file())


LLMC_HEADERS = {20240520: (1, "uint16"), 20240801: (7, "uint32")}  # llm.c's dev/data shards: magic -> version, tokens
LLMC_HEADER_BYTES = 1024  # 256 int32: magic, version, token count, zeros


@dataclass(frozen=True)
class Shard:
    """One token file of a `[data] source`: its token bytes are `size` bytes from `start`."""

    path: Path
    start: int
    size: int


def token_shards(cfg: DataConfig) -> list[Shard] | None:
    """The token files `[data] source` names, in corpus order, or None for a text source: a
    `.bin` file, or a directory whose files are all `.bin` shards (sorted by relative path: the
    corpus is their tokens one after another). A shard is a flat array of `[data] bin_dtype` ids
    (nanoGPT's, `veriloco tokenize`'s) or has llm.c's 1024-byte header (FineWeb shards as llm.c
    and modded-nanogpt write them: magic, version, token count), which is checked and skipped.
    DataError, one line: a directory that mixes shards with other files, a header that disagrees
    with its file or with `bin_dtype`, a flat file that is not whole tokens, or `[data] eos` (a
    tokenization setting; the shards are tokenized already)."""
    path = Path(cfg.source)
    if cfg.source == "stdlib":
        return None
    if path.is_file():
        if path.suffix != ".bin":
            return None
        files = [path]
    elif path.is_dir():
        files = files_under(path)
        other = [p for p in files if p.suffix != ".bin"]
        if len(other) == len(files):
            return None
        if other:
            raise DataError(f"data.source directory {path} mixes token .bin shards with other files "
                            f"({other[0].relative_to(path)}): point it at the shards alone, or at text alone")
    else:
        return None
    if cfg.eos:
        raise DataError(f"data.eos is for text sources that data.tokenizer tokenizes; {path} holds token ids already")
    return [_shard(f, cfg.bin_dtype) for f in files]


def _shard(path: Path, bin_dtype: str) -> Shard:
    size, item = path.stat().st_size, np.dtype(bin_dtype).itemsize
    with path.open("rb") as f:
        head = f.read(12)
    magic, version, count = (int.from_bytes(head[i:i + 4], "little", signed=True) for i in (0, 4, 8)) \
        if len(head) == 12 else (None, None, None)
    if magic in LLMC_HEADERS and version != LLMC_HEADERS[magic][0]:  # its header would be read as tokens
        raise DataError(f"{path}: its llm.c header (magic {magic}) has version {version}, not "
                        f"{LLMC_HEADERS[magic][0]}: a layout veriloco does not read")
    if magic in LLMC_HEADERS:
        dtype = LLMC_HEADERS[magic][1]
        if dtype != bin_dtype:
            raise DataError(f"{path} holds {dtype} tokens (its llm.c header says so) but data.bin_dtype = {bin_dtype}: "
                            f"set data.bin_dtype = {dtype}")
        held = (size - LLMC_HEADER_BYTES) / np.dtype(dtype).itemsize
        if count < 0 or held != count:
            raise DataError(f"{path}: its llm.c header says {count} tokens, the file holds {held:g}")
        return Shard(path, LLMC_HEADER_BYTES, size - LLMC_HEADER_BYTES)
    if size % item:
        raise DataError(f"token .bin {path} has {size} bytes, not a multiple of {bin_dtype} ({item})")
    return Shard(path, 0, size)


def used_bytes(shards: list[Shard], cfg: DataConfig) -> int:
    """How many token bytes of `shards` the corpus holds: all of them, or the first
    `[data] max_bytes` cut to whole tokens."""
    size = sum(s.size for s in shards)
    size = min(size, cfg.max_bytes) if cfg.max_bytes else size
    return size - size % np.dtype(cfg.bin_dtype).itemsize


def read_shards(shards: list[Shard], total: int, piece: int) -> Iterator[bytes]:
    """The first `total` token bytes of `shards`, one after another, in pieces of `piece` bytes
    (the last may be shorter), each read from its files when asked for; a piece may span shards.
    DataError if a file got shorter since `token_shards` looked at it."""
    parts: list[bytes] = []
    need = piece
    for shard in shards:
        left = min(shard.size, total)
        total -= left
        with shard.path.open("rb") as f:
            f.seek(shard.start)
            while left:
                n = min(need, left)
                data = f.read(n)
                if len(data) != n:
                    raise DataError(f"token .bin {shard.path} got shorter while it was read")
                parts.append(data)
                need, left = need - n, left - n
                if not need:
                    yield b"".join(parts)
                    parts, need = [], piece
        if not total:
            break
    if parts:
        yield b"".join(parts)


def read_tokenizer(cfg: DataConfig, vocab_size: int, bin_ids: bool = False) -> bytes | None:
    """`[data] tokenizer`'s file, checked (it loads; its vocabulary fits `vocab_size`), or None.
    `bin_ids`: the source is a .bin of its ids, checked by `check_bin_tokenizer` on the same load
    (a large vocabulary takes a while to load: it was loaded twice)."""
    if not cfg.tokenizer:
        return None
    if not Path(cfg.tokenizer).is_file():
        raise DataError(f"data.tokenizer not found: {cfg.tokenizer}")
    tokenizer_json = Path(cfg.tokenizer).read_bytes()
    tokenizer = load_tokenizer(tokenizer_json, vocab_size)
    if bin_ids:
        check_bin_tokenizer(cfg, tokenizer)
    return tokenizer_json


def check_bin_tokenizer(cfg: DataConfig, tokenizer: Any) -> None:
    """DataError when a .bin source's tokenizer (loaded) has ids past uint16 and data.bin_dtype is
    uint16: `veriloco tokenize` wrote uint32 for it, and read as uint16 every id became two (the
    corpus twice as long, every other token the high half of one)."""
    if cfg.bin_dtype != "uint16":
        return
    top = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=0)
    if top >= 1 << 16:
        raise DataError(f"data.tokenizer has ids up to {top}, past uint16, but data.bin_dtype = uint16: a .bin of its "
                        "ids holds uint32 (as veriloco tokenize writes it): set data.bin_dtype = uint32")


def load_corpus(cfg: DataConfig, vocab_size: int, ctx: int) -> Corpus:
    """Read the corpus named by `cfg.source` whole and check it fits the model (the prepare step
    streams it instead, to the same chunks: `prepare_corpus`)."""
    shards = token_shards(cfg)
    tokenizer_json = read_tokenizer(cfg, vocab_size, bin_ids=shards is not None)
    if shards is not None:  # a .bin's tokenizer is what made its ids: kept, not rerun
        size = used_bytes(shards, cfg)  # read no more than is used
        raw, kind = b"".join(read_shards(shards, size, max(size, 1))), "bin"
    elif tokenizer_json is None:
        raw, kind = b"".join(text_blocks(cfg.source, cfg.max_bytes)), "text"
    else:
        raw, kind = b"".join(a.tobytes() for a in text_ids(cfg, tokenizer_json, vocab_size)), "tokenized"
    corpus = corpus_from_raw(raw, kind, cfg, vocab_size, ctx)
    corpus.tokenizer_json = tokenizer_json
    return corpus


READ_BLOCK = 1 << 20  # a text file is read in blocks of this many bytes


def _file_blocks(path: Path) -> Iterator[bytes]:
    """The bytes of the file at `path`, a block at a time."""
    with path.open("rb") as f:
        while block := f.read(READ_BLOCK):
            yield block


def _cut(blocks: Iterable[bytes], limit: int) -> Iterator[bytes]:
    """The first `limit` bytes `blocks` make (0: all of them)."""
    left = limit
    for block in blocks:
        if limit and left <= len(block):
            if left:
                yield block[:left]
            return
        left -= len(block)
        yield block


def text_blocks(source: str, max_bytes: int = 0) -> Iterator[bytes]:
    """A text source's byte-level corpus, a block at a time: a file's bytes, or for a directory
    (and the embedded corpus) each file as `# file: <name>\\n`, its bytes, `\\n`, in corpus order;
    its first `max_bytes` (0: all)."""
    headers = source == "stdlib" or Path(source).is_dir()

    def whole() -> Iterator[bytes]:
        for name, path in documents(source):
            if headers:
                yield f"# file: {name}\n".encode()
            yield from _file_blocks(path)
            if headers:
                yield b"\n"

    return _cut(whole(), max_bytes)


def text_ids(cfg: DataConfig, tokenizer_json: bytes, vocab_size: int) -> Iterator[np.ndarray]:
    """The token ids `[data] tokenizer` makes of the text source, a batch of pieces at a time
    (uint32 arrays): the byte-level corpus (`text_blocks`, file headers and `max_bytes` cut
    included) encoded as one text, or with `[data] eos` each document on its own (no headers)
    followed by the eos token, the documents cut to `max_bytes` in all. DataError (one line) if
    the tokenizer does not load or fit, or eos is not one of its tokens."""
    tok = load_tokenizer(tokenizer_json, vocab_size)
    if not cfg.eos:
        return _encoded(tok, text_blocks(cfg.source, cfg.max_bytes))
    eos_id = tok.token_to_id(cfg.eos)
    if eos_id is None:
        raise DataError(f"data.eos {cfg.eos!r:.60} is not a token of data.tokenizer")
    return document_ids(tok, documents(cfg.source), eos_id, cfg.max_bytes)


def document_ids(tok, docs: list[tuple[str, Path]], eos_id: int | None, max_bytes: int = 0) -> Iterator[np.ndarray]:
    """Each document's token ids (`_encoded`, a document at a time, without headers), followed by
    `eos_id` (None: nothing); the documents cut to `max_bytes` in all (0: no cut), the last one
    cut short, as uint32 arrays."""
    left = max_bytes
    for _, path in docs:
        if max_bytes and left <= 0:
            break
        yield from _encoded(tok, _cut(_file_blocks(path), left if max_bytes else 0))
        if eos_id is not None:
            yield np.asarray([eos_id], dtype=TOKENIZED_DTYPE)
        left -= path.stat().st_size


TOKENIZE_PIECE = 1 << 18  # the text is tokenized in pieces of about this many bytes, cut after a newline
MAX_PIECE = 4 * TOKENIZE_PIECE  # ... and never more: text without a newline is cut after a space (or a character)


def load_tokenizer(tokenizer_json: bytes, vocab_size: int | None = None, what: str = "data.tokenizer"):
    """The `tokenizers` Tokenizer of a tokenizer.json's bytes; DataError (one line, naming the file
    as `what`) if the package is missing, the file does not load, or its vocabulary is larger than
    `vocab_size`."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(f"{what} needs the tokenizers package (pip install 'veriloco[hf]')") from None
    try:
        tok = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    except Exception as e:  # the library raises its own exception type for any bad file
        raise DataError(f"{what} is not a tokenizers tokenizer.json: {str(e).splitlines()[0][:120]}") from None
    if vocab_size is not None and tok.get_vocab_size() > vocab_size:
        raise DataError(f"{what} has {tok.get_vocab_size()} tokens > model.vocab_size {vocab_size}: "
                        f"set model.vocab_size >= {tok.get_vocab_size()}")
    return tok


def _pieces(text: bytes) -> list[str]:
    """`text` cut into pieces, each decoded (UTF-8; undecodable bytes become U+FFFD): a piece ends
    after its first newline past TOKENIZE_PIECE bytes; where none comes before MAX_PIECE bytes,
    after its last space before MAX_PIECE, else before the UTF-8 character that would cross it. A
    pure function of the bytes, so pieces (and ids) do not depend on how the text is read."""
    return list(_pieces_of([text]))


def _piece_end(buf: bytearray) -> int:
    """Where a piece of MAX_PIECE bytes or more without a newline past TOKENIZE_PIECE ends."""
    space = buf.rfind(b" ", TOKENIZE_PIECE, MAX_PIECE)
    if space >= 0:
        return space + 1
    end = MAX_PIECE
    while end > TOKENIZE_PIECE and buf[end] & 0xC0 == 0x80:  # not inside a character's bytes
        end -= 1
    return end


def _pieces_of(blocks: Iterable[bytes]) -> Iterator[str]:
    """`_pieces` of the bytes `blocks` make one after another, as they come: it holds one piece
    (and the block that ends it), not the text. Before MAX_PIECE, a text without newlines (a
    one-line dump) was one piece, and its encoding held about 70 times its size."""
    buf, scanned = bytearray(), TOKENIZE_PIECE
    for block in blocks:
        buf += block
        while True:
            if (cut := buf.find(b"\n", scanned, MAX_PIECE)) >= 0:
                end = cut + 1
            elif len(buf) > MAX_PIECE:
                end = _piece_end(buf)
            else:
                break
            yield buf[:end].decode("utf-8", errors="replace")
            del buf[:end]
            scanned = TOKENIZE_PIECE
        scanned = max(TOKENIZE_PIECE, len(buf))
    if buf:
        yield buf.decode("utf-8", errors="replace")


# pieces the tokenizer encodes at once, on its threads: one per core, up to 16 (each piece's encoding
# holds tens of MB while it is made, so this bounds the prepare step's memory)
ENCODE_BATCH = max(1, min(16, os.cpu_count() or 1))


def _encoded(tok, blocks: Iterable[bytes]) -> Iterator[np.ndarray]:
    """The token ids of the bytes `blocks` make (each of its `_pieces` encoded on its own, without
    special tokens), a batch of pieces at a time, as uint32 arrays. `encode_batch_fast` (tokenizers
    >= 0.21) makes the same ids without character offsets: 3-4x faster here."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    pieces = _pieces_of(blocks)
    while batch := list(itertools.islice(pieces, ENCODE_BATCH)):
        try:
            encoded = encode(batch, add_special_tokens=False)
        except Exception as e:  # the tokenizers library's own error type: a tokenizer that loads but cannot encode
            raise DataError(f"data.tokenizer cannot encode the text: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}") from None
        yield np.concatenate([np.asarray(e.ids, dtype=TOKENIZED_DTYPE) for e in encoded])


def tokenize(text: bytes, tokenizer_json: bytes, vocab_size: int) -> bytes:
    """`text` as uint32 token ids of the tokenizer in `tokenizer_json` (the `tokenizers`
    library's format): a pure function of the bytes and the tokenizer file."""
    return b"".join(a.tobytes() for a in _encoded(load_tokenizer(tokenizer_json, vocab_size), [text]))


def tokenize_to_bin(source: str, tokenizer: str | Path, out: str | Path, eos: str = "") -> tuple[int, str]:
    """Tokenize a text source into a token .bin at `out`, streamed (memory for a batch of pieces,
    not the source nor a document): each file of the source (`documents`) encoded as `[data] tokenizer`
    encodes it, followed by the token `eos` when given (`[data] eos`'s layout: a run on the .bin
    trains on the ids `--data.source=SOURCE --data.tokenizer=T --data.eos=EOS` would make). uint16
    when the vocabulary fits, else uint32. Written whole or not at all; an existing `out` is
    refused. Returns (tokens, dtype)."""
    out = Path(out)
    if out.exists():
        raise DataError(f"{out} already exists; tokenize writes a new file")
    if out.suffix != ".bin":
        raise DataError(f"{out}: a token file's name ends in .bin (what data.source takes as tokens)")
    if not Path(tokenizer).is_file():
        raise DataError(f"tokenizer not found: {tokenizer}")
    tok = load_tokenizer(Path(tokenizer).read_bytes(), what=str(tokenizer))
    eos_id = tok.token_to_id(eos) if eos else None
    if eos and eos_id is None:
        raise DataError(f"eos {eos!r:.60} is not a token of {tokenizer}")
    # by the largest id, not the vocabulary's size: ids need not be dense (70000 in a vocabulary of 3 wrapped)
    dtype = "uint16" if max(tok.get_vocab(with_added_tokens=True).values(), default=0) < 1 << 16 else "uint32"
    docs = documents(source)
    try:
        made = make_dirs(out.parent)
    except RunDirError as e:
        raise DataError(str(e)) from None
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    n = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for ids in document_ids(tok, docs, eos_id):
                f.write(ids.astype(dtype).tobytes())
                n += len(ids)
        os.chmod(tmp, 0o644)
        os.rename(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        remove_dirs(made)
        raise
    return n, dtype


def corpus_from_raw(raw: bytes, kind: str, cfg: DataConfig, vocab_size: int, ctx: int) -> Corpus:
    """Build a Corpus from raw bytes (also how a stored corpus is rebuilt)."""
    tokens = _tokens_from(raw, kind, cfg.bin_dtype)
    check_ids(kind, int(tokens.max()) if kind != "text" and len(tokens) else None, vocab_size)
    corpus = Corpus(tokens, raw, kind, cfg.chunk_bytes, cfg.eval_fraction)
    eval_start_of(len(tokens), cfg.eval_fraction, ctx)
    return corpus


class PreparedCorpus:
    """A corpus read and checked for a run (`prepare_corpus`): its Merkle root, its manifest, its
    tokenizer file, and `put_chunks`, which writes its chunks into the run's store once the run's
    directory is known (the run id covers the root). `close` lets go of a tokenized corpus's
    scratch file (also as a context manager)."""

    def __init__(self, root: str, manifest: dict, tokenizer_json: bytes | None,
                 chunks: Callable[[], Iterator[bytes]], close: Callable[[], None] = lambda: None) -> None:
        self.root, self.manifest, self.tokenizer_json, self._chunks = root, manifest, tokenizer_json, chunks
        self.close = close

    def __enter__(self) -> PreparedCorpus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def manifest_bytes(self) -> bytes:
        return canonical_json(self.manifest)

    def put_chunks(self, put: Callable[[bytes], str]) -> None:
        """`put` every chunk; DataError if a streamed file's chunk is no longer what was hashed."""
        chunks, digests = iter(self._chunks()), self.manifest["chunks"]
        for n, digest in enumerate([*digests, None]):  # then no chunk more than was hashed
            chunk = next(chunks, None)
            if (chunk is None) != (digest is None) or digest is not None and put(chunk) != digest:
                raise DataError(f"corpus chunk {n} changed while the run was prepared (its file was written to)")


def prepare_corpus(cfg: DataConfig, vocab_size: int, ctx: int, scratch: str | os.PathLike[str] | None = None,
                   ) -> PreparedCorpus:
    """Read the corpus `cfg` names and check it fits the model, streamed, so a corpus larger than
    memory prepares in a chunk's worth of it (a batch of tokenizer pieces for text that
    `[data] tokenizer` tokenizes). Token .bin shards and byte-level text are read twice, a chunk
    at a time (hashed, then put into the store); text that is tokenized is tokenized once, into an
    unnamed scratch file in `scratch` (None: the system's temporary directory; it goes when closed
    or when the process ends, however), whose chunks are then hashed and put. The chunks,
    manifest and root are those `load_corpus` makes of the same source (tests/test_stored_corpus.py)."""
    shards = token_shards(cfg)
    tokenizer_json = read_tokenizer(cfg, vocab_size, bin_ids=shards is not None)
    if shards is not None:
        size = used_bytes(shards, cfg)
        eval_start_of(size // np.dtype(cfg.bin_dtype).itemsize, cfg.eval_fraction, ctx)  # before reading it all
        check_chunk_count(-(-size // cfg.chunk_bytes), cfg)
        return _prepared("bin", cfg, vocab_size, ctx, tokenizer_json, lambda: read_shards(shards, size, cfg.chunk_bytes))
    if tokenizer_json is None:
        return _prepared("text", cfg, vocab_size, ctx, None, lambda: _rechunk(text_blocks(cfg.source, cfg.max_bytes),
                                                                                cfg.chunk_bytes))
    f = tempfile.TemporaryFile(dir=scratch)
    try:
        for ids in text_ids(cfg, tokenizer_json, vocab_size):
            f.write(ids.tobytes())
        f.flush()
        return _prepared("tokenized", cfg, vocab_size, ctx, tokenizer_json,
                         lambda: _file_chunks(f.fileno(), cfg.chunk_bytes), f.close)
    except BaseException:
        f.close()
        raise


def _prepared(kind: str, cfg: DataConfig, vocab_size: int, ctx: int, tokenizer_json: bytes | None,
              chunks: Callable[[], Iterator[bytes]], close: Callable[[], None] = lambda: None) -> PreparedCorpus:
    """The PreparedCorpus of the chunks `chunks()` makes, read once here to hash them and check
    their ids (a token may straddle two chunks) and size."""
    dtype = dtype_of(kind, cfg.bin_dtype)
    hashes, carry, top, size = [], b"", 0, 0
    for chunk in chunks():
        hashes.append(sha256_hex(chunk))
        size += len(chunk)
        if kind != "text":
            data = carry + chunk
            whole = len(data) - len(data) % dtype.itemsize
            if whole:
                top = max(top, int(np.frombuffer(data[:whole], dtype=dtype).max()))
            carry = data[whole:]
    check_ids(kind, top if kind != "text" else None, vocab_size)
    eval_start_of(size // dtype.itemsize, cfg.eval_fraction, ctx)
    check_chunk_count(len(hashes), cfg)  # (a .bin's was checked before it was read)
    root = merkle_root([bytes.fromhex(h) for h in hashes]).hex()
    manifest = corpus_manifest(kind, str(dtype), cfg.chunk_bytes, cfg.eval_fraction, hashes, root, size // dtype.itemsize)
    return PreparedCorpus(root, manifest, tokenizer_json, chunks, close)


def _rechunk(blocks: Iterable[bytes], size: int) -> Iterator[bytes]:
    """The bytes `blocks` make, in pieces of `size` bytes (the last may be shorter)."""
    buf = bytearray()
    for block in blocks:
        buf += block
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
    if buf:
        yield bytes(buf)


def _file_chunks(fd: int, size: int) -> Iterator[bytes]:
    """The bytes of the open file `fd` from its start, in pieces of `size` bytes (positioned reads)."""
    offset = 0
    while chunk := os.pread(fd, size, offset):
        yield chunk
        offset += len(chunk)


def _offset(tag: str, n_positions: int) -> int:
    h = hashlib.sha256(tag.encode()).digest()
    return int.from_bytes(h[:8], "little") % n_positions


def batch_offsets(
    corpus: Corpus, seed: int, worker: int, round: int, step: int, batch_size: int, ctx: int
) -> list[int]:
    """Start offsets (in the training split) of the sequences of one inner step's batch."""
    n_positions = corpus.eval_start - ctx - 1
    return [
        _offset(f"veriloco/batch/{seed}/{worker}/{round}/{step}/{i}", n_positions)
        for i in range(batch_size)
    ]


def _gather(tokens: np.ndarray, offsets: list[int], ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = np.stack([tokens[o : o + ctx + 1] for o in offsets]).astype(np.int64)
    t = torch.from_numpy(seqs)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def batch(
    corpus: Corpus, seed: int, worker: int, round: int, step: int, batch_size: int, ctx: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of shape (batch_size, ctx): the same tokens on any machine."""
    return _gather(corpus.tokens, batch_offsets(corpus, seed, worker, round, step, batch_size, ctx), ctx)


def eval_batches(
    corpus: Corpus, n_batches: int, batch_size: int, ctx: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out batches, evenly spread over the eval split (same every round)."""
    n_positions = len(corpus.tokens) - corpus.eval_start - ctx - 1
    total = n_batches * batch_size
    offsets = [corpus.eval_start + (i * n_positions) // total for i in range(total)]
    return [
        _gather(corpus.tokens, offsets[b * batch_size : (b + 1) * batch_size], ctx)
        for b in range(n_batches)
    ]


def batch_digest(inputs: torch.Tensor, targets: torch.Tensor) -> str:
    """sha256 of one batch's tokens: the leaf a worker commits for every inner step."""
    return sha256_hex(inputs.numpy().tobytes() + targets[:, -1:].numpy().tobytes())
