"""`veriloco audit`: re-verify a finished run offline, from its directory or a ledger and a store.

    veriloco audit RUN                                    # a run directory
    veriloco audit --ledger RUN/ledger.sqlite --store s3://bucket/store
    veriloco audit --ledger evm:0xCONTRACT@http://host:8545 --run-id ID --store memory://b/store

Where the run is read from (`Sources`):
  - a run directory holds everything: manifest.json, rounds.jsonl, checkpoint.sig.json, store/,
    and the ledger (RUN/ledger.sqlite, or for `[ledger] backend = "evm"` the contract named in the
    config, with the entry bodies in RUN/ledger-bodies);
  - a ledger and a store: the ledger gives the run id (entry 0; an EVM contract holds many runs,
    so there it is `--run-id`). A finished run publishes itself into its store (run.py
    `publish_run`): the blob named by the run id is the manifest core, the ref
    `runs/<run id>.sig.json` is the signed checkpoint manifest, and the blobs it lists are the
    full manifest and rounds.jsonl; the EVM ledger's entry bodies are blobs of the store too.
    Nothing is trusted for being there: every item is checked below.

What is checked, in this order (the first failure is reported with its round):
  1. the manifest: its hash is the run id; the config parses; the model built from the config's
     seed has the manifest's init hash
  2. the corpus: every chunk in the store is present and hashes to its name; the Merkle root
     of the chunks is the manifest's corpus root
  3. the ledger: every entry parses, the hash chain holds, the stored Merkle roots are right
     (RFC 9162; on an EVM chain also the on-chain hashes, roots and events); rounds.jsonl agrees
     with the ledger entry by entry (entry hash, checkpoint, aggregate and params hashes, eval
     loss, codecs, verdicts, each stage's hashes), so the report shows no lie
  4. every round, redone from the stored bytes alone, for each pipeline stage's slice of the
     model (the whole model when `[topology] stages = 1`): each worker's bundle (signed
     commitment + packet) is present and hashes to its name; the checks every worker ran
     (signature under the admitted key, base params, packet hash, assigned batches,
     equivocation, screen) give the verdicts the entry records; the accepted deltas aggregate to
     the recorded aggregate hash; the outer step from the previous params gives the params and
     the checkpoint digest the entry claims, and that checkpoint blob is in the store. With
     stages, the stage checkpoints then make the stage-checkpoint manifest the entry's subject
     names (and it is in the store), and the stages' hashes combine to the entry's. With
     `--replay N`, up to N of the rounds' sampled replays are re-run (a pipelined worker's in
     this one process, emulated bit for bit: pipeline.EmulatedPipeline) and must give the
     recorded verdicts.
  5. the signed checkpoint manifest of a complete run: the recorder's signature, and every file
     it lists (final checkpoint, manifest, rounds.jsonl) hashes to its digest.
Exit code 0 when all of it holds, 1 with a line naming the first round and thing that does not,
2 when the input is not a run (no run directory, no such ledger or store, the run not in them,
an EVM RPC that cannot be reached).
"""

from __future__ import annotations

import json
import math
import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from .config import Config, config_from_dict
from .data import DataError
from .hashing import (
    alongside,
    canonical_json,
    in_threads,
    json_hash,
    scheme_problem,
    sha256_hex,
    tensors_hash,
)
from .hf import transformers_version
from .ledger import Ledger, LedgerError, SqliteLedger
from .ledger.entry import parse_entry, verdict_reason
from .link import Link
from .model import build_meta, build_model, load_params, model_from
from .outer import OuterOptimizer
from .packet import PacketError, decode_bundle
from .pipeline import EmulatedPipeline
from .records import RunDir, RunDirError, pruned, users_task
from .round import (
    StepSchedule,
    aggregate_deltas,
    base_lag,
    batch_root,
    codec_summary,
    copies_replayable,
    evaluates,
    hide_steps,
    lookahead_momentum,
    loss_gain_action,
    loss_gain_checkers,
    make_loss_gain,
    replay_codecs,
    round_cfg,
    run_codecs,
    screens_earlier,
    start_point,
    trace_entries,
)
from .signing import FILE as SIGNED_FILE
from .signing import check_signed, read_listed, signed_files
from .store import LocalStore, StoreError, check_digest, open_store, run_ref
from .task import (
    CorpusTask,
    StoredCorpus,
    StoredParams,
    Task,
    model_init_hash,
    on_device,
    take_device,
)
from .tensorfile import layout_of, tensors_digest
from .topology import build_stage_model, stage_model
from .verify import (
    ABSENT,
    ACCEPT,
    EQUIVOCATION,
    FALSE_REPORT,
    LATE,
    OFFENCES,
    OTHER_STAGE,
    REPLAY_MISMATCH,
)
from .verify.check import (
    RoundCheck,
    binds,
    check_bundles,
    pooled_copies,
    round_seed,
    screen_checked,
    take_whole_workers,
)
from .verify.commitment import REVEAL_BYTES, EquivocationDetector, verify_equivocation_evidence
from .verify.lossgain import (
    LOSS_TOLERANCE,
    Settled,
    assign_checkers,
    gain_steps,
    misreports,
    reports_from_json,
    settle,
    stage_seed,
)
from .verify.replay import (
    Audit,
    PlanInputs,
    Replayer,
    exchange_hops,
    from_state,
    hashes_match,
    judge_reported,
    newcomer_audits,
    plain_replayer,
    replay_failed,
    replay_run,
    replayed_by_all,
    reveals_salts,
    slice_result,
    state_from_bytes,
    state_layout,
    state_nbytes,
    state_ref,
    unbound_audit,
    unsigned_reveal_action,
    worker_score,
)
from .verify.screen import LossGain

if TYPE_CHECKING:
    from .ledger.evm import EvmLedger

MAX_RECORDS_BYTES = 256 << 20  # a published rounds.jsonl (about 2-20 KB a round)
MAX_MANIFEST_BYTES = 16 << 20


class AuditFailure(Exception):
    """Something in the run does not hold; the message names the round and the thing."""


class AuditInputError(ValueError):
    """What was given is not a run to audit (no such ledger, store or run in them): exit 2."""


@dataclass
class AuditReport:
    """The outcome: ok, what was checked, the first failure."""

    ok: bool
    rounds: int = 0
    checked: dict[str, int] = field(default_factory=dict)
    first_failure: str | None = None
    ledger_root: str | None = None
    seconds: float = 0.0
    source: str = ""
    in_progress: int | None = None  # the pid of the launcher still training the run: its rounds so far were audited
    signed: bool = False  # the recorder's signed checkpoint manifest was checked (a complete run's records)
    planned_rounds: int | None = None  # the config's train.rounds
    trained_torch: str | None = None  # the torch version the run's manifest names (None before it named one)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "rounds": self.rounds, "checked": self.checked,
                "first_failure": self.first_failure, "ledger_root": self.ledger_root,
                "seconds": round(self.seconds, 3), "source": self.source, "in_progress": self.in_progress,
                "signed": self.signed, "planned_rounds": self.planned_rounds}


def _fail(msg: str) -> None:
    raise AuditFailure(msg)


# ---- where the run is read from -----------------------------------------------------------------

@dataclass
class Loaded:
    """What the audit reads before checking: the manifest, the round records, the signed
    checkpoint manifest (None when absent) and whether the run says it completed."""

    manifest: dict
    records: list[dict]
    signed: bytes | None
    complete: bool
    live: int | None = None  # the pid of a launcher training the run as it is read (RunDir.holder)
    summary: dict | None = None  # RUN/summary.json, where there is one (a finished run's; the report shows it)


class Sources(ABC):
    """A run as the audit reads it. The constructor checks only that the input names a run (else
    AuditInputError / RunDirError: exit 2); `load` and `open_ledger` run inside the audit, so
    what they find wrong is a failure of the run (exit 1), except a chain that cannot be reached
    (AuditInputError)."""

    description: str
    store: Any  # LocalStore or FsspecStore: get(digest, max_bytes) checks every blob's hash

    @abstractmethod
    def load(self) -> Loaded:
        """Manifest, records, signed checkpoint manifest, completeness."""

    @abstractmethod
    def open_ledger(self, manifest: dict) -> Ledger:
        """The run's ledger, as its manifest names it."""

    @abstractmethod
    def read(self, name: str, digest: str) -> bytes | None:
        """A file the signed checkpoint manifest lists, or None."""


class DirSources(Sources):
    """A run directory."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run = RunDir(run_dir)
        self.manifest = self.run.read_manifest()  # RunDirError: not a run directory
        self.description = str(self.run.root)
        self.store = LocalStore(self.run.store_dir, create=False)  # (an audit made an empty store/ in a run without one)

    def load(self) -> Loaded:
        live = self.run.holder()  # before the records: a run that ends meanwhile is audited as in progress
        summary = self.run.summary_path
        try:
            told = json.loads(summary.read_text()) if summary.is_file() else None
            complete = told is not None and bool(told.get("complete"))
        except (ValueError, AttributeError):
            _fail("records: summary.json is not a JSON object")
        signed = self.run.root / SIGNED_FILE
        return Loaded(self.manifest, self.run.rounds(), signed.read_bytes() if signed.is_file() else None,
                      complete and live is None, live, told)

    def open_ledger(self, manifest: dict) -> Ledger:
        ledger_cfg = manifest["config"].get("ledger", {})
        backend = ledger_cfg.get("backend", "sqlite")
        if backend == "evm":
            return open_evm_ledger(ledger_cfg.get("contract", ""), ledger_cfg.get("rpc_url", ""),
                                   manifest.get("run_id", ""), self.run.root / "ledger-bodies")
        if backend != "sqlite":
            _fail(f"ledger: the run kept no ledger (ledger.backend = {backend!r})")
        if not (self.run.root / "ledger.sqlite").exists():
            _fail("ledger: RUN/ledger.sqlite is missing")
        return SqliteLedger(self.run.root / "ledger.sqlite")

    def read(self, name: str, digest: str) -> bytes | None:
        return read_listed(self.run.root, name)


class StoreSources(Sources):
    """A ledger (an SQLite file, or `evm:CONTRACT@RPC_URL` with `run_id`) and a store URL."""

    def __init__(self, ledger: str, store_url: str, run_id: str | None = None) -> None:
        try:
            self.store = open_store(store_url, create=False)
        except StoreError as e:
            raise AuditInputError(str(e)) from None
        if run_id is not None:
            try:
                check_digest(run_id)
            except StoreError:
                raise AuditInputError(f"--run-id must be 64 lowercase hex digits, got {run_id!r:.80}") from None
        self.spec = ledger
        if ledger.startswith("evm:"):
            contract, at, url = ledger[len("evm:"):].partition("@")
            if not (contract and at and url):
                raise AuditInputError(f"an EVM ledger is given as evm:CONTRACT@RPC_URL, got {ledger!r:.120}")
            if run_id is None:
                raise AuditInputError("--run-id is needed with an EVM ledger: one contract records many runs")
            self.evm: tuple[str, str] | None = (contract, url)
            self.run_id = run_id
            with self._open_evm() as opened:  # reachable, the right contract, the run on it
                if opened.contract.count(opened.run_id) == 0:  # (bodies are read in the audit)
                    raise AuditInputError(f"contract {contract} holds no entries of run {run_id}")
        else:
            self.evm = None
            path = Path(ledger)
            if not path.is_file():
                raise AuditInputError(f"ledger {ledger} is not a file" if path.exists() else f"ledger {ledger} does not exist")
            with open(path, "rb") as f:
                if f.read(16) != b"SQLite format 3\x00":
                    raise AuditInputError(f"ledger {ledger} is not an SQLite ledger (give evm:CONTRACT@RPC_URL for a chain)")
            found = _ledger_run_id(path)
            if found is None:
                raise AuditInputError(f"ledger {ledger} holds no readable entry naming its run" +
                                      ("" if run_id else "; give --run-id"))
            if run_id is not None and found != run_id:
                raise AuditInputError(f"ledger {ledger} records run {found}, not --run-id {run_id}")
            self.run_id = run_id or found
        if not self.store.has(self.run_id):
            raise AuditInputError(f"store {store_url} holds no run {self.run_id} (no blob named by the run id)")
        self.description = f"ledger {ledger}, store {store_url}"

    def _open_evm(self) -> EvmLedger:
        assert self.evm is not None
        return open_evm_ledger(*self.evm, self.run_id, self.store)

    def load(self) -> Loaded:
        try:
            core = self.store.get(self.run_id, max_bytes=MAX_MANIFEST_BYTES)  # its name is its hash
        except StoreError as e:
            _fail(f"manifest: {e}")
        try:
            signed = self.store.get_ref(run_ref(self.run_id))
        except StoreError as e:
            _fail(f"signed checkpoint manifest: {e} (a run publishes it into its store when it completes)")
        try:
            files = signed_files(signed)
        except ValueError as e:
            _fail(f"signed checkpoint manifest: {e}")
        for name in ("manifest.json", "rounds.jsonl"):
            if name not in files:
                _fail(f"signed checkpoint manifest: it lists no {name}")
        try:
            manifest = json.loads(self.store.get(files["manifest.json"], max_bytes=MAX_MANIFEST_BYTES))
        except StoreError as e:
            _fail(f"manifest: {e}")
        except ValueError:
            _fail("manifest: the manifest.json blob is not JSON")
        if not isinstance(manifest, dict) or not isinstance(manifest.get("config"), dict):
            _fail("manifest: the manifest.json blob has no config")
        if (problem := scheme_problem(manifest)) is not None:
            _fail(f"manifest: {problem}")
        try:
            same = canonical_json({k: v for k, v in manifest.items() if k not in ("run_id", "corpus_manifest")}) == core
        except ValueError:  # NaN or the like: not something a run wrote
            same = False
        if not same:
            _fail(f"manifest: the manifest.json blob is not the manifest of run {self.run_id[:16]}")
        try:
            records = _parse_records(self.store.get(files["rounds.jsonl"], max_bytes=MAX_RECORDS_BYTES))
        except StoreError as e:
            _fail(f"records: {e}")
        return Loaded(manifest, records, signed, complete=True)

    def open_ledger(self, manifest: dict) -> Ledger:
        return self._open_evm() if self.evm is not None else SqliteLedger(self.spec)

    def read(self, name: str, digest: str) -> bytes | None:
        try:
            return self.store.get(digest)
        except StoreError:
            return None


def open_evm_ledger(contract: str, rpc_url: str, run_id: str, mirror: Any) -> EvmLedger:
    """The EVM ledger of `run_id`, read-only (no key), bodies from `mirror` (a store or a dir).
    AuditInputError when the chain cannot be reached or holds no LineageLedger there: nothing
    about the run is known yet (what the ledger holds is checked by the audit)."""
    from .ledger.evm import EvmLedger

    try:
        return EvmLedger.connect(rpc_url, contract, run_id, None, mirror, register=False, verify_on_open=False)
    except LedgerError as e:
        raise AuditInputError(str(e).splitlines()[0]) from None


def _ledger_run_id(path: Path) -> str | None:
    """The run id of the first entry of the SQLite ledger at `path` that names one."""
    with SqliteLedger(path) as ledger:
        for i in range(ledger.size()):
            try:
                run_id = json.loads(ledger.entry_bytes(i))["predicate"]["run_id"]
                return check_digest(run_id)
            except (ValueError, KeyError, TypeError, LedgerError, StoreError):
                continue
    return None


def _parse_records(data: bytes) -> list[dict]:
    """rounds.jsonl as published: every line a complete JSON object."""
    out = []
    for i, line in enumerate(data.splitlines()):
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            _fail(f"records: rounds.jsonl line {i + 1} is not valid JSON")
        if not isinstance(obj, dict):
            _fail(f"records: rounds.jsonl line {i + 1} is not a JSON object")
        out.append(obj)
    return out


# ---- the audit ------------------------------------------------------------------------------------

def audit_run(run_dir: str | Path, replay: int = 0, device: str = "cpu") -> AuditReport:
    """Audit the run in `run_dir`; RunDirError if it is not a run directory at all.

    `replay`: also re-run up to this many of the sampled replay audits (the rest of the sample
    is checked for consistency: only sampled workers may carry a replay_mismatch verdict).
    `device`: where replays and loss gains are recomputed ('cpu' or 'cuda', `_AuditTask`)."""
    return audit_sources(DirSources(run_dir), replay, device)


def audit_published(ledger: str, store_url: str, run_id: str | None = None, replay: int = 0,
                    device: str = "cpu") -> AuditReport:
    """Audit a run from a ledger (SQLite file or `evm:CONTRACT@RPC_URL`) and its store's URL;
    AuditInputError (one line) when they do not name a run."""
    return audit_sources(StoreSources(ledger, store_url, run_id), replay, device)


def audit_task(task: Task, run_dir: str | Path, replay: int = 0, device: str = "cpu") -> AuditReport:
    """Audit a run that `train_task(task, cfg, run_dir)` made, with the same `task` (its model
    factory, loss, batches and eval batches: user code, which `veriloco audit` cannot rebuild).
    Everything `audit_run` checks of a built-in task's run is checked, except the corpus: the
    ledger and records, each worker's signed commitment, its base (round 0: `task.make_model()`'s
    params), its batch root (from `task.batch`), the screen and the aggregate redone, every
    checkpoint recomputed, the drawn replays (up to `replay` re-run). Another task than the run's
    fails at round 0's base or batch roots. One stage only (a user's Task is not split)."""
    return audit_sources(DirSources(run_dir), replay, device, task)


def audit_sources(src: Sources, replay: int = 0, device: str = "cpu", user_task: Task | None = None) -> AuditReport:
    """Audit the run `src` reads; the report says what held and the first thing that did not.
    `user_task`: the Task of a `train_task` run (audit_task)."""
    t0 = time.perf_counter()
    report = AuditReport(ok=False, source=src.description)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        _audit(src, report, replay, device, user_task)
        report.ok = True
    except AuditFailure as e:
        report.first_failure = str(e)
    except (StoreError, LedgerError, RunDirError) as e:  # RunDirError here: a corrupt record
        report.first_failure = str(e).splitlines()[0]
    except AuditInputError:  # (a ValueError) a chain that cannot be reached: what was given, exit 2
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:  # a field of a record or manifest
        # of another type or missing, which no check above named: the run's files are not what a run writes
        report.first_failure = f"the run's files are malformed ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
    finally:  # the run's thread count and, on a GPU, deterministic kernels: for the audit only
        torch.set_num_threads(threads)
        if torch.are_deterministic_algorithms_enabled() != deterministic:  # the call imports torch's compiler (~1.5 s)
            torch.use_deterministic_algorithms(deterministic)
    trained = report.trained_torch
    if report.first_failure is not None and trained is not None and trained != torch.__version__:
        report.first_failure += (f" (the run trained under torch {trained}, this audit runs torch {torch.__version__}: "
                                 "exact replays and recomputed losses may need the same version)")
    report.seconds = time.perf_counter() - t0
    return report


@dataclass
class _Slice:
    """What the audit carries from round to round for one pipeline stage's slice of the model
    (the whole model when there is one stage), as that stage's processes did."""

    outer: OuterOptimizer
    init: dict  # its params before round 0
    detector: EquivocationDetector
    params_after: list = field(default_factory=list)  # params hash after each round
    previous: tuple = ({}, {})  # last round's decoded packet hashes and accepted deltas (screen)
    earlier: dict = field(default_factory=dict)  # the round before's accepted deltas (round.screens_earlier)
    # round -> the params after it (replay and loss-gain start points) and its outer momentum (lookahead), for the
    # newest two rounds: a round starts from the one before it, or with delay 1 the one before that
    bases: dict = field(default_factory=dict)
    momenta: dict = field(default_factory=dict)
    history: dict = field(default_factory=dict)  # worker -> [its newest decoded delta] (eager replay starts)
    banned: set = field(default_factory=set)  # workers convicted so far (verify.OFFENCES)
    disputes: set = field(default_factory=set)  # (auditor, worker) pairs whose states now go public

    def start_of(self, back: int) -> dict:  # G after round `back` (G_0 before round 0)
        return self.bases[back] if back >= 0 else self.init

    def momentum_of(self, back: int) -> dict | None:  # the outer momentum then
        return self.momenta[back] if back >= 0 else None


class _AuditTask:
    """The run's task, and where the audit computes it (`veriloco audit --device`): its replays and
    loss gains run on `device` at the run's precision. A run trained on GPUs reproduces its exact
    replays and its loss-gain reports only on the same kind of GPU; on the CPU they need not."""

    def __init__(self, task: CorpusTask | Task, device: str, precision: str) -> None:
        self.task, self.device = task, torch.device(device)
        self.computed = on_device(self.as_task(), self.device, precision)
        self._model: torch.nn.Module | None = None
        self._eval: list | None = None
        self._emu: EmulatedPipeline | None = None

    def as_task(self) -> Task:
        return self.task if isinstance(self.task, Task) else self.task.as_task()

    def eval_batches(self) -> list:
        """The task's eval batches, made once."""
        if self._eval is None:
            self._eval = self.computed.eval_batches()
        return self._eval

    def eval_pipeline(self, cfg, stages: int) -> EmulatedPipeline:
        """The emulated pipeline the eval losses of a pipelined run are computed through, built once
        (its params are copied in for each round)."""
        if self._emu is None:
            self._emu = EmulatedPipeline([stage_model(cfg, s, stages) for s in range(stages)], cfg.train, 1,
                                         microbatches=cfg.topology.microbatches)
        return self._emu

    def gain_model(self, G0: torch.nn.Module) -> torch.nn.Module:
        """A model for the loss gains, on the device (G0 itself on the CPU: they load their params)."""
        if self.device.type == "cpu":
            return G0
        if self._model is None:
            self._model = self.computed.make_model()
        return self._model


def _audit(src: Sources, report: AuditReport, replays_left: int = 0, device: str = "cpu",
           user_task: Task | None = None) -> None:
    counts = report.checked
    loaded = src.load()
    manifest = loaded.manifest
    if isinstance(manifest.get("torch_version"), str):
        report.trained_torch = manifest["torch_version"][:40]

    # 1. manifest
    if not isinstance(manifest.get("config"), dict):
        _fail("manifest: its config is not an object")
    core = {k: v for k, v in manifest.items() if k not in ("run_id", "corpus_manifest")}
    if json_hash(core) != manifest.get("run_id"):
        _fail("manifest: its hash is not the run id (the manifest was changed)")
    trained_task = users_task(manifest)  # train_task's: its model and batches are user code
    if trained_task is not None and user_task is None:
        _fail(f"manifest: the run trained a user's Task ({trained_task}), whose model and batches are "
              "that user's code: audit it with veriloco.audit_task(task, RUN) and that Task")
    if user_task is not None and trained_task is None:
        _fail("manifest: the run trained a built-in task (its corpus is in the store): audit it without a Task")
    try:
        cfg = config_from_dict(manifest["config"])
    except ValueError as e:
        _fail(f"manifest: config does not parse: {e}")
    torch.set_num_threads(cfg.train.threads or 1)  # the workers' count: replays are bit-exact only with their sums' order
    stages = cfg.topology.stages
    if user_task is not None:
        if stages != 1:
            _fail(f"manifest: the run has {stages} stages; audit_task audits a user's Task on one")
        task = _AuditTask(user_task, device, cfg.train.precision)
        take_device(task.device, cfg.verify.replay_match == "exact")
        _audit_rounds(src, report, loaded, cfg, task, task.as_task().make_model(), replays_left)
        return
    trained_with = manifest.get("transformers_version")
    if cfg.model.arch != "gpt" and trained_with != transformers_version():
        _fail(f"manifest: the run's {cfg.model.arch} model ran on transformers {trained_with}, this machine has "
              f"{transformers_version()}: install that version to audit it (its forward is transformers' code)")
    store = src.store
    initial, key = None, "initial_params" if "initial_params" in manifest else "init"
    if key in manifest:  # G_0 as the store keeps it (the [model] init weights, or the seed's)
        try:  # a local store's read a tensor at a time when asked for (hashed as a stream first), never held whole
            initial = StoredParams(store, manifest[key]) if isinstance(store, LocalStore) else st_load(store.get(manifest[key]))
        except (StoreError, SafetensorError, ValueError, TypeError) as e:
            _fail(f"manifest: the starting weights it names ({key}) do not load from the store: {str(e).splitlines()[0]}")
        if {k: shape for k, (_, shape) in layout_of(initial).items()} != \
                {k: tuple(p.shape) for k, p in build_meta(cfg.model).named_parameters()}:
            _fail(f"manifest: the starting weights it names ({key}) are not this config's model")
    from_disk = "init" in manifest  # [model] init: G_0 is weights from disk, not the seed's
    G0 = build_model(cfg.model, cfg.run.seed) if initial is None or not from_disk else model_from(cfg.model, initial)
    if model_init_hash(G0) != manifest.get("model_init_hash"):
        _fail("manifest: the model built from the config's seed"
              + (" and starting weights" if from_disk else "") + " does not have the manifest's init hash")
    if initial is not None and not from_disk and tensors_hash(initial) != manifest["model_init_hash"]:
        _fail("manifest: the starting weights it names (initial_params) are not the model built from the config's seed")

    # 2. corpus
    try:  # every chunk read once and checked, a cache's worth held at a time (StoredCorpus)
        corpus = StoredCorpus(store, manifest["corpus_manifest"], cfg)
        corpus.check_all(cfg.model.vocab_size)
    except (StoreError, KeyError, DataError) as e:
        _fail(f"corpus: {e}")
    if corpus.root != manifest.get("corpus_root"):
        _fail(f"corpus: Merkle root {corpus.root} is not the manifest's {str(manifest.get('corpus_root'))[:64]}")
    counts["corpus_chunks"] = len(corpus.chunk_hashes)
    if "tokenizer" in manifest:  # [data] tokenizer: the file is kept, not rerun (the text is not stored)
        try:
            store.get(manifest["tokenizer"])
        except (StoreError, ValueError, TypeError) as e:
            _fail(f"corpus: the tokenizer the manifest names is not in the store: {str(e).splitlines()[0]}")
    corpus_task = CorpusTask(cfg, "", manifest["corpus_manifest"], manifest.get(key))
    corpus_task._corpus, corpus_task._initial = corpus, initial
    task = _AuditTask(corpus_task, device if stages == 1 else "cpu", cfg.train.precision)  # stages: the emulated pipeline, on the CPU
    take_device(task.device, cfg.verify.replay_match == "exact")
    _audit_rounds(src, report, loaded, cfg, task, G0, replays_left)


def _audit_rounds(src: Sources, report: AuditReport, loaded: Loaded, cfg: Config, task: _AuditTask,
                  G0: torch.nn.Module, replays_left: int) -> None:
    """Steps 3-5 of the audit: the ledger and records, every round redone, the signed manifest."""
    counts, manifest, records, store = report.checked, loaded.manifest, loaded.records, src.store
    stages = cfg.topology.stages

    # 3. ledger and records
    ledger = src.open_ledger(manifest)
    try:
        problems = ledger.verify()
        if problems:  # "entry <i>: <why>"; entry i is round i
            m = re.match(r"entry (\d+): (.*)", problems[0], re.S)
            _fail(f"round {m[1]}: ledger entry: {m[2]}" if m else f"ledger: {problems[0]}")
        size = ledger.size()
        if loaded.live is not None and size > len(records):
            # a run in progress: a round's ledger entry is appended before its record, and the
            # ledger is read after the records; the rounds recorded by then are audited
            size = len(records)
        raw = [ledger.entry_bytes(i) for i in range(size)]
        entries, entry_hashes = [parse_entry(b) for b in raw], [sha256_hex(b) for b in raw]
        report.ledger_root = ledger.root(size)
    finally:
        ledger.close()
    report.in_progress = loaded.live
    if not records and not entries:
        _fail("records: the run has no completed round to audit")
    if len(records) != len(entries):
        r = min(len(records), len(entries))
        _fail(f"round {r}: in {'rounds.jsonl' if len(records) > r else 'the ledger'} but not in "
              f"{'the ledger' if len(records) > r else 'rounds.jsonl'} (rounds.jsonl has "
              f"{len(records)} rounds, the ledger {len(entries)} entries)")
    for r, (rec, entry) in enumerate(zip(records, entries, strict=True)):
        _check_record(r, rec, entry, entry_hashes[r], manifest["run_id"], stages, cfg.topology.workers)
    counts["ledger_entries"] = len(entries)

    # 4. every round, redone, stage by stage
    admitted = {int(k): v for k, v in manifest["worker_keys"].items()}
    slices, stage_models = [], []
    for s in range(stages):
        model = G0 if stages == 1 else build_stage_model(cfg.model, cfg.run.seed, s, stages, dict(G0.named_parameters()))
        stage_models.append(model)
        params = dict(model.named_parameters())
        slices.append(_Slice(OuterOptimizer(params, cfg.outer), {k: v.detach().clone() for k, v in params.items()},
                             EquivocationDetector(admitted)))
    counts.update(signatures=0, bundles=0, checkpoints=0, checkpoints_stored=0, checkpoints_pruned=0, replays=0)
    schedule = _step_schedule(cfg, records)
    stored_states = _stored_states(store, manifest["run_id"], stage_models)  # replay_extent "state": what auditors replayed from
    base_cfg = cfg
    for r, (rec, entry) in enumerate(zip(records, entries, strict=True)):
        cfg = round_cfg(base_cfg, schedule.at(r))  # this round's H (adaptive H: [train] inner_steps_max)
        p = entry["predicate"]
        claimed = entry["subject"][0]["digest"]["sha256"]
        if stages == 1:
            parts, wheres = [rec], [f"round {r}: "]
            recorded = [p["commitments"]]
            claims = [(p["aggregate_hash"], claimed, p.get("params_hash"))]
        else:
            parts, wheres = rec["stages"], [f"round {r}: stage {s}: " for s in range(stages)]
            recorded = [[c for c in p["commitments"] if c.get("stage") == s] for s in range(stages)]
            claims = [(x["aggregate_hash"], x["checkpoint"], x["params_hash"]) for x in p["stages"]]
        checks = [_check_slice(cfg, task, store, G0, sl, r, part, mine, where, admitted, manifest["run_id"], counts)
                  for sl, part, mine, where in zip(slices, parts, recorded, wheres, strict=True)]
        gains = _stage_settled(cfg, task, slices, checks, parts, r) if stages > 1 and cfg.verify.loss_gain_batches else None
        checks = [_screen_slice(cfg, task, G0, sl, r, part, where, c, gains)
                  for sl, part, where, c in zip(slices, parts, wheres, checks, strict=True)]
        if stages > 1:  # a worker's update is taken whole or not at all, as its stages agreed
            accepted = [sorted(c.check.accepted) for c in checks]
            for c in checks:
                take_whole_workers(c.check, accepted)
        if cfg.verify.replay_probability > 0:
            replays_left = _replays(cfg, task, r, checks, slices, recorded, parts, replays_left, counts, wheres,
                                    (schedule.before(r), schedule.total(r)), stored_states)
        # the stored checkpoints are read and hashed on a thread while the outer step and the
        # recomputed checkpoint's digest run here (a failure of the recomputation is the one told)
        results, stored_errors = alongside(partial(_finish_slices, cfg, slices, checks, r, parts, recorded, claims,
                                                   wheres, counts), partial(_stored, store, claims))
        _check_eval(cfg, task, G0, slices, r, p["eval_loss"], counts)
        for where, (_, digest, _), e in zip(wheres, claims, stored_errors, strict=True):
            if e is None:  # unless [run] keep_checkpoints has pruned it: its digest was recomputed all the same
                counts["checkpoints_stored"] += 1
            else:
                # a run in progress prunes on: a checkpoint [run] keep_checkpoints lets go may be gone by now
                ahead = loaded.live is not None and cfg.run.keep_checkpoints
                if not ((ahead or pruned(cfg.run.keep_checkpoints, len(records), r)) and not store.has(digest)):
                    _fail(f"{where}checkpoint: {e}")
                counts["checkpoints_pruned"] += 1
            counts["checkpoints"] += 1
        if stages == 1:
            continue
        # the stage checkpoints make the manifest the entry names, the stages' hashes its hashes
        stage_manifest = canonical_json({"stages": [{"checkpoint": x.checkpoint, "params_hash": x.params_hash}
                                                    for x in results]})
        if sha256_hex(stage_manifest) != claimed:
            _fail(f"round {r}: the stage checkpoints make manifest {sha256_hex(stage_manifest)[:16]}, "
                  f"the entry claims {claimed[:16]}")
        try:
            store.get(claimed)
        except StoreError as e:
            _fail(f"round {r}: stage-checkpoint manifest: {e}")
        if json_hash([x.params_hash for x in results]) != p.get("params_hash"):
            _fail(f"round {r}: the stages' params hashes do not combine to the entry's params hash")
        aggregates = [x.aggregate_hash for x in results]
        combined = json_hash(aggregates) if any(a is not None for a in aggregates) else None
        if combined != p["aggregate_hash"]:
            _fail(f"round {r}: the stages' aggregates do not combine to the entry's aggregate hash")
    report.rounds = len(records)

    # the eval loss of G_0, which the records and the report show as the start (after the rounds: a wrong G_0 is
    # named by round 0's stale bases first)
    start = _eval_loss(base_cfg, task, G0, {k: v for sl in slices for k, v in sl.init.items()}, stages)
    if not _same_loss(start, records[0].get("eval_loss_start")):
        _fail(f"round 0: the starting params' eval loss is {start:.6f}, the record claims "
              f"{str(records[0].get('eval_loss_start'))[:12]}")

    # summary.json (unsigned) says what the records and the ledger say: the report shows its numbers
    if loaded.summary is not None and loaded.live is None:
        last, evals = records[-1], [x["eval_loss"] for x in records if x.get("eval_loss") is not None]
        told = {"rounds": len(records), "final_checkpoint": last["checkpoint"], "final_params_hash": last.get("params_hash"),
                "eval_loss_start": records[0].get("eval_loss_start"), "eval_loss_end": evals[-1] if evals else None,
                "ledger_root": report.ledger_root, "ledger_head": last.get("entry")}
        for key, want in told.items():
            if key in loaded.summary and want is not None and loaded.summary[key] != want:
                _fail(f"summary: summary.json's {key} {str(loaded.summary[key])[:20]} is not the records' and the "
                      f"ledger's {str(want)[:20]}")

    # 5. the signed checkpoint manifest of a complete run (recorder = worker 0). Complete by the records' count
    # (the config's rounds; the ledger holds as many), and checked wherever it is present, not by summary.json's
    # word: that file is not signed, and deleting it must not let an edited rounds.jsonl through
    report.planned_rounds = cfg.train.rounds
    if loaded.live is None and (loaded.complete or loaded.signed is not None or len(records) >= cfg.train.rounds):
        problem = check_signed(loaded.signed, admitted[0], records[-1]["checkpoint"], src.read,
                               run_id=manifest["run_id"], round=len(records) - 1)
        if problem:
            _fail(f"signed checkpoint manifest: {problem}")
        counts["signed_manifest"] = 1
        report.signed = True


def _check_eval(cfg, task: _AuditTask, G0: torch.nn.Module, slices: list[_Slice], r: int, claimed: Any,
                counts: dict) -> None:
    """Round r's eval loss (the entry's), recomputed from the round's recomputed params on the
    task's eval batches, as the workers computed it (round.eval_sums; with stages, each worker's
    share through its pipeline: the emulated one), to LOSS_TOLERANCE; a round the schedule does not
    evaluate claims none. The loss is the run's headline result: unchecked, a recorder could claim any."""
    if not evaluates(cfg, r):
        if claimed is not None:
            _fail(f"round {r}: the entry claims an eval loss for a round that [train] eval_every does not evaluate")
        return
    if claimed is None:
        _fail(f"round {r}: the entry claims no eval loss for a round that [train] eval_every evaluates")
    got = _eval_loss(cfg, task, G0, {k: v for sl in slices for k, v in sl.outer.params.items()}, len(slices))
    if not _same_loss(got, claimed):
        _fail(f"round {r}: the recomputed params' eval loss is {got:.6f}, the entry claims {claimed:.6f}")
    counts["eval_losses"] = counts.get("eval_losses", 0) + 1


def _same_loss(got: float, claimed: Any) -> bool:
    """Within LOSS_TOLERANCE, or both NaN (an empty eval set)."""
    if not isinstance(claimed, (int, float)) or isinstance(claimed, bool):
        return False
    if math.isnan(got) or math.isnan(claimed):
        return math.isnan(got) and math.isnan(claimed)
    return abs(got - claimed) <= LOSS_TOLERANCE


def _eval_loss(cfg, task: _AuditTask, G0: torch.nn.Module, params: dict, stages: int) -> float:
    """The eval loss of `params` (the whole model's) as the workers computed it (`_check_eval`)."""
    batches = task.eval_batches()
    total, tokens = 0.0, 0
    if stages == 1:
        model = task.gain_model(G0)
        load_params(model, params)
        with torch.no_grad():
            for x, y in batches:
                total += float(task.computed.loss(model, x, y)) * y.numel()
                tokens += y.numel()
    else:
        emu = task.eval_pipeline(cfg, stages)
        with torch.no_grad():
            for k, q in emu.named_parameters():
                q.copy_(params[k])
        W = cfg.topology.workers
        for j in range(W):  # each worker's share through its own pipeline (round.setup_worker's eval_set)
            share = batches[j::W]
            if share:
                n = sum(y.numel() for _, y in share)
                total, tokens = total + emu.eval_loss(share) * n, tokens + n
    return total / tokens if tokens else math.nan


def _step_schedule(cfg, records: list[dict]) -> StepSchedule:
    """Each round's H, as the run derived it (round.StepSchedule); with adaptive H, every record's
    `inner_steps` must be its round's and its `hide_steps` what its own figures give (round.hide_steps:
    the workers computed it from the same gathered numbers), so a record edited to change H fails."""
    if not cfg.train.inner_steps_max:
        return StepSchedule.of(cfg, records)
    schedule, link = StepSchedule.of(cfg, []), Link.from_strings(cfg.link.bandwidth, cfg.link.latency)
    for r, rec in enumerate(records):  # round r's H follows from the records before it
        recorded = rec.get("hide_steps")
        if recorded is not None and (isinstance(recorded, bool) or not isinstance(recorded, int) or recorded < 1):
            _fail(f"round {r}: the record's hide_steps {recorded!r:.40} is not a positive integer")
        if rec.get("inner_steps") != schedule.at(r):
            _fail(f"round {r}: the record says H = {rec.get('inner_steps')!r:.40}, the records' hide_steps give {schedule.at(r)}")
        try:
            need = hide_steps(link, rec, schedule.at(r), cfg.compress.safety, exchange_hops(cfg.verify))
        except (KeyError, TypeError, IndexError, ValueError) as e:
            _fail(f"round {r}: hide_steps cannot be recomputed from the record ({type(e).__name__}: {e})")
        if need != recorded:
            _fail(f"round {r}: the record's hide_steps {recorded!r} is not what its inner_s and "
                  f"bundle_bytes give ({need})")
        schedule.grow(need)
    return schedule


def _check_record(r: int, rec: dict, entry: dict, entry_hash: str, run_id: str, stages: int, workers: int) -> None:
    """rounds.jsonl's record of round r says what the ledger entry says."""
    p = entry["predicate"]
    if rec.get("round") != r or p["run_id"] != run_id:
        _fail(f"round {r}: record or entry is out of order or from another run")
    if rec.get("checkpoint") != entry["subject"][0]["digest"]["sha256"]:
        _fail(f"round {r}: rounds.jsonl checkpoint differs from the ledger entry's")
    if "entry" in rec and rec["entry"] != entry_hash:
        _fail(f"round {r}: rounds.jsonl names entry {str(rec['entry'])[:16]}, the ledger's hashes to {entry_hash[:16]}")
    for key in ("aggregate_hash", "params_hash", "eval_loss", "codecs"):
        if key in rec and key in p and rec[key] != p[key]:
            _fail(f"round {r}: rounds.jsonl {key} differs from the ledger entry's")
    if stages == 1:
        if "verdicts" in rec and rec["verdicts"] != [verdict_reason(c) for c in p["commitments"]]:
            _fail(f"round {r}: rounds.jsonl verdicts differ from the ledger entry's")
        return
    parts, claimed = rec.get("stages"), p.get("stages")
    if not (isinstance(parts, list) and isinstance(claimed, list) and len(parts) == len(claimed) == stages):
        _fail(f"round {r}: rounds.jsonl or the ledger entry does not hold one part per stage ({stages})")
    for s, (part, want) in enumerate(zip(parts, claimed, strict=True)):
        if not isinstance(part, dict) or not isinstance(want, dict):
            _fail(f"round {r}: stage {s}: the record or entry part is not an object")
        for key in ("checkpoint", "params_hash", "aggregate_hash"):
            if part.get(key) != want.get(key):
                _fail(f"round {r}: stage {s}: rounds.jsonl {key} differs from the ledger entry's")
        mine = [verdict_reason(c) for c in p["commitments"] if c.get("stage") == s]
        if part.get("verdicts") != mine:
            _fail(f"round {r}: stage {s}: rounds.jsonl verdicts differ from the ledger entry's")
    # a worker's verdict: accept when every stage accepted its slice, else the first stage's own
    # reason (other_stage only says that another stage rejected it)
    combined = []
    for j in range(workers):
        mine = [part["verdicts"][j] for part in parts if j < len(part["verdicts"])]
        bad = [v for v in mine if v not in (ACCEPT, OTHER_STAGE)] or [v for v in mine if v != ACCEPT]
        combined.append(bad[0] if bad else ACCEPT)
    if rec.get("verdicts") != combined:
        _fail(f"round {r}: rounds.jsonl verdicts are not its stages' verdicts combined")


class _Redone(NamedTuple):
    """What redoing one slice's round gave."""

    checkpoint: str
    params_hash: str
    aggregate_hash: str | None


def _finish_slices(cfg, slices: list, checks: list, r: int, parts: list, recorded: list, claims: list, wheres: list,
                   counts: dict) -> list:
    return [_finish_slice(cfg, sl, check, r, part, mine, claim, where, counts)
            for sl, check, part, mine, claim, where in zip(slices, checks, parts, recorded, claims, wheres, strict=True)]


def _stored(store: Any, claims: list[tuple]) -> list[StoreError | None]:
    """For each slice's claimed checkpoint: None when it is stored and its bytes hash to its name."""
    out: list[StoreError | None] = []
    for _, digest, _ in claims:
        try:
            store.verify(digest)
            out.append(None)
        except StoreError as e:
            out.append(e)
    return out


class _Checked(NamedTuple):
    """One slice's round after its bundles were checked (before replays)."""

    check: RoundCheck
    base: str  # hash of the slice's G the round started from
    present: set[int]  # the workers whose bundles the round had


def _check_slice(
    cfg, task: _AuditTask, store: Any, G0: torch.nn.Module, sl: _Slice, r: int, part: dict, recorded: list[dict],
    where: str, admitted: dict, run_id: str, counts: dict,
) -> _Checked:
    """Check round r's bundles for one slice (`part`: its record, the whole record when there is
    one stage) as that slice's processes did: signatures, commitments, data, screen, loss gains.
    `where` starts every failure message ("round r: " or "round r: stage s: ")."""
    listed = part.get("bundles")
    if not (isinstance(listed, list) and len(listed) == cfg.topology.workers
            and all(d is None or isinstance(d, str) for d in listed)):
        _fail(f"{where}the record's bundles are not a list of {cfg.topology.workers} digests (or nulls): {listed!r:.60}")
    if cfg.run.membership == "static":  # every worker sends, or the run stops: no one is left out of a round
        out = [c for c in recorded if verdict_reason(c) in (ABSENT, LATE) and c.get("bundle_sha256") is None]
        if out:
            _fail(f"{where}worker {out[0]['worker']} is recorded as {verdict_reason(out[0])} without a bundle, which "
                  "only an elastic run records (a static run stops when a worker is missing)")
    else:  # the round's quorum: its members are all but the absent, and at least min_workers
        members = sum(verdict_reason(c) != ABSENT for c in recorded)
        least = cfg.run.min_workers or cfg.topology.workers // 2 + 1
        if members < least:
            _fail(f"{where}the round's quorum has {members} members, fewer than min_workers = {least}")
    # worker -> its bundle's digest (what store.get checks it against); a worker absent or late (elastic) has none
    digests = {j: digest for j, digest in enumerate(listed)
               if not (digest is None and part.get("verdicts", [None] * (j + 1))[j] in (ABSENT, LATE))}

    def fetch(j: int) -> tuple[bytes, str | None]:  # a bundle read and hashed, and its packet hashed, on a thread
        try:
            data = store.get(digests[j], max_bytes=cfg.run.max_packet_bytes + (1 << 20))
        except StoreError as e:
            _fail(f"{where}bundle of worker {j}: {e}")
        try:
            return data, sha256_hex(decode_bundle(data, view=True)[1])
        except PacketError:  # check_bundles says what is wrong with it
            return data, None

    fetched = dict(zip(digests, in_threads(fetch, digests), strict=True))
    bundles = {j: data for j, (data, _) in fetched.items()}
    packet_hashes = {j: h for j, (_, h) in fetched.items() if h is not None}
    present = [c for c in recorded if c["verdict"] not in (ABSENT, LATE)]
    if sorted(bundles) != sorted(c["worker"] for c in present):
        _fail(f"{where}bundles are stored for workers {sorted(bundles)}, the entry has commitments of "
              f"{sorted(c['worker'] for c in present)}")
    counts["bundles"] += len(bundles)
    for ev in (part.get("evidence") or {}).values():  # an equivocation proven by a commitment of an earlier try
        if isinstance(ev, dict) and ev.get("reason") == EQUIVOCATION and verify_equivocation_evidence(ev, admitted):
            for signed in ev["commitments"]:  # (an elastic round retried: elastic._pin), checked as the round did
                sl.detector.observe(signed)
    back = r - 1 - base_lag(cfg)
    base = sl.params_after[back] if back >= 0 else tensors_hash(sl.init)
    shapes = {k: tuple(v.shape) for k, v in sl.outer.params.items()}
    check = check_bundles(
        bundles, run_id=run_id, round=r, base_hash=base, admitted_keys=admitted,
        shapes=shapes, max_packet_bytes=cfg.run.max_packet_bytes,
        batch_root_of=lambda j: batch_root(task.as_task(), j, r, cfg.train.inner_steps),
        equivocation=sl.detector, trace_entries=trace_entries(cfg), banned=sl.banned, bundle_hashes=digests,
        packet_hashes_known=packet_hashes, reveals=_recorded_reveals(cfg, part, where),
        unsigned_reveal=unsigned_reveal_action(cfg.verify),
        unsigned_earlier=_unsigned_earlier(cfg, store, part, where, r, run_id, admitted),
        newcomers=_newcomers(cfg, part, sorted(bundles), where), codecs=run_codecs(cfg),
    )
    if "reveals" in part and [check.reveals.get(j) for j in range(cfg.topology.workers)] != part["reveals"]:
        for c in recorded:  # a sender this check rejects and the round did not: that is the first thing wrong
            j = c["worker"]
            if check.verdicts.get(j, ACCEPT) != ACCEPT and check.verdicts[j] != c["verdict"]:
                _fail(f"{where}worker {j}'s verdict recomputes to {check.verdicts[j]!r}, the entry says {c['verdict']!r}")
        _fail(f"{where}the record's reveals are not the ones the round examined (one for each sender that passed "
              "the checks, none for the others)")
    return _Checked(check, base, set(bundles))


def _unsigned_earlier(cfg, store: Any, part: dict, where: str, r: int, run_id: str, admitted: dict) -> dict[int, str]:
    """The senders the round's record names as having sent, in an earlier try of the round, a
    bundle that held no commitment they signed (round.keep_seen; the record's `unbound`), each
    with that bundle's store hash: check_bundles' unsigned_earlier.
    That bundle must be stored and must indeed bind its sender to nothing in this round (no
    commitment of this run and round that names it and that its admitted key signed). Who sent
    those bytes no one can prove (they are no one's word), as with a missing reveal; what the
    claim does is leave the sender's commitment and salt out of the seed and have it replayed
    whatever the draw (or rejected, where the run does not replay), never convict it."""
    out: dict[int, str] = {}
    listed = part.get("unbound", {})
    if not (isinstance(listed, dict) and all(isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10
                                             and int(k) < cfg.topology.workers for k in listed)):
        _fail(f"{where}the record's unbound senders are not a map of worker ids to bundles: {listed!r:.80}")
    for key, claim in listed.items():
        j = int(key)
        try:  # (a claim that is no sha256 is refused here too: store.check_digest)
            data = store.get(claim, max_bytes=cfg.run.max_packet_bytes + (1 << 20))
        except StoreError as e:
            _fail(f"{where}worker {j}'s unsigned earlier bundle: {e}")
        if binds(data, run_id=run_id, round=r, worker=j, admitted_keys=admitted):
            _fail(f"{where}worker {j}'s earlier bundle {claim[:12]} is recorded as signing nothing, but it holds "
                  "its signed commitment of the round")
        out[j] = claim
    return out


def _recorded_reveals(cfg, part: dict, where: str) -> dict[int, bytes] | None:
    """The signed reveals the round examined (its record's `reveals`: each sender's that passed the
    checks before them, null for the others), as check_bundles' reveals; None for a run without
    draws. check_bundles judges them again: the signature, and whether the salt opens."""
    if not reveals_salts(cfg.verify):
        if "reveals" in part:
            _fail(f"{where}the record has reveals, but the run draws nothing from its rounds' seeds")
        return None
    reveals = part.get("reveals")
    size = 2 * REVEAL_BYTES
    if not (isinstance(reveals, list) and len(reveals) == cfg.topology.workers
            and all(x is None or (isinstance(x, str) and re.fullmatch(f"[0-9a-f]{{{size}}}", x)) for x in reveals)):
        _fail(f"{where}the record's reveals are not a list of {cfg.topology.workers} {size}-hex reveals (or nulls): "
              f"{reveals!r:.60}")
    return {j: bytes.fromhex(x) for j, x in enumerate(reveals) if x is not None}


def _screen_slice(cfg, task: _AuditTask, G0: torch.nn.Module, sl: _Slice, r: int, part: dict, where: str,
                  checked: _Checked, stage_settled: Settled | None) -> _Checked:
    """The screen of one slice's checked bundles, as that slice's processes ran it; with stages,
    the loss gains are the worker-wide ones `_stage_settled` settled."""
    back, v = r - 1 - base_lag(cfg), cfg.verify
    n, H = v.loss_gain_batches, cfg.train.inner_steps
    if stage_settled is not None:
        gains_of = lambda decoded, seed: stage_settled  # noqa: E731
    elif loss_gain_checkers(v):
        gains_of = _AuditLossGains(cfg, make_loss_gain(task.computed, task.gain_model(G0), sl.start_of(back), r, n, H),
                                   sorted(checked.present), sl.banned, part.get("loss_gain_reports"), where)
    else:
        gains_of = None
    check = screen_checked(
        checked.check, base_hash=checked.base, screen=v.screen, previous=sl.previous,
        earlier=sl.earlier if screens_earlier(cfg) else None,
        loss_gain_of=make_loss_gain(task.computed, task.gain_model(G0), sl.start_of(back), r, n, H)
        if v.loss_gain_batches and gains_of is None else None,
        loss_gains_of=gains_of, loss_gain_action=loss_gain_action(v), loss_gain_floor=v.loss_gain_floor,
        replay_copies=copies_replayable(cfg),
    )
    return checked._replace(check=check)


def _stage_settled(cfg, task: _AuditTask, slices: list[_Slice], checked: list[_Checked], parts: list[dict],
                   r: int) -> Settled:
    """The loss gains of a pipelined round as its workers settled them (round.StageLossGains): the
    audit's own numbers (_stage_gains), or with checkers the recorded reports settled as the
    workers did, from the seed and the banned their stages pooled."""
    seed = stage_seed([round_seed(c.check, c.base) for c in checked])
    gains = _stage_gains(cfg, task, slices, checked, r, seed)
    if not loss_gain_checkers(cfg.verify):
        return Settled(gains)
    where, recorded = f"round {r}: ", [p.get("loss_gain_reports") for p in parts]
    if any(x != recorded[0] for x in recorded[1:]):
        _fail(f"{where}the stages' records hold different loss_gain_reports (every stage settles from stage 0's)")
    banned = set().union(*(sl.banned for sl in slices))
    settle_ = _AuditLossGains(cfg, lambda j, _d, _s: gains[j], sorted(checked[0].present), banned, recorded[0], where)
    return settle_(dict.fromkeys(gains), seed)


def _stage_gains(cfg, task: _AuditTask, slices: list[_Slice], checked: list[_Checked], r: int,
                 seed: str) -> dict[int, LossGain]:
    """The loss gains a pipelined run's workers computed (round.StageLossGains), in this one
    process: the whole model through the emulated stages, for the senders every slice decoded,
    on the batches gain_steps draws from the stages' pooled screen seed."""
    back, t = r - 1 - base_lag(cfg), task.computed
    at = gain_steps(seed, cfg.train.inner_steps, cfg.verify.loss_gain_batches)
    G_r = {k: v for sl in slices for k, v in sl.start_of(back).items()}
    stages = [stage_model(cfg, s, len(slices)) for s in range(len(slices))]
    emu = EmulatedPipeline(stages, cfg.train, 1, microbatches=cfg.topology.microbatches)

    def loss(params: dict[str, torch.Tensor], j: int) -> float:
        with torch.no_grad():
            for k, p in emu.named_parameters():
                p.copy_(params[k])
        return emu.eval_loss([t.batch(j, r, s) for s in at])

    everywhere = set.intersection(*(set(c.check.decoded) for c in checked))
    gains = {}
    for j in sorted(everywhere):
        delta = {k: v for c in checked for k, v in c.check.decoded[j].items()}
        gains[j] = LossGain.on_own_batches(loss(G_r, j), loss({k: G_r[k] - delta[k] for k in G_r}, j))
    return gains


def _finish_slice(cfg, sl: _Slice, checked: _Checked, r: int, part: dict, recorded: list[dict], claims: tuple,
                  where: str, counts: dict) -> _Redone:
    """The rest of round r for one slice, after its replays: compare verdicts and signed
    commitments with the entry's `recorded` commitments, aggregate, take the outer step, and
    compare with `claims` = (aggregate hash, checkpoint digest, params hash or None). Returns
    what it recomputed."""
    check = checked.check
    claimed_aggregate, claimed_checkpoint, claimed_params = claims
    if cfg.verify.ban:
        sl.banned |= {j for j, v in check.verdicts.items() if v in OFFENCES}
    if sorted(sl.banned) != part.get("banned", []):
        _fail(f"{where}the record bans workers {part.get('banned', [])}, the verdicts so far ban {sorted(sl.banned)}")
    if sorted([a, j] for a, j in sl.disputes) != part.get("disputes", []):
        _fail(f"{where}the record lists disputed pairs {part.get('disputes', [])}, the replays so far "
              f"{sorted([a, j] for a, j in sl.disputes)}")
    for j, d in check.decoded.items():
        sl.history[j] = [d]  # the next round's replays start from it (start_point: the newest counts)
    for c in recorded:
        j, verdict = c["worker"], c["verdict"]
        if j not in checked.present:  # absent or late: nothing of it may be in the round
            sl.history.pop(j, None)
            if c.get("signed") is not None or c.get("bundle_sha256") is not None:
                _fail(f"{where}worker {j} is recorded as {verdict} but the entry holds its commitment")
            continue
        if check.verdicts.get(j) != verdict:
            _fail(f"{where}worker {j}'s verdict recomputes to {check.verdicts.get(j)!r}, the entry says {verdict!r}")
        signed = check.commitments.get(j)
        if (signed.to_dict() if signed else None) != c["signed"]:
            _fail(f"{where}worker {j}'s signed commitment in the ledger is not the one in its bundle")
        counts["signatures"] += signed is not None
    # the codecs each worker's packet used, as its signed commitment names them (round.start_finish's record)
    codecs = [codec_summary(c.commitment.codec) if c is not None and isinstance(c.commitment.codec, dict) else {}
              for c in (check.commitments.get(j) for j in range(cfg.topology.workers))]
    if part.get("codecs") != codecs:
        _fail(f"{where}the record's codecs {str(part.get('codecs'))[:60]} are not the ones the signed commitments "
              f"name {str(codecs)[:60]}")
    sl.earlier = sl.previous[1] if screens_earlier(cfg) else {}  # as round.finish_round keeps them
    sl.previous = (dict(check.packet_hashes), check.accepted)
    aggregate_hash = None
    if check.accepted:
        agg = aggregate_deltas(check.accepted, cfg.verify)
        aggregate_hash = tensors_hash(agg)
        if aggregate_hash != claimed_aggregate:
            _fail(f"{where}the accepted packets aggregate to {aggregate_hash[:16]}, the entry says {str(claimed_aggregate)[:16]}")
        sl.outer.step(agg)
    elif claimed_aggregate is not None:
        _fail(f"{where}nothing was accepted but the entry claims an aggregate")
    params_hash = tensors_hash(sl.outer.params)
    sl.params_after.append(params_hash)
    if cfg.verify.replay_probability > 0 or cfg.verify.loss_gain_batches:
        sl.bases[r] = {k: v.clone() for k, v in sl.outer.params.items()}
        sl.momenta[r] = lookahead_momentum(cfg, sl.outer)
        sl.bases.pop(r - 2, None)  # (before: the audit held every round's, its memory growing with the run)
        sl.momenta.pop(r - 2, None)
    ckpt = {f"param/{k}": v for k, v in sl.outer.params.items()} | sl.outer.state_tensors()
    digest = tensors_digest(ckpt, {"round": str(r)})  # the bytes round.finish_round stored, hashed as a stream
    if digest != claimed_checkpoint or (claimed_params or params_hash) != params_hash:
        _fail(f"{where}the outer step recomputes to checkpoint {digest[:16]}, the entry claims {str(claimed_checkpoint)[:16]}")
    return _Redone(digest, params_hash, aggregate_hash)


class _AuditLossGains:
    """check_round's `loss_gains_of` in the audit: takes the checkers' reports from the record,
    checks that the checkers are the ones the round's seed draws, settles the gains exactly as
    the round did (with the audit's own numbers where the round recomputed), and names a checker
    whose report the audit's own computation does not reproduce."""

    def __init__(self, cfg, gain, members: list[int], banned: set[int], recorded: Any, where: str) -> None:
        self.gain = gain  # (worker, delta) -> the audit's own LossGain
        self.cfg, self.members, self.banned, self.recorded, self.where = cfg, members, set(banned), recorded, where

    def __call__(self, decoded: dict[int, dict[str, torch.Tensor]], seed: str) -> Settled:
        where, workers = self.where, sorted(decoded)
        if self.recorded is None:
            _fail(f"{where}the record has no loss_gain_reports, but the round screened loss gains")
        try:
            checkers, reports = reports_from_json(self.recorded, self.cfg.topology.workers)
        except ValueError as e:
            _fail(f"{where}{e}")
        eligible = [m for m in self.members if m not in self.banned]
        expected = assign_checkers(seed, workers, eligible, loss_gain_checkers(self.cfg.verify))
        if checkers != expected:
            _fail(f"{where}the record's loss-gain checkers {checkers} are not the ones the round's seed draws {expected}")
        true = {j: self.gain(j, decoded[j], seed) for j in workers}
        settled = settle(workers, checkers, reports, lambda j: true[j], self.cfg.verify.loss_gain_floor)
        for c, j in misreports(checkers, reports, true):
            if c not in settled.false_reports:
                _fail(f"{where}worker {c} reported a loss gain for worker {j} that does not reproduce, "
                      f"and the round took it")
        return settled


def _emulated_replayer(cfg, total: int) -> Replayer:
    """A pipelined worker's replayer for the audit, which is one process: its S stages emulated
    bit for bit (pipeline.EmulatedPipeline; `start` is the whole model's start point)."""
    stages = cfg.topology.stages

    def replayer(start: dict[str, torch.Tensor], steps_before: int) -> tuple[EmulatedPipeline, EmulatedPipeline]:
        models = [stage_model(cfg, s, stages) for s in range(stages)]
        with torch.no_grad():
            for m in models:
                for k, p in m.named_parameters():
                    p.copy_(start[k])
        emu = EmulatedPipeline(models, cfg.train, total, microbatches=cfg.topology.microbatches,
                               groups=cfg.topology.replicas)
        emu.step_count = steps_before
        return emu, emu

    return replayer


def _stored_states(store, run_id: str, models: list[torch.nn.Module]):
    """state_of(r, worker, segment): the start state an auditor checked against worker's trace
    and stored (`[verify] replay_extent = "state"`; round.StateMoves), as one slice per stage
    (`models`: each stage's module, in stage order; one: the whole model), or None when a slice
    is not in the store (then the replay fails at the segment's start, as it did for a withheld
    state)."""
    layouts = [state_layout(m) for m in models]

    def state_of(r: int, worker: int, segment: int) -> list[dict[str, torch.Tensor]] | None:
        out = []
        for s, layout in enumerate(layouts):
            ref = state_ref(run_id, r, worker, segment, s if len(layouts) > 1 else None)
            try:
                digest = store.get_ref(ref).decode("ascii", "replace").strip()
                out.append(state_from_bytes(store.get(check_digest(digest), max_bytes=state_nbytes(layout)), layout))
            except StoreError:
                return None
        return out

    return state_of


def _replays(cfg, task: _AuditTask, r: int, checks: list[_Checked], slices: list[_Slice], recorded: list[list[dict]],
             parts: list[dict], replays_left: int, counts: dict, wheres: list[str], clock: tuple[int, int],
             state_of=None) -> int:
    """Redo round r's replays (the random sample and the screen's suspects): re-run up to
    `replays_left` of them, check that the recorded verdicts are ones the plan allowed, and apply
    replay_mismatch / false_report verdicts to each slice's check. A re-run replay scores and
    judges exactly as the round did (verify/replay.py: replay_run, score_replayed,
    judge_reported); an audit whose replay fails although the round accepted the worker names the
    auditor who reported it as passing. With S > 1 stages the plan is the worker-wide one the
    stages pooled (PlanInputs.pooled), a replay runs the whole worker (emulated in this one
    process) and its number is the worst of the stages' comparisons, as the auditor's stages
    combined theirs. `clock`: (steps before round r, the LR schedule's length then). `state_of`:
    the stored start states of segments replayed from them (`_stored_states`)."""
    (before, total), stages = clock, len(slices)
    plans = [PlanInputs.of_round(c.base, c.check, sl.banned) for c, sl in zip(checks, slices, strict=True)]
    plan = plans[0] if stages == 1 else PlanInputs.pooled([x.to_json() for x in plans])
    # the round's members: the workers whose bundles it had (all of them, unless elastic)
    audits = plan.audits(cfg.verify, cfg.train, sorted(checks[0].present))
    sampled = {a.worker for a in audits}
    auditors = {a.auditor for a in audits}
    unbound = {j: h for c in checks for j, h in c.check.unbound.items()}  # replayed by each member that noted it
    copies = pooled_copies(c.check.copies for c in checks)  # the ends of a copy any stage found: replayed by all
    newcomers = checks[0].check.newcomers if stages == 1 else []  # (the record's: elastic runs are not pipelined)
    extra = newcomer_audits(cfg.verify, cfg.train, checks[0].base, checks[0].check, slices[0].banned,
                            sorted(checks[0].present), newcomers) if newcomers else {}  # replayed by every member
    verdicts = [{c["worker"]: c["verdict"] for c in mine} for mine in recorded]
    for checked, mine, where in zip(checks, verdicts, wheres, strict=True):
        for j, v in mine.items():
            if v == REPLAY_MISMATCH and j not in sampled and j not in unbound and j not in extra and j not in copies:
                _fail(f"{where}worker {j} is recorded as replay_mismatch but was not in the replay sample")
            lied_on_gain = "loss_gain" in (checked.check.evidence.get(j) or {})  # convicted by the audit's own check_round
            if v == FALSE_REPORT and j not in auditors and not lied_on_gain:
                _fail(f"{where}worker {j} is recorded as false_report but audited no one this round")
    t = task.computed
    if stages == 1:  # the model built at the segment's start (no G_0 read)
        build = None if isinstance(task.task, Task) else lambda start: model_from(cfg.model, start, task.device)
        replayer = plain_replayer(t.make_model, t.loss, cfg.train, total, build, replicas=cfg.topology.replicas)
    else:
        replayer = _emulated_replayer(cfg, total)
    back = r - 1 - cfg.outer.delay
    land = None
    if cfg.outer.overlap_steps:  # round r-1's update landed inside round r, before this step
        land = (cfg.outer.overlap_steps, {k: v for sl in slices for k, v in sl.start_of(r - 1).items()})
    disputes: set[tuple[int, int]] = set()  # the round's new unattributable disputes

    def replayed_score(a: Audit) -> float:  # the audit's own replay of `a`, its number as the round's
        counts["replays"] += 1
        start: dict[str, torch.Tensor] = {}  # the whole worker's start point, slice by slice
        for sl in slices:
            own = sl.history.get(a.worker, []) if cfg.outer.delay else []
            start |= start_point(cfg, sl.start_of(back), own, cfg.topology.workers, sl.momentum_of(back))
        signed = [c.check.commitments[a.worker].commitment for c in checks]
        stored = state_of(r, a.worker, a.segment) if from_state(cfg.verify, a) and state_of else None
        state = {k: v for x in stored for k, v in x.items()} if stored else None  # the stages' slices, merged
        if from_state(cfg.verify, a) and not (
                stored and hashes_match([tensors_hash(x) for x in stored], list(signed[0].trace), a.segment)):
            return float(a.segment)  # no stored state that hashes to the segment's start
        replayed = replay_run(cfg.verify, replayer, cfg.train, start, r,
                              lambda step, j=a.worker: t.batch(j, r, step), a, land,
                              steps_before=before, total_steps=total, state=state)
        return worker_score(cfg.verify, [slice_result(cfg.verify, replayed, list(x.trace), c.check.decoded[a.worker],
                                                      replay_codecs(cfg, x, c.check.decoded[a.worker]))
                                       for c, x in zip(checks, signed, strict=True)])

    for a in audits:
        evidence = [part.get("evidence") or {} for part in parts]
        evs = [ev.get(str(a.worker)) if isinstance(ev.get(str(a.worker)), dict) else {} for ev in evidence]
        disputed = any(isinstance(ev.get("replayed"), dict) and ev["replayed"].get("disputed") is True for ev in evs)
        blame = not any(isinstance(ev.get("replayed"), dict) and ev["replayed"].get("state_resent") is True for ev in evs)
        if not blame:  # an unattributable dispute: each pair has at most one (round.disputed_pairs)
            if any((a.auditor, a.worker) in sl.disputes for sl in slices):
                _fail(f"{wheres[0]}worker {a.worker}'s dispute with its auditor, worker {a.auditor}, is recorded as "
                      "unattributable, but the two had disputed before, so its state went to every member")
            disputes.add((a.auditor, a.worker))
        if replays_left > 0:
            replays_left -= 1
            score = replayed_score(a)
            for checked, mine, where in zip(checks, verdicts, wheres, strict=True):
                if replay_failed(cfg.verify, score) and mine.get(a.worker) == ACCEPT:
                    _fail(f"{where}worker {a.worker}'s replay fails, but the round accepted it: its auditor, "
                          f"worker {a.auditor}, reported it as passing")
                if replay_failed(cfg.verify, score) or disputed:
                    judge_reported(cfg.verify, checked.check, a, 0.0, score, blame)
            continue
        # not re-run: the record's verdicts stand, as far as the plan allows them
        for checked, mine in zip(checks, verdicts, strict=True):
            if mine.get(a.worker) == REPLAY_MISMATCH:
                judge_reported(cfg.verify, checked.check, a, 0.0, _recorded_score(cfg.verify, True))
            elif disputed and (mine.get(a.auditor) == FALSE_REPORT or not blame):
                judge_reported(cfg.verify, checked.check, a, 0.0, _recorded_score(cfg.verify, False),
                               blame)
    for part, mine, where in zip(parts, verdicts, wheres, strict=True):  # the replays the record names are the plan's
        evidence = part.get("evidence") or {}
        named = {j for j in mine if isinstance(evidence.get(str(j)), dict) and "replayed" in evidence[str(j)]}
        if named - sampled:
            _fail(f"{where}the record has worker {min(named - sampled)} replayed, but it was not in the replay sample")
        unnamed = [j for j in sorted(sampled) if j not in named and mine.get(j) not in (REPLAY_MISMATCH, FALSE_REPORT)]
        if unnamed:
            _fail(f"{where}worker {unnamed[0]} was in the replay sample, but the record has no replay of it")
        for a in audits:  # and by the draw's auditor, from the draw's segment
            rep = evidence[str(a.worker)]["replayed"] if a.worker in named else None
            if isinstance(rep, dict) and (rep.get("auditor") != a.auditor or rep.get("segment", a.segment) != a.segment):
                _fail(f"{where}the record's replay of worker {a.worker} is not the draw's (auditor {a.auditor}, segment "
                      f"{a.segment}): {str(rep)[:80]}")
    # noted as having signed nothing in an earlier try (the record's `unbound`), an elastic retry's newcomers (its
    # `newcomers`) and what the draw without them replays, the ends of a copy of the round's packets: replayed by
    # the recorder itself, whatever the draw
    for j, judge, because in replayed_by_all(unbound, extra, copies):
        if any(j not in c.check.accepted for c in checks) and j not in copies:  # (an end of a copy: refused or not)
            continue
        a = unbound_audit(cfg.verify, cfg.train, j, -1)
        if replays_left > 0:
            replays_left -= 1
            score = replayed_score(a)
            for mine, where in zip(verdicts, wheres, strict=True):
                if replay_failed(cfg.verify, score) and mine.get(j) == ACCEPT:
                    _fail(f"{where}worker {j}'s replay fails, but the round accepted it ({because})")
        else:  # not re-run: the record's verdict stands
            score = _recorded_score(cfg.verify, any(mine.get(j) == REPLAY_MISMATCH for mine in verdicts))
        for checked in checks:
            judge(cfg.verify, checked.check, a, score)
    for sl in slices:
        sl.disputes |= disputes
    return replays_left


def _recorded_score(verify, failed: bool) -> float:
    """A replay's number as the record's verdict has it, where the audit does not re-run it: one
    that fails (replay_failed), or one that passes."""
    if verify.replay_match == "exact":
        return 0.0 if failed else -1.0
    return math.inf if failed else 0.0


def _newcomers(cfg, part: dict, members: list[int], where: str) -> list[int]:
    """The record's `newcomers` (round.start_finish): members of an elastic retry that were not in
    the round's first try, ascending; only where the round draws (a run without draws has no
    seed to leave them out of). Who was in that try the record alone says (the coordinator that
    knew is gone): a false list changes which workers the audit replays, and the screen's seed
    (check.screen_leaves_out), never the replay draw's."""
    if "newcomers" in part and not reveals_salts(cfg.verify):
        _fail(f"{where}the record has newcomers, but the run draws nothing from its rounds' seeds")
    listed = part.get("newcomers", [])
    if not (isinstance(listed, list) and all(type(j) is int for j in listed) and listed == sorted(set(listed))
            and set(listed) <= set(members)):
        _fail(f"{where}the record's newcomers are not an ascending list of the round's members: {listed!r:.80}")
    return listed


def open_run_ledger(run_dir: str | Path) -> Ledger:
    """The ledger of the run in `run_dir` (SQLite or EVM, as its config says), read-only for EVM;
    RunDirError when there is none."""
    src = DirSources(run_dir)
    try:
        return src.open_ledger(src.manifest)
    except (AuditFailure, AuditInputError) as e:
        raise RunDirError(str(e).removeprefix("ledger: ").replace("RUN/", f"{src.run.root}/")) from None


def write_audit(run_dir: str | Path, report: AuditReport) -> None:
    """Save the outcome as RUN/audit.json (the run report shows it)."""
    (Path(run_dir) / "audit.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")


__all__ = ["AuditFailure", "AuditInputError", "AuditReport", "audit_published", "audit_run", "audit_sources", "audit_task",
           "open_run_ledger", "write_audit", "RunDirError"]
