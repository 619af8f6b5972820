"""What is trained: a model factory, a loss, deterministic batches, and held-out batches.

The round engine only sees a `Task`, so people who bring their own `nn.Module` and data train
it exactly the way the built-in GPT is trained (see examples/custom_model.py). A task's callables
must be importable top-level functions or picklable objects: local runs hand them to the worker
processes this project spawns itself (never to or from a peer).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import Config
from .data import Corpus, batch, corpus_from_raw, eval_batches
from .model import build_model, lm_loss
from .store import LocalStore, StoreError

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
    import json

    man = json.loads(store.get(manifest_digest, max_bytes=64 << 20))
    raw = b"".join(store.get(h) for h in man["chunks"])
    corpus = corpus_from_raw(raw, man["kind"], cfg.data, cfg.model.vocab_size, cfg.model.ctx)
    if corpus.root != man["root"]:
        raise StoreError(f"corpus root {corpus.root} does not match the manifest's {man['root']}")
    return corpus


class CorpusTask:
    """The built-in task: the run's model (`[model]`) on a Merkle-committed corpus from the run's store."""

    def __init__(self, cfg: Config, store_dir: str | Path, corpus_manifest: str, init: str | None = None) -> None:
        """`init`: the manifest's `init`, the store digest of the starting weights (`[model] init`)."""
        self.cfg, self.store_dir, self.corpus_manifest, self.init = cfg, str(store_dir), corpus_manifest, init
        self._corpus: Corpus | None = None
        self._initial: dict[str, torch.Tensor] | None = None

    def initial_params(self) -> dict[str, torch.Tensor] | None:
        """G_0 from the run's store when the run starts from weights (`[model] init`), else None
        (G_0 is then `run.seed`'s initialisation). Read on every call, not kept: a worker needs
        it once, and a pipeline stage only its slice (the audit presets `_initial` from its own
        store)."""
        if self._initial is not None or self.init is None:
            return self._initial
        from safetensors.torch import load as st_load

        return st_load(LocalStore(self.store_dir).get(self.init))

    @property
    def corpus(self) -> Corpus:
        if self._corpus is None:
            self._corpus = load_stored_corpus(LocalStore(self.store_dir), self.corpus_manifest, self.cfg)
        return self._corpus

    def as_task(self) -> Task:
        return Task(self.make_model, _gpt_loss, self.batch, self.eval_batches)

    def make_model(self) -> nn.Module:
        return with_initial(build_model(self.cfg.model, self.cfg.run.seed), self.initial_params())

    def batch(self, worker: int, round: int, step: int) -> Batch:
        t = self.cfg.train
        return batch(self.corpus, self.cfg.run.seed, worker, round, step, t.batch_size, self.cfg.model.ctx)

    def eval_batches(self) -> list[Batch]:
        t = self.cfg.train
        return eval_batches(self.corpus, t.eval_batches, t.batch_size, self.cfg.model.ctx)


def load_params(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy `params` (by name; a superset is fine) into `model`'s parameters, across devices."""
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(params[k])


def with_initial(model: nn.Module, initial: dict[str, torch.Tensor] | None) -> nn.Module:
    """`model` (the whole model or one stage) with its params set from `initial` (G_0 of a run
    that starts from weights: `CorpusTask.initial_params`), or as it is when that is None."""
    if initial is not None:
        load_params(model, initial)
    return model


def model_init_hash(model: nn.Module) -> str:
    """sha256 of the initial params (goes into the run manifest)."""
    from .hashing import tensors_hash

    return tensors_hash({k: v for k, v in model.state_dict().items()})


__all__ = ["Task", "CorpusTask", "load_params", "load_stored_corpus", "model_init_hash", "with_initial", "on_device", "process_device", "require_gpu",
           "take_device"]
