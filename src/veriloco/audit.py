"""`veriloco audit RUN`: re-verify a finished run offline from its directory alone.

What is checked, in this order (the first failure is reported with its round):
  1. the manifest: its hash is the run id; the config parses; the model built from the config's
     seed has the manifest's init hash
  2. the corpus: every chunk in the store is present and hashes to its name; the Merkle root
     of the chunks is the manifest's corpus root
  3. the ledger: every entry parses, the hash chain holds, the stored Merkle roots are right
     (RFC 9162); rounds.jsonl agrees with the ledger entry by entry (entry hash, checkpoint,
     aggregate and params hashes, eval loss, codecs, verdicts), so the report shows no lie
  4. every round, redone from the stored bytes alone: each worker's bundle (signed commitment +
     packet) is present and hashes to its name; the checks every worker ran (signature under the
     admitted key, base params, packet hash, assigned batches, equivocation, screen) give the
     verdicts the entry records; the accepted deltas aggregate to the recorded aggregate hash;
     the outer step from the previous params gives the params and the checkpoint digest the
     entry claims, and that checkpoint blob is in the store.
Exit code 0 when all of it holds, 1 with a line naming the first round and thing that does not,
2 when RUN is not a run directory.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from .config import config_from_dict
from .hashing import json_hash, sha256_hex, tensors_hash
from .ledger import LedgerError, SqliteLedger, verify_chain
from .ledger.entry import parse_entry, verdict_reason
from .model import build_model
from .outer import OuterOptimizer
from .records import RunDir, RunDirError
from .round import aggregate_deltas, batch_root, make_loss_gain, start_point, trace_entries
from .signing import check_signed_manifest
from .store import LocalStore, StoreError
from .task import CorpusTask, load_stored_corpus, model_init_hash
from .verify import REPLAY_MISMATCH
from .verify.check import check_round
from .verify.commitment import EquivocationDetector
from .verify.replay import check_replay, replay_trace, sample_audits


class AuditFailure(Exception):
    """Something in the run does not hold; the message names the round and the thing."""


@dataclass
class AuditReport:
    """The outcome: ok, what was checked, the first failure."""

    ok: bool
    rounds: int = 0
    checked: dict[str, int] = field(default_factory=dict)
    first_failure: str | None = None
    ledger_root: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"ok": self.ok, "rounds": self.rounds, "checked": self.checked,
                "first_failure": self.first_failure, "ledger_root": self.ledger_root,
                "seconds": round(self.seconds, 3)}


def _fail(msg: str) -> None:
    raise AuditFailure(msg)


def audit_run(run_dir: str | Path, replay: int = 0) -> AuditReport:
    """Audit the run in `run_dir`; RunDirError if it is not a run directory at all.

    `replay`: also re-run up to this many of the sampled replay audits (the rest of the sample
    is checked for consistency: only sampled workers may carry a replay_mismatch verdict)."""
    t0 = time.perf_counter()
    run = RunDir(run_dir)
    manifest = run.read_manifest()
    report = AuditReport(ok=False)
    threads = torch.get_num_threads()
    try:
        # the workers' thread count: replays are bit-exact only with the same reduction order
        torch.set_num_threads(int(manifest.get("config", {}).get("train", {}).get("threads", 1) or 1))
        _audit(run, manifest, report, replay)
        report.ok = True
    except AuditFailure as e:
        report.first_failure = str(e)
    except (StoreError, LedgerError, RunDirError) as e:  # RunDirError here: a corrupt record
        report.first_failure = str(e).splitlines()[0]
    finally:
        torch.set_num_threads(threads)
    report.seconds = time.perf_counter() - t0
    return report


def _audit(run: RunDir, manifest: dict, report: AuditReport, replays_left: int = 0) -> None:
    counts = report.checked
    # 1. manifest
    core = {k: v for k, v in manifest.items() if k not in ("run_id", "corpus_manifest")}
    if json_hash(core) != manifest.get("run_id"):
        _fail("manifest: its hash is not the run id (the manifest was changed)")
    try:
        cfg = config_from_dict(manifest["config"])
    except ValueError as e:
        _fail(f"manifest: config does not parse: {e}")
    if cfg.topology.__dict__.get("stages", 1) != 1:
        _fail("manifest: audit of pipeline-stage runs (stages > 1) is not supported yet")
    G0 = build_model(cfg.model, cfg.run.seed)
    if model_init_hash(G0) != manifest.get("model_init_hash"):
        _fail("manifest: the model built from the config's seed does not have the manifest's init hash")
    store = LocalStore(run.store_dir)

    # 2. corpus
    try:
        corpus = load_stored_corpus(store, manifest["corpus_manifest"], cfg)
    except StoreError as e:
        _fail(f"corpus: {e}")
    if corpus.root != manifest["corpus_root"]:
        _fail(f"corpus: Merkle root {corpus.root} is not the manifest's {manifest['corpus_root']}")
    counts["corpus_chunks"] = len(corpus.chunks)
    task = CorpusTask(cfg, run.store_dir, manifest["corpus_manifest"])
    task._corpus = corpus

    # 3. ledger and records
    if not (run.root / "ledger.sqlite").exists():
        _fail("ledger: RUN/ledger.sqlite is missing")
    ledger = SqliteLedger(run.root / "ledger.sqlite")
    try:
        problems = verify_chain(ledger)
        if problems:  # "entry <i>: <why>"; entry i is round i
            m = re.match(r"entry (\d+): (.*)", problems[0], re.S)
            _fail(f"round {m[1]}: ledger entry: {m[2]}" if m else f"ledger: {problems[0]}")
        raw = [ledger.entry_bytes(i) for i in range(ledger.size())]
        entries, entry_hashes = [parse_entry(b) for b in raw], [sha256_hex(b) for b in raw]
        report.ledger_root = ledger.root()
    finally:
        ledger.close()
    records = run.rounds()
    if not records and not entries:
        _fail("records: the run has no completed round to audit")
    if len(records) != len(entries):
        r = min(len(records), len(entries))
        _fail(f"round {r}: in {'rounds.jsonl' if len(records) > r else 'the ledger'} but not in "
              f"{'the ledger' if len(records) > r else 'rounds.jsonl'} (rounds.jsonl has "
              f"{len(records)} rounds, the ledger {len(entries)} entries)")
    for r, (rec, entry) in enumerate(zip(records, entries, strict=True)):
        p = entry["predicate"]
        if rec.get("round") != r or p["run_id"] != manifest["run_id"]:
            _fail(f"round {r}: record or entry is out of order or from another run")
        if rec.get("checkpoint") != entry["subject"][0]["digest"]["sha256"]:
            _fail(f"round {r}: rounds.jsonl checkpoint differs from the ledger entry's")
        if "entry" in rec and rec["entry"] != entry_hashes[r]:
            _fail(f"round {r}: rounds.jsonl names entry {str(rec['entry'])[:16]}, the ledger's hashes to {entry_hashes[r][:16]}")
        for key in ("aggregate_hash", "params_hash", "eval_loss", "codecs"):
            if key in rec and key in p and rec[key] != p[key]:
                _fail(f"round {r}: rounds.jsonl {key} differs from the ledger entry's")
        if "verdicts" in rec and rec["verdicts"] != [verdict_reason(c) for c in p["commitments"]]:
            _fail(f"round {r}: rounds.jsonl verdicts differ from the ledger entry's")
    counts["ledger_entries"] = len(entries)

    # 4. every round, redone
    admitted = {int(k): v for k, v in manifest["worker_keys"].items()}
    outer = OuterOptimizer(dict(G0.named_parameters()), cfg.outer)
    shapes = {k: tuple(v.shape) for k, v in outer.params.items()}
    detector = EquivocationDetector(admitted)
    params_after: list[str] = []
    previous: tuple = ({}, {})
    bases: list = []  # params after each round (replay start points), when replay is on
    history: dict = {}  # worker -> its last two decoded deltas (eager start points)
    init = {k: v.detach().clone() for k, v in G0.named_parameters()}

    def start_of(back: int) -> dict:  # G when round (back + 1 + delay)'s inner steps began
        return bases[back] if back >= 0 else init

    counts.update(signatures=0, bundles=0, checkpoints=0, replays=0)
    for r, (rec, entry) in enumerate(zip(records, entries, strict=True)):
        p = entry["predicate"]
        bundles = []
        for j, digest in enumerate(rec.get("bundles") or []):
            try:
                bundles.append(store.get(digest, max_bytes=cfg.run.max_packet_bytes + (1 << 20)))
            except StoreError as e:
                _fail(f"round {r}: bundle of worker {j}: {e}")
        if len(bundles) != len(p["commitments"]):
            _fail(f"round {r}: {len(bundles)} bundles stored, the entry lists {len(p['commitments'])} commitments")
        counts["bundles"] += len(bundles)
        back = r - 1 - cfg.outer.delay
        base = params_after[back] if back >= 0 else tensors_hash(dict(G0.named_parameters()))
        check = check_round(
            bundles, run_id=manifest["run_id"], round=r, base_hash=base, admitted_keys=admitted,
            shapes=shapes, max_packet_bytes=cfg.run.max_packet_bytes,
            batch_root_of=lambda j, r=r: batch_root(task.as_task(), j, r, cfg.train.inner_steps),
            equivocation=detector, screen=cfg.verify.screen, previous=previous,
            trace_entries=trace_entries(cfg),
            loss_gain_of=make_loss_gain(task.as_task(), G0, start_of(back), r, min(cfg.verify.loss_gain_batches, cfg.train.inner_steps))
            if cfg.verify.loss_gain_batches else None,
        )
        if cfg.verify.replay_probability > 0:
            start_G = start_of(back)
            recorded = {c["worker"]: c["verdict"] for c in p["commitments"]}
            replays_left = _replays(cfg, task.as_task(), r, base, check, start_G, history, recorded, replays_left, counts)
        for j, d in check.decoded.items():
            history[j] = (history.get(j, []) + [d])[-2:]
        for c in p["commitments"]:
            j, recorded = c["worker"], c["verdict"]
            if check.verdicts.get(j) != recorded:
                _fail(f"round {r}: worker {j}'s verdict recomputes to {check.verdicts.get(j)!r}, the entry says {recorded!r}")
            signed = check.commitments.get(j)
            if (signed.to_dict() if signed else None) != c["signed"]:
                _fail(f"round {r}: worker {j}'s signed commitment in the ledger is not the one in its bundle")
            counts["signatures"] += signed is not None
        previous = ({j: check.packet_hashes[j] for j in check.accepted}, check.accepted)
        if check.accepted:
            agg = aggregate_deltas(check.accepted, cfg.verify)
            if tensors_hash(agg) != p["aggregate_hash"]:
                _fail(f"round {r}: the accepted packets aggregate to {tensors_hash(agg)[:16]}, the entry says {str(p['aggregate_hash'])[:16]}")
            outer.step(agg)
        elif p["aggregate_hash"] is not None:
            _fail(f"round {r}: nothing was accepted but the entry claims an aggregate")
        params_hash = tensors_hash(outer.params)
        params_after.append(params_hash)
        if cfg.verify.replay_probability > 0 or cfg.verify.loss_gain_batches:
            bases.append({k: v.clone() for k, v in outer.params.items()})
        ckpt = {f"param/{k}": v for k, v in outer.params.items()} | outer.state_tensors()
        digest = sha256_hex(st_save(ckpt, metadata={"round": str(r)}))
        claimed = entry["subject"][0]["digest"]["sha256"]
        if digest != claimed or p.get("params_hash", params_hash) != params_hash:
            _fail(f"round {r}: the outer step recomputes to checkpoint {digest[:16]}, the entry claims {claimed[:16]}")
        try:
            store.get(claimed)
        except StoreError as e:
            _fail(f"round {r}: checkpoint: {e}")
        counts["checkpoints"] += 1
    report.rounds = len(records)
    # 5. the signed checkpoint manifest of a complete run (recorder = worker 0)
    if (run.root / "summary.json").is_file() and json.loads((run.root / "summary.json").read_text()).get("complete"):
        problem = check_signed_manifest(run, admitted[0], records[-1]["checkpoint"])
        if problem:
            _fail(f"signed checkpoint manifest: {problem}")
        counts["signed_manifest"] = 1


def _replays(cfg, task, r, base, check, start_G, history, recorded, replays_left, counts) -> int:
    """Redo round r's replay sample: re-run up to `replays_left` replays, check the rest's
    verdicts are ones the sample allowed, and apply replay_mismatch verdicts to `check`."""
    k = cfg.verify.trace_every or cfg.train.inner_steps
    segments = max(cfg.train.inner_steps // k, 1)
    seed = base + "".join(sorted(c.digest for c in check.commitments.values() if c is not None))
    audits = sample_audits(seed, sorted(check.accepted), cfg.topology.workers, segments, cfg.verify.replay_probability)
    sampled = {a.worker for a in audits}
    for j, v in recorded.items():
        if v == REPLAY_MISMATCH and j not in sampled:
            _fail(f"round {r}: worker {j} is recorded as replay_mismatch but was not in the replay sample")
    for a in audits:
        mismatch = recorded.get(a.worker) == REPLAY_MISMATCH
        if replays_left > 0:
            replays_left -= 1
            counts["replays"] += 1
            own = history.get(a.worker, []) if cfg.outer.delay else []
            start = start_point(cfg, start_G, own, cfg.topology.workers)
            replayed = replay_trace(
                task.make_model, task.loss, cfg.train, cfg.train.rounds * cfg.train.inner_steps, start,
                r * cfg.train.inner_steps, lambda step, j=a.worker: task.batch(j, r, step), k, a.segment + 1,
            )
            mismatch = check_replay(list(check.commitments[a.worker].commitment.trace), replayed) is not None
        if mismatch:
            check.verdicts[a.worker] = REPLAY_MISMATCH
            check.accepted.pop(a.worker, None)
    return replays_left


def write_audit(run_dir: str | Path, report: AuditReport) -> None:
    """Save the outcome as RUN/audit.json (the run report shows it)."""
    (Path(run_dir) / "audit.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")


__all__ = ["AuditFailure", "AuditReport", "audit_run", "write_audit", "RunDirError"]
