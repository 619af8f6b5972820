"""What is trained: a model factory, a loss, deterministic batches, and held-out batches.

The round engine only sees a `Task`, so people who bring their own `nn.Module` and data train
it exactly the way the built-in GPT is trained (see examples/custom_model.py). A task's callables
must be importable top-level functions or picklable objects: local runs hand them to the worker
processes this project spawns itself (never to or from a peer).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .config import Config
from .data import (
    MAX_CORPUS_MANIFEST,
    Corpus,
    batch,
    check_ids,
    corpus_from_raw,
    dtype_of,
    eval_batches,
    eval_start_of,
)
from .ledger.merkle import root as merkle_root
from .model import build_model, lm_loss, load_params, model_from
from .store import LocalStore, StoreError
from .tensorfile import FLOATS, TensorFile

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Task:
    """The four things the engine needs from a user.

    make_model: builds the model; must give identical params every call (seed inside).
    loss: loss(model, inputs, targets) -> scalar tensor.
    batch: batch(worker, round, step) -> (inputs, targets), a pure function.
    eval_batches: eval_batches() -> list of held-out (inputs, targets), the same every call.
    """

    make_model: Callable[[], nn.Module]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    batch: Callable[[int, int, int], Batch]
    eval_batches: Callable[[], list[Batch]]


class _ModelOn:
    """make_model, then moved to `device` (picklable: a task goes to the worker processes)."""

    def __init__(self, make_model: Callable[[], nn.Module], device: torch.device) -> None:
        self.make_model, self.device = make_model, device

    def __call__(self) -> nn.Module:
        return self.make_model().to(self.device)


class _LossOn:
    """loss(model, x, y) with the batch moved to `device`, under bf16 autocast when asked."""

    def __init__(self, loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device, precision: str) -> None:
        self.loss, self.device, self.precision = loss, device, precision

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.precision == "bf16":
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                return self.loss(model, x, y)
        return self.loss(model, x, y)


def on_device(task: Task, device: torch.device | str, precision: str = "fp32") -> Task:
    """`task` with its models built on `device` and its loss taking batches there (`[run] device`),
    under bf16 autocast with precision 'bf16' (`[train] precision`). The batches themselves are
    still made on the CPU (they are hashed and committed there). On the CPU in fp32: `task`."""
    device = torch.device(device)
    if device.type == "cpu" and precision == "fp32":
        return task
    return Task(_ModelOn(task.make_model, device), _LossOn(task.loss, device, precision), task.batch,
                task.eval_batches)


def require_gpu(asked: str) -> None:
    """ValueError naming what `asked` for a GPU, when this machine's torch sees none."""
    if not torch.cuda.is_available():
        raise ValueError(f"{asked} but torch.cuda.is_available() is False on this machine (torch {torch.__version__})")


def process_device(cfg: Config, rank: int) -> torch.device:
    """The device of a process (`[run] device`): the CPU, or cuda:(its local rank mod the GPUs
    this process sees); the local rank is torchrun's LOCAL_RANK when set, else `rank` (a launch
    on one machine; an elastic worker's id). Raises ValueError without CUDA."""
    if cfg.run.device == "cpu":
        return torch.device("cpu")
    require_gpu("run.device = 'cuda'")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())


def take_device(device: torch.device, exact: bool) -> None:
    """Make `device` this process's GPU (nothing on the CPU); with `exact` (verify.replay_match =
    'exact': replays must reproduce traces bit for bit) turn on torch's deterministic algorithms,
    with the cuBLAS workspace setting they need. A worker and an auditor of its run alike."""
    if device.type != "cuda":
        return
    torch.cuda.set_device(device)
    if exact:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for determinism
        torch.use_deterministic_algorithms(True)


def _gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(x), y)


def load_stored_corpus(store: LocalStore, manifest_digest: str, cfg: Config) -> Corpus:
    """Rebuild the corpus from the run's store, checking every chunk and the Merkle root."""
    man = json.loads(store.get(manifest_digest, max_bytes=MAX_CORPUS_MANIFEST))
    raw = b"".join(store.get(h) for h in man["chunks"])
    corpus = corpus_from_raw(raw, man["kind"], cfg.data, cfg.model.vocab_size, cfg.model.ctx)
    if corpus.root != man["root"]:
        raise StoreError(f"corpus root {corpus.root} does not match the manifest's {man['root']}")
    return corpus


class StoredCorpus:
    """The run's corpus as its store keeps it, read a chunk at a time when a batch needs it: a
    worker holds at most `cache_chunks` chunks (64 KiB each by default), not the corpus
    (`load_stored_corpus` holds all of it, twice while it reads it). The audit reads every chunk
    through it once (`check_all`). The corpus manifest's chunk hashes must make its Merkle root (checked here, no chunk
    read), and each chunk is checked against its hash when it is read, so a batch is made only
    of the committed tokens. `tokens` and `eval_start` are what `data.batch` and
    `data.eval_batches` read, as of a `Corpus`; the batches are the same tokens bit for bit."""

    def __init__(self, store: LocalStore, manifest_digest: str, cfg: Config, cache_chunks: int = 256) -> None:
        raw = store.get(manifest_digest, max_bytes=MAX_CORPUS_MANIFEST)
        try:
            man = json.loads(raw)
            kind, chunks, n, root = man["kind"], list(man["chunks"]), int(man["tokens"]), man["root"]
            self.dtype = dtype_of(kind, cfg.data.bin_dtype)
            if merkle_root([bytes.fromhex(h) for h in chunks]).hex() != root:
                raise StoreError(f"corpus root {root!r:.80} is not the root of the manifest's chunk hashes")
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            raise StoreError(f"corpus manifest {manifest_digest} is malformed: {str(e)[:80]}") from None
        self.store, self.kind, self.chunk_hashes, self.root = store, kind, chunks, root
        self.chunk_bytes, self.size = cfg.data.chunk_bytes, n * self.dtype.itemsize
        if not chunks or not (len(chunks) - 1) * self.chunk_bytes < self.size <= len(chunks) * self.chunk_bytes:
            raise StoreError(f"corpus manifest {manifest_digest}: {n} tokens do not fill {len(chunks)} chunks of "
                             f"{self.chunk_bytes} bytes")
        check_ids(kind, None, cfg.model.vocab_size)
        self.tokens = _ChunkedTokens(self, n)
        self.eval_start = eval_start_of(n, cfg.data.eval_fraction, cfg.model.ctx)
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cache_chunks = cache_chunks
        self.reads = 0  # chunks read from the store (and hashed) so far

    def check_all(self, vocab_size: int) -> None:
        """Read every chunk once (each checked against its hash as it is read; at most the cache
        held at a time) and check that every token id is below `vocab_size`: what the audit
        checks of the whole corpus without holding it."""
        if self.kind == "text":  # bytes: every id < 256 <= vocab_size (checked on opening)
            for i in range(len(self.chunk_hashes)):
                self.chunk(i)
            return
        step = max(1, self.chunk_bytes // self.dtype.itemsize) * 16
        for a in range(0, len(self.tokens), step):
            check_ids(self.kind, int(self.tokens[a:a + step].max()), vocab_size)

    def chunk(self, i: int) -> bytes:
        """Chunk `i`, checked against its hash (and its length) when read; kept in a small LRU."""
        data = self._cache.get(i)
        if data is not None:
            self._cache.move_to_end(i)
            return data
        data = self.store.get(self.chunk_hashes[i])
        expected = min(self.chunk_bytes, self.size - i * self.chunk_bytes)
        if len(data) != expected:
            raise StoreError(f"corpus chunk {i} has {len(data)} bytes, not {expected}")
        self.reads += 1
        self._cache[i] = data
        if len(self._cache) > self._cache_chunks:
            self._cache.popitem(last=False)
        return data


class _ChunkedTokens:
    """`StoredCorpus.tokens`: its length, and contiguous slices as numpy arrays."""

    def __init__(self, corpus: StoredCorpus, n: int) -> None:
        self.corpus, self.n = corpus, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, step = s.indices(self.n)
        if step != 1:
            raise ValueError("StoredCorpus.tokens takes contiguous slices only")
        c, item = self.corpus, self.corpus.dtype.itemsize
        a, b = start * item, max(stop, start) * item
        parts = [c.chunk(i)[max(a - i * c.chunk_bytes, 0):b - i * c.chunk_bytes]
                 for i in range(a // c.chunk_bytes, -(-b // c.chunk_bytes))]
        return np.frombuffer(b"".join(parts), dtype=c.dtype)


class StoredParams(TensorFile):
    """The tensors of a safetensors blob in a local store, each read from the file when asked for
    (a stored G_0: a pipeline stage reads its slice and no more; `model.model_from`). The blob's
    hash is checked, as a stream, when it is opened, and its header is validated (float dtypes
    only); a tensor is read with plain file reads, not a memory map, so a process holds only the
    tensors it asked for (tensorfile.TensorFile). StoreError, one line, for anything amiss."""

    def __init__(self, store: LocalStore, digest: str) -> None:
        try:
            super().__init__(store.verified_path(digest), f"blob {digest}", FLOATS)
        except ValueError as e:
            raise StoreError(str(e)) from None

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return super().__getitem__(name)
        except ValueError as e:
            raise StoreError(str(e)) from None


def initial_digest(manifest: dict) -> str | None:
    """The store digest of a run's G_0 (`initial_params`; a run from before it was kept: the
    `[model] init` weights, or None, and G_0 is `run.seed`'s initialisation)."""
    return manifest.get("initial_params", manifest.get("init"))


class CorpusTask:
    """The built-in task: the run's model (`[model]`) on a Merkle-committed corpus from the run's store."""

    def __init__(self, cfg: Config, store_dir: str | Path, corpus_manifest: str, initial: str | None = None) -> None:
        """`initial`: the store digest of G_0 (`initial_digest` of the manifest)."""
        self.cfg, self.store_dir, self.corpus_manifest, self.initial = cfg, str(store_dir), corpus_manifest, initial
        self._corpus: Corpus | StoredCorpus | None = None
        self._initial: Mapping[str, torch.Tensor] | None = None

    def initial_params(self) -> Mapping[str, torch.Tensor] | None:
        """G_0 as kept in the run's store, read lazily (`StoredParams`), or None for a run that
        keeps none (G_0 is then `run.seed`'s initialisation). Opened on every call, never held:
        a worker needs it once, a pipeline stage only its slice (the audit presets `_initial`
        from its own store)."""
        if self._initial is not None or self.initial is None:
            return self._initial
        return StoredParams(LocalStore(self.store_dir), self.initial)

    @property
    def corpus(self) -> Corpus | StoredCorpus:
        """The run's corpus, read from the store a chunk at a time (`StoredCorpus`; the audit
        presets `_corpus` with the one it has checked whole)."""
        if self._corpus is None:
            self._corpus = StoredCorpus(LocalStore(self.store_dir), self.corpus_manifest, self.cfg)
        return self._corpus

    def as_task(self) -> Task:
        return Task(self.make_model, _gpt_loss, self.batch, self.eval_batches)

    def make_model(self) -> nn.Module:
        """G_0: read from the store (nothing is initialised), or the seed's when the run keeps none."""
        initial = self.initial_params()
        return build_model(self.cfg.model, self.cfg.run.seed) if initial is None else model_from(self.cfg.model, initial)

    def batch(self, worker: int, round: int, step: int) -> Batch:
        t = self.cfg.train
        return batch(self.corpus, self.cfg.run.seed, worker, round, step, t.batch_size, self.cfg.model.ctx)

    def eval_batches(self) -> list[Batch]:
        t = self.cfg.train
        return eval_batches(self.corpus, t.eval_batches, t.batch_size, self.cfg.model.ctx)


def corpus_task_of(task: Task) -> CorpusTask | None:
    """The built-in task behind `task` (also through `on_device`), or None for a user's own."""
    make = getattr(task.make_model, "make_model", task.make_model)  # on_device's _ModelOn wraps it
    source = getattr(make, "__self__", None)
    return source if isinstance(source, CorpusTask) else None


def model_init_hash(model: nn.Module) -> str:
    """sha256 of the initial params (goes into the run manifest)."""
    from .hashing import tensors_hash

    return tensors_hash(dict(model.named_parameters()))  # a tied head is the embedding: named once


__all__ = ["Task", "CorpusTask", "StoredCorpus", "corpus_task_of", "StoredParams", "initial_digest", "load_params", "load_stored_corpus", "model_init_hash", "on_device", "process_device", "require_gpu",
           "take_device"]
