"""`veriloco export RUN --out DIR`: a run's global params after a round, as a model directory.

The params come from the round's checkpoint in the run's store (a pipelined run's stage
checkpoints, merged), each checked against the params hash its round record names; the store
checks every blob against its digest. A round whose checkpoint `[run] keep_checkpoints` pruned is
rebuilt from G_0 and the rounds' accepted packets (`rebuild`, one stage only). What is written:

- `[model] arch` a transformers architecture (hf.py): `config.json` and `model.safetensors`, which
  `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads as it is;
- the built-in GPT: `model.safetensors` and `model.json` (the run's `[model]` section), which
  `veriloco.model.GPT(ModelConfig(**json))` loads with `load_state_dict`;
- with `[data] tokenizer`, its `tokenizer.json` too (from the run's store), which
  `transformers.AutoTokenizer.from_pretrained(DIR)` loads;
- a user's Task (`train_task`): `model.safetensors` alone, under its module's parameter names,
  which that module loads with `load_state_dict(safetensors.torch.load_file(...))`.

The records are the run's own: `veriloco audit RUN` checks them (signatures, verdicts, every outer
step) before you trust what they name. DIR is written whole or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from .config import Config, ConfigError, config_from_dict
from .hashing import TensorsHasher
from .records import RunDir, make_dirs, pruned, remove_dirs, users_task
from .store import LocalStore, StoreError
from .tensorfile import FileTensors, TensorFile, write_tensors


class ExportError(ValueError):
    """The run cannot be exported as asked: one line naming why."""


class RoundParams(FileTensors):
    """The global params after round `r`, read a tensor at a time from the round's checkpoints in
    the store (a pipelined run's stage checkpoints, merged; `tensorfile.TensorFile` on each blob,
    whose hash the store checks as a stream first), so export writes the model and sample builds
    it without also holding the checkpoints. `check` holds each stage's params to the params hash
    its record names. ExportError, one line, for a checkpoint that does not load or match."""

    def __init__(self, store: LocalStore, parts: list[dict], r: int) -> None:
        where: dict[str, tuple[TensorFile, str]] = {}  # name -> its checkpoint, and its key there
        self._stages: list[tuple[list[str], str, str]] = []  # (names, params hash, what to call it)
        for s, part in enumerate(parts):
            label = f"round {r}: checkpoint of stage {s}"
            try:
                ckpt = TensorFile(store.verified_path(part["checkpoint"]), label)
            except (StoreError, ValueError, OSError) as e:
                raise ExportError(f"{label} does not load: {str(e).splitlines()[0]}") from None
            names = sorted(k[len("param/"):] for k in ckpt.index if k.startswith("param/"))
            where.update((n, (ckpt, f"param/{n}")) for n in names)
            self._stages.append((names, part["params_hash"], label))
        super().__init__(where, ExportError)  # a blob changed since its hash was checked: one line

    def check(self) -> None:
        for names, params_hash, label in self._stages:
            hasher = TensorsHasher()
            for name in names:
                hasher.add(name, self[name])
            if hasher.hexdigest() != params_hash:
                raise ExportError(f"{label} does not match its record's params hash")


class Opened(NamedTuple):
    """A run's round as export and sample read it: its manifest, its store, its config, and its
    global params after `round` (`RoundParams`: each stage's checkpoint checked against its
    record, its tensors read when asked for)."""

    manifest: dict
    store: LocalStore
    cfg: Config
    params: RoundParams | RebuiltParams
    round: int

    def tokenizer_json(self) -> bytes | None:
        """The run's `[data] tokenizer` file from its store, or None when it has none."""
        digest = self.manifest.get("tokenizer")
        if digest is None:
            return None
        try:
            return self.store.get(digest)
        except StoreError as e:
            raise ExportError(f"the run's tokenizer does not load from its store: {str(e).splitlines()[0]}") from None


class RebuiltParams(dict):
    """The global params after a round whose checkpoint `[run] keep_checkpoints` pruned, redone
    from G_0 and the packets (`rebuild`), which checked them round by round."""

    def layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {k: (v.dtype, tuple(v.shape)) for k, v in self.items()}

    def check(self) -> None:
        """Nothing left to check: every round's aggregate and params hash were, as it was rebuilt."""


def rebuild(store: LocalStore, manifest: dict, cfg: Config, records: list[dict]) -> RebuiltParams:
    """G after the last of `records` (rounds 0..r, in order) without its checkpoint: from G_0 (the
    store's, or the seed's for a run that kept none), each round's accepted packets (its record's
    verdicts) decoded from their bundles, aggregated as the run did and stepped by the outer
    optimizer, as `veriloco audit` redoes the rounds; each round's aggregate and params hash must
    be its record's. ExportError, one line, where one is not."""
    from .hashing import tensors_hash
    from .model import build_model
    from .outer import OuterOptimizer
    from .packet import PacketError, decode_bundle, decode_packet
    from .round import aggregate_deltas
    from .task import StoredParams, initial_digest

    digest = initial_digest(manifest)
    try:
        start = StoredParams(store, digest) if digest else dict(build_model(cfg.model, cfg.run.seed).named_parameters())
        outer = OuterOptimizer({k: start[k].detach().clone() for k in start}, cfg.outer)
    except StoreError as e:
        raise ExportError(f"G_0 does not load from the run's store: {str(e).splitlines()[0]}") from None
    shapes = {k: tuple(v.shape) for k, v in outer.params.items()}
    for r, rec in enumerate(records):
        accepted = {}
        verdicts, bundles = rec.get("verdicts"), rec.get("bundles")
        if not (isinstance(verdicts, list) and isinstance(bundles, list) and len(verdicts) == len(bundles)):
            raise ExportError(f"round {r}: its record does not name a verdict and a bundle for every worker")
        for j, verdict in enumerate(verdicts):
            if verdict == "accept":
                try:
                    packet = decode_bundle(store.get(bundles[j], max_bytes=cfg.run.max_packet_bytes + (1 << 20)))[1]
                    accepted[j] = decode_packet(packet, shapes, cfg.run.max_packet_bytes)
                except (StoreError, PacketError, ValueError, TypeError) as e:
                    raise ExportError(f"round {r}: worker {j}'s accepted packet does not load: {str(e).splitlines()[0]}") from None
        aggregate = aggregate_deltas(accepted, cfg.verify) if accepted else None
        if (tensors_hash(aggregate) if aggregate is not None else None) != rec.get("aggregate_hash"):
            raise ExportError(f"round {r}: the accepted packets do not aggregate to its record's aggregate hash")
        if aggregate is not None:
            outer.step(aggregate)
        if tensors_hash(outer.params) != rec.get("params_hash"):
            raise ExportError(f"round {r}: the outer step does not give its record's params hash")
    return RebuiltParams(outer.params)


def open_round(run_dir: str | Path, round: int | None = None) -> Opened:
    """The run in `run_dir` after `round` (default: the last recorded); ExportError or
    RunDirError (one line) for anything missing or malformed."""
    run = RunDir(run_dir)
    manifest = run.read_manifest()
    try:
        cfg = config_from_dict(manifest["config"])
    except (KeyError, ConfigError, AttributeError, TypeError) as e:
        raise ExportError(f"{run.root}: the manifest's config does not load: {str(e)[:120]}") from None
    records = run.rounds()
    if not records:
        raise ExportError(f"{run.root} has no complete round to export")
    rounds = {rec.get("round"): rec for rec in records}
    if not all(isinstance(k, int) and not isinstance(k, bool) for k in rounds):
        raise ExportError(f"{run.root}/rounds.jsonl has a record without an integer 'round'")
    r = max(rounds) if round is None else round
    if r not in rounds:
        raise ExportError(f"round {r} is not in {run.root}/rounds.jsonl (it has rounds {min(rounds)}..{max(rounds)})")
    store = LocalStore(run.store_dir, create=False)
    rec = rounds[r]
    parts = rec.get("stages") or [{"checkpoint": rec.get("checkpoint"), "params_hash": rec.get("params_hash")}]
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("checkpoint"), str)
                                              and isinstance(p.get("params_hash"), str) for p in parts):
        raise ExportError(f"round {r}: its record does not name a checkpoint and params hash for every stage")
    keep = cfg.run.keep_checkpoints
    if pruned(keep, len(records), r) and not all(store.has(p["checkpoint"]) for p in parts):
        if users_task(manifest) is not None:
            raise ExportError(f"round {r}'s checkpoint was pruned: run.keep_checkpoints = {keep} keeps rounds "
                              f"{len(records) - keep}..{len(records) - 1} (a user's Task's run keeps no G_0 to "
                              "rebuild the others from)")
        if cfg.topology.stages > 1:
            raise ExportError(f"round {r}'s checkpoint was pruned: run.keep_checkpoints = {keep} keeps rounds "
                              f"{len(records) - keep}..{len(records) - 1} (a pipelined run's pruned rounds are not rebuilt)")
        if sorted(x for x in rounds if x <= r) != list(range(r + 1)):
            raise ExportError(f"{run.root}/rounds.jsonl does not hold rounds 0..{r}, which rebuild round {r}")
        return Opened(manifest, store, cfg, rebuild(store, manifest, cfg, [rounds[x] for x in range(r + 1)]), r)
    params = RoundParams(store, parts, r)
    params.check()
    return Opened(manifest, store, cfg, params, r)


def run_params(run_dir: str | Path, round: int | None = None) -> tuple[Config, RoundParams, int]:
    """The run's config, its global params after `round` (default: the last recorded), and that
    round. Every checkpoint is checked against its record's params hash."""
    opened = open_round(run_dir, round)
    return opened.cfg, opened.params, opened.round


def export_run(run_dir: str | Path, out: str | Path, round: int | None = None) -> tuple[Path, int]:
    """Write the run's params after `round` to `out` (see the module docstring); returns (out, round)."""
    out = Path(out)
    if out.exists() or out.is_symlink():  # a dangling link exists() denies; the rename onto it would fail
        raise ExportError(f"{out} already exists; export writes a new directory")
    opened = open_round(run_dir, round)
    cfg, params, r = opened.cfg, opened.params, opened.round
    made = make_dirs(out.parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # renamed to out once whole
    except OSError as e:
        remove_dirs(made)
        raise ExportError(f"cannot write the export beside {out}: {e.strerror or e}") from None
    try:
        users = users_task(opened.manifest) is not None  # the model is the user's module: no config of ours describes it
        if cfg.model.arch != "gpt" and not users:
            from .hf import save_hf

            try:
                save_hf(params, cfg.model, tmp)
            except ValueError as e:
                raise ExportError(str(e)) from None
        else:
            layout = params.layout()
            tie = cfg.model.tie and not users
            if tie:  # GPT(...).load_state_dict wants the tied head's name too (safetensors keeps no aliases)
                layout["lm_head.weight"] = layout["tok_emb.weight"]
            with (tmp / "model.safetensors").open("wb") as f:  # a tensor at a time
                write_tensors(f, layout, lambda k: params["tok_emb.weight" if k == "lm_head.weight" and tie else k],
                              metadata={"format": "pt"})
            if not users:
                (tmp / "model.json").write_text(json.dumps(cfg.to_dict()["model"], indent=2, sort_keys=True) + "\n",
                                                encoding="utf-8")
        tokenizer = opened.tokenizer_json()
        if tokenizer is not None:  # [data] tokenizer: what turned the text into the tokens trained on
            (tmp / "tokenizer.json").write_bytes(tokenizer)
        mask = os.umask(0)
        os.umask(mask)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp's and safetensors' private modes -> the umask's
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_dirs(made)
        raise
    return out, r


__all__ = ["ExportError", "Opened", "RebuiltParams", "RoundParams", "export_run", "open_round", "rebuild", "run_params"]
